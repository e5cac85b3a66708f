"""Records, on every rank, exactly the arguments and working directory it was started with, then ends the run.

``python argv_probe.py ARGS...``: writes ``$FTKIT_RUN_DIR/argv-rank-R.json`` and commits a one-file final model
through ``ftkit.hf.final``, so the launch ends with exit 0.
"""

import json
import os
import sys
from pathlib import Path

import ftkit.hf

ctx = ftkit.hf.context()
Path(os.environ["FTKIT_RUN_DIR"], f"argv-rank-{ctx.rank}.json").write_text(
    json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "host": ctx.node_host})
)
ftkit.hf.step(1)
with ftkit.hf.final(1) as path:
    if ctx.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / "probe.txt").write_text("ok\n")
