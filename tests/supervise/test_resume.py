"""Resume selection (``ftkit.supervise.resume.Resumer``) as one decision per attempt, on synthetic checkpoints (real
commit records, real verification) and a stand-in for the local tier's agents: no process is started."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftkit.checkpoint.directory import record_save_begun
from ftkit.errors import ExitCode, UserError
from ftkit.rundir.layout import RunDir
from ftkit.supervise.resume import Resumer
from ftkit.supervise.tier_resume import LocalTier, TierChoice
from tests.helpers.ckpt import commit, flip_byte, make_ckpt

HOSTS = ["node0", "node1"]


class Recorded:
    """events.jsonl as a list: (event, message, data)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str | None, dict[str, object]]] = []

    def __call__(self, event: str, message: str | None = None, /, **data: object) -> None:
        self.lines.append((event, message, data))

    def names(self) -> list[str]:
        return [e for e, _, _ in self.lines]

    def of(self, event: str) -> list[tuple[str, str | None, dict[str, object]]]:
        return [x for x in self.lines if x[0] == event]


@dataclass
class FakeTier:
    """The local tier as the nodes' agents would answer: ``picked`` is what choose() finds; the calls are kept."""

    picked: TierChoice | None = None
    on_choose: object = None  # called when choose() is (a peer assembly writes the run directory)
    local_steps: list[int] = field(default_factory=list)
    chosen: list[tuple[list[str], int, int | None]] = field(default_factory=list)
    discarded: list[tuple[list[str], int | None]] = field(default_factory=list)

    def choose(self, hosts, world_size, durable_step, max_steps):  # noqa: ARG002
        self.chosen.append((hosts, world_size, durable_step))
        if callable(self.on_choose):
            self.on_choose()
        return self.picked

    def discard_stale(self, hosts, step):
        self.discarded.append((hosts, step))

    def steps(self):
        return self.local_steps


def _committed(run: Path, *steps: int, world_size: int = 2) -> None:
    for s in steps:
        commit(make_ckpt(run, s, world_size=world_size), world_size=world_size)


def _torn(run: Path, step: int) -> None:
    make_ckpt(run, step)
    record_save_begun(run, step, attempt=0)


def _resumer(run: Path, tier=None, **kw) -> tuple[Resumer, Recorded]:
    events = Recorded()
    rd = RunDir(run)
    run.mkdir(parents=True, exist_ok=True)
    tier = tier if tier is not None else LocalTier(rd, agents=None, events=events)  # type: ignore[arg-type]
    kw = {"checksums": True, "world_size": 2, "stage": 2, "max_steps": None, **kw}
    return Resumer(rd, events, tier, **kw), events


def test_a_run_without_checkpoints_starts_fresh_and_says_so(tmp_path):
    resumer, events = _resumer(tmp_path / "run")
    resume = resumer.next(None, HOSTS)
    assert resume.exit_code is None and resume.choice.resume is None and resume.tier == "durable"
    assert events.names() == ["fresh_start"]


def test_the_newest_committed_checkpoint_is_resumed_and_a_newer_torn_one_set_aside(tmp_path):
    run = tmp_path / "run"
    _committed(run, 4)
    _torn(run, 8)  # a save the crash tore: never committed
    tier = FakeTier()
    resumer, events = _resumer(run, tier)
    resume = resumer.next(None, HOSTS)
    assert resume.choice.step == 4 and resume.choice.resume == str(run / "checkpoint-4") and resume.tier == "durable"
    assert not (run / "checkpoint-8").exists(), "the torn save is set aside so the resumed run can write step 8"
    assert events.names() == ["checkpoint_rejected", "set_aside", "checkpoint_chosen"]
    assert events.of("checkpoint_chosen")[0][1] == "resuming from checkpoint-4 (step 4, commit verified)"
    assert tier.chosen == [(HOSTS, 2, 4)] and tier.discarded == [(HOSTS, 4)]


def test_the_launch_s_first_choice_is_carried_out_not_made_again(tmp_path):
    run = tmp_path / "run"
    _committed(run, 4)
    resumer, _ = _resumer(run, FakeTier())
    first = resumer.select()  # the launch checks (and fingerprints) it before the first attempt
    assert resumer.next(first, HOSTS).choice is first
    _committed(run, 8)  # the first attempt saved step 8
    assert resumer.next(None, HOSTS).choice.step == 8  # the next attempt chooses again


def test_a_step_verified_on_every_node_s_local_tier_wins_and_is_announced_as_local(tmp_path):
    run = tmp_path / "run"
    _committed(run, 4)
    tier = FakeTier(picked=TierChoice("local", 6, "/tier/{host}/checkpoint-6"))
    resumer, events = _resumer(run, tier)
    resume = resumer.next(None, HOSTS)
    assert resume.tier == "local" and resume.choice.step == 6 and resume.choice.resume == "/tier/{host}/checkpoint-6"
    (chosen,) = events.of("checkpoint_chosen")  # the durable checkpoint is not announced as well
    assert chosen[1] == "resuming from checkpoint-6 in the local tier (commit verified on every node)"
    assert chosen[2]["tier"] == "local"
    assert tier.discarded == [(HOSTS, 6)]  # later steps of an earlier attempt go


def test_a_step_assembled_from_peer_copies_is_chosen_again_as_durable_and_named_peer(tmp_path):
    run = tmp_path / "run"
    _committed(run, 4)
    tier = FakeTier(picked=TierChoice("peer", 8, None), on_choose=lambda: _committed(run, 8))
    resumer, events = _resumer(run, tier)
    resume = resumer.next(None, HOSTS)
    assert resume.tier == "peer" and resume.choice.step == 8 and resume.choice.resume == str(run / "checkpoint-8")
    assert events.names() == ["checkpoint_chosen"]


def test_a_refusal_is_the_decision_with_its_exit_code_and_nothing_is_discarded(tmp_path):
    run = tmp_path / "run"
    _committed(run, 4, 8)
    for s in (4, 8):
        flip_byte(run / f"checkpoint-{s}" / "model.safetensors", 10)
    tier = FakeTier(picked=TierChoice("local", 9, "/x"))
    resumer, events = _resumer(run, tier)
    resume = resumer.next(None, HOSTS)
    assert resume.exit_code == ExitCode.NO_CHECKPOINT and resume.choice.resume is None
    assert events.names() == ["checkpoint_rejected", "checkpoint_rejected", "refused"]
    assert tier.chosen == [] and tier.discarded == []  # no tier is asked, no local step removed
    assert (run / "checkpoint-8").is_dir() and (run / "checkpoint-4").is_dir()


class Replan:
    """The launch's replanner: a plan for the hosts left, and each prepare() it was asked for."""

    def __init__(self, fail: str | None = None, tp: int = 1, sp: int = 1):
        self.fail, self.prepared, self.tp, self.sp = fail, [], tp, sp

    def replan(self, hosts):
        if self.fail:
            raise UserError(self.fail)
        world = sum(n for _, n in hosts)
        return SimpleNamespace(
            hosts=hosts,
            world_size=world,
            master_addr=hosts[0][0],
            global_batch_size=8,
            grad_accum=8 // world,
            tp=self.tp,
            sp=self.sp,
        )

    def prepare(self, plan, load_universal):
        self.prepared.append((plan.world_size, load_universal))


def test_a_shrink_replans_on_the_hosts_left_and_converts_the_old_world_size_s_checkpoints(tmp_path):
    run = tmp_path / "run"
    _committed(run, 4)  # saved by 2 ranks
    replan = Replan()
    resumer, events = _resumer(run, FakeTier(), replanner=replan)
    assert resumer.select().step == 4
    plan = resumer.shrink([("node0", 1), ("node1", 1)], ["node1"])
    assert not isinstance(plan, int) and plan.hosts == [("node0", 1)]
    assert resumer.world_size == 1 and replan.prepared == [(1, False)]
    (shrink,) = events.of("shrink")
    assert shrink[1] == "continuing on node0: world size 1, global batch 8 kept with gradient accumulation 8"
    choice = resumer.select()  # checkpoint-4 is 2 ranks': converted now, never refused
    assert choice.convert and choice.exit_code is None


def test_an_attempt_that_loads_a_universal_checkpoint_is_the_only_one(tmp_path, monkeypatch):
    """After the conversion the configs load the universal checkpoint for one attempt; the next attempt's configs
    load the new world size's own checkpoints again (DeepSpeed's conversion itself is the integration tests')."""
    from ftkit.supervise import resume as module

    run = tmp_path / "run"
    _committed(run, 4)
    converted = []

    def convert(sel, incompatible, world_size, events):  # noqa: ARG001
        converted.append(world_size)
        return str(incompatible[0].path)

    monkeypatch.setattr(module, "convert_newest", convert)
    replan = Replan()
    resumer, _ = _resumer(run, FakeTier(), replanner=replan)
    resumer.shrink([("node0", 1), ("node1", 1)], ["node1"])
    resume = resumer.next(None, ["node0"])
    assert converted == [1] and resume.choice.step == 4 and resume.tier == "durable"
    assert replan.prepared == [(1, False), (1, True)]
    resumer.restarting()
    resumer.restarting()
    assert replan.prepared == [(1, False), (1, True), (1, False)]


@pytest.mark.parametrize("replanner", [None, Replan(fail="the global batch 8 does not divide by 3 ranks")])
def test_a_shrink_that_cannot_keep_the_job_ends_it_as_a_lost_host(tmp_path, replanner):
    resumer, events = _resumer(tmp_path / "run", FakeTier(), replanner=replanner)
    assert resumer.shrink([("node0", 1), ("node1", 2)], ["node0"]) == ExitCode.HOST_LOST
    assert resumer.world_size == 2
    if replanner is not None:
        (gave_up,) = events.of("gave_up")
        assert gave_up[1] == "cannot continue on node1: the global batch 8 does not divide by 3 ranks"


def test_the_newest_commit_counts_a_step_every_node_holds_in_its_local_tier(tmp_path):
    run = tmp_path / "run"
    resumer, _ = _resumer(run, FakeTier())
    assert resumer.newest_commit() is None
    _committed(run, 4)
    assert resumer.newest_commit() == 4
    resumer, _ = _resumer(run, FakeTier(local_steps=[6]))
    assert resumer.newest_commit() == 6


def test_after_a_full_disk_only_uncommitted_newer_checkpoints_are_deleted(tmp_path):
    run = tmp_path / "run"
    _committed(run, 4)
    _torn(run, 8)
    resumer, events = _resumer(run, FakeTier())
    resumer.discard_torn()
    assert (run / "checkpoint-4").is_dir() and not (run / "checkpoint-8").exists()
    assert events.of("discarded")[0][1] == "deleted checkpoint-8: torn by the full disk, never committed"


def test_the_local_tier_is_off_without_one_in_the_spec(tmp_path):
    """A run whose spec names no tier: the real LocalTier asks no agent anything (None would fail if it did)."""
    from tests.helpers.rundir import write_spec

    rd = write_spec(tmp_path / "run")
    tier = LocalTier(rd, agents=None, events=Recorded())  # type: ignore[arg-type]
    assert tier.spec() is None and tier.choose(HOSTS, 2, None, None) is None and tier.steps() == []
    tier.discard_stale(HOSTS, 4)
    tier.end()
    assert tier.own_dirs() == [] and tier.local_dirs(["localhost"]) == []


class FakeAgents:
    """The nodes' checkpoint agents as they answer (``ftkit.launch.agent``): ``bad`` hosts fail verify."""

    def __init__(self, bad: dict[str, str] | None = None):
        self.bad, self.calls = bad or {}, []

    def run(self, hosts, command, **options):
        self.calls.append((command, list(hosts), options))
        return {h: {"ok": h not in self.bad, "reason": self.bad.get(h)} for h in hosts}


def _tiered(tmp_path, agents: FakeAgents) -> tuple[LocalTier, Recorded, RunDir]:
    from ftkit.checkpoint.tiers import write_set_record
    from tests.helpers.rundir import tier_run

    rd = tier_run(tmp_path / "run", str(tmp_path / "tier" / "{host}"), HOSTS)
    write_set_record(rd.path, 6, attempt=0, nodes=HOSTS, world_size=4, stop=None)
    events = Recorded()
    return LocalTier(rd, agents, events), events, rd  # type: ignore[arg-type]


def test_a_step_every_node_verifies_in_its_local_tier_is_the_tier_s_choice(tmp_path):
    agents = FakeAgents()
    tier, events, _ = _tiered(tmp_path, agents)
    picked = tier.choose(HOSTS, 4, durable_step=4, max_steps=None)
    assert picked == TierChoice("local", 6, f"{tmp_path}/tier/{{host}}/checkpoint-6")
    assert agents.calls == [("verify", HOSTS, {"step": 6})]
    assert events.names() == ["tier_chosen"] and tier.steps() == [6]
    assert tier.own_dirs() == [f"{tmp_path}/tier"]
    assert tier.local_dirs(["localhost", "node0"]) == [f"{tmp_path}/tier/localhost"]


def test_a_step_one_node_cannot_verify_is_rejected_with_its_reason(tmp_path):
    tier, events, _ = _tiered(tmp_path, FakeAgents(bad={"node1": "checkpoint-6: model.safetensors differs"}))
    assert tier.choose(HOSTS, 4, durable_step=4, max_steps=None) is None  # no peer copies: durable it is
    (rejected,) = events.of("tier_rejected")
    assert rejected[1] == "step 6 on node1: checkpoint-6: model.safetensors differs"


def test_before_an_attempt_the_tier_s_later_steps_are_discarded_on_every_node(tmp_path):
    agents = FakeAgents()
    tier, _, _ = _tiered(tmp_path, agents)
    tier.discard_stale(HOSTS, 4)
    assert agents.calls == [("clean", HOSTS, {"newer_than": 4})]
    assert tier.steps() == []  # the set record of step 6 went with them


@pytest.mark.parametrize(("tp", "sp"), [(2, 1), (1, 2)])
def test_a_tensor_or_sequence_parallel_job_stops_on_a_shrink_with_one_line(tmp_path, tp, sp):
    """Issue 40: a lost host under TP or SP stops the job (HOST_LOST) with one line saying how to go on; nothing is
    converted or rewritten (the old code replanned it as a data-parallel shrink and converted its checkpoints)."""
    replan = Replan(tp=tp, sp=sp)
    resumer, events = _resumer(tmp_path / "run", FakeTier(), replanner=replan)
    assert resumer.shrink([("node0", 2), ("node1", 2)], ["node1"]) == ExitCode.HOST_LOST
    assert resumer.world_size == 2 and replan.prepared == [] and events.of("shrink") == []
    (gave_up,) = events.of("gave_up")
    assert gave_up[1] == (
        f"cannot continue on node0: a tensor/sequence-parallel run (tp {tp} x sp {sp}) does not continue on fewer "
        "hosts (its checkpoints are not converted to another layout); bring the host(s) back and launch again: it "
        "resumes from the newest committed step"
    )
