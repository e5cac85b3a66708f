"""Slurm inside an allocation: hosts from the allocation, and commands on other nodes through ``srun`` instead of
ssh. The ``srun`` engine's command is built with the others (:mod:`ftkit.command.engines`); ``ftkit submit`` and the
batch side of a job live in :mod:`ftkit.run.submit`.

The engine runs **one task per node, each running torchrun** (c10d rendezvous on the first host, a per-job rendezvous id
and port), not one task per rank, because:

* the ranks get exactly the environment torchrun gives them under every other engine (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``): HF Trainer, Accelerate and DeepSpeed need no Slurm-specific
  detection, and the per-rank side (:mod:`ftkit.hf`) is the one already tested;
* the srun step stays one task per node whatever the GPUs per node (a step of 8 tasks per node is 8x the
  slurmstepd work and 8x the per-task signal forwarding);
* torchrun's agent watches its node's ranks and ends them together; ``--kill-on-bad-exit`` ends the whole step
  when one node's agent fails, so ftkit's supervisor sees one exit, as with the other engines.

The supervisor spawns the ``srun`` client locally in its own process group; its teardown SIGTERMs that group
(srun forwards it to every task of the step) and then checks the ranks' pid records. The records name the node
(``FTKIT_NODE``, set per task from ``SLURMD_NODENAME``); other nodes are reached with :func:`srun_run` /
:class:`SrunTransport` (``srun --overlap --jobid J -w HOST``), never ssh.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ftkit.errors import UserError

NOT_IN_ALLOCATION = (
    "cluster.engine slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set): submit the job with "
    "`ftkit submit RECIPE` (or run ftkit launch inside salloc/sbatch)"
)
PORT_SPAN = 4096  # per-job rendezvous ports: master_port + job id mod this, so two jobs on one node do not collide


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def require_allocation(env: Mapping[str, str]) -> None:
    if not in_allocation(env):
        raise UserError(NOT_IN_ALLOCATION)


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's hostlist grammar (``n[1-3,7]``, ``gpu[001-004]-ib``, ``a[1-2]b[3-4]``, comma lists), in Slurm's
    order, as ``scontrol show hostnames`` prints it (a test compares them). Raises UserError on a bad list."""
    import hostlist

    try:
        return list(hostlist.expand_hostlist(spec.strip(), allow_duplicates=True))
    except hostlist.BadHostlist as e:
        raise UserError(f"SLURM_JOB_NODELIST {spec!r}: not a Slurm host list ({e})") from None


def allocation_nodes(env: Mapping[str, str]) -> list[str]:
    """The allocation's nodes in Slurm's order (the first is where the batch script runs)."""
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not spec:
        raise UserError("inside a Slurm allocation but SLURM_JOB_NODELIST is not set: cannot tell its nodes")
    return expand_hostlist(spec)


def allocation_hosts(env: Mapping[str, str], slots: int) -> list[tuple[str, int]]:
    """(host, processes) in rank order for the allocation; the first host is rank 0's (the master)."""
    require_allocation(env)
    return [(h, slots) for h in allocation_nodes(env)]


def job_port(env: Mapping[str, str], base: int) -> int:
    """A rendezvous port of this job's own: ``base + job id mod PORT_SPAN`` (wrapping below 65536)."""
    try:
        job = int(env.get("SLURM_JOB_ID") or 0)
    except ValueError:
        job = 0
    port = base + job % PORT_SPAN
    return port if port <= 65535 else 1024 + port % (65536 - 1024)


def slurm_env(base_env: Mapping[str, str]) -> dict[str, str]:
    """What the srun client needs to find its allocation and the cluster (SLURM_JOB_ID, SLURM_CONF, ...)."""
    return {k: v for k, v in base_env.items() if k.startswith(("SLURM_", "SLURMD_"))}


def srun_argv(job_id: str, host: str, script: str) -> list[str]:
    """``srun`` running one shell line on ``host`` beside the job's running steps (``--overlap``)."""
    return [
        "srun",
        "--overlap",
        f"--jobid={job_id}",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={host}",
        "--quiet",
        "sh",
        "-c",
        _own_status(script),
    ]


def _own_status(script: str) -> str:
    """The line's own exit status, except 1 (srun's own "could not start the task") which becomes 125."""
    return f"sh -c {shlex.quote(script)}; r=$?; [ $r -eq 1 ] && r=125; exit $r"


def srun_run(host: str, script: str, timeout: float, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Run ``script`` on ``host`` of this job through srun: (reachable, stdout); unreachable: (False, why)."""
    import os

    e = dict(os.environ if env is None else env)
    require_allocation(e)
    try:
        r = subprocess.run(
            srun_argv(e["SLURM_JOB_ID"], host, script),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=e,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return False, f"srun to {host} timed out after {timeout:g}s"
    except OSError as err:
        return False, f"cannot run srun: {err.strerror or err}"
    if SrunTransport().unreachable(r.returncode):
        return False, " ".join(r.stderr.split())[:300] or f"srun exit {r.returncode}"
    return True, r.stdout


@dataclass(frozen=True)
class SrunTransport:
    """:class:`ftkit.cluster.fanout.Transport` for the nodes of the current allocation: ``run_on_hosts(hosts, script,
    [], deadline_s=..., transport=SrunTransport(job_id))``. srun exits 1 when it cannot start the task (a node
    that is down or not in the job: "Unable to create step"), else with the task's status; the line's own 1 is
    reported as 125 so that 1 always means unreachable."""

    job_id: str = ""

    def argv(self, host: str, script: str, connect_timeout_s: float) -> list[str]:  # noqa: ARG002
        import os

        job = self.job_id or os.environ.get("SLURM_JOB_ID", "")
        return srun_argv(job, host, script)

    def unreachable(self, rc: int) -> bool:
        return rc == 1 or rc < 0


def transport_for(engine: str, env: Mapping[str, str]):
    """The fan-out transport for a run: srun for the slurm engine inside its allocation, else None (ssh)."""
    if engine == "slurm" and in_allocation(env):
        return SrunTransport(env["SLURM_JOB_ID"])
    return None
