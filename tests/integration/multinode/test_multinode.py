"""Multi-node for real: two hosts as network namespaces with their own sshd, `ftkit launch --hostfile` through the
deepspeed launcher (pdsh) and torchrun (c10d over ssh), node loss, and a partition.

The head (pytest, `ftkit launch`, pdsh) stays in the root namespace; every rank runs inside a node, started over
ssh. The filesystem is shared (the run directory is "shared storage"). Needs root; skips otherwise.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.netns import NetnsCluster
from tests.helpers.paths import SCRIPTS
from tests.helpers.runs import (
    assert_no_process_left,
    events,
    ftkit,
    heartbeat_step,
    log_tails,
    losses,
    mp_lock,
    start_ftkit,
    wait_for,
    write_recipe,
)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

ENV = {"GLOO_SOCKET_IFNAME": "eth0", "FTKIT_TEST_MARKER": "forwarded", "LEAKY_VAR": "must-not-travel"}


@pytest.fixture(scope="module")
def fixtures(fx):
    return fx  # conftest's, made once per session


@pytest.fixture(scope="module")
def single_host_losses(fixtures, tmp_path_factory):
    """The same job on one host with the same world size (2): what the two-host runs must reproduce."""
    d = tmp_path_factory.mktemp("single")
    recipe = write_recipe(d, fixtures, train__max_steps=8)
    with mp_lock():
        out = ftkit("launch", str(recipe))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return losses(d / "run")


def _recipe(tmp_path: Path, fixtures, cluster: NetnsCluster, **kw) -> Path:
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=1)
    return write_recipe(
        tmp_path,
        fixtures,
        cluster__hostfile=str(hostfile),
        cluster__ssh_config=str(cluster.ssh_config),
        cluster__master_addr=cluster.address(0),
        **kw,
    )


# Issue 41 (secrets never reach a record) and issue 35 (the user's environment reaches the ranks), in the same runs:
# secrets of every shape, forwarded by the allow-list (HF_*, MLFLOW_*) and by cluster.env (a NAME from this machine
# and a NAME=VALUE of the recipe); cluster.env's plain variables; an arch list DeepSpeed 0.19 cannot parse.
SECRETS = {
    "HF_TOKEN": "hf-ab.cd-123",
    "MLFLOW_TRACKING_PASSWORD": "p@ss:word",
    "MY_API_KEY": "k3y-0f-the.user",  # not on the allow-list: reaches remote ranks through cluster.env only
}
RECIPE_SECRET = ("EXTRA_TOKEN", "tok.en-456")  # written in the recipe's cluster.env
CLUSTER_ENV = ["MY_DATA_DIR", "FOO=1", "MY_API_KEY", "=".join(RECIPE_SECRET)]
USER_ENV = {**SECRETS, "MY_DATA_DIR": "/data/sets/ftkit-41", "TORCH_CUDA_ARCH_LIST": "9.0a"}
PROBED = ("MY_DATA_DIR", "FOO", "TORCH_CUDA_ARCH_LIST", "LEAKY_VAR", *SECRETS, RECIPE_SECRET[0])

# Imported by every Python process that has it on PYTHONPATH (which the allow-list forwards): each rank writes what
# its environment holds to a directory outside the run directory, which the test then reads.
_PROBE = """\
import json, os
if os.environ.get("RANK") is not None and os.environ.get("FTKIT_RUN_DIR"):
    try:
        with open(os.path.join({out!r}, "rank-" + os.environ["RANK"] + ".json"), "w") as f:
            json.dump({{k: os.environ.get(k) for k in {names!r}}}, f)
    except OSError:
        pass
"""


def _secret_pieces() -> list[bytes]:
    """Every 6 characters of every secret value: a mask of only some of a value's characters is a leak too."""
    values = [*SECRETS.values(), RECIPE_SECRET[1]]
    return sorted({v[i : i + 6].encode() for v in values for i in range(len(v) - 5)})


def _leaks(text: bytes, where: str) -> list[str]:
    return [f"{where}: {piece.decode()!r}" for piece in _secret_pieces() if piece in text]


def _remote_env_shown(dry_run: str, engine: str) -> str:
    """What ``--dry-run`` shows the remote hosts get: every node's ssh line under torchrun; under DeepSpeed the env
    file its runner exports on each host, and that remote shell line (the runner itself runs here, with all of this
    machine's environment, as a local launch's ranks do)."""
    lines = dry_run.splitlines()
    if engine == "torchrun":
        return "\n".join(itertools.dropwhile(lambda x: not x.startswith("node 0 "), lines))
    at = next(i for i, x in enumerate(lines) if x.startswith("file ") and x.endswith("/ds_env:"))
    section = list(itertools.takewhile(lambda x: x.startswith("    "), lines[at + 1 :]))
    return "\n".join(section + [x for x in lines if x.startswith("remote shell line")])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["deepspeed", "torchrun"])
def test_two_hosts_match_one_host_and_env_is_exactly_forwarded(tmp_path, fixtures, netns2, single_host_losses, engine):
    """Two hosts reproduce the one-host losses; the ranks get exactly what ftkit forwards (the allow-list, cluster.env,
    an arch list DeepSpeed parses: 9.0a becomes 9.0), read back from every rank; and no secret's value appears in
    anything under the run directory (logs, records, checkpoints: every file, read as bytes) nor in anything ftkit
    prints (--dry-run, the launch, status): each is forwarded, and only its name shows."""
    probe, probed = tmp_path / "probe", tmp_path / "probed"  # both outside the run directory
    probe.mkdir()
    probed.mkdir()
    (probe / "sitecustomize.py").write_text(_PROBE.format(out=str(probed), names=PROBED))
    pythonpath = os.pathsep.join(p for p in (str(probe), os.environ.get("PYTHONPATH")) if p)
    env = {**ENV, **USER_ENV, "PYTHONPATH": pythonpath}
    recipe = _recipe(tmp_path, fixtures, netns2, train__max_steps=8, cluster__engine=engine, cluster__env=CLUSTER_ENV)
    run_dir = tmp_path / "run"
    dry = ftkit("launch", str(recipe), "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    remote = _remote_env_shown(dry.stdout, engine)  # what the hosts get (this machine's runner gets all of it)
    assert "FTKIT_TEST_MARKER=forwarded" in remote and "LEAKY_VAR" not in remote, remote
    assert "MY_DATA_DIR=/data/sets/ftkit-41" in remote and "FOO=1" in remote, remote
    assert "HF_TOKEN=***" in remote and "EXTRA_TOKEN=***" in remote and "MY_API_KEY=***" in remote, remote
    assert "TORCH_CUDA_ARCH_LIST=9.0" in remote and "9.0a" not in remote, remote
    assert "the ranks get TORCH_CUDA_ARCH_LIST=9.0 instead of '9.0a'" in dry.stdout, dry.stdout
    with mp_lock():
        out = ftkit("launch", str(recipe), env=env, timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = losses(run_dir)
    assert sorted(got) == sorted(single_host_losses)
    for step, loss in single_host_losses.items():
        assert abs(got[step] - loss) < 1e-6, (step, got[step], loss)
    # What reached the remote ranks is what ftkit forwards: the marker arrived, the stray variable did not.
    recs = [json.loads(p.read_text()) for p in sorted((run_dir / "ftkit/attempts/0/pids").glob("rank-*.json"))]
    assert {r["host"] for r in recs} == {"node0", "node1"}
    for r in recs:
        assert r["env"].get("FTKIT_TEST_MARKER") == "forwarded" and r["env"].get("DS_ACCELERATOR") == "cpu"
        assert "LEAKY_VAR" not in r["env_keys"]
    # ... and as each rank read its own environment (the probe): cluster.env's variables, every secret, the arch list
    seen = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in probed.glob("rank-*.json")}
    assert sorted(seen) == sorted(r["rank"] for r in recs) == [0, 1], seen  # one rank on each host (above)
    for s in seen.values():
        assert s["MY_DATA_DIR"] == "/data/sets/ftkit-41" and s["FOO"] == "1" and s["LEAKY_VAR"] is None, s
        assert s["TORCH_CUDA_ARCH_LIST"] == "9.0", s
        assert {k: s[k] for k in SECRETS} == SECRETS and s[RECIPE_SECRET[0]] == RECIPE_SECRET[1], s
    # No secret's value anywhere under the run directory, nor in what ftkit printed; the names are there, masked.
    status = ftkit("status", str(run_dir), timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    leaks = []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()):
        leaks += _leaks(path.read_bytes(), str(path.relative_to(run_dir)))
    for name, r in (("--dry-run", dry), ("launch", out), ("status", status)):
        leaks += _leaks((r.stdout + r.stderr).encode(), f"ftkit {name}")
    assert not leaks, leaks
    spawns = "\n".join(" ".join(e["argv"]) for e in events(run_dir) if e["event"] == "spawn")
    if engine == "torchrun":  # the ssh line carries the environment inline: forwarded, masked
        assert "HF_TOKEN=***" in spawns and "EXTRA_TOKEN=***" in spawns and "MY_API_KEY=***" in spawns, spawns
    assert_no_process_left(run_dir)
    assert not any(netns2.pids(i) != [netns2.node(i).sshd_pid] for i in (0, 1)), "a rank outlived the run"


@pytest.mark.timeout(600)
def test_every_process_on_a_host_killed_recovers(tmp_path, fixtures, netns2):
    recipe = _recipe(tmp_path, fixtures, netns2, train__max_steps=16, train__save_steps=4)
    run_dir = tmp_path / "run"
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=ENV, log=tmp_path / "launch.log")
        try:
            wait_for(lambda: heartbeat_step(run_dir, 1) >= 6, 300, "rank 1 to reach step 6")
            netns2.kill_node(1)  # the whole host: ranks, agent, sshd
            netns2.start_sshd(1)  # ... and it comes back (a reboot)
            code = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "launch.log").read_text()
    assert code == 0, log[-4000:] + "\n" + log_tails(run_dir)
    ev = events(run_dir)
    assert [e["event"] for e in ev].count("restart") == 1
    chosen = [e for e in ev if e["event"] == "checkpoint_chosen"]
    assert chosen and chosen[0]["step"] in (4, 8)
    assert sorted(losses(run_dir)) == list(range(1, 17))
    assert_no_process_left(run_dir)


@pytest.mark.timeout(600)
def test_fsdp2_host_lost_shrinks_to_one_rank_resuming_the_dcp_checkpoint(tmp_path, fixtures, netns2):
    """FSDP2 under accelerate launch on two hosts; the second host is lost for good (every process killed, no
    sshd): with min_nodes 1 the job continues on one rank from the newest DCP checkpoint, which reshards on load
    (no conversion), the global batch kept by gradient accumulation."""
    recipe = _recipe(
        tmp_path,
        fixtures,
        netns2,
        train__max_steps=16,
        train__save_steps=4,
        train__backend="fsdp2",
        zero=None,
        cluster__min_nodes=1,
    )
    run_dir = tmp_path / "run"
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=ENV, log=tmp_path / "launch.log")
        try:
            wait_for(lambda: heartbeat_step(run_dir, 1) >= 6, 300, "rank 1 to reach step 6")
            netns2.kill_node(1)  # the whole host, sshd included, and it stays down
            code = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            netns2.start_sshd(1)  # for the module's next tests
    log = (tmp_path / "launch.log").read_text()
    assert code == 0, log[-4000:] + "\n" + log_tails(run_dir)
    ev = events(run_dir)
    shrink = next(e for e in ev if e["event"] == "shrink")
    assert shrink["hosts"] == [["node0", 1]] and shrink["gradient_accumulation_steps"] == 16 // (4 * 1), shrink
    assert not [e for e in ev if e["event"] == "converted"], "a DCP checkpoint needs no conversion"
    chosen = [e for e in ev if e["event"] == "checkpoint_chosen"]
    assert chosen and chosen[-1]["step"] in (4, 8), chosen
    assert sorted(losses(run_dir)) == list(range(1, 17))
    last = max(int(a.name) for a in (run_dir / "ftkit/attempts").glob("*"))
    beat = json.loads((run_dir / "ftkit/heartbeat/rank-0.json").read_text())
    assert beat["attempt"] == last and beat["sharding"]["dtensor_params"] == beat["sharding"]["params"] > 0, beat
    assert json.loads((run_dir / "ftkit/spec.json").read_text())["world_size"] == 1
    assert_no_process_left(run_dir)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("min_nodes", [1, 2])
def test_partition_detected_by_heartbeat_then_shrink_or_stop(tmp_path, fixtures, netns2, min_nodes):
    hang = 12  # a step takes ~0.2 s across the two namespace hosts, a save ~1-2 s
    recipe = _recipe(
        tmp_path,
        fixtures,
        netns2,
        train__max_steps=16,
        train__save_steps=4,
        cluster__min_nodes=min_nodes,
        resilience__hang_timeout_s=hang,
    )
    run_dir = tmp_path / "run"
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=ENV, log=tmp_path / "launch.log")
        try:
            wait_for(lambda: heartbeat_step(run_dir, 1) >= 6, 300, "rank 1 to reach step 6")
            t_down = time.time()
            netns2.link_down(1)  # a pulled cable: packets to and from node1 vanish
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "launch.log").read_text()
    ev = events(run_dir)
    failure = next(e for e in ev if e["event"] == "failure")
    assert failure["kind"] == "hang", failure
    assert failure["time"] - t_down <= hang + 10, f"detected after {failure['time'] - t_down:.1f}s"
    lost = [e for e in ev if e["event"] == "host_lost"]
    assert lost and lost[0]["hosts"] == ["node1"], ev
    names = [e["event"] for e in ev]
    if min_nodes == 2:
        assert "restart" not in names, names  # stopping is decided before any restart is announced
    if min_nodes == 1:
        assert code == 0, log[-4000:]
        shrink = next(e for e in ev if e["event"] == "shrink")
        assert shrink["hosts"] == [["node0", 1]] and shrink["global_batch_size"] == 16
        assert shrink["gradient_accumulation_steps"] == 16 // (4 * 1)
        assert sorted(losses(run_dir)) == list(range(1, 17))
        spec = json.loads((run_dir / "ftkit/spec.json").read_text())
        assert spec["world_size"] == 1
    else:
        assert code == 7, log[-4000:]  # ExitCode.HOST_LOST
        assert any(e["event"] == "gave_up" and "min_nodes" in e.get("message", "") for e in ev)
    # ftkit cleaned the reachable host; the lost one kept its (blocked) ranks, as a real partitioned host would.
    node0_ranks = [
        r
        for a in (run_dir / "ftkit/attempts").glob("*")
        for r in (json.loads(p.read_text()) for p in a.glob("pids/rank-*.json"))
        if r["host"] == "node0"
    ]
    assert node0_ranks and not any(
        os.path.exists(f"/proc/{r['pid']}")
        and open(f"/proc/{r['pid']}/stat").read().split(")")[1].split()[0] not in "ZX"
        for r in node0_ranks
    )
    netns2.link_up(1)
    netns2.kill_node(1)  # what the lost host's operator does; then nothing of the run may be left anywhere
    assert_no_process_left(run_dir)


@pytest.mark.timeout(600)
def test_deepspeed_over_pdsh_runs_any_argument_and_directory_as_itself(tmp_path, fixtures, netns2):
    """DeepSpeed's pdsh runner puts `cd CWD; python ... SCRIPT ARGS` on one remote shell line and quotes only
    arguments with spaces: `{"min_lr":1e-5}` arrived as `{min_lr:1e-5}`, `Q: $x` as `Q: `, `a&b` ran `b`, and
    `$(touch ...)` in an argument or in the launch directory's name ran on the hosts. Every value now arrives
    byte for byte and nothing runs; --dry-run shows the remote line as DeepSpeed builds it."""
    import secrets

    token = secrets.token_hex(4)
    markers = [Path(f"/tmp/ftkit-pwned-{token}-{i}") for i in range(4)] + [Path.home() / f"ftkit-pwned-{token}-dir"]
    launch_dir = tmp_path / f"dir$(touch ftkit-pwned-{token}-dir)"
    launch_dir.mkdir()
    args = [
        '{"min_lr":1e-5}',
        "Q: $x",
        "a&b",
        f"$(touch {markers[0]})",
        f"`touch {markers[1]}`",
        f"x;touch {markers[2]}",
        f"y|touch {markers[3]}",
        "it's",
        "tab\there",
    ]
    recipe = _recipe(tmp_path, fixtures, netns2, train__max_steps=1, cluster__engine="deepspeed")
    script = str(SCRIPTS / "argv_probe.py")
    try:
        dry = ftkit("launch", str(recipe), "--dry-run", "--", "python", script, *args, env=ENV, cwd=launch_dir)
        assert dry.returncode == 0, dry.stderr
        assert "remote shell line (DeepSpeed's pdsh runner, on each host):" in dry.stdout, dry.stdout
        remote = next(x for x in dry.stdout.splitlines() if x.startswith("remote shell line"))
        assert "ftkit.launch.run_command" in remote and "min_lr" not in remote and "touch" not in remote, remote
        with mp_lock():
            out = ftkit("launch", str(recipe), "--", "python", script, *args, env=ENV, cwd=launch_dir, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        run = tmp_path / "run"
        got = [json.loads(p.read_text()) for p in sorted(run.glob("argv-rank-*.json"))]
        assert [g["host"] for g in got] == ["node0", "node1"], got
        for g in got:
            assert g["argv"] == args, g["argv"]
            assert g["cwd"] == str(launch_dir), g["cwd"]
        assert not [m for m in markers if m.exists()], "a shell ran a command from an argument or a directory name"
        assert_no_process_left(run)
    finally:
        for m in markers:
            m.unlink(missing_ok=True)
