"""Supervision, one function per phase: choose checkpoint → spawn → monitor → tear down → decide → (back off).

* **monitor** watches the processes ftkit spawned and every rank's heartbeat. A non-zero exit, no first step
  within ``resilience.startup_timeout_s``, or no progress for ``resilience.hang_timeout_s`` is a failure (a dead
  peer otherwise hangs the survivors in a collective for up to 30 minutes).
* **teardown** stops the whole run on every host by process group and recorded pid (SIGTERM, grace, SIGKILL)
  and reports what was left and which host could not be reached.
* **choose** walks the checkpoints newest first and takes the first whose commit record verifies; newer torn
  ones are set aside (renamed) with the reason logged, so the resumed run can write that step again.
* **decide**: one restart budget for the whole job, one restart per incident; exponential backoff with jitter;
  give up when failures repeat at the same step without a new committed checkpoint; a rank that reported a
  user error (bad data) ends the job at once: a restart cannot fix it.

Every decision is a line in ``events.jsonl``.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoints import read_commit, select_resume, set_aside_newer
from .command import LaunchCommand, LaunchInputs, build_launch
from .errors import ExitCode
from .procs import exit_meaning, group_exists, remove_shm, targets_from_records, teardown
from .rundir import RunDir, append_jsonl, atomic_write

NO_PROGRESS_LIMIT = 2  # the same failure point this many times in a row, with no new commit: give up


class Events:
    def __init__(self, rd: RunDir, echo: Callable[[str], None]):
        self.rd = rd
        self.echo = echo
        self.attempt = 0

    def __call__(self, event: str, message: str | None = None, **data: Any) -> None:
        rec = {"time": round(time.time(), 3), "event": event, "attempt": self.attempt, **data}
        if message:
            rec["message"] = message
        append_jsonl(self.rd.events, rec)
        if message:
            self.echo(f"ftkit: {message}")


@dataclass
class Decision:
    restart: bool
    delay_s: float
    reason: str
    exit_code: int = ExitCode.OK


@dataclass
class RestartPolicy:
    """Pure restart bookkeeping (no clock, no processes): tested with fake inputs."""

    max_restarts: int
    backoff_s: float
    backoff_max_s: float
    rng: random.Random = field(default_factory=random.Random)
    used: int = 0
    no_progress: int = 0
    last_failure: tuple[int | None, int | None] | None = None  # (step at failure, newest commit then)

    def backoff(self) -> float:
        """Exponential backoff with jitter: base x 2^k, capped, then scaled by a random 0.5-1.0."""
        base = min(self.backoff_max_s, self.backoff_s * (2**self.used))
        return base * self.rng.uniform(0.5, 1.0)

    def on_failure(self, step: int | None, newest_commit: int | None) -> Decision:
        point = (step, newest_commit)
        if self.last_failure is not None and point == self.last_failure:
            self.no_progress += 1
        else:
            self.no_progress = 0
        self.last_failure = point
        if self.no_progress + 1 >= NO_PROGRESS_LIMIT + 1:
            return Decision(
                False,
                0.0,
                f"failed {self.no_progress + 1} times in a row at step {step} with no new "
                f"committed checkpoint: giving up (restarts used {self.used} of "
                f"{self.max_restarts})",
                ExitCode.BUDGET_EXHAUSTED,
            )
        if self.used >= self.max_restarts:
            return Decision(
                False,
                0.0,
                f"restart budget exhausted ({self.used} of {self.max_restarts} used)",
                ExitCode.BUDGET_EXHAUSTED,
            )
        delay = self.backoff()
        self.used += 1
        return Decision(True, delay, f"restart {self.used} of {self.max_restarts} in {delay:.1f}s")


@dataclass
class Failure:
    kind: str  # "exit", "hang", "startup", "user_error", "lost_host"
    message: str
    step: int | None = None
    exit_code: int | None = None
    user_error_lines: list[str] = field(default_factory=list)


@dataclass
class Spawned:
    node_rank: int
    host: str
    proc: subprocess.Popen
    log: Path


class Supervisor:
    def __init__(
        self,
        *,
        rd: RunDir,
        inputs: LaunchInputs,
        base_env: Mapping[str, str],
        resilience: Mapping[str, Any],
        stage: int,
        world_size: int,
        max_steps: int | None,
        ssh_args: list[str],
        echo: Callable[[str], None] = print,
        poll_s: float = 0.5,
        grace_s: float = 10.0,
        rng: random.Random | None = None,
        min_nodes: int | None = None,
        replan: Callable[[list[tuple[str, int]]], Any] | None = None,
        prepare: Callable[[Any, bool], Any] | None = None,
    ):
        self.rd = rd
        self.min_nodes = min_nodes
        self.replan = replan  # hosts -> Plan (raises RecipeError when the global batch cannot be kept)
        self.prepare = prepare  # (Plan, load_universal) -> writes the run's configs and spec
        self._convert_from_world: int | None = None  # set after a shrink: checkpoints of that size get converted
        self.inputs = inputs
        self.base_env = dict(base_env)
        self.res = dict(resilience)
        self.stage = stage
        self.world_size = world_size
        self.max_steps = max_steps
        self.ssh_args = ssh_args
        self.echo = echo
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.events = Events(rd, echo)
        self.policy = RestartPolicy(
            self.res["max_restarts"], self.res["backoff_s"], self.res["backoff_max_s"], rng or random.Random()
        )
        self.interrupted: int | None = None
        self._metrics_pos = 0
        self._plan: Any = None
        self._universal_attempt = False

    # ------------------------------------------------------------------------------------------------ phases

    def choose_checkpoint(self) -> tuple[str | None, int | None]:
        """(checkpoint to resume from or None for a fresh start, exit code when the run cannot continue)."""
        sel = select_resume(
            self.rd.path,
            checksums=bool(self.res.get("verify_checksums")),
            require_commit=True,
            world_size=self.world_size,
            stage=self.stage,
        )
        for v in sel.rejected:
            self.events(
                "checkpoint_rejected",
                f"skipping {v.reason}",  # the reason starts with the checkpoint's name
                checkpoint=str(v.path),
                reason=v.reason,
                kind=v.kind,
            )
        incompatible = [v for v in sel.rejected if v.incompatible]
        if incompatible and self._convert_from_world is not None:
            converted = self._convert_newest(sel, incompatible)
            if isinstance(converted, int):
                return None, converted
            if converted is not None:
                return converted, None
            incompatible = []
        if incompatible:
            v = incompatible[0]
            self.events(
                "refused",
                f"{v.reason}; ftkit converts a checkpoint to DeepSpeed's universal format only when it "
                "continues a running job on fewer hosts itself (cluster.min_nodes): launch with the "
                "original cluster, or use a new train.output_dir",
                checkpoint=str(v.path),
            )
            return None, ExitCode.NO_CHECKPOINT
        if sel.chosen is None and any(v.kind != "no_commit" for v in sel.rejected):
            self.events(
                "no_valid_checkpoint",
                "no checkpoint verifies (reasons above) and some were complete once: "
                "refusing to start over and overwrite them; move them away or use a "
                "new train.output_dir",
            )
            return None, ExitCode.NO_CHECKPOINT
        for dst in set_aside_newer(self.rd.path, sel):
            self.events("set_aside", f"moved {dst.name.split('.rejected')[0]} aside to {dst.name}", dst=str(dst))
        if sel.chosen is None:
            self.events("fresh_start", None)
            return None, None
        self.events(
            "checkpoint_chosen",
            f"resuming from {sel.chosen.name} (step {sel.step}, commit verified)",
            checkpoint=str(sel.chosen),
            step=sel.step,
        )
        return str(sel.chosen), None

    def _convert_newest(self, sel: Any, incompatible: list[Any]) -> str | int | None:
        """After losing hosts: convert the newest intact checkpoint (newer than any compatible one) to DeepSpeed's
        universal format and resume from it on the new world size. Returns its path, an exit code, or None when a
        compatible checkpoint is newer anyway."""
        from .universal import ConversionError, convert_to_universal

        v = max(incompatible, key=lambda x: x.step or -1)
        if sel.step is not None and (v.step or -1) <= sel.step:
            return None
        if v.kind != "world_size_mismatch":
            self.events(
                "refused",
                f"{v.reason}: a different ZeRO stage cannot be resumed; launch with the original zero.stage",
                checkpoint=str(v.path),
            )
            return ExitCode.NO_CHECKPOINT
        record = v.record or {}
        tag = record.get("tag") or (v.path / "latest").read_text().strip()
        t0 = time.monotonic()
        try:
            convert_to_universal(v.path, tag)
        except ConversionError as e:
            self.events("refused", f"{e}; cannot resume on {self.world_size} rank(s)", checkpoint=str(v.path))
            return ExitCode.NO_CHECKPOINT
        self.events(
            "converted",
            f"converted {v.path.name} ({record.get('world_size')} ranks) to DeepSpeed's "
            f"universal checkpoint for {self.world_size} rank(s) in {time.monotonic() - t0:.1f}s",
            checkpoint=str(v.path),
            from_world_size=record.get("world_size"),
            to_world_size=self.world_size,
        )
        # Newer torn checkpoints are moved aside as usual; older compatible ones stay.
        for dst in set_aside_newer(self.rd.path, type(sel)(chosen=v.path, step=v.step, verdict=v, rejected=[])):
            self.events("set_aside", f"moved {dst.name.split('.rejected')[0]} aside to {dst.name}", dst=str(dst))
        self.events(
            "checkpoint_chosen",
            f"resuming from {v.path.name} (step {v.step}, commit verified, universal format)",
            checkpoint=str(v.path),
            step=v.step,
            universal=True,
        )
        if self.prepare is not None and self._plan is not None:
            self.prepare(self._plan, True)
            self._universal_attempt = True
        return str(v.path)

    def probe_hosts(self) -> list[str]:
        """Remote hosts of the current cluster that ssh cannot reach now (ssh `true`, 10 s timeout each)."""
        from .procs import LOCAL_HOSTS, ssh_run

        lost = []
        for host, _ in self.inputs.hosts:
            if host in LOCAL_HOSTS:
                continue
            ok, _ = ssh_run(host, "true", self.ssh_args, 10)
            if not ok:
                lost.append(host)
        return lost

    def handle_lost_hosts(self) -> int | None:
        """Continue without unreachable hosts when cluster.min_nodes allows it (keeping the global batch), else
        stop with exit 7. None: carry on (nothing lost, or shrunk)."""
        lost = self.probe_hosts()
        if not lost:
            return None
        hosts = list(self.inputs.hosts)
        self.events("host_lost", f"lost host(s) {', '.join(lost)}: not reachable over ssh", hosts=lost)
        remaining = [(h, n) for h, n in hosts if h not in lost]
        need = self.min_nodes if self.min_nodes is not None else len(hosts)
        if len(remaining) < need or not remaining or self.replan is None:
            self.events(
                "gave_up",
                f"{len(remaining)} of {len(hosts)} node(s) left and cluster.min_nodes is "
                f"{self.min_nodes if self.min_nodes is not None else 'null (all nodes)'}: stopping; "
                "bring the host(s) back and launch again (the run resumes from its newest "
                "committed checkpoint), or allow fewer nodes with cluster.min_nodes",
                hosts=lost,
            )
            return ExitCode.HOST_LOST
        from .errors import UserError

        try:
            plan = self.replan(remaining)
        except UserError as e:
            self.events("gave_up", f"cannot continue on {', '.join(h for h, _ in remaining)}: {e.lines()[0]}")
            return ExitCode.HOST_LOST
        self._plan = plan
        if self.prepare is not None:
            self.prepare(plan, False)
        self._convert_from_world = self.world_size
        self.world_size = plan.world_size
        self.inputs = LaunchInputs(
            **{**self.inputs.__dict__, "hosts": tuple(plan.hosts), "master_addr": plan.master_addr}
        )
        self.events(
            "shrink",
            f"continuing on {', '.join(h for h, _ in plan.hosts)}: world size {plan.world_size}, "
            f"global batch {plan.global_batch_size} kept with gradient accumulation "
            f"{plan.grad_accum}",
            hosts=[list(h) for h in plan.hosts],
            world_size=plan.world_size,
            global_batch_size=plan.global_batch_size,
            gradient_accumulation_steps=plan.grad_accum,
        )
        return None

    def spawn(self, cmd: LaunchCommand, attempt: int) -> list[Spawned]:
        for path, text in cmd.files.items():
            atomic_write(Path(path), text)
        log_dir = self.rd.log_dir(attempt)
        log_dir.mkdir(parents=True, exist_ok=True)
        out = []
        for node in cmd.nodes:
            log = log_dir / f"launcher-node{node.node_rank}.log"
            fh = open(log, "ab")  # noqa: SIM115 - the child keeps it; closed when the Popen is collected
            proc = subprocess.Popen(
                list(node.argv),
                env=dict(node.env) if node.env else None,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=str(self.rd.path.parent),
            )
            fh.close()
            out.append(Spawned(node.node_rank, node.host, proc, log))
            self.events(
                "spawn",
                None,
                node=node.node_rank,
                host=node.host,
                pid=proc.pid,
                remote=node.remote,
                argv=list(node.argv),
            )
        return out

    def monitor(self, procs: list[Spawned], attempt: int, started: float) -> Failure | None:
        """Until success (None) or the first failure. Heartbeat changes are timed by this clock (no skew)."""
        seen: dict[int, tuple] = {}
        last_progress = time.monotonic()
        first_step_seen = False
        hang = float(self.res["hang_timeout_s"])
        startup = float(self.res["startup_timeout_s"])
        while True:
            if self.interrupted:
                return Failure("interrupted", f"interrupted by {signal.Signals(self.interrupted).name}")
            self._echo_metrics(attempt)
            codes = [p.proc.poll() for p in procs]
            errors = self.rd.records("errors", attempt)
            if errors:
                lines = [line for e in errors for line in e.get("lines", [])]
                return Failure(
                    "user_error",
                    "a rank reported an error a restart cannot fix",
                    user_error_lines=sorted(set(lines), key=lines.index),
                )
            bad = [(p, c) for p, c in zip(procs, codes, strict=True) if c not in (None, 0)]
            if bad:
                p, c = bad[0]
                time.sleep(0.3)  # let a rank finish writing its error record before we look again
                if self.rd.records("errors", attempt):
                    continue
                return Failure(
                    "exit",
                    f"node {p.node_rank} ({p.host}) engine ended: {exit_meaning(c)}" + _root_cause(p.log),
                    step=self._step(attempt),
                    exit_code=c,
                )
            if all(c == 0 for c in codes):
                return None
            now = time.monotonic()
            for hb in self.rd.heartbeats():
                if hb.get("attempt") != attempt:
                    continue
                key = (hb.get("phase"), hb.get("step"), hb.get("time"))
                if seen.get(hb["rank"]) != key:
                    seen[hb["rank"]] = key
                    if hb.get("phase") == "train" and hb.get("step") is not None:
                        first_step_seen = True
                        last_progress = now
            if not first_step_seen and now - started > startup:
                return Failure(
                    "startup",
                    f"no training step within startup_timeout_s={startup:g}s "
                    f"(ranks heard from: {sorted(seen) or 'none'})",
                    step=self._step(attempt),
                )
            if first_step_seen and now - last_progress > hang:
                return Failure(
                    "hang",
                    f"no progress for {now - last_progress:.0f}s "
                    f"(hang_timeout_s={hang:g}) at step {self._step(attempt)}",
                    step=self._step(attempt),
                )
            time.sleep(self.poll_s)

    def teardown(self, procs: list[Spawned], attempt: int) -> None:
        groups = [p.proc.pid for p in procs if p.proc.poll() is None]
        groups += [p.proc.pid for p in procs]  # the group may outlive its leader
        records = self.rd.records("pids", attempt)
        targets = targets_from_records(records)
        res = teardown(sorted(set(groups)), targets, grace_s=self.grace_s, ssh_args=self.ssh_args)
        for p in procs:
            try:
                p.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        # Ranks orphaned by their agent's death are zombies until init reaps them, a moment later; until then
        # killpg(group, 0) still finds them. Wait for that, so that when ftkit returns nothing of the run is left.
        end = time.monotonic() + 5.0
        while time.monotonic() < end and any(group_exists(p.proc.pid) for p in procs):
            time.sleep(0.05)
        # Only now (no rank left) is it safe to remove the run's /dev/shm buffers; unreachable hosts are skipped.
        live = [r for r in records if r["host"] not in set(res.unreachable)]
        remove_shm(live, self.ssh_args)
        msg = None
        if res.unreachable:
            msg = f"teardown could not reach host(s) {', '.join(sorted(set(res.unreachable)))}"
        elif res.left:
            msg = f"teardown left processes: {', '.join(res.left)}"
        self.events("teardown", msg, **res.as_dict())

    # ------------------------------------------------------------------------------------------------ helpers

    def _step(self, attempt: int) -> int | None:
        steps = [hb.get("step") for hb in self.rd.heartbeats() if hb.get("attempt") == attempt]
        steps = [s for s in steps if s is not None]
        return max(steps) if steps else None

    def _echo_metrics(self, attempt: int) -> None:
        path = self.rd.metrics
        if not path.exists():
            return
        with open(path, encoding="utf-8") as fh:
            fh.seek(self._metrics_pos)
            chunk = fh.read()
        end = chunk.rfind("\n")
        if end < 0:
            return
        self._metrics_pos += len(chunk[: end + 1].encode())
        for line in chunk[: end + 1].splitlines():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if "loss" in m and m.get("attempt") == attempt:
                total = f"/{self.max_steps}" if self.max_steps else ""
                self.echo(f"  step {m['step']}{total}  loss {m['loss']:.4f}")
            elif m.get("event") == "commit" and m.get("attempt") == attempt:
                self.echo(f"  committed checkpoint-{m['step']} ({m.get('commit_s', 0):.2f}s)")

    def _final_committed(self, attempt: int) -> bool:
        """final/ committed by *this* attempt: a relaunch of a finished run finds the old record still there."""
        try:
            rec = read_commit(self.rd.final)
        except (OSError, ValueError):
            return False
        return bool(rec) and (rec.get("extra") or {}).get("attempt") == attempt

    def _newest_commit(self) -> int | None:
        sel = select_resume(self.rd.path, require_commit=True, world_size=self.world_size, stage=self.stage)
        return sel.step

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.interrupted = signum

    # ------------------------------------------------------------------------------------------------ script

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _run(self) -> int:
        attempt = self.next_attempt()
        if self.rd.metrics.exists():
            self._metrics_pos = self.rd.metrics.stat().st_size
        while True:
            self.events.attempt = attempt
            resume, code = self.choose_checkpoint()
            if code is not None:
                return code
            if self.interrupted:
                return self._interrupted_code()
            inputs = LaunchInputs(**{**self.inputs.__dict__, "attempt": attempt, "resume": resume})
            cmd = build_launch(inputs, self.base_env)
            self.events(
                "launch",
                f"attempt {attempt}: starting {cmd.engine} on "
                f"{', '.join(h for h, _ in inputs.hosts)}" + (f", resuming from {Path(resume).name}" if resume else ""),
                engine=cmd.engine,
                resume=resume,
            )
            started = time.monotonic()
            procs = self.spawn(cmd, attempt)
            failure = self.monitor(procs, attempt, started)
            if failure is None:
                self.teardown(procs, attempt)  # nothing should be left; make sure of it
                if not self._final_committed(attempt):
                    self.events(
                        "failed", "the engine exited 0 but no committed final model was written", attempt=attempt
                    )
                    return ExitCode.TRAINING_FAILED
                self.events("finished", f"finished: final model in {self.rd.final}", step=self._step(attempt))
                return ExitCode.OK
            self.events(
                "failure",
                f"attempt {attempt} failed: {failure.message}",
                kind=failure.kind,
                step=failure.step,
                exit_code=failure.exit_code,
                exit_meaning=exit_meaning(failure.exit_code) if failure.exit_code is not None else None,
                dead_ranks=self._dead_ranks(attempt),
            )
            self.teardown(procs, attempt)
            if failure.kind == "interrupted":
                return self._interrupted_code()
            if failure.kind == "user_error":
                for line in failure.user_error_lines:
                    self.echo(f"ftkit: error: {line}")
                self.events(
                    "gave_up", "not restarting: fix the error above and launch again", errors=failure.user_error_lines
                )
                return ExitCode.USAGE
            self._echo_log_tail(procs, attempt)
            code = self.handle_lost_hosts()  # before the restart decision: a lost host may end the job here
            if code is not None:
                return code
            decision = self.policy.on_failure(failure.step, self._newest_commit())
            if not decision.restart:
                self.events("gave_up", decision.reason, restarts=self.policy.used)
                return decision.exit_code
            self.events("restart", decision.reason, restarts=self.policy.used, delay_s=round(decision.delay_s, 2))
            deadline = time.monotonic() + decision.delay_s
            while time.monotonic() < deadline and not self.interrupted:
                time.sleep(0.1)
            if self.interrupted:
                return self._interrupted_code()
            if self._universal_attempt and self.prepare is not None:
                self.prepare(self._plan, False)  # later attempts load the new world size's own checkpoints
                self._universal_attempt = False
            attempt += 1

    def _interrupted_code(self) -> int:
        code = ExitCode.SIGINT if self.interrupted == signal.SIGINT else ExitCode.SIGTERM
        self.events("interrupted", f"interrupted: run torn down, exit {code}")
        return code

    def next_attempt(self) -> int:
        return self.rd.next_attempt()

    def _dead_ranks(self, attempt: int) -> list[int]:
        from .procs import is_alive, is_this_machine

        dead = []
        for r in self.rd.records("pids", attempt):
            if is_this_machine(r["host"]):
                if not is_alive(int(r["pid"]), r.get("start_time")):
                    dead.append(int(r["rank"]))
        return dead

    def _echo_log_tail(self, procs: list[Spawned], attempt: int, lines: int = 6) -> None:
        """Show the error of a rank that failed by itself; survivors' 'connection reset by peer' is only an echo."""
        for log in sorted(self.rd.log_dir(attempt).glob("rank-*.log")):
            tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-lines:]
            text = "\n".join(tail)
            if "Traceback" in text or "Error" in text:
                if any(s in text for s in ("by peer", "Connection closed", "Socket Timeout", "NCCL communicator")):
                    continue
                self.echo(f"  last lines of {log}:")
                for x in tail:
                    self.echo(f"    {x[:200]}")
        self.echo(f"  logs of every rank: {self.rd.log_dir(attempt)}")


_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", re.S)


def _root_cause(log: Path) -> str:
    """torchrun (and accelerate, which runs it) exits 1 whatever happened; its summary names the rank that failed
    first and that rank's own exit code (-9: SIGKILL). Map it back so the event says what really happened."""
    try:
        text = log.read_text(errors="replace")[-20000:]
    except OSError:
        return ""
    tail = text.split("Root Cause (first observed failure):")[-1] if "Root Cause" in text else ""
    m = _TORCHRUN_FAILURE.search(tail)
    if not m:
        return ""
    return f"; root cause: rank {m.group(1)} {exit_meaning(int(m.group(2)))}"
