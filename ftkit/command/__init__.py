"""The commands ftkit starts, as data: every engine's launch command and the user's own training command.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.engines`: Launch commands as data: one ``(argv, env)`` per process ftkit starts, for every engine, built
  here only.
* :mod:`.user_command`: The user's own training command (``ftkit launch RECIPE -- CMD``, or ``train.command``) as
  every rank runs it: ``python SCRIPT ARGS``, ``python -m MODULE ARGS`` or an executable, checked before anything
  starts (a script or module that is not there, a launcher inside the ranks), and the directory of ftkit's import
  hook for it.
"""

__all__ = ["engines", "user_command"]
