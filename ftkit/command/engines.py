"""Launch commands as data: one ``(argv, env)`` per process ftkit starts, for every engine, built here only.

Nothing here reads ``os.environ`` or spawns anything: the caller passes the base environment in, and
``ftkit launch --dry-run`` prints exactly the value :func:`build_launch` returns. The supervisor spawns it.

Engines (all existing ones, never a home-made launcher):

* ``deepspeed``: one ``deepspeed`` runner on the head node, which fans out over pdsh/ssh; for one local host ftkit
  starts DeepSpeed's per-node launcher (``deepspeed.launcher.launch``) itself, with the arguments the runner would
  give it, one process (and one import of DeepSpeed) less per attempt. ftkit passes ``--no_local_rank --module``
  and an explicit ``--master_addr``; the environment for remote ranks goes through a fresh per-attempt
  ``DS_ENV_FILE`` (never appended to ``.deepspeed_env``). Its pdsh runner puts the rank's command on one remote
  shell line unquoted, so a user command travels in ``FTKIT_COMMAND`` instead (``launch/run_command.py`` runs it
  on the rank).
* ``accelerate``: ``accelerate launch --config_file accelerate.yaml`` on every host (over ssh for remote ones)
  with its ``--machine_rank``.
* ``torchrun``: one ``torchrun`` agent per host with c10d rendezvous at ``master_addr:master_port`` (over ssh for
  remote hosts); ``--max-restarts 0`` because restarts are ftkit's, counted once per incident for the whole job.

ftkit starts each of these processes through :mod:`ftkit.launch.engine` (``python -m ftkit.launch.engine MODULE
ARGS``: the engine's module run as ``python -m MODULE ARGS`` would run it, with the garbage collector tuned as in the
ranks, ~1.2 s less per attempt). The line DeepSpeed's pdsh runner builds for remote hosts is DeepSpeed's own.

What runs on every rank is ftkit's built-in entry (``python -m ftkit.launch.train RUN_DIR --attempt N``) or the
user's own command (``ftkit launch RECIPE -- CMD``, :class:`UserCommand`): a script, a module or an executable,
each in the engine's own form (:func:`program_argv`). Every rank gets the run's environment contract
(``FTKIT_RUN_DIR``, ``FTKIT_ATTEMPT``, ``FTKIT_RESUME``); a user command also gets ftkit's import hook
(``launch/inject/sitecustomize.py``, see :mod:`ftkit.launch.hook`) first on its ``PYTHONPATH`` unless ``--no-inject``,
and runs in the directory ftkit was launched from (``env -C DIR`` here, ``cd DIR`` over ssh).
"""

from __future__ import annotations

import base64
import fnmatch
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ftkit.cluster.hosts import is_local
from ftkit.cluster.slurm import require_allocation, slurm_env
from ftkit.cluster.toolchain import arch_problem, sanitize_arch_list
from ftkit.command.user_command import UserCommand
from ftkit.errors import Problem, UserError
from ftkit.rundir.env import (
    ATTEMPT_ENV,
    COMMAND_ENV,
    ENV_ALLOW,
    NODE_ENV,
    RESUME_ENV,
    RUN_DIR_ENV,
    Redactor,
    encode_command,
    path_with_python_first,
)

TRAIN_MODULE = "ftkit.launch.train"
RUN_COMMAND_MODULE = "ftkit.launch.run_command"  # the trampoline that runs a command carried in COMMAND_ENV
# every engine process ftkit starts runs as `python -m ENGINE_MODULE MODULE ARGS`: the module as `python -m` would
# run it, with a rank's garbage-collector tuning (launch/engine.py)
ENGINE_MODULE = "ftkit.launch.engine"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name a shell can export (environ can hold any other)
# What DeepSpeed's pdsh runner splices into the remote shell line unquoted (cd to the runner's directory, the
# Python path, the user arguments of ftkit's rank entry, --master_addr): shlex's own set of characters that never
# need quoting. ftkit cannot quote these (DeepSpeed builds that line), so it refuses anything else.
_PDSH_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


@dataclass(frozen=True)
class NodeCommand:
    """One process to start on the head node: ``argv`` with ``env``; ``host`` is where its ranks run."""

    host: str
    node_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    remote: bool = False  # argv is an ssh command that starts the engine on ``host``


@dataclass(frozen=True)
class LaunchCommand:
    engine: str
    nodes: tuple[NodeCommand, ...]
    files: Mapping[str, str] = field(default_factory=dict)  # files to write before spawning (path -> text)
    notes: tuple[str, ...] = ()  # what --dry-run also shows: the remote shell line an engine builds itself
    # masks the secrets of the environments above wherever the command is printed or recorded (--dry-run, the
    # spawn events)
    redactor: Redactor = field(default_factory=Redactor, compare=False)


@dataclass(frozen=True)
class LaunchInputs:
    """Everything a command depends on, as plain data (from the Plan and the run directory)."""

    engine: str
    hosts: tuple[tuple[str, int], ...]
    master_addr: str
    master_port: int
    run_dir: str
    attempt: int
    resume: str | None
    accelerator: str
    python: str
    name: str
    ssh_config: str | None = None
    ssh_port: int | None = None
    # host -> the device indices its ranks use, from a slot selection (--include/--exclude); empty without one
    devices: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    command: UserCommand | None = None  # the user's command on every rank; None: the built-in entry
    inject: bool = True  # put ftkit's import hook on a user command's PYTHONPATH (--no-inject: off)
    inject_path: str | None = None  # the hook's directory (inject_dir()); needed when command and inject
    workdir: str | None = None  # where a user command runs (the directory ftkit launch ran in)
    # cluster.env: NAME (this machine's value) or NAME=VALUE, for the ranks on every host
    cluster_env: tuple[str, ...] = ()
    # DeepSpeed's .deepspeed_env convention (~/.deepspeed_env, then ./.deepspeed_env): what remote hosts also get
    deepspeed_env: Mapping[str, str] = field(default_factory=dict)
    # a directory only this user can read, for the files that hold environment values (DeepSpeed's env file):
    # None puts them in the attempt's directory (tests, --dry-run)
    private_dir: str | None = None

    @property
    def world_size(self) -> int:
        return sum(n for _, n in self.hosts)

    def node_env(self, host: str) -> dict[str, str]:
        """What ftkit sets on one node besides the forwarded environment: its name, and its selected devices."""
        env = {NODE_ENV: host}
        if host in self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.devices[host]))
        return env


def cluster_env_values(items: tuple[str, ...] | list[str], base_env: Mapping[str, str]) -> dict[str, str]:
    """``cluster.env``'s items as variables: NAME=VALUE sets VALUE, NAME forwards this machine's value (a NAME that
    is not set here forwards nothing)."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if eq:
            out[name] = value
        elif name in base_env:
            out[name] = base_env[name]
    return out


def forwarded_env(
    base_env: Mapping[str, str],
    accelerator: str,
    extra: Mapping[str, str] | None = None,
    *,
    local: bool = False,
    cluster_env: tuple[str, ...] | list[str] = (),
    deepspeed_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of the ranks on one host. On this machine (``local``): all of ``base_env``, as torchrun,
    ``deepspeed`` and ``accelerate launch`` pass it (CUDA_HOME, LD_LIBRARY_PATH, proxies, what a script reads).
    On another host: the allow-list (:data:`ftkit.rundir.env.ENV_ALLOW`; a stale or secret variable must not leak
    into a remote job by accident), then DeepSpeed's ``.deepspeed_env`` values. Then ``cluster.env`` everywhere, and
    what ftkit sets itself (accelerator, unbuffered output, an arch list DeepSpeed can parse, ``extra``)."""
    env = {
        k: v
        for k, v in sorted(base_env.items())
        if _ENV_NAME.fullmatch(k) and (local or any(fnmatch.fnmatchcase(k, pat) for pat in ENV_ALLOW))
    }
    if not local:
        env.update(deepspeed_env or {})
    env.update(cluster_env_values(cluster_env, base_env))
    env["PYTHONUNBUFFERED"] = "1"
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")  # every engine the same: CPU ranks share the cores
    else:
        env.pop("DS_ACCELERATOR", None)
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if arch is not None and arch_problem(arch):  # DeepSpeed 0.19 cannot parse it: its op builds would fail
        clean = sanitize_arch_list(arch)
        if clean:
            env["TORCH_CUDA_ARCH_LIST"] = clean
        else:
            env.pop("TORCH_CUDA_ARCH_LIST")
    env.update(extra or {})
    return env


def arch_note(base_env: Mapping[str, str], cluster_env: tuple[str, ...] | list[str] = ()) -> str | None:
    """The one line ftkit says when the ranks get another TORCH_CUDA_ARCH_LIST than this machine's (None: same)."""
    arch = {**base_env, **cluster_env_values(cluster_env, base_env)}.get("TORCH_CUDA_ARCH_LIST")
    if arch is None or not arch_problem(arch):
        return None
    clean = sanitize_arch_list(arch)
    given = f"TORCH_CUDA_ARCH_LIST={clean}" if clean else "no TORCH_CUDA_ARCH_LIST (DeepSpeed reads the GPUs)"
    return (
        f"the ranks get {given} instead of {arch!r}: DeepSpeed 0.19 cannot parse arch suffixes or names in it and "
        "would fail to build its ops (DeepSpeed PR #8619); the same kernels are built"
    )


def launch_redactor(inp: LaunchInputs, base_env: Mapping[str, str]) -> Redactor:
    """Masks every secret the ranks' environments of ``inp`` can hold."""
    return Redactor({**base_env, **inp.deepspeed_env}, extra=inp.cluster_env)


def redact(env: Mapping[str, str]) -> dict[str, str]:
    return Redactor(env).env(env)


def _entry_args(inp: LaunchInputs) -> list[str]:
    args = [inp.run_dir, "--attempt", str(inp.attempt)]
    if inp.resume:
        args += ["--resume", inp.resume]
    return args


# engine -> how it is told "run a module" / "run this executable, not through python" (a script needs neither)
_ENGINE_FLAGS = {
    "deepspeed": ("--module", "--no_python"),
    "accelerate": ("-m", "--no_python"),
    "torchrun": ("-m", "--no-python"),
}


def program_argv(inp: LaunchInputs, engine: str) -> tuple[list[str], list[str]]:
    """What one rank runs, in ``engine``'s terms: (engine flags, program and arguments).

    The built-in entry is a module (``ftkit.launch.train RUN_DIR --attempt N [--resume CKPT]``); a user command
    is its script, module or executable. ``engine`` is deepspeed, accelerate or torchrun (Slurm's srun runs
    torchrun's form). The engine's own flags are placed by its builder (DeepSpeed takes ``--module`` among its
    options, accelerate and torchrun just before the program)."""
    module_flag, exec_flag = _ENGINE_FLAGS[engine]
    c = inp.command
    if c is None:
        return [module_flag], [TRAIN_MODULE, *_entry_args(inp)]
    if c.kind == "module":
        return [module_flag], [c.target, *c.args]
    if c.kind == "exec":
        return [exec_flag], [c.target, *c.args]
    return [], [c.target, *c.args]


def run_env(inp: LaunchInputs, base_env: Mapping[str, str]) -> dict[str, str]:
    """The run's environment contract on every rank, and the import hook's PYTHONPATH for a user command."""
    env = {RUN_DIR_ENV: inp.run_dir, ATTEMPT_ENV: str(inp.attempt), RESUME_ENV: inp.resume or ""}
    env["PATH"] = path_with_python_first(inp.python, base_env.get("PATH"))  # one ninja for every rank's op builds
    if inp.command is not None and inp.inject:
        if not inp.inject_path:
            raise ValueError("inject_path is required for a user command with the import hook")
        rest = base_env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = inp.inject_path + (":" + rest if rest else "")  # every rank is a POSIX host
    return env


def _in_workdir(inp: LaunchInputs, argv: list[str]) -> list[str]:
    """A user command runs where ftkit launch ran (its relative paths mean what the user meant)."""
    if inp.command is None or not inp.workdir:
        return argv
    return ["env", "-C", inp.workdir, *argv]


def _ssh(inp: LaunchInputs, host: str, remote_argv: list[str], env: Mapping[str, str]) -> tuple[str, ...]:
    """ssh HOST 'cd RUN_PARENT && env K=V ... ARGV' — the environment travels inline, visible in --dry-run.

    This is the one place that remote shell line is built, so every word of it is quoted here, once.
    """
    assignments = [shlex.quote(f"{k}={v}") for k, v in env.items()]
    cwd = inp.workdir if inp.command is not None and inp.workdir else str(Path(inp.run_dir).parent)
    remote = f"cd {shlex.quote(cwd)} && exec env {' '.join(assignments)} {shlex.join(remote_argv)}"
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    if inp.ssh_config:
        argv += ["-F", inp.ssh_config]
    if inp.ssh_port:
        argv += ["-p", str(inp.ssh_port)]
    return tuple([*argv, host, remote])


def _node_command(inp: LaunchInputs, i: int, host: str, argv: list[str], env: dict[str, str]) -> NodeCommand:
    """Start ``argv`` directly for this machine, or over ssh (environment inlined) for a remote host."""
    if is_local(host):
        return NodeCommand(host, i, tuple(_in_workdir(inp, argv)), env)
    return NodeCommand(host, i, _ssh(inp, host, argv, env), {}, remote=True)


def hostfile_text(hosts: tuple[tuple[str, int], ...], devices: Mapping[str, tuple[int, ...]] | None = None) -> str:
    """DeepSpeed's hostfile; a host with selected devices lists enough slots for them (``--include`` picks them)."""
    devices = devices or {}
    return "".join(f"{h} slots={max(devices[h]) + 1 if h in devices else n}\n" for h, n in hosts)


def deepspeed_include(inp: LaunchInputs) -> str | None:
    """DeepSpeed's ``--include`` for the selected devices (``w0:1,3@w1``), or None when every host uses 0..n-1."""
    if not any(h in inp.devices for h, _ in inp.hosts):
        return None
    return "@".join(f"{h}:{','.join(map(str, inp.devices[h]))}" if h in inp.devices else h for h, _ in inp.hosts)


def pdsh_problems(run_dir: str, python: str, master_addr: str) -> list[str]:
    """Values DeepSpeed's pdsh runner would put unquoted into the remote shell line, that are not plain words."""
    out = []
    for what, value in (("run directory", run_dir), ("its parent", str(Path(run_dir).parent)), ("python", python)):
        if not _PDSH_SAFE.fullmatch(value):
            out.append(
                f"{what} {value!r} has characters DeepSpeed's pdsh launcher passes unquoted to a remote shell; "
                "use a path of letters, digits and ._-/ (or cluster.engine: torchrun)"
            )
    if not _PDSH_SAFE.fullmatch(master_addr):
        out.append(f"master address {master_addr!r} is not a host name or IP address")
    return out


def ds_env_value(value: str) -> str:
    r"""A value for DeepSpeed's env file that reaches the remote shell as itself.

    DeepSpeed's runner writes ``export K=V`` into the pdsh command line and wraps V in double quotes when it holds
    anything but ``[\w@%+=:,./-]`` (``MultiNodeRunner.add_export``); inside double quotes ``$``, backticks, ``"``
    and ``\\`` still act, so those are escaped here. Newlines cannot be carried (the file is line-based).
    """
    if "\n" in value or "\r" in value:
        raise UserError(f"an environment value forwarded to remote ranks has a newline: {value[:40]!r}...")
    if re.search(r"[^\w@%+=:,./-]", value.strip()):
        return re.sub(r'([$`"\\])', r"\\\1", value)
    return value


def build_launch(inp: LaunchInputs, base_env: Mapping[str, str]) -> LaunchCommand:
    """The exact commands for one attempt. Raises ValueError only for programming errors (inputs are validated)."""
    meta = Path(inp.run_dir) / "ftkit"
    attempt_dir = meta / "attempts" / str(inp.attempt)
    if inp.engine == "deepspeed":
        return _deepspeed(inp, base_env, attempt_dir)
    if inp.engine == "accelerate":
        return _accelerate(inp, base_env, meta)
    if inp.engine == "torchrun":
        return _torchrun(inp, base_env)
    if inp.engine == "slurm":  # inside an allocation: srun starts the ranks, no ssh
        return _srun(inp, base_env)
    raise ValueError(f"unknown engine {inp.engine!r}")


def _env(inp: LaunchInputs, base_env: Mapping[str, str], local: bool, extra: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment on this machine (``local``) or another host."""
    return forwarded_env(
        base_env,
        inp.accelerator,
        extra,
        local=local,
        cluster_env=inp.cluster_env,
        deepspeed_env=inp.deepspeed_env,
    )


def _deepspeed(inp: LaunchInputs, base_env: Mapping[str, str], attempt_dir: Path) -> LaunchCommand:
    redactor = launch_redactor(inp, base_env)
    env = _env(inp, base_env, True, run_env(inp, base_env))
    flags, program = program_argv(inp, "deepspeed")
    if len(inp.hosts) == 1 and is_local(inp.hosts[0][0]):
        # DeepSpeed's per-node launcher, started exactly as its runner starts it for one local host: the runner's
        # own process (importing all of DeepSpeed, then waiting) added ~3 s to every attempt
        # (benchmarks/engine_start.py)
        launch = [inp.python, "-u", "-m", ENGINE_MODULE, "deepspeed.launcher.launch"]
        argv = _in_workdir(inp, [*launch, *_launch_args(inp, flags, node_rank=None), "--log_level=info", *program])
        node = NodeCommand(inp.hosts[0][0], 0, tuple(argv), env, remote=False)
        note = f"deepspeed.launcher.launch --world_info: {json.dumps(_world(inp))}"  # which devices, readable
        return LaunchCommand("deepspeed", (node,), notes=(note,), redactor=redactor)
    if pdsh_problems(inp.run_dir, inp.python, inp.master_addr):  # preflight said so already
        raise UserError([Problem(m) for m in pdsh_problems(inp.run_dir, inp.python, inp.master_addr)])
    hostfile = attempt_dir / "hostfile"
    env_file = Path(inp.private_dir or attempt_dir) / "ds_env"  # values of the environment: not in the run directory
    argv = [
        inp.python,
        "-u",
        "-m",
        ENGINE_MODULE,
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--master_addr",
        inp.master_addr,
        "--master_port",
        str(inp.master_port),
        "--no_local_rank",
        *flags,
    ]
    include = deepspeed_include(inp)
    if include:  # DeepSpeed's launch sets CUDA_VISIBLE_DEVICES on each node from it
        argv += ["--include", include]
    # ftkit's preflight checks ssh itself (with cluster.ssh_config); DeepSpeed's own check would ignore that config.
    argv += ["--no_ssh_check", "--launcher", "pdsh"]
    if len(inp.hosts) == 1:
        argv.append("--force_multi")  # one remote host is still reached over pdsh, never started locally
    if inp.ssh_port:
        argv += ["--ssh_port", str(inp.ssh_port)]
    # Remote ranks get exactly this environment: a fresh file per attempt (DeepSpeed's runner then reads no
    # .deepspeed_env itself; ftkit read them into inp.deepspeed_env). PATH too, as over ssh for the other engines (its
    # first entry, the ranks' Python's directory, picks the ninja of their op builds).
    remote = _env(inp, base_env, False, run_env(inp, base_env))
    remote_env = {k: v for k, v in remote.items() if k not in ("HOME", "USER")}
    files = {
        str(hostfile): hostfile_text(inp.hosts, inp.devices),
        str(env_file): "".join(f"{k}={ds_env_value(v)}\n" for k, v in remote_env.items()),
    }
    env["DS_ENV_FILE"] = str(env_file)
    env["PDSH_RCMD_TYPE"] = "ssh"
    if inp.ssh_config:
        env["PDSH_SSH_ARGS_APPEND"] = f"-F {inp.ssh_config}"
    notes: tuple[str, ...] = ()
    if inp.command is not None:
        # DeepSpeed's pdsh runner joins `cd CWD; python ... SCRIPT ARGS` into one remote shell line and quotes only
        # arguments with spaces: the command (and the directory it runs in) travel in the environment instead,
        # base64-encoded, and every rank runs ftkit's trampoline from the (validated) run directory.
        c = inp.command
        encoded = encode_command(c.kind, c.target, list(c.args), inp.workdir or inp.run_dir)
        env[COMMAND_ENV] = encoded
        files[str(env_file)] += f"{COMMAND_ENV}={encoded}\n"
        at = argv.index("--no_local_rank") + 1
        argv[at : at + len(flags)] = ["--module"]
        flags, program = ["--module"], [RUN_COMMAND_MODULE]
        argv = ["env", "-C", inp.run_dir, *argv, *program]
        notes = (f"{COMMAND_ENV} carries: {shlex.join(c.display(inp.python))}  (run in {inp.workdir})",)
    else:
        argv = _in_workdir(inp, [*argv, *program])
    line = pdsh_line(inp, files[str(env_file)], flags, program)
    notes = (f"remote shell line (DeepSpeed's pdsh runner, on each host): {line}", *notes)
    node = NodeCommand(inp.hosts[0][0], 0, tuple(argv), env, remote=False)
    return LaunchCommand("deepspeed", (node,), files, notes, redactor=redactor)


def _launch_args(inp: LaunchInputs, flags: list[str], node_rank: str | None) -> list[str]:
    """The arguments of DeepSpeed's per-node launcher (``deepspeed.launcher.launch``) as its runner builds them: the
    world (every host's devices, base64 JSON), the master, ``--node_rank`` (pdsh's ``%n``; None: the runner's local
    start passes none) and the program flags in the runner's order."""
    info = base64.urlsafe_b64encode(json.dumps(_world(inp)).encode()).decode()
    argv = [f"--world_info={info}"]
    if node_rank is not None:
        argv.append(f"--node_rank={node_rank}")
    argv += [f"--master_addr={inp.master_addr}", f"--master_port={inp.master_port}"]
    order = ("--no_python", "--module", "--no_local_rank")  # the order DeepSpeed appends them in
    return argv + [f for f in order if f in (*flags, "--no_local_rank")]


def _world(inp: LaunchInputs) -> dict[str, list[int]]:
    """DeepSpeed's world info: each host's device indices."""
    return {h: list(inp.devices.get(h) or range(n)) for h, n in inp.hosts}


def pdsh_line(inp: LaunchInputs, env_file: str, flags: list[str], program: list[str]) -> str:
    """The shell line DeepSpeed's pdsh runner has every remote host run (``multinode_runner.PDSHRunner``): the
    env file's exports (quoted as its ``add_export`` does), ``cd`` to the runner's directory, its launcher and the
    program. ``%n`` is pdsh's node index."""
    exports = ""
    for line in env_file.splitlines():
        key, _, value = line.partition("=")
        value = value.strip()
        if re.search(r"[^\w@%+=:,./-]", value):
            value = '"' + value + '"'
        exports += f"export {key.strip()}={value}; "
    cwd = inp.run_dir if inp.command is not None else (inp.workdir or inp.run_dir)
    launch = [inp.python, "-u", "-m", "deepspeed.launcher.launch", *_launch_args(inp, flags, node_rank="%n")]
    return f"{exports}cd {cwd}; " + " ".join([*launch, *program])


def _accelerate(inp: LaunchInputs, base_env: Mapping[str, str], meta: Path) -> LaunchCommand:
    nodes = []
    for i, (host, _) in enumerate(inp.hosts):
        env = _env(inp, base_env, is_local(host), {**run_env(inp, base_env), **inp.node_env(host)})
        flags, program = program_argv(inp, "accelerate")
        argv = [
            inp.python,
            "-m",
            ENGINE_MODULE,
            "accelerate.commands.launch",
            "--config_file",
            str(meta / "accelerate.yaml"),
            "--machine_rank",
            str(i),
            "--main_process_ip",
            inp.master_addr,
            "--main_process_port",
            str(inp.master_port),
            *flags,
            *program,
        ]
        nodes.append(_node_command(inp, i, host, argv, env))
    return LaunchCommand("accelerate", tuple(nodes), redactor=launch_redactor(inp, base_env))


def torchrun_argv(inp: LaunchInputs, nnodes: int, nproc: int, rdzv_id: str) -> list[str]:
    """The one torchrun agent command line, for the torchrun engine (an agent per host) and the slurm engine (an
    agent per srun task): c10d rendezvous at master_addr:master_port, no restarts of its own (ftkit's), and the
    program after it."""
    argv = [
        inp.python,
        "-m",
        ENGINE_MODULE,
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{inp.master_addr}:{inp.master_port}",
        "--rdzv-id",
        rdzv_id,
        "--max-restarts",
        "0",
    ]
    return argv


def _torchrun(inp: LaunchInputs, base_env: Mapping[str, str]) -> LaunchCommand:
    nodes = []
    n = len(inp.hosts)
    for i, (host, slots) in enumerate(inp.hosts):
        env = _env(inp, base_env, is_local(host), {**run_env(inp, base_env), **inp.node_env(host)})
        argv = torchrun_argv(inp, n, slots, f"{inp.name}-{inp.attempt}")
        if n > 1 or not is_local(host):
            # Hosts may share a hostname (containers, namespaces): say explicitly which agent hosts the store, and
            # advertise the node by its hostfile name (which every node resolves) instead of its own FQDN. A single
            # remote node too (left after a shrink): torchrun's own guess compares the endpoint with its hostname.
            argv += ["--rdzv-conf", f"is_host={1 if i == 0 else 0}", "--local-addr", host]
        flags, program = program_argv(inp, "torchrun")
        argv += [*flags, *program]
        nodes.append(_node_command(inp, i, host, argv, env))
    return LaunchCommand("torchrun", tuple(nodes), redactor=launch_redactor(inp, base_env))


def _srun(inp: LaunchInputs, base_env: Mapping[str, str]) -> LaunchCommand:
    """Inside a Slurm allocation: one ``srun`` step over the hosts, one task per node, each a torchrun agent (the
    ranks see what torchrun gives them under every other engine; a failing node ends the whole step)."""

    require_allocation(base_env)
    job = base_env["SLURM_JOB_ID"]
    hosts = [h for h, _ in inp.hosts]
    slots = {n for _, n in inp.hosts}
    if len(slots) != 1:  # plan refuses it earlier; torchrun needs one count per node
        raise UserError(Problem("the srun engine needs the same processes on every node", key="cluster.gpus_per_node"))
    # srun --export=ALL hands this environment to every node, as Slurm users expect of their jobs
    env = _env(inp, base_env, True, run_env(inp, base_env))
    env.update(slurm_env(base_env))
    n = len(hosts)
    torchrun = torchrun_argv(inp, n, slots.pop(), f"{inp.name}-slurm{job}-{inp.attempt}")
    flags, program = program_argv(inp, "torchrun")
    torchrun += [*flags, *program]
    if inp.command is not None and inp.workdir:
        torchrun = ["env", "-C", inp.workdir, *torchrun]
    argv = [
        "srun",
        f"--jobid={job}",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(hosts)}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--unbuffered",
        # each task names its node (pid records, heartbeats) by Slurm's node name, as the allocation lists it
        "sh",
        "-c",
        'FTKIT_NODE="${SLURMD_NODENAME:-$(hostname -s)}"; export FTKIT_NODE; exec "$@"',
        "ftkit-node",
        *torchrun,
    ]
    return LaunchCommand(
        "slurm", (NodeCommand(hosts[0], 0, tuple(argv), env, remote=False),), redactor=launch_redactor(inp, base_env)
    )


def describe(cmd: LaunchCommand) -> str:
    """The human-readable form ``--dry-run`` prints: per node, the environment and argv, secrets masked."""
    r = cmd.redactor
    lines = [f"engine: {cmd.engine}"]
    for path, text in cmd.files.items():
        lines.append(f"file {path}:")
        lines += [f"    {line}" for line in r.text(text).splitlines()]
    for node in cmd.nodes:
        where = f"node {node.node_rank} ({node.host})" + (" over ssh" if node.remote else "")
        lines.append(f"{where}:")
        for k, v in r.env(node.env).items():
            lines.append(f"    {k}={v}")
        lines.append("    " + r.text(shlex.join(node.argv)))
    lines += [r.text(note) for note in cmd.notes]
    return "\n".join(lines)
