"""The recipe's sections as typed, frozen records: ``recipe.train.save_steps`` instead of a string lookup.

Here, in the stdlib-only contract between the head and the ranks, so both sides import them: the loader builds them
(:mod:`ftkit.recipe.load`), the run spec carries the resolved ones to the ranks (:class:`ftkit.rundir.spec.RunSpec`).
Generated from the one schema table (:mod:`ftkit.recipe.schema`; ``tests/recipe`` checks they agree): one class per
section, one attribute per field, in the table's order, with the Python type of the field's schema type (``path``
and ``host`` are ``str``; ``auto`` is the string ``"auto"``; ``null`` is ``None``). The loader builds them from the
validated values (:attr:`ftkit.recipe.load.Recipe.model` and its siblings); the field's one line of documentation
lives in the schema table, where the commented recipe and the docs read it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSection:
    """``model``: The model to fine-tune."""

    path: str
    revision: str | None
    config: str | None
    tokenizer: str | None
    gradient_checkpointing: bool


@dataclass(frozen=True)
class PeftSection:
    """``peft``: Parameter-efficient fine-tuning; omit the whole section for full fine-tuning."""

    method: str
    r: int
    alpha: float
    dropout: float
    target_modules: list[str]


@dataclass(frozen=True)
class DataSection:
    """``data``: Training data from local files."""

    train: str
    max_seq_len: int
    truncate: bool
    eval: str | None


@dataclass(frozen=True)
class TrainSection:
    """``train``: The HF Trainer run."""

    output_dir: str
    backend: str
    precision: str
    fp16_loss_scale: float | str
    fp16_initial_scale_power: int | str
    fp16_loss_scale_window: int | str
    fp16_hysteresis: int | str
    fp16_min_loss_scale: float | str
    micro_batch_size: int
    global_batch_size: int
    max_steps: int | None
    epochs: float | None
    learning_rate: float
    lr_scheduler: str
    warmup_steps: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float
    logging_steps: int
    save_steps: int
    save_total_limit: int
    seed: int
    eval_steps: int | None
    report_to: list[str]
    command: list[str] | None


@dataclass(frozen=True)
class SchedulerSection:
    """``scheduler``: DeepSpeed's own learning-rate schedules (train.lr_scheduler WarmupLR, WarmupDecayLR,
    WarmupCosineLR, OneCycle, LRRangeTest)."""

    warmup_type: str
    warmup_min_lr: float
    warmup_min_ratio: float
    cos_min_ratio: float
    cycle_min_lr: float | None
    cycle_max_lr: float | None
    cycle_first_step_size: int
    cycle_second_step_size: int | None
    cycle_first_stair_count: int
    cycle_second_stair_count: int | None
    decay_lr_rate: float
    decay_step_size: int
    cycle_momentum: bool
    cycle_min_mom: float
    cycle_max_mom: float
    decay_mom_rate: float
    lr_range_test_min_lr: float
    lr_range_test_step_size: int
    lr_range_test_step_rate: float
    lr_range_test_staircase: bool


@dataclass(frozen=True)
class CheckpointSection:
    """``checkpoint``: Checkpoint tiers: a node-local tier saved often, copied to the run directory in the
    background."""

    local_dir: str | None
    local_steps: int | str
    local_keep: int
    peer_copies: int


@dataclass(frozen=True)
class ZeroSection:
    """``zero``: DeepSpeed ZeRO sharding."""

    stage: int | str
    offload_optimizer: str
    offload_params: str
    nvme_path: str | None
    cpu_adam: bool | str
    overlap_comm: bool | str
    reduce_bucket_size: int | str
    allgather_bucket_size: int | str
    contiguous_gradients: bool | str
    round_robin_gradients: bool | str
    pin_memory: bool | str
    sub_group_size: int | str
    prefetch_bucket_size: int | str
    param_persistence_threshold: int | str
    max_live_parameters: int | str
    max_reuse_distance: int | str


@dataclass(frozen=True)
class FsdpSection:
    """``fsdp``: PyTorch FSDP2 sharding (train.backend: fsdp2)."""

    reshard_after_forward: bool
    offload_params: bool
    transformer_layer_cls: str
    state_dict_type: str
    cpu_ram_efficient_loading: bool


@dataclass(frozen=True)
class ParallelSection:
    """``parallel``: Tensor and sequence parallelism inside a node, on top of the data parallelism of zero or
    fsdp."""

    tp: int | str
    sp: int | str


@dataclass(frozen=True)
class ClusterSection:
    """``cluster``: Where the job runs."""

    hostfile: str | None
    num_nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    host_memory_gb: float
    accelerator: str
    engine: str
    master_addr: str | None
    ssh_config: str | None
    env: list[str] | None
    master_port: int
    min_nodes: int | None
    gpu: str
    network: str
    intra_node_gbs: float | None
    inter_node_gbs: float | None


@dataclass(frozen=True)
class ResilienceSection:
    """``resilience``: Supervision and restarts."""

    max_restarts: int
    hang_timeout_s: float
    startup_timeout_s: float
    backoff_s: float
    backoff_max_s: float
    stop_timeout_s: float
    mtbf_hours: float
    max_requeues: int
    exclude_stragglers: bool
    orphan_timeout_s: float
    resume_tolerance: float
    checksum: str
    verify_checksums: bool


SECTION_TYPES: dict[str, type] = {
    "model": ModelSection,
    "peft": PeftSection,
    "data": DataSection,
    "train": TrainSection,
    "scheduler": SchedulerSection,
    "checkpoint": CheckpointSection,
    "zero": ZeroSection,
    "fsdp": FsdpSection,
    "parallel": ParallelSection,
    "cluster": ClusterSection,
    "resilience": ResilienceSection,
}
