"""Resume across checkpoint tiers, and the local tiers' end (:mod:`ftkit.checkpoint.tiers`).

Before an attempt the supervisor looks for a step newer than the run directory's newest durable checkpoint that
every node of the attempt can resume from: each node's agent verifies its part in its own tier, every byte against
the node's commit record (``python -m ftkit.launch.agent verify`` on every host at once). All parts verify: the
attempt resumes from the **local** tier. A node's part is missing (the node is gone, or lost its memory) and
``checkpoint.peer_copies: 1`` left a copy of it on a survivor: the survivors assemble the step in the run directory
from their own parts and the peer copies (a staging directory, committed only when every part verified there), and
the attempt resumes from it as from any durable checkpoint (**peer**; after a shrink it is converted as usual).
Otherwise it resumes from the run directory (**durable**).

At the end of a launch, whatever its outcome, each node's agent copies the newest committed local step the run
directory does not have yet (``flush``), then removes the run's local tier from the node (``clean``).

:class:`LocalTier` is what the supervisor holds: these steps for the run's tier as its spec has it now.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, cast

from ftkit.checkpoint.layout import COMMIT_FILE
from ftkit.checkpoint.tiers import (
    SetRecord,
    TierUnsafe,
    clear_peer_claims,
    clear_set_records,
    clear_staging,
    discard_set_records_newer,
    due_in_run_dir,
    flush_due,
    node_dir,
    resume_path,
    set_records,
)
from ftkit.cluster.fanout import HostResult, run_on_hosts
from ftkit.cluster.hosts import is_local
from ftkit.rundir.layout import RunDir
from ftkit.rundir.records import EventSink
from ftkit.rundir.spec import LocalTierSpec, RunSpec

if TYPE_CHECKING:
    from ftkit.cluster.fanout import Transport

AGENT_TIMEOUT_S = 600.0  # one fan-out of the agents (verify reads every byte of a node's part)


class AgentAnswer(TypedDict, total=False):
    """A checkpoint agent's one-line JSON answer (``python -m ftkit.launch.agent``)."""

    host: str
    ok: bool
    reason: str | None
    discarded: list[str]  # clean --newer-than: the local parts removed
    cleaned: str | None
    kept: list[str]  # clean: directories left (not made by ftkit, or holding something else)
    unsafe: bool  # the node's tier directory is not this user's alone (ftkit.checkpoint.tiers.open_tier)
    published: bool


@dataclass(frozen=True)
class TierChoice:
    """Where an attempt resumes from when it is not the run directory's newest durable checkpoint."""

    tier: str  # "local" or "peer"
    step: int
    resume: str | None  # the local tier's path ({host} replaced by each rank); None for peer: select() finds it


class Agents:
    """The nodes' checkpoint agents, run as one-shot commands on every host (``ftkit.launch.agent``)."""

    def __init__(self, rd: RunDir, python: str, ssh_args: list[str], transport: Transport | None = None):
        self.rd, self.python, self.ssh_args, self.transport = rd, python, ssh_args, transport

    def run(self, hosts: list[str], command: str, **options: str | int | None) -> dict[str, AgentAnswer]:
        """host -> the agent's JSON answer; a host that did not answer gets ``{"ok": False, "reason": ...}``."""
        q = shlex.quote

        def line(host: str) -> str:
            opts = " ".join(f"--{k.replace('_', '-')} {q(str(v))}" for k, v in options.items() if v is not None)
            return f"{q(self.python)} -m ftkit.launch.agent {command} {q(str(self.rd.path))} --host {q(host)} {opts}"

        results = run_on_hosts(
            hosts, line, self.ssh_args, deadline_s=AGENT_TIMEOUT_S, connect_timeout_s=15, transport=self.transport
        )
        return {h: _answer(r) for h, r in results.items()}


def _answer(r: HostResult) -> AgentAnswer:
    if not r.reachable:
        return {"ok": False, "reason": f"not reachable: {r.out}"}
    for line in reversed(r.out.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            return cast("AgentAnswer", rec)
    return {"ok": False, "reason": f"the agent answered nothing (exit {r.rc}): {r.out.strip()[-200:]}"}


def choose_tier(
    rd: RunDir,
    tier: LocalTierSpec,
    hosts: list[str],
    world_size: int,
    durable_step: int | None,
    max_steps: int | None,
    agents: Agents,
    events: EventSink,
) -> TierChoice | None:
    """The newest step newer than ``durable_step`` that the attempt on ``hosts`` can resume from, else None."""
    clear_staging(rd.path)  # copies no agent is making any more: never a checkpoint
    for rec in set_records(rd.path):
        step = rec["step"]
        # a step also durable is resumed from the local tier: the same bytes, read from memory
        if (durable_step is not None and step < durable_step) or (max_steps is not None and step > max_steps):
            continue
        nodes = [str(n) for n in rec.get("nodes") or []]
        here = [n for n in nodes if n in hosts]
        answers = agents.run(here, "verify", step=step) if here else {}
        bad = {
            n: (answers.get(n) or {}).get("reason") or "not in this attempt"
            for n in nodes
            if not (answers.get(n) or {}).get("ok")
        }
        if not bad and nodes == hosts and rec.get("world_size") == world_size:
            events("tier_chosen", f"step {step} verified in the local tier of every node", step=step, tier="local")
            return TierChoice("local", step, resume_path(tier["dir"], step))
        for node, why in bad.items():
            events("tier_rejected", f"step {step} on {node}: {why}", step=step, node=node, reason=why)
        if not tier.get("peer_copies"):
            continue
        # the part of each bad node from the next node's tier, when that node is here and its own part verified
        holders: dict[str, list[str]] = {}
        for i, node in enumerate(nodes):
            if node in bad:
                holder = nodes[(i + 1) % len(nodes)]
                if holder in bad:
                    break
                holders.setdefault(holder, []).append(node)
        else:
            good = [n for n in nodes if n not in bad and n not in holders]
            answers = agents.run(good, "assemble", step=step) if good else {}  # their own parts ...
            for holder, lost in holders.items():  # ... then each holder's, with the peer copies it keeps
                answers[holder] = agents.run([holder], "assemble", step=step, lost=",".join(lost))[holder]
            if all(a.get("ok") for a in answers.values()) and (rd.path / f"checkpoint-{step}").is_dir():
                events(
                    "tier_chosen",
                    f"step {step} assembled in the run directory from peer copies of {', '.join(bad)}",
                    step=step,
                    tier="peer",
                )
                return TierChoice("peer", step, None)
            for node, a in answers.items():
                if not a.get("ok"):
                    why = f"assembling from peer copies on {node}: {a.get('reason') or 'no reason given'}"
                    events("tier_rejected", f"step {step}: {why}", step=step, node=node, reason=why)
    return None


def discard_stale(rd: RunDir, hosts: list[str], step: int | None, agents: Agents, events: EventSink) -> None:
    """Before an attempt resumes from ``step`` (None: from scratch): the local parts, peer copies and set records
    of later steps are an earlier attempt's (perhaps at another world size); the attempt saves those steps anew."""
    discard_set_records_newer(rd.path, step)
    clear_peer_claims(rd.path)
    answers = agents.run(hosts, "clean", newer_than=-1 if step is None else step)
    unsafe = {h: str(a.get("reason")) for h, a in answers.items() if a.get("unsafe")}
    if unsafe:  # another local user made (or can write to) where the ranks would save: nothing starts
        host, why = next(iter(unsafe.items()))
        message = f"the local checkpoint tier on {host}: {why}"
        events("refused", message, kind="tier_unsafe", hosts=sorted(unsafe))
        raise TierUnsafe(message)
    gone = {h: a.get("discarded") for h, a in answers.items() if a.get("discarded")}
    if gone:
        newer = "every step (a fresh start)" if step is None else f"the steps after {step}"
        message = f"removed an earlier attempt's local parts of {newer}: {gone}"
        events("tier_discarded", message, step=step, discarded=gone)


def _due_note(rec: SetRecord, tier: LocalTierSpec) -> str:
    return " (due in the run directory: train.save_steps)" if due_in_run_dir(rec, tier) else ""


def end_local_tier(rd: RunDir, tier: LocalTierSpec, hosts: list[str], agents: Agents, events: EventSink) -> None:
    """The end of a launch, whatever its outcome: every step due in the run directory that the background copies
    did not make durable yet, and the newest step every node committed, are copied there
    (:func:`ftkit.checkpoint.tiers.flush_due`; a
    finished run's last step too: a later launch with a raised step limit continues from it), and a step that
    cannot be is said (``tier_flush_failed``); then the run's local tier is removed from every node, what ftkit
    made of it only (:func:`ftkit.checkpoint.tiers.remove_tier`)."""
    for rec in flush_due(rd.path, tier):
        step = rec["step"]
        if not set(rec.get("nodes") or []) <= set(hosts):
            why = f"its nodes {', '.join(rec.get('nodes') or [])} are not all in this launch"
            answers: dict[str, AgentAnswer] = {}
        else:
            answers = agents.run(list(rec["nodes"]), "flush", step=step)
            why = "; ".join(
                f"{h}: {a.get('reason') or 'no reason given'}" for h, a in answers.items() if not a.get("ok")
            )
        if (rd.path / f"checkpoint-{step}" / COMMIT_FILE).is_file():
            events("tier_flushed", f"copied step {step} from the local tier to the run directory", step=step)
        else:  # said, never silent: the local tier is removed next, and this step with it
            events(
                "tier_flush_failed",
                f"step {step}{_due_note(rec, tier)} was never made durable: could not copy it to the run directory "
                f"({why or 'not published'}); it is lost with the local tier",
                step=step,
            )
    cleaned = agents.run(hosts, "clean")
    left = {h: a.get("reason") for h, a in cleaned.items() if not a.get("ok")}
    if left:
        why = "; ".join(f"{h}: {r}" for h, r in left.items() if r)
        events(
            "tier_left",
            f"could not remove the local tier on {', '.join(left)}" + (f" ({why})" if why else ""),
            hosts=list(left),
        )
    clear_staging(rd.path)
    clear_set_records(rd.path)


class LocalTier:
    """The local-tier orchestration of one launch: the run's tier as its spec has it now (a shrink rewrites the
    spec; None: off), driven through the nodes' agents. Every method does nothing when the run has no tier."""

    def __init__(self, rd: RunDir, agents: Agents, events: EventSink):
        self.rd, self.agents, self.events = rd, agents, events

    def spec(self) -> LocalTierSpec | None:
        try:
            return RunSpec.read(self.rd.spec).local_tier
        except (OSError, ValueError, TypeError):
            return None

    def choose(
        self, hosts: list[str], world_size: int, durable_step: int | None, max_steps: int | None
    ) -> TierChoice | None:
        """:func:`choose_tier` for the attempt on ``hosts``; None without a tier."""
        tier = self.spec()
        if not tier:
            return None
        return choose_tier(self.rd, tier, hosts, world_size, durable_step, max_steps, self.agents, self.events)

    def discard_stale(self, hosts: list[str], step: int | None) -> None:
        if self.spec():
            discard_stale(self.rd, hosts, step, self.agents, self.events)

    def steps(self) -> list[int]:
        """The steps every node committed in its local tier (their set records)."""
        return [r["step"] for r in set_records(self.rd.path)] if self.spec() else []

    def own_dirs(self) -> list[str]:
        """Where ftkit keeps files besides the run directory: the local tier's root (before its ``{host}``)."""
        tier = self.spec()
        return [tier["dir"].split("{host}")[0].rstrip("/")] if tier and tier.get("dir") else []

    def local_dirs(self, hosts: list[str]) -> list[str]:
        """The tier's directories of the hosts that are this machine."""
        tier = self.spec()
        return [str(node_dir(tier["dir"], h)) for h in hosts if is_local(h)] if tier else []

    def end(self) -> None:
        """Copy what is due from the local tier and remove it (the end of a launch; also a relaunch that finds the
        run finished: an orphan-finished run's tier may still be there)."""
        tier = self.spec()
        if not tier:
            return
        try:
            end_local_tier(self.rd, tier, list(tier.get("nodes") or []), self.agents, self.events)
        except Exception as e:  # noqa: BLE001 - the launch's outcome stands; say what was left
            self.events("tier_left", f"could not end the local tier: {type(e).__name__}: {e}")
