"""The run directory, the contract between the controller and the ranks: its layout, the typed run spec and sections,
records, environment, owner, build locks.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.batons`: The build locks a run's ranks hold: recorded while held, so the ones a killed rank left can be
  removed safely.
* :mod:`.env`: The run's environment contract between ``ftkit launch`` and every rank: which variables of the head's
  environment travel to the ranks (the allow-list; secrets are redacted wherever an environment is printed or
  recorded) and the ``FTKIT_*`` names ftkit sets.
* :mod:`.failures`: Why an attempt failed, as a class both sides name the same way: whether a restart can change it.
* :mod:`.layout`: The run directory's layout, shared by the supervisor (head node) and the training entry (every
  rank).
* :mod:`.outputs`: Where a command may write what the user asked for (``ftkit report -o``, ``ftkit status --plot``,
  ``ftkit export -o``): the rules every such path obeys, in one place.
* :mod:`.owner`: Who owns a run directory: the owner record (``ftkit/owner.json``: host, pid, process start time,
  boot) and the supervisor heartbeat's cadence, read by the supervisor (:mod:`ftkit.run.ownership` holds the ownership
  itself) and by every rank's watchdog (:mod:`ftkit.launch.watchdog`).
* :mod:`.records`: The JSON records ranks leave in the run directory, as types: what each file holds, so readers
  (the supervisor, ``ftkit status``, teardown, the doctor) are checked against what writers write.
* :mod:`.sections`: The recipe's sections as typed, frozen records: ``recipe.train.save_steps`` instead of a string
  lookup.
* :mod:`.spec`: What crosses from the controller to the ranks, as one typed structure both sides import.
"""

__all__ = ["batons", "env", "failures", "layout", "outputs", "owner", "records", "sections", "spec"]
