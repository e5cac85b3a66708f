"""The JSON records ranks leave in the run directory, as types: what each file holds, so readers (the supervisor,
``ftkit status``, teardown, the doctor) are checked against what writers write.

Every key is optional to a reader (``total=False``): a record may come from an older ftkit, or be read while a
rank that crashed left it half-filled, so readers use ``.get`` and check what they need.
"""

from __future__ import annotations

from typing import TypedDict


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


class AgentRecord(TypedDict, total=False):
    """``ftkit/attempts/N/agents/agent-HOST.json``: a node's checkpoint agent of the local tier."""

    host: str
    pid: int
    start_time: int | None
    attempt: int
    agent_of_rank: int
