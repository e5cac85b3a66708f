"""Launch commands are plain data: golden per-engine argv/env, the environment allow-list, redaction."""

from __future__ import annotations

import base64
import json

import pytest

from ftkit.cluster.procs import exit_meaning
from ftkit.command.engines import LaunchInputs, build_launch, describe, forwarded_env

BASE_ENV = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "HF_TOKEN": "hf_secret",
    "NCCL_DEBUG": "INFO",
    "AWS_SECRET": "x",
    "RANDOM_VAR": "leak",
    "WANDB_API_KEY": "k",
    "GLOO_SOCKET_IFNAME": "eth0",
}


def _inputs(engine: str, hosts=(("localhost", 2),), **kw) -> LaunchInputs:
    base = dict(
        engine=engine,
        hosts=tuple(hosts),
        master_addr="127.0.0.1",
        master_port=29500,
        run_dir="/r/run",
        attempt=1,
        resume="/r/run/checkpoint-8",
        accelerator="cpu",
        python="/py",
        name="demo",
    )
    base.update(kw)
    return LaunchInputs(**base)


def test_env_is_an_allow_list_with_the_accelerator():
    env = forwarded_env(BASE_ENV, "cpu")
    assert "RANDOM_VAR" not in env and "AWS_SECRET" not in env
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1" and env["NCCL_DEBUG"] == "INFO"
    assert "DS_ACCELERATOR" not in forwarded_env({**BASE_ENV, "DS_ACCELERATOR": "cpu"}, "cuda")


def test_every_rank_finds_the_tools_beside_its_python_first():
    """torch builds DeepSpeed's ops with the ``ninja`` on PATH; the system's and pip's (beside the ranks' Python)
    hash build commands differently, so ranks that found different ones rebuilt each other's ops at every start."""
    py = "/venv/bin/python"
    for engine in ("deepspeed", "accelerate", "torchrun"):
        for hosts in ((("localhost", 2),), (("localhost", 1), ("w1", 1))):
            cmd = build_launch(_inputs(engine, hosts=hosts, python=py), {**BASE_ENV, "PATH": "/usr/bin:/venv/bin"})
            for node in cmd.nodes:
                words = node.argv[-1].split() if node.remote else []  # ssh: the environment is inline
                env = dict(w.strip("'").split("=", 1) for w in words if "=" in w) if node.remote else node.env
                path = env.get("PATH", "")
                assert path == "/venv/bin:/usr/bin", (engine, node.host, path)
            for name, text in cmd.files.items():  # DeepSpeed's pdsh runner: the remote ranks' environment file
                if name.endswith("ds_env"):
                    assert "PATH=/venv/bin:/usr/bin\n" in text, text


def test_deepspeed_local_golden():
    """One local host: DeepSpeed's per-node launcher, with the arguments its runner would give it."""
    cmd = build_launch(_inputs("deepspeed"), BASE_ENV)
    (node,) = cmd.nodes
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    assert node.argv == (
        "/py",
        "-u",
        "-m",
        "ftkit.launch.engine",
        "deepspeed.launcher.launch",
        f"--world_info={world}",
        "--master_addr=127.0.0.1",
        "--master_port=29500",
        "--module",
        "--no_local_rank",
        "--log_level=info",
        "ftkit.launch.train",
        "/r/run",
        "--attempt",
        "1",
        "--resume",
        "/r/run/checkpoint-8",
    )
    assert cmd.files == {} and cmd.notes == ('deepspeed.launcher.launch --world_info: {"localhost": [0, 1]}',)
    text = describe(cmd)
    assert "HF_TOKEN=***" in text and "hf_secret" not in text and "WANDB_API_KEY=***" in text


def test_deepspeed_multinode_uses_pdsh_and_a_fresh_env_file():
    cmd = build_launch(
        _inputs("deepspeed", hosts=(("n0", 1), ("n1", 1)), master_addr="10.0.0.1", ssh_config="/cfg/ssh"), BASE_ENV
    )
    (node,) = cmd.nodes
    assert node.argv[:5] == ("/py", "-u", "-m", "ftkit.launch.engine", "deepspeed.launcher.runner")
    assert "--no_ssh_check" in node.argv and ("--launcher", "pdsh") == node.argv[14:16]
    assert " -m deepspeed.launcher.launch --world_info=" in cmd.notes[0]  # the remote line is DeepSpeed's own
    env_file = "/r/run/ftkit/attempts/1/ds_env"
    assert node.env["DS_ENV_FILE"] == env_file and node.env["PDSH_SSH_ARGS_APPEND"] == "-F /cfg/ssh"
    assert "DS_ACCELERATOR=cpu\n" in cmd.files[env_file] and "RANDOM_VAR" not in cmd.files[env_file]
    assert cmd.files["/r/run/ftkit/attempts/1/hostfile"] == "n0 slots=1\nn1 slots=1\n"
    assert "hf_secret" not in describe(cmd)


def test_torchrun_per_host_over_ssh_golden():
    cmd = build_launch(
        _inputs("torchrun", hosts=(("n0", 2), ("n1", 2)), master_addr="10.0.0.1", ssh_config="/cfg/ssh"), BASE_ENV
    )
    n0, n1 = cmd.nodes
    for node, is_host in ((n0, 1), (n1, 0)):
        assert node.remote and node.argv[:7] == (
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            "-F",
            "/cfg/ssh",
        )
        remote = node.argv[-1]
        assert remote.startswith("cd /r && exec env ")
        assert (
            f"/py -m ftkit.launch.engine torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d "
            f"--rdzv-endpoint 10.0.0.1:29500 --rdzv-id demo-1 --max-restarts 0 --rdzv-conf is_host={is_host} "
            f"--local-addr {node.host} -m ftkit.launch.train /r/run --attempt 1 --resume /r/run/checkpoint-8"
        ) in remote
        assert "DS_ACCELERATOR=cpu" in remote and "RANDOM_VAR" not in remote
    assert "hf_secret" not in describe(cmd) and "HF_TOKEN=***" in describe(cmd)


def test_a_single_remote_host_is_still_remote():
    ds = build_launch(_inputs("deepspeed", hosts=(("n0", 2),), master_addr="10.0.0.1"), BASE_ENV).nodes[0]
    assert "--force_multi" in ds.argv and "pdsh" in ds.argv
    tr = build_launch(_inputs("torchrun", hosts=(("n0", 2),), master_addr="10.0.0.1"), BASE_ENV).nodes[0]
    assert tr.remote and tr.argv[0] == "ssh"


def test_accelerate_machine_ranks():
    cmd = build_launch(_inputs("accelerate", hosts=(("n0", 2), ("n1", 2)), master_addr="10.0.0.1"), BASE_ENV)
    assert [n.argv[-1].split("--machine_rank ")[1].split()[0] for n in cmd.nodes] == ["0", "1"]
    local = build_launch(_inputs("accelerate"), BASE_ENV).nodes[0]
    assert local.argv[:7] == (
        "/py",
        "-m",
        "ftkit.launch.engine",
        "accelerate.commands.launch",
        "--config_file",
        "/r/run/ftkit/accelerate.yaml",
        "--machine_rank",
    )


def test_exit_meanings():
    assert "SIGKILL" in exit_meaning(247) and "DeepSpeed" in exit_meaning(247)
    assert exit_meaning(-9) == "killed by SIGKILL"
    assert "SIGTERM" in exit_meaning(143)
    assert exit_meaning(1) == "exit 1"


# ------------------------------------------------------------------------------------------------ user commands


def _cmd(tmp_path, *argv, which=None, trl_dir=None):
    from ftkit.command.user_command import parse_command

    return parse_command(list(argv), str(tmp_path), which or (lambda name: None), trl_dir)


def test_builtin_entry_argv_is_unchanged_and_gets_the_env_contract():
    for engine in ("deepspeed", "accelerate", "torchrun"):
        (node,) = build_launch(_inputs(engine), BASE_ENV).nodes
        assert node.argv[0] == "/py" and "env" not in node.argv[:1]
        assert node.argv[-6:] == ("ftkit.launch.train", "/r/run", "--attempt", "1", "--resume", "/r/run/checkpoint-8")
        assert node.env["FTKIT_RUN_DIR"] == "/r/run" and node.env["FTKIT_ATTEMPT"] == "1"
        assert node.env["FTKIT_RESUME"] == "/r/run/checkpoint-8"
        assert "PYTHONPATH" not in node.env  # the built-in entry uses ftkit.hf itself: no hook


def test_user_command_forms(tmp_path):
    (tmp_path / "sft.py").write_text("")
    exe = tmp_path / "bin" / "mytrain"
    exe.parent.mkdir()
    exe.write_text("")
    script = _cmd(tmp_path, "python3", "-u", "sft.py", "--output_dir", "x")
    assert (script.kind, script.target, script.args) == ("script", str(tmp_path / "sft.py"), ("--output_dir", "x"))
    mod = _cmd(tmp_path, "python", "-m", "pkg.train", "--a", "1")
    assert (mod.kind, mod.target, mod.args) == ("module", "pkg.train", ("--a", "1"))
    ex = _cmd(tmp_path, "mytrain", "--a", which=lambda n: str(exe) if n == "mytrain" else None)
    assert (ex.kind, ex.target, ex.args) == ("exec", str(exe), ("--a",))


def test_trl_console_command_is_unwrapped_to_its_module(tmp_path):
    trl = tmp_path / "trl"
    (trl / "scripts").mkdir(parents=True)
    (trl / "scripts" / "sft.py").write_text("")
    c = _cmd(tmp_path, "trl", "sft", "--model_name_or_path", "m", trl_dir=str(trl), which=lambda n: "/bin/true")
    assert (c.kind, c.target, c.args) == ("module", "trl.scripts.sft", ("--model_name_or_path", "m"))
    assert "accelerate-launch wrapper" in c.note
    # `trl env` is not a training script: it stays the console command
    assert _cmd(tmp_path, "trl", "env", trl_dir=str(trl), which=lambda n: "/bin/true").kind == "exec"


def test_user_command_mistakes_are_one_line_user_errors(tmp_path):
    import pytest

    from ftkit.errors import UserError

    cases = {
        (): "empty",
        ("python", "missing.py"): "script not found",
        ("python", "-c", "print(1)"): "put the code in a script",
        ("python", "-m", "torch.distributed.run", "x.py"): "is a launcher",
        ("torchrun", "x.py"): "is a launcher",
        ("accelerate", "launch", "x.py"): "is a launcher",
        ("/usr/bin/deepspeed", "x.py"): "is a launcher",
        ("nosuchprogram",): "not found on PATH",
        ("python", "-m", "1bad"): "not a module name",
    }
    for argv, text in cases.items():
        with pytest.raises(UserError, match=text):
            _cmd(tmp_path, *argv)


def test_user_command_argv_per_engine(tmp_path):
    from ftkit.command.user_command import UserCommand

    cases = {
        UserCommand("script", "/w/sft.py", ("--a", "1")): {
            "deepspeed": ("--no_local_rank", "--log_level=info", "/w/sft.py", "--a", "1"),
            "accelerate": ("--main_process_port", "29500", "/w/sft.py", "--a", "1"),
            "torchrun": ("--max-restarts", "0", "/w/sft.py", "--a", "1"),
        },
        UserCommand("module", "trl.scripts.sft", ("--a",)): {
            "deepspeed": ("--module", "--no_local_rank", "--log_level=info", "trl.scripts.sft", "--a"),
            "accelerate": ("--main_process_port", "29500", "-m", "trl.scripts.sft", "--a"),
            "torchrun": ("--max-restarts", "0", "-m", "trl.scripts.sft", "--a"),
        },
        UserCommand("exec", "/bin/mytrain", ()): {
            "deepspeed": ("--no_python", "--no_local_rank", "--log_level=info", "/bin/mytrain"),
            "accelerate": ("--main_process_port", "29500", "--no_python", "/bin/mytrain"),
            "torchrun": ("--max-restarts", "0", "--no-python", "/bin/mytrain"),
        },
    }
    for command, per_engine in cases.items():
        for engine, tail in per_engine.items():
            inp = _inputs(engine, command=command, inject_path="/ft/launch/inject", workdir="/w")
            (node,) = build_launch(inp, {**BASE_ENV, "PYTHONPATH": "/site"}).nodes
            assert node.argv[:4] == ("env", "-C", "/w", "/py"), engine  # runs where ftkit launch ran
            assert node.argv[-len(tail) :] == tail if engine != "deepspeed" else _subseq(tail, node.argv), engine
            assert node.env["PYTHONPATH"] == "/ft/launch/inject:/site"
            assert node.env["FTKIT_RUN_DIR"] == "/r/run" and node.env["FTKIT_RESUME"] == "/r/run/checkpoint-8"
            off = build_launch(_inputs(engine, command=command, inject=False, workdir="/w"), BASE_ENV).nodes[0]
            assert "PYTHONPATH" not in off.env  # --no-inject: no hook


def _subseq(sub, seq) -> bool:
    it = iter(seq)
    return all(x in it for x in sub)


def test_user_command_over_ssh_runs_in_the_launch_directory():
    from ftkit.command.user_command import UserCommand

    inp = _inputs(
        "torchrun",
        hosts=(("n0", 2), ("n1", 2)),
        master_addr="10.0.0.1",
        command=UserCommand("script", "/w/sft.py", ()),
        inject_path="/ft/inject",
        workdir="/w",
    )
    for node in build_launch(inp, BASE_ENV).nodes:
        remote = node.argv[-1]
        assert remote.startswith("cd /w && exec env ") and "FTKIT_RUN_DIR=/r/run" in remote
        assert "PYTHONPATH=/ft/inject" in remote and remote.endswith("--local-addr " + node.host + " /w/sft.py")
    ds = build_launch(
        _inputs(
            "deepspeed",
            hosts=(("n0", 1), ("n1", 1)),
            master_addr="10.0.0.1",
            command=inp.command,
            inject_path="/ft/inject",
            workdir="/w",
        ),
        BASE_ENV,
    )
    env_file = ds.files["/r/run/ftkit/attempts/1/ds_env"]
    assert "FTKIT_RUN_DIR=/r/run\n" in env_file and "PYTHONPATH=/ft/inject\n" in env_file


def test_builtin_only_keys():
    from ftkit.command.user_command import builtin_only_keys

    assert builtin_only_keys({"data.train", "peft.r", "train.seed", "model.path"}) == ["data.train", "peft.r"]


def test_module_lookup_finds_what_python_m_would_without_importing(tmp_path) -> None:
    """`-- python -m missing_module` used to start three attempts (exit 4), its cause only in a rank log."""
    import sys

    from ftkit.command.user_command import module_exists

    (tmp_path / "mymod.py").write_text("raise SystemExit('imported!')\n")
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('imported!')\n")
    (tmp_path / "pkg" / "sub" / "run.py").write_text("")
    search = [str(tmp_path)]
    found = ("mymod", "pkg", "pkg.sub", "pkg.sub.run", "json", "json.tool", "ftkit.launch.train", "trl.scripts.sft")
    for name in found:
        assert module_exists(name, search), name
    for name in ("missing_xyz", "pkg.nope", "pkg.sub.run.deeper", "json.nope", "mymod.sub"):
        assert not module_exists(name, search), name
    assert "pkg" not in sys.modules and "mymod" not in sys.modules and str(tmp_path) not in sys.path


# ------------------------------------------------------------------------------------------------ issue 35: environment


def _node_env(node) -> dict[str, str]:
    """A node's environment: its env, or for an ssh node the assignments inlined in the remote shell line."""
    import shlex

    if not node.remote:
        return dict(node.env)
    words = shlex.split(node.argv[-1])
    start = words.index("env") + 1
    out = {}
    for w in words[start:]:
        if "=" not in w:
            break
        k, _, v = w.partition("=")
        out[k] = v
    return out


def test_local_ranks_get_the_whole_environment_remote_ones_the_allow_list_and_cluster_env():
    """Issue 35: a local launch passes the user's whole environment to the ranks (as torchrun, deepspeed and
    accelerate launch do); other hosts get the allow-list, DeepSpeed's .deepspeed_env and cluster.env."""
    base = {**BASE_ENV, "LD_LIBRARY_PATH": "/opt/cuda/lib64", "MY_DATA_DIR": "/data", "CUDA_HOME": "/opt/cuda"}
    items = ("MY_DATA_DIR", "FOO=1", "NOT_SET_HERE")
    ds_env = {"NCCL_IB_DISABLE": "1", "FROM_DS_ENV": "yes"}
    for engine in ("deepspeed", "accelerate", "torchrun"):
        cmd = build_launch(_inputs(engine, cluster_env=items, deepspeed_env=ds_env), base)
        env = _node_env(cmd.nodes[0])
        for k in ("LD_LIBRARY_PATH", "MY_DATA_DIR", "CUDA_HOME", "RANDOM_VAR", "HF_TOKEN"):
            assert env[k] == base[k], (engine, k)
        assert env["FOO"] == "1" and "NOT_SET_HERE" not in env and "FROM_DS_ENV" not in env, engine
    for engine in ("accelerate", "torchrun"):
        cmd = build_launch(_inputs(engine, hosts=(("n0", 1), ("n1", 1)), master_addr="10.0.0.1", cluster_env=items,
                                   deepspeed_env=ds_env), base)  # fmt: skip
        for node in cmd.nodes:
            env = _node_env(node)
            assert "LD_LIBRARY_PATH" not in env and "RANDOM_VAR" not in env and "CUDA_HOME" not in env, engine
            assert env["MY_DATA_DIR"] == "/data" and env["FOO"] == "1" and env["FROM_DS_ENV"] == "yes", engine
            assert env["HF_TOKEN"] == "hf_secret" and env["NCCL_DEBUG"] == "INFO", engine  # allow-listed
    cmd = build_launch(_inputs("deepspeed", hosts=(("n0", 1), ("n1", 1)), master_addr="10.0.0.1", cluster_env=items,
                               deepspeed_env=ds_env, private_dir="/tmp/ftkit-env-x"), base)  # fmt: skip
    text = cmd.files["/tmp/ftkit-env-x/ds_env"]  # outside the run directory: it holds the environment's values
    assert "MY_DATA_DIR=/data\n" in text and "FOO=1\n" in text and "FROM_DS_ENV=yes\n" in text, text
    assert "LD_LIBRARY_PATH" not in text and "RANDOM_VAR" not in text
    assert cmd.nodes[0].env["LD_LIBRARY_PATH"] == "/opt/cuda/lib64"  # the runner itself runs here


def test_an_arch_list_deepspeed_cannot_parse_reaches_the_ranks_as_one_it_can():
    """Issue 35: TORCH_CUDA_ARCH_LIST=9.0a (CUDA images set such values) made DeepSpeed 0.19's op builds fail on
    every rank; the ranks get 9.0 (the same kernels) and the launch says so once."""
    from ftkit.command.engines import arch_note

    for given, want in (("9.0a", "9.0"), ("8.0 9.0+PTX", "8.0 9.0+PTX"), ("10.0f+PTX;9.0a", "10.0+PTX;9.0"),
                        ("Hopper", "9.0+PTX"), ("9.0", "9.0")):  # fmt: skip
        for engine, hosts in (("deepspeed", (("localhost", 2),)), ("torchrun", (("n0", 1), ("n1", 1)))):
            cmd = build_launch(_inputs(engine, hosts=hosts, master_addr="10.0.0.1"),
                               {**BASE_ENV, "TORCH_CUDA_ARCH_LIST": given})  # fmt: skip
            for node in cmd.nodes:
                assert _node_env(node)["TORCH_CUDA_ARCH_LIST"] == want, (given, engine)
        note = arch_note({"TORCH_CUDA_ARCH_LIST": given})
        assert (note is None) == (given == want), (given, note)
    assert "TORCH_CUDA_ARCH_LIST" not in forwarded_env({"TORCH_CUDA_ARCH_LIST": "junk"}, "cuda")
    assert "TORCH_CUDA_ARCH_LIST=9.0 instead of '9.0a'" in arch_note({"TORCH_CUDA_ARCH_LIST": "9.0a"})


@pytest.mark.heavy
def test_deepspeed_s_own_arch_parser_fails_on_the_given_value_and_reads_the_sanitised_one(monkeypatch):
    """The parse check against DeepSpeed's real op builder (FusedAdamBuilder.compute_capability_args in JIT mode,
    the path the GPU log shows): the raw value raises, what ftkit gives the ranks parses."""
    pytest.importorskip("deepspeed")
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from ftkit.cluster.toolchain import arch_problem, sanitize_arch_list

    def parses(value: str) -> bool:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        b = FusedAdamBuilder()
        b.jit_mode = True
        try:
            b.compute_capability_args()
        except ValueError:
            return False
        return True

    for value in ("9.0a", "10.0f+PTX;9.0a", "8.0 9.0+PTX", "8.0;8.6;9.0", "Hopper"):
        assert parses(value) == (arch_problem(value) is None), value
        assert parses(sanitize_arch_list(value)), value


# ------------------------------------------------------------------------------------------------ issue 41: redaction

# One variable per word of the secret pattern, with values of every shape a token or password takes
SECRETS = {
    "HF_TOKEN": "hf-ab.cd-123",
    "MLFLOW_TRACKING_PASSWORD": "p@ss:word",
    "DB_PASSWD": "pa$$ w'rd\"x",
    "AWS_SECRET_ACCESS_KEY": "wJalr/XUtnFEMI+K7MDENG==",
    "WANDB_API_KEY": "0123456789abcdef",
    "SSH_KEY": "-----BEGIN KEY-----",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON": '{"k": "v1v2v3"}',
    "MY_SECRET": "s3cr3t;rm -rf",
}


@pytest.mark.parametrize("engine", ["deepspeed", "accelerate", "torchrun", "slurm"])
@pytest.mark.parametrize("where", ["local", "remote"])
def test_no_secret_value_is_printed_whatever_its_name_or_shape(engine, where):
    """Issue 41: --dry-run's text and the spawn event's argv (the ssh line carries the environment inline) mask every
    variable the secret pattern names, for values of any shape; cluster.env's NAME=VALUE secrets too."""
    from ftkit.rundir.env import MASK, is_secret

    assert all(is_secret(k) for k in SECRETS)
    hosts = (("localhost", 2),) if where == "local" else (("n0", 1), ("n1", 1))
    base = {**BASE_ENV, **SECRETS, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-1]"}
    inp = _inputs(engine, hosts=hosts, master_addr="10.0.0.1", cluster_env=("HF_TOKEN", "EXTRA_TOKEN=tok.en-456"))
    cmd = build_launch(inp, base)
    recorded = describe(cmd) + "\n" + "\n".join(" ".join(cmd.redactor.argv(n.argv)) for n in cmd.nodes)
    for value in [*SECRETS.values(), "tok.en-456"]:
        for i in range(len(value) - 5):  # no 6 characters of it either (a mask of its word characters only is a leak)
            assert value[i : i + 6] not in recorded, (value, recorded)
    assert f"HF_TOKEN={MASK}" in recorded


def test_the_redactor_masks_a_secret_by_its_value_anywhere_and_by_its_name_whatever_its_value():
    """The two halves of the one redaction function, each on its own (issue 41's mutation check: either half alone
    passed the test above, where every value also follows its name):
    * by value: a known secret's value where no name precedes it (an argv word, a log line printing it, JSON);
    * by name: NAME=VALUE with a secret-looking NAME whose value the redactor was never given (a log line of the
      user's script, another host's environment), whatever characters the value has and however it is quoted."""
    from ftkit.rundir.env import MASK, Redactor

    known = Redactor({"HF_TOKEN": "hf-ab.cd-123", "MLFLOW_TRACKING_PASSWORD": "p@ss:word"})
    assert known.argv(["train.py", "--hub-token", "hf-ab.cd-123"]) == ["train.py", "--hub-token", MASK]
    assert known.text('login with p@ss:word, {"token": "hf-ab.cd-123"}') == f'login with {MASK}, {{"token": "{MASK}"}}'
    unknown = Redactor({})
    for line, want in (
        ("export HF_TOKEN=hf-ab.cd-123", f"export HF_TOKEN={MASK}"),
        ("MLFLOW_TRACKING_PASSWORD=p@ss:word rank 3", f"MLFLOW_TRACKING_PASSWORD={MASK} rank 3"),
        ("DB_PASSWD='pa$$ w rd' next", f"DB_PASSWD={MASK} next"),
        ('MY_SECRET="s3cr3t;rm -rf" next', f"MY_SECRET={MASK} next"),
        ("PATH=/usr/bin:/bin", "PATH=/usr/bin:/bin"),  # not a secret's name: left as it is
    ):
        assert unknown.text(line) == want, line
    assert unknown.env({"HF_TOKEN": "x", "HOME": "/root"}) == {"HF_TOKEN": MASK, "HOME": "/root"}
