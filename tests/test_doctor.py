"""ftkit doctor: the report (table, JSON, one line per failure with the fix), the stale JIT build lock finder and
the supervisor's loading hint, CLI errors; then real runs: this machine, and two namespace hosts with one broken
(interface misnamed, port to the master blocked, another torch) — doctor must name that host and the cause
within 30 s — and a healthy pair with --bandwidth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.cluster import buildlocks
from ftkit.errors import PreflightError
from ftkit.run.doctor import RENDEZVOUS_TIMEOUT_S, cheap_checks
from ftkit.run.doctor_checks import DoctorReport, _ifname_matches, check_facts, check_locks, format_report
from tests.helpers.doctor import build_lock, clean_ftkit, failures, local_recipe

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
        + (
            "assert b.try_acquire(); print('ready', flush=True); import time; time.sleep(60)\n"
            if what == "acquire"
            else "print('ready', flush=True); b.wait()\n"
        )
    )
    return _holder(code)


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


@pytest.mark.slow
@pytest.mark.timeout(600)  # mostly waiting for mp_lock; the doctor runs take ~5 s each
def test_local_doctor_passes_then_names_a_stale_lock(tmp_path):
    from tests.helpers.runs import free_port, mp_lock

    recipe = local_recipe(tmp_path, master_port=free_port())
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    with mp_lock():
        ok = clean_ftkit("doctor", str(recipe), env=env)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "localhost" in ok.stdout and "all checks passed on 1 host(s)" in ok.stdout
        lock = build_lock(tmp_path / "ext", "cpu_adam")
        bad = clean_ftkit("doctor", str(recipe), "--json", env=env)
    assert bad.returncode == 3, bad.stdout + bad.stderr
    assert json.loads(bad.stdout)["hosts"]["localhost"]["rendezvous"].startswith("ok")
    assert bad.stderr.strip() == (
        f"ftkit: error: host localhost: locks: stale torch extension build lock {lock}: a killed build left it; "
        f"every rank that builds this op waits forever [rm {lock}]"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_launch_whose_ranks_wait_on_a_stale_lock_says_so(fx, tmp_path):
    """The acceptance's launch half, with real ranks and DeepSpeed's own op loading (torch's FileBaton).

    A lock there at launch is refused by the preflight: exit 3 naming it and the fix, no rank started. One that
    appears after the preflight (a build killed meanwhile) leaves the ranks waiting in ``FileBaton.wait()`` on the
    shared-memory op every CPU run loads: ``ftkit launch`` names it within 90 s; removed, the run goes on and ends.
    """
    import shutil

    from ftkit.rundir.layout import RunDir
    from tests.helpers.runs import (
        RUN_ENV,
        RUN_TIMEOUT_S,
        assert_no_process_left,
        ftkit,
        kill_tree,
        losses,
        mp_lock,
        named,
        start_ftkit,
        wait_for,
        write_recipe,
    )

    default_env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    built = [r for r in buildlocks.extension_roots(default_env) if (r / "deepspeed_shm_comm").is_dir()]
    assert built, "make install builds DeepSpeed's ops once (ftkit.launch.warmup)"
    ext = tmp_path / "ext"  # a copy of this machine's built ops: a lock here blocks only this test's ranks
    shutil.copytree(built[0], ext, symlinks=True)
    env = {**RUN_ENV, "TORCH_EXTENSIONS_DIR": str(ext)}
    recipe, run, log = write_recipe(tmp_path, fx), tmp_path / "run", tmp_path / "launch.log"
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.write_text("")

    refused = ftkit("launch", str(recipe), env=env, timeout=120)
    assert refused.returncode == 3, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert f"stale torch extension build lock {lock}" in refused.stderr and f"[rm {lock}]" in refused.stderr
    assert not named(run, "spawn")

    lock.unlink()
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=env, log=log)
        try:
            wait_for(lambda: named(run, "spawn"), 120, "the ranks to be spawned")
            lock.write_text("")  # before any rank reaches the op: importing torch and deepspeed takes seconds
            t0 = time.monotonic()
            wait_for(lambda: "stale torch extension build lock" in log.read_text(), 90, "the launch to name the lock")
            took = time.monotonic() - t0
            assert not (RunDir(run).metrics.exists() and losses(run))  # the ranks really waited: no step yet
            lock.unlink()
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            kill_tree(proc)
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert 55 <= took <= 90, took  # the hint comes once a rank has waited a minute, not before
    hint = named(run, "build_lock")
    assert len(hint) == 1 and f"rm {lock}" in hint[0]["message"], hint
    assert_no_process_left(run)


# ------------------------------------------------------------------------------------------- two namespace hosts

DOCTOR_BUDGET_S = 30  # the acceptance: a broken host is named within 30 s


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two namespace hosts, one per module (each test repairs what it broke)."""
    from tests.helpers.netns import netns_cluster, require_netns

    require_netns()
    with netns_cluster(2, workdir=tmp_path_factory.mktemp("netns")) as cluster:
        yield cluster


def _pair_recipe(d: Path, cluster) -> Path:
    from tests.helpers.runs import free_port

    hostfile = cluster.write_hostfile(d / "hostfile", slots=1)
    return local_recipe(
        d,
        gpus_per_node=1,
        hostfile=hostfile,
        ssh_config=cluster.ssh_config,
        master_addr=cluster.address(0),
        master_port=free_port(),
    )


def _doctor(recipe: Path, *args: str, env: dict | None = None):
    from tests.helpers.runs import mp_lock

    with mp_lock():
        t0 = time.monotonic()
        out = clean_ftkit("doctor", str(recipe), *args, env={"GLOO_SOCKET_IFNAME": "eth0", **(env or {})}, timeout=120)
        return out, time.monotonic() - t0


def _assert_clean(cluster) -> None:
    for i in (0, 1):
        assert cluster.pids(i) == [cluster.node(i).sshd_pid], f"a probe outlived doctor on node{i}"


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(900)
def test_healthy_pair_passes_and_measures_bandwidth(tmp_path, pair):
    recipe = _pair_recipe(tmp_path, pair)
    bw = tmp_path / "bandwidth.json"
    out, took = _doctor(recipe, "--bandwidth", env={"FTKIT_BANDWIDTH_FILE": str(bw)})
    assert out.returncode == 0, out.stdout + out.stderr
    rows = out.stdout.splitlines()
    assert [r.split()[0] for r in rows[1:3]] == ["node0", "node1"] and "FAIL" not in out.stdout
    assert all(r.split()[-2:] != ["waited"] and " ok " in r for r in rows[1:3])
    assert "all-reduce bus bandwidth across 2 host(s) (gloo):" in out.stdout and "GB/s" in out.stdout
    assert f"bandwidth recorded in {bw}" in out.stdout
    data = json.loads(bw.read_text())
    assert data["version"] == 1 and data["hosts"] == ["node0", "node1"] and data["inter_node_gbs"] > 0
    assert [r["bytes"] for r in data["all_reduce"]] == [2**20, 8 * 2**20, 32 * 2**20]
    from ftkit.plan.comm import read_bandwidth_file

    assert read_bandwidth_file(["node1", "node0"], bw).inter_gbs == data["inter_node_gbs"]  # the planner reads it
    print(f"healthy pair: {took:.1f}s; bus bandwidth {[round(r['busbw_gbs'], 3) for r in data['all_reduce']]} GB/s")
    _assert_clean(pair)


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(900)
def test_misnamed_interface_names_the_host(tmp_path, pair):
    recipe = _pair_recipe(tmp_path, pair)
    ns = pair.node(1).namespace
    rename = [["ip", "-n", ns, "link", "set", "eth0", "down"], ["ip", "-n", ns, "link", "set", "eth0", "name", "eth9"]]
    for argv in [*rename, ["ip", "-n", ns, "link", "set", "eth9", "up"]]:
        subprocess.run(argv, check=True, timeout=15)
    try:
        out, took = _doctor(recipe)
    finally:
        for argv in (
            ["link", "set", "eth9", "down"],
            ["link", "set", "eth9", "name", "eth0"],
            ["link", "set", "eth0", "up"],
        ):
            subprocess.run(["ip", "-n", ns, *argv], check=True, timeout=15)
    assert out.returncode == 3, out.stdout + out.stderr
    print(f"doctor named the broken host in {took:.1f}s")
    assert took < DOCTOR_BUDGET_S, took
    # The healthy host learns of its peer's failure at once, not at the rendezvous timeout: watching on the
    # collective's own store connection, it waited the whole 10 s and could then name itself (its own timeout).
    assert took < RENDEZVOUS_TIMEOUT_S, took
    fails = failures(out)
    assert any(f.startswith("host node1: iface: GLOO_SOCKET_IFNAME=eth0 names no interface there") for f in fails), (
        fails
    )
    assert any(f.startswith("host node1: rendezvous: ") for f in fails), fails
    assert not any(f.startswith("host node0") for f in fails), fails
    _assert_clean(pair)


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(900)
def test_blocked_port_to_the_master_names_the_host(tmp_path, pair):
    """No iptables/nft here: a policy-routing rule in node1 drops TCP to the master's port only (ssh still works)."""
    recipe = _pair_recipe(tmp_path, pair)
    import yaml

    port = yaml.safe_load(recipe.read_text())["cluster"]["master_port"]
    ns, master = pair.node(1).namespace, pair.address(0)
    rule = ["to", f"{master}/32", "ipproto", "tcp", "dport", str(port), "prohibit"]
    subprocess.run(["ip", "-n", ns, "rule", "add", *rule], check=True, timeout=15)
    try:
        out, took = _doctor(recipe)
    finally:
        subprocess.run(["ip", "-n", ns, "rule", "del", *rule], check=True, timeout=15)
    assert out.returncode == 3, out.stdout + out.stderr
    print(f"doctor named the broken host in {took:.1f}s")
    assert took < DOCTOR_BUDGET_S, took
    fails = failures(out)
    assert any(
        f.startswith(
            f"host node1: rendezvous: did not join the rendezvous: cannot reach the rendezvous at {master}:{port}"
        )
        and f"[open TCP port {port} to {master}" in f
        for f in fails
    ), fails
    assert not any(f.startswith("host node0") for f in fails), fails
    _assert_clean(pair)


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(900)
def test_other_torch_on_one_host_names_the_host(tmp_path, pair):
    """node1's sessions get a PYTHONPATH (its sshd's SetEnv) holding another 'torch': installed metadata and all."""
    fake = tmp_path / "other-site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("__version__ = '2.1.0'\nraise ImportError('this torch is broken')\n")
    (fake / "torch-2.1.0.dist-info").mkdir()
    (fake / "torch-2.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.1.0\n")
    node = pair.node(1)
    original = node.sshd_config.read_text()
    node.sshd_config.write_text(original + f"SetEnv PYTHONPATH={fake}\n")
    pair.stop_sshd(1)
    pair.start_sshd(1)
    try:
        recipe = _pair_recipe(tmp_path, pair)
        out, took = _doctor(recipe)
    finally:
        node.sshd_config.write_text(original)
        pair.stop_sshd(1)
        pair.start_sshd(1)
    assert out.returncode == 3, out.stdout + out.stderr
    print(f"doctor named the broken host in {took:.1f}s")
    assert took < DOCTOR_BUDGET_S, took
    fails = failures(out)
    assert any(f.startswith("host node1: versions: differs: torch 2.1.0 (here ") for f in fails), fails
    assert any(f.startswith("host node1: rendezvous: ") and "this torch is broken" in f for f in fails), fails
    assert not any(f.startswith("host node0") for f in fails), fails
    _assert_clean(pair)


@pytest.mark.slow
@pytest.mark.timeout(600)  # mostly waiting for mp_lock; the probes take ~10 s
def test_probe_measures_every_pair_of_three_ranks():
    """The rank-side probe on its own, three ranks on loopback: all-reduce sizes across all and every pair once."""
    from tests.helpers.runs import free_port, mp_lock

    port = free_port()
    argv = [sys.executable, "-m", "ftkit.launch.doctor_probe", "rendezvous", "--world", "3", "--master-addr"]
    argv += [
        "127.0.0.1",
        "--port",
        str(port),
        "--bandwidth",
        "--sizes-mib",
        "1,2",
        "--pair-mib",
        "1",
        "--timeout",
        "60",
    ]
    with mp_lock():
        procs = [subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(3)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    res = [json.loads(next(ln for ln in o.splitlines() if ln.startswith("FTKIT_DOCTOR "))[13:]) for o in outs]
    assert all(r["ok"] for r in res), res
    assert [row["bytes"] for row in res[0]["all"]] == [2**20, 2**21] and all(
        row["busbw_gbs"] > 0 for row in res[0]["all"]
    )
    pairs = sorted(tuple(p["ranks"]) for r in res for p in r["pairs"])
    assert pairs == [(0, 1), (0, 2), (1, 2)] and res[0]["missing"] == []
