"""Every string that reaches a shell is quoted once, where the shell line is built (issue 10; docs/design.md, Launch
commands).

A recording ``ssh`` stand-in sits first on PATH: it appends its argv to a log and runs the remote command with
``sh -c`` on this machine, as real ssh would on the remote host. Hostile values (``$(touch MARK)``, backticks,
``;touch MARK``, quotes) go through every shell-bound value ftkit handles; no MARK may appear, and the intended
command must still have run. The library functions are the real ones: teardown, remove_shm, preflight, the
command builder.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ftkit.cluster.procs import SHM_DIR, SHM_PREFIX, Target, proc_start_time, remove_shm, teardown
from ftkit.command.engines import LaunchInputs, build_launch
from ftkit.errors import PreflightError, UserError
from ftkit.run.preflight import run_preflight

MARK = "ftkit-injected-MARK"  # relative: the stand-in runs remote commands in the test's directory

PAYLOADS = [
    f"$(touch {MARK})",
    f"`touch {MARK}`",
    f";touch {MARK}",
    f"x';touch {MARK};'",
    f'x";touch {MARK};"',
    f"a b'c\"d$(touch {MARK})",
]

FAKE_SSH = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SSH_LOG"], "a") as fh:
    fh.write(json.dumps(args) + "\\n")
i = 0
while i < len(args) and args[i].startswith("-"):
    i += 2 if args[i] in ("-o", "-F", "-p", "-i", "-l") else 1
host, command = args[i], " ".join(args[i + 1 :])
if host == "unreachable":
    sys.stderr.write("Warning: Permanently added 'x' to the list of known hosts.\\r\\n")
    sys.stderr.write("ssh: connect to host unreachable port 22: No route to host\\nkex_exchange_identification: x\\n")
    sys.exit(255)
sys.exit(subprocess.run(["sh", "-c", command], cwd=os.environ["FAKE_SSH_CWD"]).returncode)
"""

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["FAKE_RECORD"], "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}) + "\\n")
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch):
    """PATH gets a recording ssh; returns a function giving the argv lists it was called with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "ssh", FAKE_SSH)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    monkeypatch.setenv("FAKE_SSH_CWD", str(tmp_path))

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    yield calls
    assert not list(tmp_path.rglob(MARK)), "a value was executed by a shell"


def test_teardown_remote_targets_quotes_pid_records(fake_ssh, tmp_path):
    """Start times come from pid records on disk; a hostile one is a start time that never matches."""
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        targets = [Target("node1", victim.pid, proc_start_time(victim.pid), what="rank 0")]
        targets += [Target("node1", other.pid, p, what="rank 1") for p in PAYLOADS]
        res = teardown([], targets, grace_s=3, ssh_args=[], ssh_timeout=10)
        victim.wait(timeout=5)  # the intended kill happened, over the remote script
        assert victim.returncode == -15
        assert other.poll() is None  # a start time that is not its own never matches: not signalled
        assert f"node1:{victim.pid}" in res.signalled and not res.unreachable
        assert fake_ssh() and all(c[-2] == "node1" for c in fake_ssh())
    finally:
        for p in (victim, other):
            p.kill()
            p.wait()


def test_teardown_never_hands_an_option_to_ssh_as_a_host(fake_ssh, tmp_path):
    """A host name from a pid record starting with '-' would be an ssh option (-oProxyCommand runs a command)."""
    host = f"-oProxyCommand=touch {MARK}"
    res = teardown([], [Target(host, 1234567, 1)], grace_s=0, ssh_args=[], ssh_timeout=5)
    assert res.unreachable == [host]
    assert not any(host in c for c in fake_ssh())


def test_remove_shm_quotes_the_recorded_address(fake_ssh, tmp_path):
    """remove_shm stripped its own quoting: '10.0.0.1;touch …' ran touch at every teardown."""
    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm")
    tag = uuid.uuid4().hex[:8]
    addrs = ["127.0.0.9", *(p.replace("/", "") for p in PAYLOADS)]
    records, files = [], []
    for i, addr in enumerate(addrs):
        port = 40000 + i
        records.append({"host": "node1", "rank": i, "pid": 1, "master_addr": f"{tag}{addr}", "master_port": port})
        f = Path(SHM_DIR) / f"{SHM_PREFIX}{tag}x_{tag}{addr}_{port}_0"
        f.write_bytes(b"")
        files.append(f)
    bystander = Path(SHM_DIR) / f"{SHM_PREFIX}{tag}x_{tag}other_40000_0"
    bystander.write_bytes(b"")
    try:
        assert remove_shm(records, ssh_args=[]) == []
        assert [f.name for f in files if f.exists()] == []  # the intended rm ran, for every name
        assert bystander.exists()  # and removed nothing else
        (call,) = fake_ssh()
        assert call[-1].startswith(f"rm -f {SHM_DIR}/{SHM_PREFIX}*")
    finally:
        for f in [*files, bystander]:
            f.unlink(missing_ok=True)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_preflight_remote_probes_quote_master_addr(fake_ssh, tmp_path, payload):
    """`cluster.master_addr: "$(touch /tmp/x)"` ran on remote hosts in preflight (the recipe now refuses it too; the
    quoting holds on its own)."""
    with pytest.raises(PreflightError) as e:
        run_preflight(
            hosts=[("node1", 2)],
            master_addr=payload,
            master_port=29500,
            run_dir=tmp_path / "run",
            engine="torchrun",
            ssh_args=[],
        )
    assert any(f"master address {payload} does not resolve there" in line for line in e.value.lines())
    assert fake_ssh()


def test_preflight_remote_run_dir_and_python_quoted(fake_ssh, tmp_path):
    """A run directory with a space, quotes and $(...) in its name: probed as itself, nothing executed."""
    run_dir = tmp_path / f"run dir 'q\" $(touch {MARK})"
    run_dir.mkdir()
    python = tmp_path / f"py dir 'q\" $(touch {MARK})" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    report = run_preflight(
        hosts=[("node1", 2)],
        master_addr="127.0.0.1",
        master_port=29500,
        run_dir=run_dir,
        engine="torchrun",
        ssh_args=[],
        python=str(python),
    )
    assert "host node1 reachable, same versions" in report.checks
    assert report.versions["node1"]["run_dir"] == "writable"  # test -w ran on the real path


def _preflight_fails(tmp_path, host: str, master_addr: str) -> list[str]:
    """The lines of the PreflightError run_preflight raises for one host (torchrun engine, no ssh options)."""
    with pytest.raises(PreflightError) as e:
        run_preflight(
            hosts=[(host, 2)],
            master_addr=master_addr,
            master_port=29500,
            run_dir=tmp_path / "run",
            engine="torchrun",
            ssh_args=[],
        )
    return e.value.lines()


def test_preflight_unresolvable_master(fake_ssh, tmp_path):
    """An unresolvable master_addr passed preflight and hung each attempt until startup_timeout_s."""
    (line,) = _preflight_fails(tmp_path, "localhost", "no-such-host.invalid")
    assert line.startswith("cluster.master_addr: master address no-such-host.invalid does not resolve here")
    lines = _preflight_fails(tmp_path, "node1", "no-such-host.invalid")
    assert [x for x in lines if "no-such-host.invalid" in x] == [
        x for x in lines if x.startswith("cluster.master_addr: host node1: master address")
    ]


def test_preflight_ssh_error_is_one_line(fake_ssh, tmp_path):
    """One ssh error was printed as two error lines."""
    every = _preflight_fails(tmp_path, "unreachable", "127.0.0.1")
    lines = [x for x in every if "unreachable" in x]
    assert len(lines) == 1 and "No route to host; kex_exchange_identification" in lines[0], every
    assert "Permanently added" not in lines[0]


def _inputs(tmp_path: Path, engine: str, run_dir: Path, **kw) -> LaunchInputs:
    base = dict(
        engine=engine,
        hosts=(("localhost", 1), ("node1", 1)),
        master_addr="127.0.0.1",
        master_port=29500,
        run_dir=str(run_dir),
        attempt=1,
        resume=str(run_dir / "checkpoint-8"),
        accelerator="cpu",
        python=str(_script(tmp_path / "python rec'q", RECORDER)),
        name=f"n;touch {MARK}",
    )
    base.update(kw)
    return LaunchInputs(**base)


@pytest.mark.parametrize("engine", ["torchrun", "accelerate"])
def test_remote_command_lines_quote_every_word(fake_ssh, tmp_path, monkeypatch, engine):
    """The ssh line the builder makes for a remote node, run by a shell: every value arrives as itself."""
    run_dir = tmp_path / f"runs 'a\" $(touch {MARK})" / "run"
    run_dir.mkdir(parents=True)
    record = tmp_path / "record.jsonl"
    env = {"PATH": os.environ["PATH"], "FTKIT_RECORD_X": "1"}
    env.update({f"NCCL_P{i}": p for i, p in enumerate(PAYLOADS)})
    env[f"NCCL_$(touch {MARK})"] = "1"  # environ may hold any name; a shell would run this one
    monkeypatch.setenv("FAKE_RECORD", str(record))
    cmd = build_launch(_inputs(tmp_path, engine, run_dir), env)
    node = cmd.nodes[1]
    assert node.remote and node.argv[0] == "ssh"
    subprocess.run(list(node.argv), check=True, timeout=30)
    (seen,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert seen["cwd"] == str(run_dir.parent)
    for i, p in enumerate(PAYLOADS):
        assert seen["env"][f"NCCL_P{i}"] == p
    assert not any("$(" in k for k in seen["env"])
    assert str(run_dir) in seen["argv"] and str(run_dir / "checkpoint-8") in seen["argv"]
    if engine == "torchrun":
        assert f"n;touch {MARK}-1" in seen["argv"]


def test_deepspeed_env_file_survives_deepspeeds_double_quotes(tmp_path):
    """DeepSpeed's pdsh runner puts ``export K="V"`` into the remote line (double quotes: $ and backticks still act).
    ftkit escapes what acts inside them; the line is evaluated by sh as DeepSpeed builds it (its add_export rule)."""
    import re

    from ftkit.command.engines import ds_env_value

    for value in [*PAYLOADS, "plain", "a b", "back\\slash", "", " padded"]:
        v = ds_env_value(value).strip()
        if re.search(r"[^\w@%+=:,./-]", v):  # deepspeed.launcher.multinode_runner.MultiNodeRunner.add_export
            v = f'"{v}"'
        out = subprocess.run(
            ["sh", "-c", f'export K={v}; printf %s "$K"'], cwd=tmp_path, capture_output=True, text=True, check=True
        )
        assert out.stdout == value.strip()
    assert not (tmp_path / MARK).exists()
    with pytest.raises(UserError, match="newline"):
        ds_env_value("a\nb")


def test_deepspeed_pdsh_refuses_what_deepspeed_would_splice_unquoted(tmp_path):
    """DeepSpeed's pdsh line holds ``cd <cwd>;``, the Python path and ftkit's arguments without quoting them."""
    run_dir = tmp_path / f"r$(touch {MARK})" / "run"
    inp = _inputs(tmp_path, "deepspeed", run_dir, python=sys.executable)
    with pytest.raises(UserError) as e:
        build_launch(inp, {"PATH": "/usr/bin"})
    assert any("DeepSpeed's pdsh launcher passes unquoted" in line for line in e.value.lines())
    with pytest.raises(PreflightError, match="pdsh launcher passes unquoted"):
        run_preflight(
            hosts=[("node1", 1)],
            master_addr="127.0.0.1",
            master_port=29500,
            run_dir=run_dir,
            engine="deepspeed",
            ssh_args=["-o", f"ProxyCommand=false {time.time()}"],
        )
