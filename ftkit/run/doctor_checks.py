"""What ``ftkit doctor`` found, as data: one :class:`DoctorReport` (a row per host, a check per column, one
:class:`Failure` per problem with its fix), its text and JSON forms, and the pure rules that turn one host's facts
(``python -m ftkit.launch.doctor_probe facts``) into cells and failures. No processes here (:mod:`ftkit.run.doctor`
runs the probes), so every rule is tested without a host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from ftkit.cluster.toolchain import OPS, ToolchainFacts, op_problems

if TYPE_CHECKING:
    from ftkit.run.preflight import PreflightReport

MIN_FREE_RUN_DIR = 1 << 30  # bytes free in the run directory below which doctor fails (checkpoints need room)
MIN_SHM = 512 << 20  # bytes of /dev/shm (size and free) below which doctor fails (NCCL/DeepSpeed shm buffers)
MAX_SKEW_S = 5.0  # clock skew against this machine above which doctor fails (logs and events disagree)

COLUMNS = ("ssh", "versions", "gpu", "run_dir", "shm", "clock", "iface", "locks", "ops", "rendezvous")


# ------------------------------------------------------------------------------- what the probes print


class DiskFacts(TypedDict, total=False):
    """Space in a directory (the run directory, /dev/shm) as the facts probe reports it; ``error`` instead."""

    path: str
    free: int
    total: int
    error: str


class GpuFacts(TypedDict, total=False):
    """nvidia-smi's answer (cuda only): GPU count, models, drivers; or ``error``."""

    count: int
    models: list[str]
    drivers: list[str]
    error: str


class RouteFacts(TypedDict, total=False):
    """The interface (``dev``) and address (``ip``) the host routes master_addr through; or ``error``."""

    ip: str
    dev: str
    error: str


class LockFact(TypedDict):
    """A torch extension build lock and the pid building behind it (None: nobody holds it)."""

    path: str
    holder: int | None


class HostFacts(TypedDict, total=False):
    """What ``python -m ftkit.launch.doctor_probe facts`` prints for one host (``gpu`` on cuda only)."""

    hostname: str
    python_exe: str
    versions: dict[str, str]
    run_dir: DiskFacts
    shm: DiskFacts
    interfaces: list[str]
    ifname_var: str
    ifname: str | None
    route: RouteFacts
    locks: list[LockFact]
    locks_released: list[str]
    gpu: GpuFacts
    toolchain: ToolchainFacts
    time: float


class AllReduceTiming(TypedDict):
    """One timed all-reduce: its size, seconds per call and NCCL bus bandwidth."""

    bytes: int
    seconds: float
    busbw_gbs: float


class PairTiming(AllReduceTiming):
    """A timed all-reduce between two hosts, named (the probe names them by rank)."""

    hosts: list[str]


class Bandwidth(TypedDict):
    """What ``ftkit doctor --bandwidth`` measured, in the bandwidth file's format (:mod:`ftkit.run.doctor`)."""

    version: int
    measured_at: str
    hosts: list[str]
    inter_node_gbs: float | None
    intra_node_gbs: float
    intra_node_source: str
    backend: str
    all_reduce: list[AllReduceTiming]
    pairs: list[PairTiming]


@dataclass
class Failure:
    host: str  # "-" for a failure not tied to one host
    check: str
    message: str
    fix: str = ""

    def line(self) -> str:
        where = f"host {self.host}: " if self.host != "-" else ""
        return f"{where}{self.check}: {self.message}" + (f" [{self.fix}]" if self.fix else "")


@dataclass
class DoctorReport:
    hosts: list[str]
    cells: dict[str, dict[str, str]] = field(default_factory=dict)  # host -> column -> short value
    failures: list[Failure] = field(default_factory=list)
    bandwidth: Bandwidth | None = None
    bandwidth_file: str | None = None
    notes: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # build locks a killed rank of the run left, removed
    seconds: float = 0.0
    preflight: PreflightReport | None = None  # when preflight passed
    toolchain: dict[str, ToolchainFacts] = field(default_factory=dict)  # host -> its facts for DeepSpeed's ops

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, host: str, check: str, message: str, fix: str = "") -> None:
        self.failures.append(Failure(host, check, message, fix))
        if host in self.cells:
            self.cells[host][check] = "FAIL"

    def set(self, host: str, check: str, value: str) -> None:
        row = self.cells.setdefault(host, {})
        if row.get(check) != "FAIL":
            row[check] = value

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "hosts": {h: self.cells.get(h, {}) for h in self.hosts},
            "failures": [f.__dict__ | {"line": f.line()} for f in self.failures],
            "bandwidth": self.bandwidth,
            "bandwidth_file": self.bandwidth_file,
            "notes": self.notes,
            "seconds": round(self.seconds, 2),
        }


def slow_pairs(bandwidth: Bandwidth) -> list[PairTiming]:
    """Pairs whose bus bandwidth is under half the median pair's: the slow link to look at."""
    pairs = bandwidth.get("pairs") or []
    if len(pairs) < 3:
        return []
    speeds = sorted(p["busbw_gbs"] for p in pairs)
    median = speeds[len(speeds) // 2]
    return [p for p in pairs if p["busbw_gbs"] < median / 2]


def format_report(rep: DoctorReport) -> str:
    """One row per host, a check per column; then one line per failure with its fix; then bandwidth."""
    head = ["host", *COLUMNS]
    rows = [[h, *(rep.cells.get(h, {}).get(c, "-") for c in COLUMNS)] for h in rep.hosts]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows]]
    if rep.bandwidth:
        lines.append("")
        lines.append(f"all-reduce bus bandwidth across {len(rep.hosts)} host(s) ({rep.bandwidth.get('backend')}):")
        for row in rep.bandwidth.get("all_reduce", []):
            lines.append(
                f"  {row['bytes'] / 2**20:8.1f} MiB  {row['busbw_gbs']:9.3f} GB/s  ({row['seconds'] * 1e3:.1f} ms)"
            )
        for row in rep.bandwidth.get("pairs", []):
            a, b = row["hosts"]
            slow = "  <- slow link (under half the median pair)" if row in slow_pairs(rep.bandwidth) else ""
            lines.append(f"  pair {a} <-> {b}: {row['busbw_gbs']:.3f} GB/s at {row['bytes'] / 2**20:.0f} MiB{slow}")
        if rep.bandwidth_file:
            lines.append(f"bandwidth recorded in {rep.bandwidth_file} (ftkit plan reads it)")
    lines.append("")
    lines += rep.notes
    if rep.failures:
        lines.append(f"{len(rep.failures)} check(s) failed:")
        lines += [f"  {f.line()}" for f in rep.failures]
    else:
        lines.append(f"all checks passed on {len(rep.hosts)} host(s) in {rep.seconds:.1f}s")
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}G"


def _ifname_matches(spec: str, names: list[str], nccl: bool) -> list[str]:
    """The interfaces ``spec`` selects: gloo takes exact names (comma list); NCCL prefixes, ``=`` exact, ``^`` not."""
    items = [s for s in spec.split(",") if s]
    if not nccl:
        return [n for n in names if n in items]
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    items = [s for s in (body[1:] if exact else body).split(",") if s]
    hit = [n for n in names if any(n == s if exact else n.startswith(s) for s in items)]
    return [n for n in names if n not in hit and n != "lo"] if exclude else hit


def check_facts(
    rep: DoctorReport,
    host: str,
    f: HostFacts,
    mine: dict[str, str],
    received: float,
    accel: str,
    tier_bytes: int = 0,
    shm_need: int = 0,
    ranks: int = 0,
) -> None:
    """Turn one host's facts into cells and failures (pure: tested without any host). ``tier_bytes``: what the
    run's local checkpoint tier needs of /dev/shm on each node (0: no tier there); ``shm_need``: what the ranks
    themselves map there (DeepSpeed's CPU collectives on one node: 66 MiB for each of the host's ``ranks``), which
    blocks a launch: every rank would die of SIGBUS at its first collective, and every restart again."""
    theirs = f.get("versions", {})
    diffs = [f"{k} {theirs.get(k, 'missing')} (here {v})" for k, v in mine.items() if theirs.get(k) != v]
    if diffs:
        rep.fail(host, "versions", "differs: " + "; ".join(diffs), "install the same versions on every host")
    else:
        rep.set(host, "versions", f"torch {theirs.get('torch', '?')}")
    if accel == "cuda":
        g = f.get("gpu") or {}
        if g.get("error"):
            rep.fail(host, "gpu", g["error"], "install the NVIDIA driver, or set cluster.accelerator=cpu")
        else:
            rep.set(
                host, "gpu", f"{g.get('count')}x {','.join(g.get('models', []))} drv {','.join(g.get('drivers', []))}"
            )
    else:
        rep.set(host, "gpu", "cpu")
    rd = f.get("run_dir") or {}
    if rd.get("error"):
        rep.fail(
            host, "run_dir", f"{rd.get('path')}: {rd['error']}", "put train.output_dir on storage every host shares"
        )
    elif rd.get("free", 0) < MIN_FREE_RUN_DIR:
        rep.fail(
            host,
            "run_dir",
            f"only {_gib(rd.get('free', 0))} free in {rd.get('path')}",
            "free space or move train.output_dir",
        )
    else:
        rep.set(host, "run_dir", f"{_gib(rd['free'])} free")
    shm = f.get("shm") or {}
    if shm.get("error"):
        rep.fail(host, "shm", shm["error"], "mount a tmpfs on /dev/shm")
    elif shm_need and shm.get("free", 0) < shm_need:
        what = (
            f"DeepSpeed's CPU collectives need {shm_need // ranks >> 20} MiB per rank ({ranks} here: {_gib(shm_need)})"
        )
        rep.fail(
            host,
            "shm",
            f"/dev/shm has {_gib(shm.get('free', 0))} free: {what}; every rank would die of SIGBUS at its first "
            "collective",
            "enlarge it (docker run --shm-size=16g; mount -o remount,size=16G /dev/shm) or remove stale buffers",
        )
    elif shm.get("total", 0) < MIN_SHM or shm.get("free", 0) < MIN_SHM:
        rep.fail(
            host,
            "shm",
            f"/dev/shm {_gib(shm.get('total', 0))} total, {_gib(shm.get('free', 0))} free (< {_gib(MIN_SHM)})",
            "enlarge it (docker run --shm-size=16g; mount -o remount,size=16G /dev/shm) or remove stale buffers",
        )
    elif tier_bytes and shm.get("free", 0) < tier_bytes + MIN_SHM:
        rep.fail(
            host,
            "shm",
            f"the local checkpoint tier needs {_gib(tier_bytes)} of /dev/shm and the collectives {_gib(MIN_SHM)}: "
            f"{_gib(shm.get('free', 0))} free",
            "set checkpoint.local_dir to node-local NVMe, or null; or enlarge /dev/shm",
        )
    else:
        rep.set(host, "shm", f"{_gib(shm['total'])}/{_gib(shm['free'])} free")
    if isinstance(f.get("time"), (int, float)):
        skew = float(f["time"]) - received
        if abs(skew) > MAX_SKEW_S:
            rep.fail(host, "clock", f"clock {skew:+.1f}s off this machine", "synchronise clocks (chrony/NTP)")
        else:
            rep.set(host, "clock", f"{skew:+.1f}s")
    names = list(f.get("interfaces", []))
    var, spec = f.get("ifname_var"), f.get("ifname")
    route = f.get("route") or {}
    if spec:
        hit = _ifname_matches(spec, names, nccl=var == "NCCL_SOCKET_IFNAME")
        first = spec.lstrip("^=").split(",")[0]
        if not hit:
            rep.fail(
                host,
                "iface",
                f"{var}={spec} names no interface there (it has {', '.join(names) or 'none'})",
                f"name an interface every host has, or rename it there (ip link set <dev> name {first})",
            )
        else:
            rep.set(host, "iface", ",".join(hit))
    elif route.get("error"):
        rep.fail(host, "iface", route["error"], "fix cluster.master_addr or the routes on that host")
    else:
        rep.set(host, "iface", route.get("dev") or route.get("ip") or "?")


def check_ops(rep: DoctorReport, host: str, facts: ToolchainFacts, ops: list[str], accel: str, why: str = "") -> None:
    """The compiled DeepSpeed ops the run needs (``ops``, :func:`ftkit.plan.knobs.compiled_ops`) on one host: each
    prebuilt there, or buildable (one failure per cause, naming the op, the cause and the fix). ``why``: what needs
    them (``zero.cpu_adam true``)."""
    if not ops:
        rep.set(host, "ops", "none needed")
        return
    cells = []
    for op in ops:
        problems = op_problems(op, facts, accel)
        for p in problems:
            rep.fail(host, "ops", f"{op} ({OPS.get(op, op)}{', ' + why if why else ''}) cannot be built: {p}")
        if op in facts.get("ds_prebuilt", []) and facts.get("ds_accelerator") == accel:
            cells.append(f"{op} prebuilt")
        elif not problems:
            cells.append(f"{op} {'built' if op in facts.get('jit_cached', []) else 'buildable'}")
    if cells:
        rep.set(host, "ops", ", ".join(cells))


def check_locks(rep: DoctorReport, per_host: dict[str, list[LockFact]]) -> None:
    """A lock is stale when no host reports a holder for it (hosts may share the file system)."""
    held = {lk["path"] for locks in per_host.values() for lk in locks if lk.get("holder")}
    for host, locks in per_host.items():
        stale = [lk["path"] for lk in locks if not lk.get("holder") and lk["path"] not in held]
        for path in stale:
            rep.fail(
                host,
                "locks",
                f"stale torch extension build lock {path}: a killed build left it; "
                "every rank that builds this op waits forever",
                f"rm {path}",
            )
        if not stale:
            rep.set(host, "locks", "building" if any(lk.get("holder") for lk in locks) else "none")
