"""How long do preflight, teardown and the lost-host probe take on N hosts, with and without unreachable ones?

Why: every one of them used to visit hosts one after another over ssh, each with its own 10-15 s timeout, so a
recovery at 64 hosts with two down spent minutes in ssh alone (issue 13). ftkit.cluster.fanout runs them on all hosts at
once under one deadline. Acceptance: at N = 32 preflight and teardown each take <= 1.5x their N = 2 time, and two
unreachable hosts add <= one ssh timeout (not two).

Hosts are network namespaces with their own sshd (tests/helpers/netns.py), all on this machine: N = 32 means 32 sshd
sessions sharing this machine's cores, so the ratio includes that CPU (a real head node only pays the client side).
The sessions skip root's ~/.bashrc (``skip_bashrc``: this machine's runs ``pyenv init``, 0.15 s of CPU each).
For each N the first N nodes of one 32-node cluster are used; "2 down" takes the bridge port of the last two down
(``cluster.link_down``: packets vanish, as with a pulled cable). Teardown kills stand-in ranks (2 per host and a
per-host agent, writing real pid records) by their records, as the supervisor does (grace 10 s; they exit on
SIGTERM). The operations are ftkit's own: ``run_preflight`` (engine torchrun, master on node0), ``teardown``
(ssh timeout 10 s), ``probe_hosts`` (10 s).

Usage: ``python benchmarks/fanout.py [--sizes 2,4,8,16,32] [--repeats 3] [--no-down]``. Needs root. Takes
``/tmp/ftkit-mp.lock`` so it never shares the cores with a multi-process test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftkit.cluster.procs import targets_from_records, teardown  # noqa: E402
from ftkit.errors import PreflightError  # noqa: E402
from ftkit.run.preflight import run_preflight  # noqa: E402
from ftkit.rundir.layout import RunDir  # noqa: E402
from ftkit.supervise.shrink import probe_hosts  # noqa: E402
from tests.helpers.netns import NetnsCluster, netns_cluster, require_netns, start_standins  # noqa: E402
from tests.helpers.runs import mp_lock  # noqa: E402

PREFLIGHT_TIMEOUT = 15  # ftkit.run.preflight's ssh ConnectTimeout
SSH_TIMEOUT = 10  # teardown's and probe_hosts' default


class Bench:
    def __init__(self, cluster: NetnsCluster, root: Path):
        self.c = cluster
        self.root = root
        self.ssh_args = ["-F", str(cluster.ssh_config)]
        self.attempt = 0
        self.run_dir = root / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def preflight(self, hosts: list[str]) -> tuple[float, str]:
        t0 = time.monotonic()
        try:
            run_preflight(
                hosts=[(h, 1) for h in hosts],
                master_addr=self.c.address(hosts[0]),
                master_port=29517,
                run_dir=self.run_dir,
                engine="torchrun",
                ssh_args=self.ssh_args,
            )
            note = "ok"
        except PreflightError as e:
            note = f"{len(str(e).splitlines())} problem(s)"
        return time.monotonic() - t0, note

    def cpu(self) -> float:
        """CPU seconds spent so far by this process, its reaped children (ssh clients, sh) and every node's sshd
        with its reaped sessions (the remote side of each fan-out)."""
        t = os.times()
        total = t.user + t.system + t.children_user + t.children_system
        for n in self.c.nodes:
            try:
                f = Path(f"/proc/{n.sshd_pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, TypeError):
                continue
            total += sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        return total

    def session_cpu(self, host: str, n: int = 10) -> float:
        """CPU seconds one no-op ``ssh HOST true`` costs here (client, sshd, the session's shell): the floor under
        any fan-out over ssh, since N namespace hosts pay it N times on this machine's cores."""
        argv = ["ssh", *self.ssh_args, "-o", "BatchMode=yes", host, "true"]
        c0 = self.cpu()
        for _ in range(n):
            subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=True, timeout=30)
        return (self.cpu() - c0) / n

    def probe(self, hosts: list[str]) -> tuple[float, str]:
        t0 = time.monotonic()
        lost = probe_hosts([(h, 1) for h in hosts], self.ssh_args, timeout=SSH_TIMEOUT)
        return time.monotonic() - t0, f"{len(lost)} lost"


def measure(b: Bench, n: int, down: int, repeats: int) -> dict[str, tuple[float, str, float]]:
    hosts = b.c.aliases[:n]
    gone = hosts[-down:] if down else []
    out: dict[str, tuple[float, str, float]] = {}
    for name in ("preflight", "teardown", "probe"):
        times, cpus, note = [], [], ""
        for _ in range(repeats):
            if name == "teardown":  # the stand-ins start while all links are up; then hosts are lost
                t, note, cpu = _teardown_with_loss(b, hosts, gone)
            else:
                for h in gone:
                    b.c.link_down(h)
                try:
                    c0 = b.cpu()
                    t, note = getattr(b, name)(hosts)
                    cpu = b.cpu() - c0
                finally:
                    for h in gone:
                        b.c.link_up(h)
            cpus.append(cpu)
            times.append(t)
        out[name] = (statistics.median(times), note, statistics.median(cpus))
    return out


def _teardown_with_loss(b: Bench, hosts: list[str], gone: list[str]) -> tuple[float, str, float]:
    b.attempt += 1
    standins = start_standins(b.c, b.run_dir, attempt=b.attempt, ranks_per_node=2, nodes=hosts)
    try:
        standins.wait_ready(timeout=60)
        for h in gone:
            b.c.link_down(h)
        targets = targets_from_records(RunDir(b.run_dir).records("pids", b.attempt))
        c0, t0 = b.cpu(), time.monotonic()
        res = teardown([], targets, grace_s=10.0, ssh_args=b.ssh_args, ssh_timeout=SSH_TIMEOUT)
        took, cpu = time.monotonic() - t0, b.cpu() - c0
        return took, f"{len(res.signalled)} signalled, {len(res.unreachable)} unreachable, {len(res.left)} left", cpu
    finally:
        for h in gone:
            b.c.link_up(h)
        standins.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=3, help="for the all-reachable case (median); 1 with hosts down")
    ap.add_argument("--no-down", action="store_true", help="skip the 2-unreachable-hosts rows")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    require_netns()
    rows: dict[tuple[int, int], dict[str, tuple[float, str, float]]] = {}
    with mp_lock(), tempfile.TemporaryDirectory(prefix="ftkit-fanout-bench-") as tmp:
        print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
        t0 = time.monotonic()
        with netns_cluster(max(sizes), workdir=Path(tmp) / "netns", skip_bashrc=True) as cluster:
            print(f"{max(sizes)} namespace hosts up in {time.monotonic() - t0:.1f}s", flush=True)
            b = Bench(cluster, Path(tmp))
            session = b.session_cpu(cluster.aliases[0])
            print(f"one no-op ssh session: {1000 * session:.0f} ms of CPU (client + sshd + shell)", flush=True)
            for down in (0,) if args.no_down else (0, 2):
                for n in sizes:
                    rows[n, down] = measure(b, n, down, args.repeats if down == 0 else 1)
                    cells = "  ".join(f"{k} {v[0]:6.2f}s cpu {v[2]:5.2f}s ({v[1]})" for k, v in rows[n, down].items())
                    print(f"N={n:<3} down={down}  {cells}", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    _table(rows, sizes, session)


def _table(rows: dict[tuple[int, int], dict[str, tuple[float, str, float]]], sizes: list[int], session: float) -> None:
    ops = ("preflight", "teardown", "probe")
    timeout = {"preflight": PREFLIGHT_TIMEOUT, "teardown": SSH_TIMEOUT, "probe": SSH_TIMEOUT}
    print()
    print("wall seconds (median), ratio to the smallest N, and CPU seconds spent (head + every sshd and session)")
    print("| N | down | " + " | ".join(f"{o} s | ×N={sizes[0]} | cpu s" for o in ops) + " |")
    print("|---|---|" + "---|---|---|" * len(ops))
    for (n, down), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base = rows.get((sizes[0], down))
        cells = []
        for o in ops:
            ratio = r[o][0] / base[o][0] if base else float("nan")
            cells.append(f"{r[o][0]:.2f} | {ratio:.2f} | {r[o][2]:.2f}")
        print(f"| {n} | {down} | " + " | ".join(cells) + " |")
    big = max(sizes)
    if (big, 0) in rows and (sizes[0], 0) in rows:
        for o in ("preflight", "teardown"):
            ratio = rows[big, 0][o][0] / rows[sizes[0], 0][o][0]
            cores = os.cpu_count() or 1
            floor = rows[big, 0][o][2] / cores  # the wall time the CPU alone needs on this machine's cores
            # N no-op ssh sessions alone need N * session CPU-seconds on this machine's cores, however well they
            # overlap: a lower bound on N's wall time, so on the ratio any ssh fan-out can reach here.
            best = big * session / cores / rows[sizes[0], 0][o][0]
            print(
                f"{o}: N={big} / N={sizes[0]} = {ratio:.2f} ({'ok' if ratio <= 1.5 else 'OVER'} the 1.5 bound); "
                f"N={big} used {rows[big, 0][o][2]:.2f} CPU-s = {floor:.2f}s of wall on {cores} cores at best; "
                f"{big} no-op ssh sessions alone put the ratio at >= {best:.2f} here"
            )
    for n in sizes:
        if (n, 2) in rows:
            extra = {o: rows[n, 2][o][0] - rows[n, 0][o][0] for o in ops}
            print(
                f"N={n}: 2 unreachable hosts add "
                + ", ".join(f"{o} {extra[o]:.1f}s (timeout {timeout[o]}s)" for o in ops)
                + ("" if all(extra[o] <= timeout[o] for o in ops) else "  OVER one timeout")
            )


if __name__ == "__main__":
    main()
