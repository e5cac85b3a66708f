"""The machines of a run, read without the training stack: hostfiles, which host is this one, processes, Slurm, fan-out
over ssh, what a host has for compiled ops.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.buildlocks`: Stale JIT build locks: torch's extension builder waits forever on a ``lock`` file a killed
  build left behind.
* :mod:`.fanout`: Run one shell line on many hosts at once: the single place ftkit fans out (preflight, teardown,
  the lost-host probe, /dev/shm cleanup, leftover checks, doctor).
* :mod:`.hostfile`: Hostfiles: which hosts a run uses and how many processes (slots) each one gets.
* :mod:`.hosts`: Whether a host name means this machine: the one answer every part of ftkit uses (a plan deciding to
  start a node without ssh, a hostfile refusing this machine twice, teardown and the owner check deciding whether a
  pid can be checked here).
* :mod:`.pkgversions`: Installed versions of named distributions, read from the installation's ``*.dist-info``
  directory names.
* :mod:`.procs`: Processes of a run: what an exit code means, whether a recorded pid is still ours, and teardown by
  pid.
* :mod:`.slurm`: Slurm inside an allocation: hosts from the allocation, and commands on other nodes through ``srun``
  instead of ssh.
* :mod:`.toolchain`: What a host has for DeepSpeed's compiled ops: prebuilt ones, and what a just-in-time build
  needs there.
"""

__all__ = ["buildlocks", "fanout", "hostfile", "hosts", "pkgversions", "procs", "slurm", "toolchain"]
