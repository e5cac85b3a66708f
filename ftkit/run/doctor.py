"""``ftkit doctor``: find the host that will break a multi-node start, in seconds, before anything is launched.

Steps (each host in parallel through :func:`ftkit.cluster.fanout.run_on_hosts`; the probes are
``python -m ftkit.launch.doctor_probe``, run with the ranks' interpreter):

1. everything :func:`ftkit.run.preflight.run_preflight` checks (reused as it is: hosts reachable over ssh, run
   directory writable, master port free, same versions, master address resolves);
2. ``facts`` on every host: ftkit/python/torch/deepspeed/transformers versions against this machine's, GPU model
   and driver (cuda), free space in the run directory, /dev/shm size and free space, clock skew against this
   machine, the interface the collectives use (``GLOO_SOCKET_IFNAME`` on cpu, ``NCCL_SOCKET_IFNAME`` on cuda, else
   the route to master_addr) and whether it exists there, stale torch extension build locks
   (:mod:`ftkit.cluster.buildlocks`; stale only if no host holds it). Thresholds and rules:
   :mod:`ftkit.run.doctor_checks`;
3. a real rendezvous and all-reduce across all hosts with the engine's backend (gloo on cpu, nccl on cuda), one
   process per host, bounded by ``RENDEZVOUS_TIMEOUT_S``; hosts that did not join are named with their own error.
   Skipped when a host is unreachable (it cannot join).

``--bandwidth`` adds all-reduce bus bandwidth (NCCL's factor 2(n-1)/n) for a few sizes across all hosts and for
every pair of hosts (three or more), and writes it where the planner reads it (:func:`ftkit.plan.comm.bandwidth_file`,
``$FTKIT_BANDWIDTH_FILE`` or ``~/.cache/ftkit/bandwidth.json``). Format: comm's version-1 object
(``version``, ``measured_at``, ``hosts``, ``inter_node_gbs``: the all-hosts bus bandwidth at the largest size,
``intra_node_gbs``: the recipe's value, doctor measures one process per host) plus what doctor measured::

    "backend": "gloo", "intra_node_source": "recipe (not measured: one probe per host)",
    "all_reduce": [{"bytes": 1048576, "seconds": 0.02, "busbw_gbs": 0.05}, ...],
    "pairs": [{"hosts": ["node0", "node1"], "bytes": 8388608, "seconds": 0.1, "busbw_gbs": 0.08}, ...]

Exit codes (``ftkit doctor``): 0 every check passed; 2 bad recipe, hostfile or command line; 3 (PREFLIGHT) a check
failed: one line per failure with its fix. :func:`cheap_checks` is the part ``ftkit launch`` runs as preflight
(1 and 2, no rendezvous).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

from ftkit.cluster.fanout import run_on_hosts
from ftkit.cluster.hosts import LOCAL_HOSTS
from ftkit.command.engines import forwarded_env
from ftkit.errors import PreflightError
from ftkit.plan.comm import BANDWIDTH_FILE_VERSION, DEFAULT_NETWORK, NETWORK_PRESETS, bandwidth_file
from ftkit.plan.knobs import compiled_ops, ops_reason
from ftkit.plan.local_tier import shm_bytes
from ftkit.run.doctor_checks import (
    AllReduceTiming,
    Bandwidth,
    DoctorReport,
    Failure,
    HostFacts,
    LockFact,
    PairTiming,
    check_facts,
    check_locks,
    check_ops,
)
from ftkit.run.preflight import PreflightReport, local_versions, run_preflight
from ftkit.rundir.env import path_with_python_first, read_deepspeed_env
from ftkit.rundir.failures import DS_SHM_BYTES_PER_RANK
from ftkit.rundir.layout import atomic_write
from ftkit.rundir.records import JSONObject

if TYPE_CHECKING:
    from ftkit.cluster.fanout import Transport
    from ftkit.plan.plan import Plan

FACTS_DEADLINE_S = 15.0
RENDEZVOUS_TIMEOUT_S = 10.0
BANDWIDTH_BUDGET_S = 60.0
MARK = "FTKIT_DOCTOR "
FORWARD = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME", "PYTHONPATH")
TOOLCHAIN_ENV = ("CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST", "CXX", "TORCH_EXTENSIONS_DIR")


class RankPairTiming(AllReduceTiming):
    """A timed all-reduce between two ranks, as the rendezvous probe reports it (rank i of the pair reports it)."""

    ranks: list[int]


class RendezvousResult(TypedDict, total=False):
    """What ``python -m ftkit.launch.doctor_probe rendezvous`` prints for one host (``all``/``pairs`` with
    ``--bandwidth``; ``stage`` and ``error`` when it failed; ``missing`` on rank 0 or after a peer's error)."""

    rank: int
    world: int
    ok: bool
    stage: str
    error: str
    allreduce_s: float
    all: list[AllReduceTiming]
    pairs: list[RankPairTiming]
    missing: list[int]
    peer_errors: dict[str, str]
    seconds: float


# ----------------------------------------------------------------------------------------------- probes


def _probe_line(python: str, args: list[str], env: dict[str, str]) -> str:
    """The shell line that runs the probe with ``env`` set; every word quoted once, here."""
    words = ["exec", "env", *(f"{k}={v}" for k, v in env.items()), python, "-m", "ftkit.launch.doctor_probe", *args]
    return shlex.join(words)


def _parse(out: str) -> JSONObject | None:
    """The probe's ``FTKIT_DOCTOR {json}`` line (the last one) as an object; None when there is none."""
    for line in reversed(out.splitlines()):
        if line.startswith(MARK):
            try:
                return cast("JSONObject", json.loads(line[len(MARK) :]))
            except ValueError:
                return None
    return None


def build_env(env: dict[str, str], plan: Plan | None = None, python: str = sys.executable) -> dict[str, str]:
    """What the probes run with: doctor's own variables, and (``plan``) those of the ranks' environment that decide
    their op builds, as a remote host's ranks get them (a local host's probe also inherits this machine's, as its
    ranks do): the sanitised arch list, CUDA_HOME where cluster.env names it, the PATH with the ranks' Python first."""
    out = {k: env[k] for k in FORWARD if env.get(k)}
    if plan is not None:
        r = plan.recipe
        ranks = forwarded_env(
            env,
            r.cluster.accelerator,
            local=False,
            cluster_env=r.cluster.env or (),
            deepspeed_env=read_deepspeed_env([Path.home(), os.getcwd()]),
        )
        out.update({k: ranks[k] for k in TOOLCHAIN_ENV if ranks.get(k)})
        out["PATH"] = path_with_python_first(python, env.get("PATH"))
    return out


def _facts(
    plan: Plan,
    rep: DoctorReport,
    ssh_args: list[str],
    python: str,
    env: dict[str, str],
    transport: Transport | None = None,
    release_dead_batons: bool = False,
) -> set[str]:
    """Run the facts probe everywhere; returns the hosts that could not be reached."""

    r = plan.recipe
    hosts = rep.hosts
    args = ["facts", "--run-dir", str(Path(r.train.output_dir).resolve()), "--master-addr", plan.master_addr]
    args += ["--accelerator", r.cluster.accelerator]
    if release_dead_batons:
        args.append("--release-dead-batons")
    line = _probe_line(python, args, build_env(env, plan, python))
    results = run_on_hosts(
        hosts, line, ssh_args, deadline_s=FACTS_DEADLINE_S, connect_timeout_s=FACTS_DEADLINE_S - 2, transport=transport
    )
    ops, why = compiled_ops(plan), ops_reason(plan)
    mine = local_versions()
    unreachable: set[str] = set()
    locks: dict[str, list[LockFact]] = {}
    for host in hosts:
        res = results[host]
        if not res.reachable:
            unreachable.add(host)
            rep.fail(host, "ssh", f"not reachable ({res.out})", "check the hostfile, the host and passwordless ssh")
            continue
        f = cast("HostFacts | None", _parse(res.out))
        if f is None:
            why = " ".join(res.out.split())[-300:] or f"exit {res.rc}"
            rep.fail(
                host,
                "versions",
                f"{python} -m ftkit.launch.doctor_probe did not run there: {why}",
                "install ftkit with the same interpreter path on every host",
            )
            continue
        rep.set(host, "ssh", "local" if host in LOCAL_HOSTS else f"{res.seconds:.1f}s")
        ranks = dict(plan.hosts).get(host, 0)
        # DeepSpeed's CPU collectives map their buffers in /dev/shm when every rank is on this one node
        need = DS_SHM_BYTES_PER_RANK * ranks if shm_collectives(plan) else 0
        check_facts(
            rep,
            host,
            f,
            mine,
            time.time(),
            r.cluster.accelerator,
            tier_bytes=shm_bytes(plan.local_tier),
            shm_need=need,
            ranks=ranks,
        )
        rep.toolchain[host] = f.get("toolchain") or {}
        check_ops(rep, host, rep.toolchain[host], ops, r.cluster.accelerator, why)
        locks[host] = f.get("locks", [])
        rep.released += [
            f"host {host}: removed {lock}: a build lock a killed rank of this run left"
            for lock in f.get("locks_released", [])
        ]
    check_locks(rep, locks)
    return unreachable


def shm_collectives(plan: Plan) -> bool:
    """Whether the ranks map DeepSpeed's CPU collectives into /dev/shm (cpu accelerator, DeepSpeed, one node)."""
    r = plan.recipe
    return r.cluster.accelerator == "cpu" and r.train.backend == "deepspeed" and plan.num_nodes == 1


def _preflight(
    plan: Plan, hosts: list[str], ssh_args: list[str], python: str
) -> tuple[PreflightReport | None, list[tuple[str, str]]]:
    """run_preflight as it is: (its report or None, [(host or "-", problem)])."""

    r = plan.recipe
    try:
        report = run_preflight(
            hosts=plan.hosts,
            master_addr=plan.master_addr,
            master_port=plan.master_port,
            run_dir=Path(r.train.output_dir),
            engine=r.cluster.engine,
            ssh_args=ssh_args,
            python=python,
        )
        return report, []
    except PreflightError as e:
        found: list[tuple[str, str]] = []
        for text in e.lines():
            # doctor's own columns say unreachable/versions per host: keep preflight's other findings
            if " is not reachable over ssh " in text or " differs: " in text:
                continue
            host = next((h for h in hosts if text.startswith((f"host {h}:", f"host {h} "))), "-")
            found.append((host, text))
        return None, found


# ------------------------------------------------------------------------------------------- rendezvous


def _rendezvous(
    plan: Plan,
    rep: DoctorReport,
    ssh_args: list[str],
    python: str,
    env: dict[str, str],
    bandwidth: bool,
    transport: Transport | None = None,
) -> None:
    r = plan.recipe
    hosts = rep.hosts
    backend = "nccl" if r.cluster.accelerator == "cuda" else "gloo"
    world = len(hosts)
    penv = build_env(env)

    def line(host: str) -> str:
        args = [
            "rendezvous",
            "--rank",
            str(hosts.index(host)),
            "--world",
            str(world),
            "--master-addr",
            plan.master_addr,
        ]
        args += ["--port", str(plan.master_port), "--backend", backend, "--timeout", f"{RENDEZVOUS_TIMEOUT_S:g}"]
        if bandwidth:
            args += ["--bandwidth", "--bandwidth-budget", f"{BANDWIDTH_BUDGET_S:g}"]
        return _probe_line(python, args, penv)

    deadline = RENDEZVOUS_TIMEOUT_S + 20 + (BANDWIDTH_BUDGET_S if bandwidth else 0)
    results = run_on_hosts(hosts, line, ssh_args, deadline_s=deadline, connect_timeout_s=10, transport=transport)
    outs: dict[str, RendezvousResult] = {}
    for host in hosts:
        res = results[host]
        o = cast("RendezvousResult | None", _parse(res.out)) if res.reachable else None
        if o is None:
            why = res.out if not res.reachable else (" ".join(res.out.split())[-300:] or f"exit {res.rc}")
            o = {"ok": False, "error": f"probe gave no answer ({why})", "stage": "probe"}
        outs[host] = o
    failed = [h for h in hosts if not outs[h].get("ok")]
    if not failed:
        for h in hosts:
            rep.set(h, "rendezvous", f"ok {outs[h].get('allreduce_s', 0):.1f}s")
        if bandwidth:
            rep.bandwidth = _bandwidth(plan, hosts, outs, backend)
        return
    # Name the cause: a host whose own probe failed first (import, store, gloo device) or never joined; the others
    # only waited for it.
    missing = {hosts[i] for i in outs[hosts[0]].get("missing", []) if 0 <= i < world}
    causes = [h for h in failed if outs[h].get("stage") in ("import", "store", "probe") or h in missing]
    if not causes:  # everyone reached the collective: those with an error of their own (not "peer(s) failed first")
        causes = [h for h in failed if not str(outs[h].get("error", "")).startswith("peer(s) failed")] or failed
    for h in hosts:
        if h in causes:
            o = outs[h]
            what = "did not join the rendezvous" if h in missing else "failed in the rendezvous/all-reduce"
            rep.fail(h, "rendezvous", f"{what}: {o.get('error')}", _rendezvous_fix(o, plan))
        else:
            rep.set(h, "rendezvous", "waited")


def _rendezvous_fix(o: RendezvousResult, plan: Plan) -> str:
    err = str(o.get("error", ""))
    if o.get("stage") == "import":
        return "install the same torch on every host"
    if o.get("stage") == "store":
        port, addr = plan.master_port, plan.master_addr
        return f"open TCP port {port} to {addr} from this host (firewall? route?), or check cluster.master_addr"
    if "IFNAME" in err or "interface" in err.lower() or "find address" in err.lower():
        return "set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to an interface every host has"
    return "check the interface (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME) and that hosts reach each other on all ports"


def _bandwidth(plan: Plan, hosts: list[str], outs: dict[str, RendezvousResult], backend: str) -> Bandwidth:

    r = plan.recipe
    rows = outs[hosts[0]].get("all", [])
    pairs: list[PairTiming] = []
    for o in outs.values():
        for p in o.get("pairs", []):
            i, j = p["ranks"]
            pairs.append(
                {
                    "hosts": [hosts[i], hosts[j]],
                    "bytes": p["bytes"],
                    "seconds": p["seconds"],
                    "busbw_gbs": p["busbw_gbs"],
                }
            )
    name = r.cluster.network
    if name == "auto":
        name = "loopback" if r.cluster.accelerator == "cpu" else DEFAULT_NETWORK
    intra = r.cluster.intra_node_gbs or NETWORK_PRESETS[name].intra_gbs
    return {
        "version": BANDWIDTH_FILE_VERSION,
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hosts": list(hosts),
        "inter_node_gbs": rows[-1]["busbw_gbs"] if rows else None,
        "intra_node_gbs": float(intra),
        "intra_node_source": f"recipe ({name}; not measured: one probe per host)",
        "backend": backend,
        "all_reduce": rows,
        "pairs": sorted(pairs, key=lambda p: p["hosts"]),
    }


def write_bandwidth(data: Bandwidth, path: Path | None = None) -> Path:

    p = path or bandwidth_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, json.dumps(data, indent=2) + "\n")
    return p


# ------------------------------------------------------------------------------------------------- entry


def run_doctor(
    plan: Plan,
    *,
    ssh_args: list[str],
    bandwidth: bool = False,
    rendezvous: bool = True,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    transport: Transport | None = None,
    release_dead_batons: bool = False,
) -> DoctorReport:
    """All of doctor's checks for ``plan``'s hosts; the report carries every failure (nothing raised for them).

    ``transport``: how the probes reach the hosts (:class:`ftkit.cluster.fanout.Transport`; default ssh with
    ``ssh_args``), e.g. srun inside a Slurm allocation. run_preflight picks its own."""
    t0 = time.monotonic()
    env = dict(os.environ if env is None else env)
    rep = DoctorReport(hosts=[h for h, _ in plan.hosts])
    for h in rep.hosts:
        rep.cells[h] = {}
    # preflight and facts fan out at the same time: an unreachable host costs one ssh timeout, not two
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="doctor-preflight") as ex:
        pre = ex.submit(_preflight, plan, list(rep.hosts), ssh_args, python)
        unreachable = _facts(plan, rep, ssh_args, python, env, transport, release_dead_batons)
        rep.preflight, pre_failures = pre.result()
    facts_failures, rep.failures = rep.failures, []
    for host, text in pre_failures:
        rep.fail(host, "preflight", text)
    rep.failures += facts_failures
    if rendezvous:
        if unreachable:
            for h in rep.hosts:
                rep.set(h, "rendezvous", "skipped")
        else:
            _rendezvous(plan, rep, ssh_args, python, env, bandwidth, transport)
    if rep.bandwidth and rep.bandwidth.get("inter_node_gbs"):
        rep.bandwidth_file = str(write_bandwidth(rep.bandwidth))
    elif bandwidth and len(rep.hosts) < 2:
        rep.notes.append("bandwidth: a single host has no link between hosts to measure; nothing recorded")
    rep.seconds = time.monotonic() - t0
    return rep


def cheap_checks(
    plan: Plan,
    ssh_args: list[str],
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    transport: Transport | None = None,
) -> PreflightReport:
    """The part of doctor ``ftkit launch`` runs as its preflight: preflight + facts (no rendezvous, a few seconds).

    Raises PreflightError (exit 3) with one line per failure. Returns what :func:`ftkit.run.preflight.run_preflight`
    returns (a drop-in for it), with doctor's checks appended to ``checks``."""
    rep = run_doctor(
        plan, ssh_args=ssh_args, rendezvous=False, env=env, python=python, transport=transport, release_dead_batons=True
    )
    # doctor's thresholds on space, /dev/shm and clock are advice: a launch goes on with a warning (a disk that
    # fills ends the run with exit 12, committed checkpoints intact; ftkit times heartbeats on its own clock)
    advisory = [f for f in rep.failures if _advisory(f)]
    blocking = [f for f in rep.failures if not _advisory(f)]
    if blocking or rep.preflight is None:
        raise PreflightError("\n".join(f.line() for f in blocking) or "preflight failed")
    report = rep.preflight
    report.toolchain = rep.toolchain
    report.checks.extend(f"warning: {f.line()}" for f in advisory)
    report.checks.extend(rep.released)
    report.checks.append(
        f"doctor: versions, run-directory space, /dev/shm, clock, interface, build locks, compiled ops ok on "
        f"{len(rep.hosts)} host(s)"
    )
    return report


def _advisory(f: Failure) -> bool:
    """A finding that is advice for ``ftkit launch`` (under doctor's thresholds), not a reason to refuse."""
    return (
        f.check == "clock"
        or (f.check == "run_dir" and f.message.startswith("only "))
        or (f.check == "shm" and " total, " in f.message)
    )
