"""ftkit doctor: the report (table, JSON, one line per failure with the fix), the stale JIT build lock finder and
the supervisor's loading hint, CLI errors, an unreachable host. The real runs (this machine, and two namespace hosts
with one broken) are in tests/integration/doctor/test_doctor.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ftkit.cluster import buildlocks
from ftkit.errors import PreflightError
from ftkit.plan.local_tier import shm_bytes
from ftkit.run.doctor import cheap_checks
from ftkit.run.doctor_checks import DoctorReport, _ifname_matches, check_facts, check_locks, format_report
from tests.helpers.doctor import build_lock, clean_ftkit, failures, holding_rank, local_recipe, read_until
from tests.helpers.paths import MODEL_CONFIGS

# ------------------------------------------------------------------------------------------- build locks


def _holder(argv_code: str, cwd: Path | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", argv_code], cwd=cwd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_stale_lock_is_the_one_no_process_holds(tmp_path):
    root = tmp_path / "ext"
    stale = build_lock(root, "cpu_adam")
    by_fd = build_lock(root, "deepspeed_shm_comm")
    by_cwd = build_lock(root, "fused_op")
    # As FileBaton's builder: the lock's descriptor open for the whole build; as ninja: running in the op's dir.
    a = _holder(
        f"import os, time; fd = os.open({str(by_fd)!r}, os.O_RDONLY); print('ready', flush=True); time.sleep(60)"
    )
    b = _holder("import time; print('ready', flush=True); time.sleep(60)", cwd=by_cwd.parent)
    try:
        env = {"TORCH_EXTENSIONS_DIR": str(root)}
        assert buildlocks.stale_build_locks(env) == [stale]
        states = dict(buildlocks.lock_states(env))
        assert states[by_fd] == a.pid and states[by_cwd] == b.pid and states[stale] is None
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    assert buildlocks.stale_build_locks(env) == sorted([stale, by_fd, by_cwd])  # holders gone: all stale now


def _baton(lock: Path, what: str) -> subprocess.Popen:
    """torch's own FileBaton (loaded from its file, without importing torch): ``acquire`` holds the baton as a
    building process does; ``wait`` waits for it as every other rank does."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    path = Path(spec.origin).parent / "utils" / "file_baton.py"
    code = (
        "import importlib.util, sys\n"
        f"s = importlib.util.spec_from_file_location('fb', {str(path)!r}); m = importlib.util.module_from_spec(s)\n"
        f"s.loader.exec_module(m); b = m.FileBaton({str(lock)!r})\n"
        + {
            "acquire": "assert b.try_acquire(); print('ready', flush=True); import time; time.sleep(60)\n",
            "wait": "print('ready', flush=True); b.wait()\n",
            # every rank of a running job loading its ops: the baton taken (the file created), a no-op build,
            # the baton given back (the file closed, then removed), again and again
            "cycle": (
                "import time; print('ready', flush=True)\n"
                "while True:\n"
                "    if b.try_acquire():\n"
                "        time.sleep(0.01); b.release()\n"
                "    time.sleep(0.002)\n"
            ),
        }[what]
    )
    return _holder(code)


@pytest.mark.heavy
def test_real_file_baton_holder_and_waiter(tmp_path):
    root = tmp_path / "ext"
    (root / "built").mkdir(parents=True)
    held = root / "built" / "lock"
    stale = build_lock(root, "deepspeed_shm_comm")
    holder = _baton(held, "acquire")  # creates the lock (O_CREAT|O_EXCL) and keeps it open, as a build does
    waiter = _baton(stale, "wait")  # polls a lock nobody holds: waits forever, and does not count as a holder
    try:
        env = {"TORCH_EXTENSIONS_DIR": str(root)}
        assert buildlocks.stale_build_locks(env) == [stale]
        assert dict(buildlocks.lock_states(env))[held] == holder.pid
        assert waiter.poll() is None
    finally:
        for p in (holder, waiter):
            p.kill()
            p.wait()


@pytest.mark.heavy
def test_a_build_that_starts_or_ends_during_the_scan_is_not_stale(tmp_path):
    """Another job on this machine loading its ops takes and gives back the baton many times a second; a lock seen
    between its listing and the scan of /proc, or between the holder's close and its remove, is not stale. (Seen
    for real: a second job's preflight refused with exit 3, naming a lock the first job's ranks held.)"""
    root = tmp_path / "ext"
    (root / "deepspeed_shm_comm").mkdir(parents=True)
    lock = root / "deepspeed_shm_comm" / "lock"
    cycling = _baton(lock, "cycle")
    try:
        env = {"TORCH_EXTENSIONS_DIR": str(root)}
        seen = [buildlocks.stale_build_locks(env) for _ in range(100)]
        assert not any(seen), f"{sum(map(bool, seen))} of 100 scans called a held lock stale"
    finally:
        cycling.kill()
        cycling.wait()
    if lock.exists():  # killed holding the baton: now it is stale, and still found
        assert buildlocks.stale_build_locks(env) == [lock]


def test_default_layout_under_the_cache_dir(tmp_path):
    stale = build_lock(tmp_path / "cache" / "torch_extensions" / "py311_cpu", "cpu_adam")
    (stale.parent / "cpu_adam.so").write_text("")  # a finished build next to it changes nothing
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    assert buildlocks.stale_build_locks(env) == [stale]
    assert buildlocks.stale_build_locks({"HOME": str(tmp_path / "nowhere")}) == []


def test_loading_hint_after_a_minute_with_a_stale_lock(tmp_path):
    root = tmp_path / "ext"
    env = {"TORCH_EXTENSIONS_DIR": str(root)}
    now = 1000.0
    hbs = [{"rank": 0, "phase": "loading", "time": now - 61}, {"rank": 1, "phase": "train", "time": now}]
    assert buildlocks.loading_hint(hbs, now, env=env) is None  # no lock: nothing to say
    lock = build_lock(root, "cpu_adam")
    hint = buildlocks.loading_hint(hbs, now, env=env)
    assert hint and "rank(s) 0" in hint and f"[rm {lock}]" in hint
    assert buildlocks.loading_hint([{"rank": 0, "phase": "loading", "time": now - 30}], now, env=env) is None
    # DeepSpeed builds CPU Adam inside trainer.train(): after the "train" heartbeat, before the first step
    assert "rank(s) 2" in buildlocks.loading_hint(
        [{"rank": 2, "phase": "train", "step": None, "time": now - 90}], now, env=env
    )
    assert buildlocks.loading_hint([{"rank": 2, "phase": "train", "step": 3, "time": now - 90}], now, env=env) is None
    # On the supervisor's own clock (Progress.phases): the heartbeat's time is ignored.
    hb = [{"rank": 3, "phase": "loading", "time": 0.0}]
    assert buildlocks.loading_hint(hb, 500.0, since={3: ("loading", 470.0)}, env=env) is None
    assert "rank(s) 3" in buildlocks.loading_hint(hb, 500.0, since={3: ("loading", 430.0)}, env=env)


# ------------------------------------------------------------------------------------------- the report


MINE = {"python": "3.11.7", "torch": "2.13.0+cpu", "ftkit": "0.1.0"}
GOOD = {
    "versions": dict(MINE),
    "run_dir": {"path": "/r", "free": 50 << 30, "total": 100 << 30},
    "shm": {"path": "/dev/shm", "free": 8 << 30, "total": 8 << 30},
    "interfaces": ["eth0", "lo"],
    "ifname_var": "GLOO_SOCKET_IFNAME",
    "ifname": "eth0",
    "route": {"ip": "10.0.0.1", "dev": "eth0"},
    "time": 1000.0,
}


def test_report_row_per_host_and_a_line_per_failure_with_its_fix():
    rep = DoctorReport(hosts=["node0", "node1"], cells={"node0": {}, "node1": {}})
    check_facts(rep, "node0", GOOD, MINE, 1000.2, "cpu")
    bad = {
        **GOOD,
        "versions": {**MINE, "torch": "2.1.0"},
        "shm": {"path": "/dev/shm", "free": 10 << 20, "total": 64 << 20},
        "interfaces": ["eth9", "lo"],
        "time": 1060.0,
    }
    check_facts(rep, "node1", bad, MINE, 1000.0, "cpu")
    check_locks(rep, {"node0": [], "node1": [{"path": "/c/op/lock", "holder": None}]})
    assert rep.ok is False
    lines = [f.line() for f in rep.failures]
    assert lines == [
        "host node1: versions: differs: torch 2.1.0 (here 2.13.0+cpu) [install the same versions on every host]",
        "host node1: shm: /dev/shm 0.1G total, 0.0G free (< 0.5G) [enlarge it (docker run --shm-size=16g; "
        "mount -o remount,size=16G /dev/shm) or remove stale buffers]",
        "host node1: clock: clock +60.0s off this machine [synchronise clocks (chrony/NTP)]",
        "host node1: iface: GLOO_SOCKET_IFNAME=eth0 names no interface there (it has eth9, lo) [name an interface "
        "every host has, or rename it there (ip link set <dev> name eth0)]",
        "host node1: locks: stale torch extension build lock /c/op/lock: a killed build left it; every rank that "
        "builds this op waits forever [rm /c/op/lock]",
    ]
    text = format_report(rep)
    table = text.splitlines()
    assert table[0].split() == [
        "host",
        "ssh",
        "versions",
        "gpu",
        "run_dir",
        "shm",
        "clock",
        "iface",
        "locks",
        "ops",
        "rendezvous",
    ]
    assert table[1].split()[0] == "node0" and "FAIL" not in table[1] and "-0.2s" in table[1]
    assert table[2].split()[0] == "node1" and table[2].count("FAIL") == 5
    assert "5 check(s) failed:" in text and all(f"  {line}" in text for line in lines)
    data = json.loads(json.dumps(rep.as_dict()))
    assert data["ok"] is False and data["hosts"]["node1"]["iface"] == "FAIL"
    assert [f["fix"] for f in data["failures"]][-1] == "rm /c/op/lock"


def test_bandwidth_section_names_a_slow_pair():
    rep = DoctorReport(hosts=["a", "b", "c"], cells={h: {} for h in "abc"})
    pair = {"bytes": 8 << 20, "seconds": 0.1}
    rep.bandwidth = {
        "backend": "gloo",
        "all_reduce": [{"bytes": 32 << 20, "seconds": 0.5, "busbw_gbs": 1.25}],
        "pairs": [
            {"hosts": ["a", "b"], **pair, "busbw_gbs": 10.0},
            {"hosts": ["a", "c"], **pair, "busbw_gbs": 9.0},
            {"hosts": ["b", "c"], **pair, "busbw_gbs": 2.0},
        ],
    }
    rep.bandwidth_file = "/x/bandwidth.json"
    text = format_report(rep)
    assert "      32.0 MiB      1.250 GB/s  (500.0 ms)" in text
    assert "pair b <-> c: 2.000 GB/s at 8 MiB  <- slow link" in text and text.count("slow link") == 1
    assert "bandwidth recorded in /x/bandwidth.json (ftkit plan reads it)" in text


def test_a_lock_held_on_any_host_is_not_stale_anywhere():
    rep = DoctorReport(hosts=["a", "b"], cells={"a": {}, "b": {}})
    check_locks(
        rep, {"a": [{"path": "/shared/op/lock", "holder": None}], "b": [{"path": "/shared/op/lock", "holder": 42}]}
    )
    assert rep.ok and rep.cells["b"]["locks"] == "building"


def test_interface_selection_follows_gloo_and_nccl_syntax():
    names = ["eth0", "eth1", "ib0", "lo", "docker0"]
    assert _ifname_matches("eth0", names, nccl=False) == ["eth0"]
    assert _ifname_matches("eth", names, nccl=False) == []  # gloo: exact names only
    assert _ifname_matches("eth", names, nccl=True) == ["eth0", "eth1"]  # NCCL: prefixes
    assert _ifname_matches("=eth", names, nccl=True) == []
    assert _ifname_matches("^docker,eth", names, nccl=True) == ["ib0"]


# ------------------------------------------------------------------------------------------- CLI and local


def test_cli_usage_errors_are_one_line_exit_2(tmp_path):
    out = clean_ftkit("doctor", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and out.stderr.startswith("ftkit: error: ") and "Traceback" not in out.stderr
    recipe = local_recipe(tmp_path)
    out = clean_ftkit("doctor", str(recipe), "cluster.acelerator=cpu")
    assert out.returncode == 2 and "did you mean 'accelerator'" in out.stderr and "Traceback" not in out.stderr
    out = clean_ftkit("doctor", str(recipe), "--hostfile", str(tmp_path / "missing-hostfile"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    help_ = clean_ftkit("doctor", "--help")
    assert help_.returncode == 0 and "3 a check failed" in help_.stdout and "ftkit doctor recipe.yaml" in help_.stdout


def test_doctor_stays_import_light():
    code = (
        "import sys, ftkit.cli.main, ftkit.run.doctor, ftkit.cluster.buildlocks, ftkit.launch.doctor_probe\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers', 'accelerate', 'peft') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cheap_checks_name_a_stale_build_lock(tmp_path):
    """What `ftkit launch` runs as its preflight: preflight + facts, no rendezvous, a second or two."""
    from ftkit.plan.load import load_and_plan

    plan = load_and_plan(str(local_recipe(tmp_path)), ())
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    t0 = time.monotonic()
    report = cheap_checks(plan, [], env=env)  # a drop-in for run_preflight's report
    assert report.versions["localhost"]["torch"] and report.checks[-1].startswith("doctor: versions, run-directory")
    lock = build_lock(tmp_path / "ext", "cpu_adam")
    with pytest.raises(PreflightError) as e:
        cheap_checks(plan, [], env=env)
    assert f"host localhost: locks: stale torch extension build lock {lock}" in str(e.value)
    assert str(e.value).endswith(f"[rm {lock}]")
    assert time.monotonic() - t0 < 20


@pytest.mark.heavy
def test_the_launchs_preflight_removes_the_lock_a_killed_rank_of_the_run_left(tmp_path):
    """A rank SIGKILLed while it held torch's build baton (a teardown during start-up, the OOM killer) left the lock.
    It is ftkit's own and provably dead: the next launch's preflight removes it and says so, instead of refusing
    with exit 3. A lock no rank of this run recorded is still refused, with the rm to run."""
    import signal

    from ftkit.plan.load import load_and_plan
    from ftkit.rundir.layout import RunDir

    plan = load_and_plan(str(local_recipe(tmp_path)), ())
    records = RunDir(plan.recipe.train.output_dir).batons
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    rank = holding_rank(records, lock)
    try:
        assert read_until(rank, "held")[-1] == "held"
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
    assert lock.exists()
    report = cheap_checks(plan, [], env=env)
    assert f"host localhost: removed {lock}: a build lock a killed rank of this run left" in report.checks
    assert not lock.exists() and list(records.iterdir()) == []

    other = build_lock(tmp_path / "ext", "cpu_adam")  # nobody of this run made it
    with pytest.raises(PreflightError) as e:
        cheap_checks(plan, [], env=env)
    assert f"stale torch extension build lock {other}" in str(e.value) and other.exists()


def test_unreachable_host_is_named_and_the_rendezvous_skipped(tmp_path):
    """ssh to a closed loopback port: refused at once; no probe or rendezvous is attempted there."""
    from tests.helpers.runs import free_port

    (tmp_path / "ssh_config").write_text(f"Host ghost\n  HostName 127.0.0.1\n  Port {free_port()}\n")
    (tmp_path / "hosts").write_text("ghost slots=1\n")
    recipe = local_recipe(tmp_path, gpus_per_node=1, ssh_config=tmp_path / "ssh_config")
    out = clean_ftkit("doctor", str(recipe), "--hostfile", str(tmp_path / "hosts"), "--json")
    assert out.returncode == 3, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["hosts"]["ghost"]["ssh"] == "FAIL" and data["hosts"]["ghost"]["rendezvous"] == "skipped"
    assert failures(out) == [f["line"] for f in data["failures"]]
    assert failures(out)[0].startswith("host ghost: ssh: not reachable (") and "Connection refused" in out.stderr


def test_a_local_tier_that_does_not_fit_in_dev_shm_is_a_blocking_finding():
    rep = DoctorReport(hosts=["node0", "node1"], cells={"node0": {}, "node1": {}})
    check_facts(rep, "node0", GOOD, MINE, 1000.0, "cpu", tier_bytes=6 << 30)  # 6 + 0.5 of 8 GiB free: fits
    check_facts(rep, "node1", GOOD, MINE, 1000.0, "cpu", tier_bytes=8 << 30)
    assert [f.line() for f in rep.failures] == [
        "host node1: shm: the local checkpoint tier needs 8.0G of /dev/shm and the collectives 0.5G: 8.0G free "
        "[set checkpoint.local_dir to node-local NVMe, or null; or enlarge /dev/shm]"
    ]


def test_launch_preflight_refuses_a_local_tier_larger_than_dev_shm(tmp_path):
    """An 8B full fine-tune's tier (3 checkpoints of ~30 GiB per node) in this machine's /dev/shm: refused before
    anything starts, in one line naming the key to change; a tier on disk is not /dev/shm's business."""
    from ftkit.plan.load import load_and_plan

    recipe = local_recipe(tmp_path)
    shutil.copy(MODEL_CONFIGS / "Meta-Llama-3-8B.json", tmp_path / "model" / "config.json")
    spec = yaml.safe_load(recipe.read_text())
    spec["checkpoint"] = {"local_dir": f"/dev/shm/ftkit-pytest-{os.getpid()}/{{host}}"}
    recipe.write_text(yaml.safe_dump(spec))
    plan = load_and_plan(str(recipe), ())
    free = shutil.disk_usage("/dev/shm").free
    if shm_bytes(plan.local_tier) <= free:  # a machine with a large /dev/shm: keep more checkpoints than it holds
        spec["checkpoint"]["local_keep"] = free // plan.local_tier.bytes_per_node + 1
        recipe.write_text(yaml.safe_dump(spec))
        plan = load_and_plan(str(recipe), ())
    assert shm_bytes(plan.local_tier) > free
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    with pytest.raises(PreflightError) as e:
        cheap_checks(plan, [], env=env)
    assert "host localhost: shm: the local checkpoint tier needs" in str(e.value), str(e.value)
    assert "set checkpoint.local_dir" in str(e.value)
    spec["checkpoint"] = {"local_dir": str(tmp_path / "nvme" / "{host}")}
    recipe.write_text(yaml.safe_dump(spec))
    assert shm_bytes(load_and_plan(str(recipe), ()).local_tier) == 0
