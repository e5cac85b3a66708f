"""Tier 0 tests of ftkit.cluster.hostfile: the strict DeepSpeed hostfile grammar, --include/--exclude, local-only
detection.

The comparison tests run DeepSpeed's own hostfile and filter functions. They are taken from the installed
``deepspeed/launcher/runner.py`` by source (ast) rather than imported, because importing ``deepspeed`` imports
torch (~2 s) and these functions only need the standard library.
"""

from __future__ import annotations

import ast
import base64
import collections
import copy
import importlib.util
import itertools
import json
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftkit.cluster import hosts as hosts_mod
from ftkit.cluster.hostfile import Host, Hostfile, apply_filters, local_hostfile, parse_hostfile, parse_hostfile_text
from ftkit.cluster.hosts import is_local
from ftkit.errors import HostfileError, Problem, UserError

# --------------------------------------------------------------------------------------------------------------
# valid hostfiles


def test_basic_hostfile() -> None:
    hf = parse_hostfile_text("worker-0 slots=8\nworker-1 slots=4\n", path="hosts")
    assert hf == Hostfile("hosts", (Host("worker-0", 8, 1), Host("worker-1", 4, 2)))
    assert hf.world_size == 12
    assert hf.num_nodes == 2
    assert hf.names == ("worker-0", "worker-1")
    assert hf.host("worker-1").slots == 4
    assert hf.resource_pool() == {"worker-0": list(range(8)), "worker-1": [0, 1, 2, 3]}


def test_comments_blank_lines_and_whitespace() -> None:
    text = (
        "\ufeff# full-line comment\n"
        "\n"
        "   \n"
        "  node-a   slots=2   # trailing comment\r\n"
        "\tnode_b\tslots=1#no space before the comment\n"
        "   # indented comment\n"
        "10.0.0.3 slots=16\n"
        "n4.example.com slots=01"  # no final newline; a leading zero is still a number
    )
    hf = parse_hostfile_text(text)
    assert [(h.name, h.slots, h.line) for h in hf.hosts] == [
        ("node-a", 2, 4),
        ("node_b", 1, 5),
        ("10.0.0.3", 16, 7),
        ("n4.example.com", 1, 8),
    ]
    assert hf.path == "<hostfile>"


def test_parse_hostfile_reads_a_file(tmp_path: Path) -> None:
    p = tmp_path / "hostfile"
    p.write_text("a slots=1\nb slots=2\n")
    hf = parse_hostfile(p)
    assert hf.path == str(p) and hf.world_size == 3


def test_to_text_round_trips() -> None:
    hf = parse_hostfile_text("# x\na slots=3  # y\n\nb slots=1\n")
    assert hf.to_text() == "a slots=3\nb slots=1\n"
    assert parse_hostfile_text(hf.to_text()).resource_pool() == hf.resource_pool()


# --------------------------------------------------------------------------------------------------------------
# errors: one line each, quoting the line, with its number


BAD_LINES = [
    ("host1 slots=4 foo", "unexpected text 'foo' after slots=4"),
    ("host1 slots=4 slots=2", "unexpected text 'slots=2'"),
    ("host1 slots=x", "slots must be a positive integer, got 'x'"),
    ("host1 slots=4x", "slots must be a positive integer, got '4x'"),
    ("host1 slots=", "slots= needs a number"),
    ("host1 slots=0", "slots must be at least 1, got 0"),
    ("host1 slots=-1", "slots must be a positive integer, got '-1'"),
    ("host1 slots=+2", "slots must be a positive integer, got '+2'"),
    ("host1 slots=2.5", "slots must be a positive integer, got '2.5'"),
    ("host1", "missing slots=N"),
    ("host1 4", "expected slots=N after the host name, got '4'"),
    ("host1 slots = 4", "no spaces around '='"),
    ("slots=4", "missing host name"),
    ("root@host1 slots=4", "put the user in ssh config"),
    ("host1;rm slots=1", "shell metacharacter(s) ;"),
    ("a|b slots=1", "shell metacharacter(s) |"),
    ("a&b slots=1", "shell metacharacter(s) &"),
    ("$HOST slots=1", "shell metacharacter(s) $"),
    ("`id` slots=1", "shell metacharacter(s) `"),
    ("a>b slots=1", "shell metacharacter(s) >"),
    ("a<b slots=1", "shell metacharacter(s) <"),
    ("$(id) slots=1", "shell metacharacter(s) $ ( )"),
    ("'host1' slots=1", "shell metacharacter(s) '"),
    ('"host1" slots=1', 'shell metacharacter(s) "'),
    ("a\\b slots=1", "shell metacharacter(s) \\"),
    ("node[1-2] slots=1", "shell metacharacter(s) [ ]"),
    ("my host slots=2", "contains a space"),
    ("a,b slots=1", "contains ','"),
    ("fe80::1 slots=1", "contains ':'"),
    ("-oProxyCommand=x slots=1", "contains '='"),
    ("-o slots=1", "starts with '-'"),
]


@pytest.mark.parametrize(("line", "expected"), BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_bad_line(line: str, expected: str) -> None:
    text = f"# header\nok-host slots=1\n{line}   # a comment\n"
    with pytest.raises(HostfileError) as ei:
        parse_hostfile_text(text, path="hosts.txt")
    (problem,) = ei.value.problems
    assert problem.file == "hosts.txt" and problem.line == 3
    assert expected in problem.message
    assert f'"{line}   # a comment"' in problem.message  # quotes the line as written
    assert str(problem).startswith("hosts.txt:3: ")


def test_user_at_host_names_the_ssh_config_fix() -> None:
    with pytest.raises(HostfileError) as ei:
        parse_hostfile_text("ubuntu@gpu-7 slots=8\n")
    message = ei.value.problems[0].message
    assert "'gpu-7'" in message and "User ubuntu" in message and "Host gpu-7" in message


def test_duplicate_host_names_the_earlier_line() -> None:
    with pytest.raises(HostfileError) as ei:
        parse_hostfile_text("a slots=1\n\nb slots=1\na slots=2\nB slots=3\n")
    assert [(p.line, p.message.split(" in ")[0]) for p in ei.value.problems] == [
        (4, "duplicate host 'a' (already listed on line 1)"),
        (5, "duplicate host 'B' (already listed on line 3 as 'b')"),
    ]


@pytest.mark.parametrize("text", ["", "\n\n", "# only comments\n   # here\n", "\ufeff"])
def test_empty_hostfile(text: str) -> None:
    with pytest.raises(HostfileError) as ei:
        parse_hostfile_text(text, path="hf")
    assert [str(p) for p in ei.value.problems] == [
        "hf: hostfile lists no hosts (expected lines like 'worker-0 slots=8')"
    ]


def test_every_problem_is_reported_at_once() -> None:
    lines_of_file = [
        "# cluster",  # 1
        "good-0 slots=4",  # 2
        "host1 slots=4 foo",  # 3
        "host2 slots=0",  # 4
        "",  # 5
        "root@host3 slots=2",  # 6
        "good-0 slots=4",  # 7
        "h;4 slots=x",  # 8: two problems on one line
        "good-1 slots=2  # fine",  # 9
    ]
    text = "\n".join(lines_of_file)
    with pytest.raises(HostfileError) as ei:
        parse_hostfile_text(text, path="cluster/hostfile")
    err = ei.value
    assert isinstance(err, UserError) and err.exit_code == 2
    assert [p.line for p in err.problems] == [3, 4, 6, 7, 8, 8]
    lines = err.lines()
    assert all(line.startswith("cluster/hostfile:") for line in lines)
    assert "already listed on line 2" in lines[3]
    assert "metacharacter" in lines[4] and "positive integer" in lines[5]
    assert str(err) == "\n".join(lines)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="hostfile not found"):
        parse_hostfile(tmp_path / "missing")
    with pytest.raises(HostfileError, match="is a directory"):
        parse_hostfile(tmp_path)
    bad = tmp_path / "latin1"
    bad.write_bytes(b"h\xe9 slots=1\n")
    with pytest.raises(HostfileError, match="not UTF-8"):
        parse_hostfile(bad)
    broken = tmp_path / "broken"
    broken.write_text("a slots=1\na slots=1\n")
    with pytest.raises(HostfileError) as ei:
        parse_hostfile(broken)
    assert ei.value.problems[0].file == str(broken) and ei.value.problems[0].line == 2


# --------------------------------------------------------------------------------------------------------------
# --include / --exclude

TWO = "w0 slots=4\nw1 slots=4\nw2 slots=2\n"

FILTERS = [
    # (hostfile, include, exclude, expected resource pool)
    (TWO, "w0", None, {"w0": [0, 1, 2, 3]}),
    (TWO, "w1@w0", None, {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}),  # hostfile order, not filter order
    (TWO, "w0@w1:0,2", None, {"w0": [0, 1, 2, 3], "w1": [0, 2]}),
    (TWO, "w1:3,1,1", None, {"w1": [1, 3]}),
    (TWO, "w1:0@w1:2", None, {"w1": [0, 2]}),
    (TWO, "w2:1", None, {"w2": [1]}),
    (TWO, None, "w1", {"w0": [0, 1, 2, 3], "w2": [0, 1]}),
    (TWO, None, "w1:0", {"w0": [0, 1, 2, 3], "w1": [1, 2, 3], "w2": [0, 1]}),
    (TWO, None, "w0:0,1@w2", {"w0": [2, 3], "w1": [0, 1, 2, 3]}),
    (TWO, None, "w2:0,1", {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}),
    (TWO, "", "", {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3], "w2": [0, 1]}),
    ("localhost slots=2\n", "localhost:1", None, {"localhost": [1]}),
]


@pytest.mark.parametrize(("text", "include", "exclude", "expected"), FILTERS)
def test_filters(text: str, include: str | None, exclude: str | None, expected: dict[str, list[int]]) -> None:
    hf = parse_hostfile_text(text)
    out = apply_filters(hf, include=include, exclude=exclude)
    assert out.resource_pool() == expected
    assert out.world_size == sum(len(v) for v in expected.values())
    assert all(h.slots == len(h.slot_indices) for h in out.hosts)
    assert out.path == hf.path
    assert [h.line for h in out.hosts] == [hf.host(n).line for n in expected]


def test_filter_that_keeps_leading_slots_equals_a_plain_host() -> None:
    out = apply_filters(parse_hostfile_text(TWO), include="w0:0,1")
    assert out.hosts == (Host("w0", 2, 1),)
    assert out.hosts[0].selected_slots is None


def test_filters_compose_on_a_filtered_hostfile() -> None:
    first = apply_filters(parse_hostfile_text(TWO), exclude="w0:0")
    assert apply_filters(first, exclude="w0:2").resource_pool()["w0"] == [1, 3]
    with pytest.raises(HostfileError, match="host 'w0' has no slot 0"):
        apply_filters(first, include="w0:0")


FILTER_ERRORS = [
    ("w0", "w1", "cannot be used together"),
    ("w00", None, "unknown host 'w00' (did you mean 'w0'?)"),
    ("zzz", None, "unknown host 'zzz' (hosts: w0, w1, w2)"),
    ("w2:2", None, "host 'w2' has no slot 2 (its slots: 0,1)"),
    (None, "w0:4", "host 'w0' has no slot 4 (its slots: 0-3)"),
    ("w0:", None, "bad slot list ''"),
    ("w0:a", None, "bad slot list 'a'"),
    ("w0:-1", None, "bad slot list '-1'"),
    ("w0:0:1", None, "bad slot list '0:1'"),
    ("w0:0,", None, "bad slot list '0,'"),
    ("w0@", None, "empty host name"),
    (None, "@w0", "empty host name"),
    ("w0@w0:1", None, "named both whole and with slot indices"),
    (None, "w0:1@w0", "named both whole and with slot indices"),
    (None, "w0@w1@w2", "leaves no slot on any host"),
    (None, "w0@w1@w2:0,1", "leaves no slot on any host"),
]


@pytest.mark.parametrize(("include", "exclude", "expected"), FILTER_ERRORS)
def test_filter_errors(include: str | None, exclude: str | None, expected: str) -> None:
    with pytest.raises(HostfileError) as ei:
        apply_filters(parse_hostfile_text(TWO), include=include, exclude=exclude)
    assert any(expected in str(p) for p in ei.value.problems), ei.value.lines()
    flag = "--include" if include and not exclude else "--exclude" if exclude and not include else "--include/"
    assert all(p.key is not None and p.key.startswith(flag) for p in ei.value.problems)


def test_filter_reports_every_problem_at_once() -> None:
    with pytest.raises(HostfileError) as ei:
        apply_filters(parse_hostfile_text(TWO), include="w00@w0:7@w1:x@w2")
    assert ei.value.lines() == [
        "--include: unknown host 'w00' (did you mean 'w0'?)",
        "--include: host 'w0' has no slot 7 (its slots: 0-3)",
        "--include: bad slot list 'x' for host 'w1' (expected comma-separated indices, e.g. 'w1:0,2')",
    ]


# --------------------------------------------------------------------------------------------------------------
# local-only detection


def test_local_hostfile() -> None:
    hf = local_hostfile(2)
    assert hf.hosts == (Host("localhost", 2, 0),)
    assert hf.world_size == 2 and hf.num_nodes == 1 and hf.is_local_only
    for bad in (0, -1, True, 1.5):
        with pytest.raises(HostfileError, match="positive integer"):
            local_hostfile(bad)  # type: ignore[arg-type]


@pytest.fixture
def fake_host_identity(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(hosts_mod.socket, "gethostname", lambda: "Box7")
    monkeypatch.setattr(hosts_mod.socket, "getfqdn", lambda name="": "box7.lab.example.")
    hosts_mod._fqdn.cache_clear()
    yield
    hosts_mod._fqdn.cache_clear()


@pytest.mark.parametrize(
    ("name", "local"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("box7", True),
        ("box7.lab.example", True),
        ("box7.lab.example.", True),
        ("box8", False),
        ("10.0.0.1", False),
        ("box7.other", False),
    ],
)
def test_is_local_host(fake_host_identity: None, name: str, local: bool) -> None:
    assert is_local(name) is local


def test_is_local_only(fake_host_identity: None) -> None:
    assert parse_hostfile_text("box7 slots=2\n").is_local_only
    assert not parse_hostfile_text("localhost slots=1\nnode1 slots=1\n").is_local_only


def test_real_hostname_is_local() -> None:
    assert is_local(socket.gethostname())


def test_import_is_light() -> None:
    code = "import sys, ftkit.cluster.hostfile; print(sorted({'torch', 'deepspeed', 'yaml'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == "[]"


def test_problem_type() -> None:
    with pytest.raises(HostfileError) as ei:
        parse_hostfile_text("a slots=0\n")
    assert isinstance(ei.value.problems[0], Problem)


# --------------------------------------------------------------------------------------------------------------
# agreement with DeepSpeed's own launcher code

_DS_FUNCS = (
    "fetch_hostfile",
    "_parse_hostfile",
    "_stable_remove_duplicates",
    "parse_node_config",
    "parse_node_config_list",
    "parse_resource_filter",
    "parse_inclusion_exclusion",
)


@pytest.fixture(scope="module")
def ds() -> SimpleNamespace:
    spec = importlib.util.find_spec("deepspeed")  # does not import deepspeed (or torch)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepspeed is not installed")
    runner = Path(next(iter(spec.submodule_search_locations))) / "launcher" / "runner.py"
    tree = ast.parse(runner.read_text(), filename=str(runner))
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _DS_FUNCS]
    assert sorted(f.name for f in funcs) == sorted(_DS_FUNCS), "deepspeed's runner.py changed shape"
    namespace: dict[str, object] = {
        "os": os,
        "re": re,
        "collections": collections,
        "defaultdict": collections.defaultdict,
        "deepcopy": copy.deepcopy,
        "logger": logging.getLogger("deepspeed-runner-under-test"),
        "Tuple": tuple,
        "List": list,
        "Dict": dict,
    }
    # Runs DeepSpeed's own function bodies from its installed source, not arbitrary input.
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(runner), "exec"), namespace)  # noqa: S102
    return SimpleNamespace(**{name: namespace[name] for name in _DS_FUNCS})


VALID_HOSTFILES = [
    "worker-0 slots=8\nworker-1 slots=8\n",
    "# c\n\nlocalhost slots=2\n",
    "a slots=1  # trailing comment\n\tb\tslots=3\n  c   slots=02\n",
    "10.1.2.3 slots=4\r\nnode_x.lab slots=1",
    TWO,
]


@pytest.mark.heavy
@pytest.mark.parametrize("text", VALID_HOSTFILES)
def test_parse_matches_deepspeed(ds: SimpleNamespace, tmp_path: Path, text: str) -> None:
    p = tmp_path / "hostfile"
    p.write_text(text, newline="")
    ours = parse_hostfile(p)
    theirs = ds.fetch_hostfile(str(p))
    assert list(theirs.items()) == [(h.name, h.slots) for h in ours.hosts]


@pytest.mark.heavy
def test_deepspeed_is_laxer_than_us(ds: SimpleNamespace) -> None:
    # Documents why ftkit parses itself: DeepSpeed accepts these lines, silently.
    for line in ("host1 slots=4 foo", "host1 slots=4x", "root@host1 slots=4", "h;rm slots=1", "h slots=0"):
        assert ds._parse_hostfile([line])
        with pytest.raises(HostfileError):
            parse_hostfile_text(line)


@pytest.mark.heavy
@pytest.mark.parametrize(("text", "include", "exclude", "expected"), FILTERS)
def test_filters_match_deepspeed(
    ds: SimpleNamespace, text: str, include: str | None, exclude: str | None, expected: dict[str, list[int]]
) -> None:
    hf = parse_hostfile_text(text)
    ours = apply_filters(hf, include=include, exclude=exclude).resource_pool()
    pool = collections.OrderedDict((h.name, h.slots) for h in hf.hosts)
    via_launcher = ds.parse_inclusion_exclusion(pool, include or "", exclude or "")
    active = collections.OrderedDict((h.name, list(range(h.slots))) for h in hf.hosts)
    direct = ds.parse_resource_filter(active, include_str=include or "", exclude_str=exclude or "")
    assert list(ours.items()) == list(via_launcher.items()) == list(direct.items()) == list(expected.items())


@pytest.mark.parametrize(
    ("include", "exclude"), [("w0", "w1"), ("w9", None), ("w2:2", None), (None, "w0:4"), ("w0:a", None)]
)
@pytest.mark.heavy
def test_deepspeed_also_rejects_these_filters(ds: SimpleNamespace, include: str | None, exclude: str | None) -> None:
    pool = collections.OrderedDict((h.name, h.slots) for h in parse_hostfile_text(TWO).hosts)
    with pytest.raises(ValueError):
        ds.parse_inclusion_exclusion(pool, include or "", exclude or "")
    with pytest.raises(HostfileError):
        apply_filters(parse_hostfile_text(TWO), include=include, exclude=exclude)


# --------------------------------------------------------------------------------------------------------------
# slot selections reach the ranks (issue 10, observed 9: plan.resolve_hosts kept only name and count, so
# `--include w0:1,3` ran on devices 0 and 1)

SELECTIONS = [
    # (hostfile, include, exclude)
    ("w0 slots=4\n", "w0:1,3", None),
    ("w0 slots=4\nw1 slots=4\n", "w0:2,3@w1:0,1", None),
    ("w0 slots=4\nw1 slots=4\n", None, "w1:0,2@w0:1,3"),
    ("w0 slots=2\nw1 slots=2\n", "w0:0@w1:1", None),
    ("localhost slots=4\n", "localhost:1,3", None),
    ("w0 slots=4\n", "w0:0,1", None),  # a prefix selection: the same as slots=2
]


def _node_env(node) -> dict[str, str]:
    """A node's environment: its own for a local process, the inline `env K=V ...` of the ssh line for a remote one."""
    if not node.remote:
        return dict(node.env)
    words = shlex.split(node.argv[-1])
    start = words.index("env") + 1
    return dict(w.split("=", 1) for w in itertools.takewhile(lambda w: "=" in w, words[start:]))


def _launched_devices(ds: SimpleNamespace, cmd, slots: dict[str, int], tmp_path: Path) -> dict[str, list[int]]:
    """Which device indices each host's ranks get from a built command, read the way the engine reads it."""
    if cmd.engine == "deepspeed":  # its runner reads the hostfile and --include/--exclude, then sets the devices
        (node,) = cmd.nodes
        argv = list(node.argv)
        info = next((a.split("=", 1)[1] for a in argv if a.startswith("--world_info=")), None)
        if info is not None:  # one local host: DeepSpeed's launcher itself, given the world the runner would give
            return json.loads(base64.urlsafe_b64decode(info))
        hostfile = tmp_path / "launched-hostfile"
        hostfile.write_text(cmd.files[argv[argv.index("--hostfile") + 1]])
        include = argv[argv.index("--include") + 1] if "--include" in argv else ""
        exclude = argv[argv.index("--exclude") + 1] if "--exclude" in argv else ""
        return dict(ds.parse_inclusion_exclusion(ds.fetch_hostfile(str(hostfile)), include, exclude))
    out = {}
    for node in cmd.nodes:  # torchrun and accelerate start LOCAL_RANK 0..n-1 on the node's visible devices
        visible = _node_env(node).get("CUDA_VISIBLE_DEVICES")
        devices = [int(d) for d in visible.split(",")] if visible else list(range(slots[node.host]))
        out[node.host] = devices[: slots[node.host]]
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("engine", ["deepspeed", "torchrun", "accelerate"])
@pytest.mark.parametrize(("text", "include", "exclude"), SELECTIONS)
def test_slot_selection_reaches_the_ranks(
    ds: SimpleNamespace, write_recipe, tmp_path: Path, engine: str, text: str, include, exclude
) -> None:
    try:
        from ftkit.run.job import launch_inputs
    except ImportError:  # before launch_inputs moved out of the CLI
        from ftkit.run.job import launch_inputs
    from ftkit.command.engines import build_launch
    from ftkit.plan.load import load_and_plan

    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    overrides = [f"cluster.hostfile={hostfile}", f"cluster.engine={engine}", "cluster.master_addr=10.0.0.1"]
    plan = load_and_plan(str(write_recipe()), overrides, include=include, exclude=exclude)
    cmd = build_launch(launch_inputs(plan), {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    expected = dict(ds.parse_inclusion_exclusion(ds.fetch_hostfile(str(hostfile)), include or "", exclude or ""))
    assert _launched_devices(ds, cmd, dict(plan.hosts), tmp_path) == expected
    assert plan.world_size == sum(len(d) for d in expected.values())


def test_slot_selection_shows_in_dry_run(tmp_path: Path, write_recipe) -> None:
    from tests.helpers.cli import run_ftkit

    (tmp_path / "hostfile").write_text("localhost slots=4\n")
    recipe = write_recipe()
    for engine, shown in (
        ("torchrun", "CUDA_VISIBLE_DEVICES=1,3"),
        ("deepspeed", '--world_info: {"localhost": [1, 3]}'),
    ):
        argv = ["launch", str(recipe), "--hostfile", "hostfile", "--include", "localhost:1,3", "--engine", engine]
        out = run_ftkit(*argv, "--dry-run", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert shown in out.stdout, out.stdout


def test_endless_hostfile_is_refused_in_one_line(tmp_path: Path) -> None:
    """`--hostfile /dev/zero` used to read until memory ran out (MemoryError traceback, exit 1)."""
    with pytest.raises(HostfileError, match="larger than 1 MiB"):
        parse_hostfile("/dev/zero")
    big = tmp_path / "big"
    big.write_text("w0 slots=1\n" * 100_000)
    with pytest.raises(HostfileError, match="larger than 1 MiB"):
        parse_hostfile(big)


def test_endless_hostfile_on_the_command_line(write_recipe, tmp_path: Path) -> None:
    from tests.helpers.cli import run_ftkit

    r = run_ftkit("launch", str(write_recipe()), "--hostfile", "/dev/zero", "--dry-run", cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "larger than 1 MiB" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("second", ["127.0.0.1", "127.0.1.1", "LOCALHOST.", "::1"])
def test_this_machine_twice_is_a_duplicate(second: str) -> None:
    """localhost and 127.0.0.1 used to be accepted as two nodes (two node ranks on one machine, one port)."""
    text = f"localhost slots=1\n{second} slots=1\n"
    if second == "::1":  # not a hostfile name at all (':'), refused before this check
        with pytest.raises(HostfileError, match="contains ':'"):
            parse_hostfile_text(text)
        return
    with pytest.raises(HostfileError, match=r"\(line 1\) are both this machine"):
        parse_hostfile_text(text)
