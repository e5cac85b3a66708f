"""Run ownership without training: the flock and the owner record each refuse a second owner on their own (NFS may
not honour flock), a dead owner's record is replaced, its live ranks block a launch unless taken over, and the
ranks' watchdog stops a rank whose supervisor is gone (fake clock)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.cluster.procs import proc_start_time
from ftkit.errors import ExitCode, RunBusy
from ftkit.run.ownership import Leftovers, Ownership, leftovers, owner_state
from ftkit.rundir.layout import RunDir
from ftkit.rundir.owner import Owner, read_owner
from launch.watchdog import SupervisorWatchdog


@pytest.fixture
def sleeper():
    """A real process that stands for a live supervisor or rank."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def owner_of(pid: int) -> Owner:
    me = Owner.me()
    return Owner(me.host, pid, proc_start_time(pid), me.boot_id, time.time(), ("ftkit", "launch"))


def test_acquire_writes_the_owner_record_and_release_removes_it(tmp_path):
    rd = RunDir(tmp_path / "run")
    own = Ownership(rd)
    own.acquire()
    try:
        rec = read_owner(rd)
        assert rec is not None and rec.pid == os.getpid() and rec.start_time == proc_start_time(os.getpid())
        assert owner_state(rec, []) == "alive"
        assert sorted(p.name for p in rd.meta.iterdir()) == ["lock", "owner.json", "supervisor.json"]
    finally:
        own.release()
    assert read_owner(rd) is None and not (rd.meta / "supervisor.json").exists()
    assert not list(rd.meta.glob(".owner*"))  # no temp record left


def test_a_held_flock_refuses_a_second_owner(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl,time; f=open({str(rd.meta / 'lock')!r},'w'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunBusy) as e:
            Ownership(rd).acquire()
        assert e.value.exit_code == ExitCode.RUN_BUSY and "ftkit stop" in str(e.value)
    finally:
        holder.kill()
        holder.wait()


def test_a_live_owner_record_refuses_even_without_the_flock(tmp_path, sleeper):
    """On a file system where flock does not reach the other host, the record alone still protects the run."""
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    (rd.meta / "owner.json").write_text(owner_of(sleeper.pid).to_json())
    with pytest.raises(RunBusy) as e:
        Ownership(rd).acquire()
    assert f"pid {sleeper.pid}" in str(e.value)
    # The refusal wrote nothing and left the record alone.
    assert read_owner(rd).pid == sleeper.pid and not (rd.meta / "supervisor.json").exists()
    with open(rd.meta / "lock") as fh:  # and the lock was released again
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_dead_owner_record_is_replaced(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Owner(Owner.me().host, int(dead.stdout), 12345, Owner.me().boot_id, 1.0)
    (rd.meta / "owner.json").write_text(stale.to_json())
    own = Ownership(rd)
    own.acquire()
    try:
        assert read_owner(rd).pid == os.getpid()
    finally:
        own.release()


def test_an_owner_on_a_host_that_cannot_be_reached_refuses_unless_taken_over(tmp_path):
    """Nobody can tell whether a supervisor on an unreachable host still runs: the launch refuses, naming the host
    and --takeover, and leaves the record; with --takeover it becomes the owner (issue 41's mutation check: taking
    over silently passed every fast test)."""
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    away = Owner("ftkit-test-host.invalid", 4242, 12345, "another-boot", 1.0, ("ftkit", "launch"))
    (rd.meta / "owner.json").write_text(away.to_json())
    ssh = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=2"]
    assert owner_state(away, ssh) == "unknown"
    with pytest.raises(RunBusy) as e:
        Ownership(rd, ssh).acquire()
    assert "ftkit-test-host.invalid cannot be reached" in str(e.value) and "--takeover" in str(e.value), e.value
    assert read_owner(rd) == away
    own = Ownership(rd, ssh)
    own.acquire(takeover=True)
    try:
        assert read_owner(rd).pid == os.getpid()
    finally:
        own.release()


def test_a_record_from_before_a_reboot_is_dead(sleeper):
    o = owner_of(sleeper.pid)
    assert owner_state(o, []) == "alive"
    assert owner_state(Owner(o.host, o.pid, o.start_time, "another-boot"), []) == "dead"
    assert owner_state(Owner(o.host, o.pid, (o.start_time or 0) + 1, o.boot_id), []) == "dead"  # pid reused


def _orphan_run(tmp_path: Path, pid: int) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rec = {"rank": 0, "host": "localhost", "pid": pid, "start_time": proc_start_time(pid), "attempt": 0}
    rd.pid_file(0, 0).parent.mkdir(parents=True)
    rd.pid_file(0, 0).write_text(json.dumps(rec))
    dead = Owner(Owner.me().host, 2**22 + 7, 1, Owner.me().boot_id, 1.0)  # a pid that cannot exist
    (rd.meta / "owner.json").write_text(dead.to_json())
    return rd


def test_ranks_of_a_dead_supervisor_block_a_launch_unless_taken_over(tmp_path, sleeper):
    rd = _orphan_run(tmp_path, sleeper.pid)
    with pytest.raises(RunBusy) as e:
        Ownership(rd).acquire()
    assert "--takeover" in str(e.value) and f"pid {sleeper.pid}" in str(e.value)
    seen: list[Leftovers] = []

    def teardown(left: Leftovers) -> None:
        seen.append(left)
        sleeper.kill()
        sleeper.wait()

    own = Ownership(rd)
    own.acquire(takeover=True, teardown=teardown)
    try:
        assert [r["pid"] for r in seen[0].records] == [sleeper.pid] and own.taken_over
        assert not leftovers(rd)
    finally:
        own.release()


def test_malformed_owner_record_is_one_clear_error(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    (rd.meta / "owner.json").write_text("[1, 2")
    with pytest.raises(Exception) as e:
        Ownership(rd).acquire()
    assert "owner record is malformed" in str(e.value) and e.value.exit_code == ExitCode.USAGE


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_watchdog_stops_a_rank_when_the_supervisor_heartbeat_goes_silent(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    remote = Owner("head-node-elsewhere", 4242, 1, "b", 1.0)  # not this host: only the heartbeat tells
    (rd.meta / "owner.json").write_text(remote.to_json())
    beat = rd.meta / "supervisor.json"
    beat.write_text('{"seq": 1}')
    clock = Clock()
    wd = SupervisorWatchdog(rd, timeout_s=30, clock=clock)
    for seq in range(2, 10):  # a beating supervisor, whatever the clocks say
        clock.t += 10
        beat.write_text(json.dumps({"seq": seq}))
        assert wd.check() is None
    clock.t += 29
    assert wd.check() is None
    clock.t += 2
    why = wd.check()
    assert why and "not seen for 31s" in why and "orphan_timeout_s=30" in why


def test_watchdog_sees_a_dead_local_supervisor_and_a_takeover(tmp_path, sleeper):
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    (rd.meta / "owner.json").write_text(owner_of(sleeper.pid).to_json())
    clock = Clock()
    wd = SupervisorWatchdog(rd, timeout_s=5, clock=clock)
    clock.t = 100  # no heartbeat file at all, but the supervisor's pid is alive here
    assert wd.check() is None
    sleeper.kill()
    sleeper.wait()
    clock.t = 104
    assert wd.check() is None  # dead, but not yet for orphan_timeout_s
    clock.t = 106
    assert "not seen" in wd.check()
    wd2 = SupervisorWatchdog(rd, timeout_s=5, clock=clock)
    (rd.meta / "owner.json").write_text(owner_of(os.getpid()).to_json())
    assert "took the run over" in wd2.check()


SPINNING_RANK = """
import ctypes, signal, sys
from pathlib import Path
from ftkit.rundir.layout import RunDir
import launch.watchdog as watchdog
from launch.watchdog import SupervisorWatchdog

watchdog.ESCALATE_S = 1.0
def exit_on_sigterm(signum, frame):  # as launch/train.py does until training begins
    raise SystemExit(143)

signal.signal(signal.SIGTERM, exit_on_sigterm)
assert SupervisorWatchdog(RunDir(Path(sys.argv[1])), timeout_s=0.5).start()
print("blocked", flush=True)
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # zeroed: glibc's PTHREAD_MUTEX_INITIALIZER
libc.pthread_mutex_lock(mutex)
# blocked in C for good with the GIL released (ctypes lets go of it), deaf to signals: a rank waiting in a collective
libc.pthread_mutex_lock(mutex)
"""


def test_watchdog_ends_a_rank_stuck_where_its_sigterm_cannot_reach(tmp_path):
    """A rank blocked in C during start-up (its SIGTERM handler unwinds by an exception, which Python raises only back
    in the interpreter) used to outlive its dead supervisor for good (two ranks seen 10 minutes later, one spinning);
    the watchdog now SIGKILLs it escalate_s after its SIGTERM."""
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    gone = Owner(Owner.me().host, 2**22 + 7, 1, Owner.me().boot_id, 1.0)  # a pid that cannot exist: a dead supervisor
    (rd.meta / "owner.json").write_text(gone.to_json())
    rank = subprocess.Popen(
        [sys.executable, "-c", SPINNING_RANK, str(rd.path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = rank.communicate(timeout=30)  # 0.5 s orphan timeout + a 2 s poll + 1 s escalation
    except subprocess.TimeoutExpired:
        rank.kill()
        out, _ = rank.communicate()
        pytest.fail(f"the stuck rank outlived its supervisor by 30 s: {out}")
    assert rank.returncode == -9, out
    assert "this rank stops itself" in out and "still running 1s after SIGTERM: SIGKILL" in out


def test_watchdog_is_off_when_no_supervisor_owns_the_run(tmp_path):
    assert SupervisorWatchdog(RunDir(tmp_path), timeout_s=1).start() is False


def test_watchdog_trusts_a_pid_only_on_the_same_running_kernel(tmp_path, sleeper):
    """Containers on different machines often share a host name: a pid there means nothing here."""
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    twin = owner_of(sleeper.pid)
    (rd.meta / "owner.json").write_text(Owner(twin.host, twin.pid, twin.start_time, "another-kernel", 1.0).to_json())
    clock = Clock()
    wd = SupervisorWatchdog(rd, timeout_s=5, clock=clock)
    clock.t = 6  # the pid is alive here, but the record is another kernel's and no heartbeat came
    assert "not seen" in wd.check()


def test_status_line_says_who_runs_the_run_or_that_its_ranks_run_unsupervised(tmp_path, sleeper):
    from ftkit.run.ownership import liveness

    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    assert liveness(rd.path) is None
    (rd.meta / "owner.json").write_text(owner_of(sleeper.pid).to_json())
    assert liveness(rd.path).startswith("running, supervised by ftkit launch")
    rd = _orphan_run(tmp_path / "b", sleeper.pid)
    line = liveness(rd.path)
    assert line.startswith("NOT SUPERVISED") and f"pid {sleeper.pid}" in line and "--takeover" in line


def test_status_and_stop_never_run_configuration_from_the_run_directory(tmp_path):
    """`ftkit status`/`ftkit stop` used to pass the cluster.ssh_config recorded in RUN/ftkit/spec.json to `ssh -F`:
    a ProxyCommand there ran as whoever inspected the run. A host name read from the run's records can never be
    taken for an ssh option either."""
    from tests.helpers.cli import run_ftkit

    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil_ssh_config"
    evil.write_text(f"Host *\n  ProxyCommand touch {marker}\n")
    rd.spec.write_text(json.dumps({"recipe": {"cluster": {"ssh_config": str(evil)}}}))
    (rd.path / "events.jsonl").write_text("")
    for host in ("node-elsewhere.invalid", f"-oProxyCommand=touch {marker}"):
        owner = Owner(host, 4242, 1, "another-boot", time.time(), ("ftkit", "launch"))
        (rd.meta / "owner.json").write_text(owner.to_json())
        for args in (["status", str(rd.path)], ["stop", str(rd.path), "--timeout", "1"]):
            r = run_ftkit(*args, timeout=60)
            assert "Traceback" not in r.stderr, r.stderr
            assert not marker.exists(), (host, args, r.stdout, r.stderr)
    # The caller's own configuration, named on the command line, is used.
    mine = tmp_path / "my_ssh_config"
    mine.write_text(f"Host *\n  ProxyCommand sh -c 'touch {tmp_path}/mine; exit 1'\n")
    owner = Owner("node-elsewhere.invalid", 4242, 1, "another-boot", time.time(), ("ftkit", "launch"))
    (rd.meta / "owner.json").write_text(owner.to_json())
    run_ftkit("status", str(rd.path), "--ssh-config", str(mine), timeout=60)
    assert (tmp_path / "mine").exists() and not marker.exists()
