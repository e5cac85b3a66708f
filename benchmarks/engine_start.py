"""What DeepSpeed's engine costs every attempt on one host, before the first rank starts and after the last one
ends: its runner (``deepspeed.launcher.runner``, which for one local host only starts the per-node launcher)
followed by the launcher (``deepspeed.launcher.launch``), against the launcher alone, started with the arguments
the runner gives it (:mod:`ftkit.command.engines`), and the launcher alone run through :mod:`ftkit.launch.engine`
(its garbage collector tuned as a rank's): what ``ftkit launch`` does for one local host.

    python benchmarks/engine_start.py [--repeat 5]

The ranks are ``/bin/true`` (``--no_python``), so what is timed is the engine only: its processes' imports of
DeepSpeed and torch, its polling, its exit. Prints the median wall time of each variant, interleaved.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def argv(variant: str, hostfile: str) -> list[str]:
    port = str(_port())
    if variant == "runner":
        return [
            sys.executable,
            "-u",
            "-m",
            "deepspeed.launcher.runner",
            "--hostfile",
            hostfile,
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "--no_local_rank",
            "--no_python",
            "--no_ssh_check",
            "/bin/true",
        ]
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    module = (
        ["-m", "ftkit.launch.engine", "deepspeed.launcher.launch"]
        if variant == "ftkit"
        else ["-m", "deepspeed.launcher.launch"]
    )
    return [
        sys.executable,
        "-u",
        *module,
        f"--world_info={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "--no_python",
        "--no_local_rank",
        "--log_level=info",
        "/bin/true",
    ]


def one(variant: str, hostfile: str) -> float:
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    t0 = time.monotonic()
    subprocess.run(argv(variant, hostfile), check=True, env=env, capture_output=True)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        hostfile = os.path.join(d, "hostfile")
        with open(hostfile, "w") as fh:
            fh.write("localhost slots=2\n")
        runs: dict[str, list[float]] = {"runner": [], "launch": [], "ftkit": []}
        for _ in range(args.repeat):  # interleaved: a busy moment of the machine hits both variants alike
            for variant in runs:
                runs[variant].append(one(variant, hostfile))
    labels = {"runner": "runner + launcher", "launch": "launcher alone", "ftkit": "launcher, ftkit.launch.engine"}
    for variant, times in runs.items():
        median = statistics.median(times)
        print(f"{labels[variant]:30s} {median:.2f} s   (median of {len(times)}, 2 ranks of /bin/true)")


if __name__ == "__main__":
    main()
