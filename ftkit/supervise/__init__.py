"""Supervision of a launch as a fixed script (resume, spawn, monitor, tear down, decide) over collaborators each tested
without processes.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.attempt`: One attempt's processes: start the engine's commands, and stop everything of the attempt on every
  host.
* :mod:`.cause`: Why an attempt failed, read from what it left: the ranks' error records and logs (issue 35).
* :mod:`.choose`: Choose where an attempt resumes from (read-only): the first step of resume selection
  (:mod:`ftkit.supervise.resume`).
* :mod:`.decide`: The supervisor's decisions as pure functions: no processes, no files, no clock of their own.
* :mod:`.events`: ``events.jsonl`` as the supervisor writes it: one line per decision, its message said to the user
  too.
* :mod:`.fidelity`: Resume fidelity: a resumed attempt recomputes steps an earlier attempt already logged; they must
  agree.
* :mod:`.monitor`: The monitor step of the supervisor's script: watch one attempt until it succeeds or first fails.
* :mod:`.observe`: What the supervisor reads while an attempt runs, besides exits and heartbeat timing
  (:mod:`ftkit.supervise.supervisor`).
* :mod:`.progress`: The progress line of ``ftkit launch``: step/total, loss, samples/s, tokens/s, elapsed and ETA.
* :mod:`.resume`: Resume selection: where the next attempt resumes from, as one decision (:class:`Resume`).
* :mod:`.shrink`: Continuing on fewer hosts: find the lost ones, and convert a checkpoint to DeepSpeed's universal
  format.
* :mod:`.stopping`: Stop control: the signals that stop a launch, the stop file that asks the ranks to save and end,
  and the stragglers a graceful stop leaves out.
* :mod:`.stragglers`: Stragglers: a host whose ranks compute each step consistently slower than the other hosts'
  ranks.
* :mod:`.supervisor`: Supervision as a fixed script: resume → spawn → monitor → tear down → decide → (back off,
  again).
* :mod:`.tier_resume`: Resume across checkpoint tiers, and the local tiers' end (:mod:`ftkit.checkpoint.tiers`).
* :mod:`.universal`: Resuming on a different world size: convert a committed ZeRO checkpoint to DeepSpeed's
  universal format.
"""

__all__ = [
    "attempt",
    "cause",
    "choose",
    "decide",
    "events",
    "fidelity",
    "monitor",
    "observe",
    "progress",
    "resume",
    "shrink",
    "stopping",
    "stragglers",
    "supervisor",
    "tier_resume",
    "universal",
]
