"""Running a job as library calls: launch (own the run directory, preflight, prepare, supervise), doctor, status,
submit, probe.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.doctor`: ``ftkit doctor``: find the host that will break a multi-node start, in seconds, before anything is
  launched.
* :mod:`.doctor_checks`: What ``ftkit doctor`` found, as data: one :class:`DoctorReport` (a row per host, a check
  per column, one :class:`Failure` per problem with its fix), its text and JSON forms, and the pure rules that turn
  one host's facts (``python -m ftkit.launch.doctor_probe facts``) into cells and failures.
* :mod:`.fingerprint`: What shapes a run, recorded with every checkpoint and compared when a run resumes.
* :mod:`.job`: ``ftkit launch`` as a library call: plan → own the run directory → preflight → decide the resume →
  write the run's configs and spec → supervise → summary.
* :mod:`.make_spec`: The run spec: everything a rank needs, computed once on the head node from the Plan and written
  to ``ftkit/spec.json`` in the run directory.
* :mod:`.ops`: DeepSpeed's compiled ops at launch: settle what the optimizer needs from what every host has, and
  build what is missing once per host before any rank starts (docs/design.md, Rendering rules; issue 35).
* :mod:`.ownership`: Who owns a run directory: one live supervisor per run (docs/design.md, Run directory).
* :mod:`.preflight`: Checks before anything is spawned: hosts reachable, run directory writable, master port free,
  same Python and key package versions everywhere.
* :mod:`.prepare`: Prepare a run directory: render the configs the run will use and write the spec every rank reads.
* :mod:`.probe`: ``ftkit plan --probe``: measure the fastest candidates on one GPU of this machine, then calibrate
  the plan with them.
* :mod:`.status`: Summaries of a run directory: attempts, restarts, steps, losses and eval losses, checkpoints
  (committed or rejected, why), Slurm job events, and hosts that straggle.
* :mod:`.submit`: ``ftkit submit``: a Slurm batch script for a recipe, written into the run directory and handed to
  ``sbatch``; and the batch side of that job (``python -m ftkit.run.submit batch ...``, what the script runs).
"""

__all__ = [
    "doctor",
    "doctor_checks",
    "fingerprint",
    "job",
    "make_spec",
    "ops",
    "ownership",
    "preflight",
    "prepare",
    "probe",
    "status",
    "submit",
]
