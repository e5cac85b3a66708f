"""The JSON records ranks leave in the run directory, as types: what each file holds, so readers (the supervisor,
``ftkit status``, teardown, the doctor) are checked against what writers write.

Every key is optional to a reader (``total=False``): a record may come from an older ftkit, or be read while a
rank that crashed left it half-filled, so readers use ``.get`` and check what they need.
"""

from __future__ import annotations

import math
from typing import Protocol, TypeAlias, TypedDict

JSONScalar: TypeAlias = str | int | float | bool | None
JSON: TypeAlias = JSONScalar | list["JSON"] | dict[str, "JSON"]  # what json.loads returns, for free-form data
JSONObject: TypeAlias = dict[str, JSON]  # a JSON object whose keys are not fixed (the recipe, a user's config)


def as_number(x: object, *, finite: bool = True) -> float | None:
    """A record's value as a float when it is a JSON number (not a bool), else None; NaN and infinities are None
    unless ``finite=False`` (a loss that went NaN is worth showing)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (finite and not math.isfinite(x)):
        return None
    return float(x)


def as_int(x: object) -> int | None:
    """A record's value as an int when it is a whole JSON number (``3`` or ``3.0``, not a bool), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    return int(x) if isinstance(x, float) and math.isfinite(x) and x.is_integer() else None


class Heartbeat(TypedDict, total=False):
    """``ftkit/heartbeat/rank-R.json``: a rank's progress, rewritten on every event (:meth:`RankContext.heartbeat`)."""

    rank: int
    attempt: int
    phase: str  # starting, loading, train, saving, stopped, finished
    step: int | None
    loss: float | None
    time: float  # the rank's wall clock (compared only with the same rank's earlier beats)
    pid: int
    host: str  # the machine's own hostname
    node: str  # the node's name in the hostfile
    compute_ewma_s: float | None  # this rank's own compute time per step (straggler detection)
    compute_n: int
    hooked: bool  # ftkit's callback is on the script's Trainer
    trainer: bool  # a Trainer was built
    loop: bool  # the script reports its steps through ftkit.hf.step (its own loop, no HF Trainer)
    started_at_step: int | None
    committed: int | None  # the newest step this rank saw committed (any tier)
    sharding: dict[str, int]  # FSDP2: {"dtensor_params": n, "params": n}, from the model the Trainer trains


class PidRecord(TypedDict, total=False):
    """``ftkit/attempts/N/pids/rank-R.json``: where a rank runs, for teardown by pid (``RankContext.record_pid``)."""

    rank: int
    local_rank: int
    node_rank: int
    host: str  # the node's name in the hostfile
    hostname: str
    pid: int
    start_time: int | None  # guards against pid reuse
    ppid: int  # the per-node agent (launcher)
    ppid_start_time: int | None
    pgid: int
    attempt: int
    time: float
    env: dict[str, str]  # the allow-listed environment the rank saw (secrets left out)
    env_keys: list[str]
    master_addr: str | None  # DeepSpeed's CPU collectives name their /dev/shm buffers after these
    master_port: str | None
    watchdog: dict[str, float] | None


class ErrorRecord(TypedDict, total=False):
    """``ftkit/attempts/N/errors/rank-R.json``: a user error a rank reported (not worth a restart)."""

    rank: int
    host: str
    kind: str  # the FtkitError's class name
    lines: list[str]
    exit_code: int
    step: int | None
    repeats: bool  # the same error would recur on a restart
    traceback: list[str]
    failure_class: str  # ftkit.rundir.failures: why, in the supervisor's and events.jsonl's words
    restartable: bool  # whether a restart may change it (a wrapped script's own exception before its first step
    # is not: the script meets it again)
    summary: str  # the exception's own line: "ModuleNotFoundError: No module named 'x'"


class AgentRecord(TypedDict, total=False):
    """``ftkit/attempts/N/agents/agent-HOST.json``: a node's checkpoint agent of the local tier."""

    host: str
    pid: int
    start_time: int | None
    attempt: int
    agent_of_rank: int


class FileEntry(TypedDict):
    """One file of a checkpoint's manifest: its size, checksum and the rank that wrote it."""

    size: int
    checksum: str  # "xxh3:<hex>", or "sampled:<hex>" (checkpoint.checksums)
    rank: int


class Fingerprint(TypedDict, total=False):
    """What a run's results depend on (:func:`ftkit.run.fingerprint.compute`), recorded in the spec and every
    commit: a resume compares it with today's to refuse silent changes."""

    format: int
    recipe: dict[str, JSON]  # dotted recipe key -> value (peft.* null for full fine-tuning)
    peft: bool
    data: dict[str, JSON]  # path, size, content hash of the training file
    model: dict[str, JSON]  # path, config hash, revision
    tokenizer: dict[str, JSON]
    versions: dict[str, str | None]  # package -> version (None: not installed)
    seconds: float  # what computing it cost


class ChecksumInfo(TypedDict, total=False):
    """A commit record's checksum: ``{"mode": "full", "name": "xxh3_128"}``, or the sampled digest's parameters."""

    mode: str  # full, sampled
    name: str
    small_file_bytes: int
    blocks: int
    block_bytes: int


class CommitExtra(TypedDict, total=False):
    """What a commit record says beyond its files: who saved it and, on the local tier, which nodes hold it."""

    attempt: int
    fingerprint: Fingerprint  # the run's at the save
    node: str  # a node's part of a local-tier checkpoint
    nodes: list[str]  # every node of the set
    ranks: list[int]  # the ranks whose files the part holds
    stop: bool | None  # a graceful stop's save
    tier: str  # durable: published by the agents from the local tier
    export: dict[str, JSON]  # an exported model: its source checkpoint, step, kind, dtype, verdict
    final: bool  # the run's final model


class CommitRecord(TypedDict, total=False):
    """``CHECKPOINT/ftkit-commit.json``: the proof a checkpoint is complete
    (:func:`ftkit.checkpoint.commit.write_commit`)."""

    format: str
    version: int
    ftkit_version: str
    step: int
    created: float
    created_utc: str
    world_size: int
    stage: int | None  # the ZeRO stage (None: not a DeepSpeed run)
    recipe_hash: str
    tag: str | None  # DeepSpeed's checkpoint tag (global_stepN)
    checksum: ChecksumInfo
    kind: str  # checkpoint, model, state, node
    files: dict[str, FileEntry]
    extra: CommitExtra


class HostStepTimes(TypedDict):
    """One host's compute time per step against the other hosts' (the ``step_times`` event, straggler reports)."""

    host: str
    ranks: list[int]
    compute_s: float
    reference_s: float | None
    score: float | None
    steps: int
    straggler: bool


class RankStepTimes(TypedDict):
    """One rank's compute time per step (the ``step_times`` event)."""

    rank: int | None
    host: str | None
    compute_s: float | None
    steps: int | None


class StragglerRecord(TypedDict):
    """A straggler report: every host's step times and which ones are stragglers (``exclude_stragglers``)."""

    attempt: int | None
    threshold: float
    min_steps: int
    hosts: list[HostStepTimes]
    stragglers: list[str]


class EventSink(Protocol):
    """Writes one line of ``events.jsonl`` (``ftkit.supervise.events.Events``); ``message`` is said to the user
    too."""

    def __call__(self, event: str, message: str | None = None, /, **data: object) -> None: ...


class Event(TypedDict, total=False):
    """One line of ``ftkit/events.jsonl``: what the supervisor decided and why (``Events.__call__``). ``time``,
    ``event`` and ``attempt`` are on every line; the rest depends on the event."""

    time: float
    event: str  # launch, failure, restart, checkpoint_chosen, shrink, finished, ...
    attempt: int
    message: str
    step: int | None
    kind: str
    reason: str
    checkpoint: str | None
    hosts: list[str] | list[list[str | int]] | list[HostStepTimes]  # lost or excluded; [host, slots]; step_times
    ranks: list[RankStepTimes]  # step_times
    node: str
    host: str
    pid: int
    start_time: int | None
    remote: bool
    argv: list[str]
    engine: str
    resume: str | None
    tier: str | None
    world_size: int
    from_world_size: int
    to_world_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    exit_code: int | None
    exit_meaning: str | None
    dead_ranks: list[int]
    restarts: int
    delay_s: float
    signal: str
    timeout_s: float
    dst: str
    universal: bool
    discarded: list[str]
    changes: list[JSON]
    versions: dict[str, JSON]
    report: StragglerRecord
    metric: str
    logged: float
    now: float
    relative: float
    stop: bool
    job_id: str  # slurm: the batch job's SLURM_JOB_ID
    restart_count: int  # slurm: SLURM_RESTART_COUNT (0: the job's first start)


class MetricsRecord(TypedDict, total=False):
    """One line of ``ftkit/metrics.jsonl`` (rank 0): a logged step (``loss``, ``lr``, ...; a script's own metrics
    from ``ftkit.hf.step`` too), an eval, a checkpoint commit (``event: "commit"``) or a checkpoint agent's event."""

    step: int
    attempt: int
    time: float
    loss: float
    lr: float | None
    grad_norm: float | None
    tokens_seen: int | None
    mem_peak: int  # on a GPU: rank 0's allocator peak so far (torch.cuda.max_memory_allocated), bytes
    mem_reserved_peak: int  # and its reserved peak (max_memory_reserved)
    eval_loss: float
    event: str  # commit, or an agent's event (durable, peer_copy, ...)
    commit_s: float
    save_s: float
    rotated: list[str]
    stop: bool | None
    host: str
    tier: str
    published: bool  # durable: the agent published the step (the last node's copy)
    copy_s: float
