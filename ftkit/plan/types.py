"""The plan's records, below everything else in ``plan/``: the inputs gathered at the edge (:class:`PlanInputs`), the
result (:class:`Plan`, each knob with its reason) and the memory and step-time report (:class:`MemoryReport`).

Every other module of ``plan/`` imports these at run time (no type-only import loop): :mod:`ftkit.plan.inputs`
gathers a :class:`PlanInputs` (the only I/O of planning: hostfile, environment, config.json, the profile's trace or
cache, the bandwidth file, calibrations, earlier metrics), :func:`ftkit.plan.plan.plan_from` builds the
:class:`Plan` from it without I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

from ftkit.cluster.hosts import LOCAL_HOSTS
from ftkit.errors import Problem, RecipeError
from ftkit.model.shape import ModelShape
from ftkit.plan.comm import Network, Prediction
from ftkit.plan.local_tier import LocalTier
from ftkit.plan.memory import Candidate, Choice, Estimate, Workload
from ftkit.plan.profile import Profile
from ftkit.plan.speed import Calibration
from ftkit.recipe.load import Recipe
from ftkit.recipe.schema import Value
from ftkit.rundir.records import JSONObject

HEADROOM = 0.10  # fraction of GPU memory and host RAM kept free


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan is built from, read once at the edge (:func:`ftkit.plan.inputs.gather`)."""

    recipe: Recipe
    hosts: tuple[tuple[str, int], ...]  # (host, processes) in rank order
    devices: Mapping[str, tuple[int, ...]]  # host -> the device indices an --include/--exclude kept
    master_port: int
    model_config: JSONObject  # config.json ({} when it could not be read)
    model_config_file: str
    model_config_label: str
    model_problems: tuple[Problem, ...] = ()  # why config.json could not be read
    hidden_size: int = 0
    shape: ModelShape | None = None  # parameter counts (None: memory not planned)
    network: Network | None = None
    gpu: str = ""  # GPU_PEAK_TFLOPS's key
    gpu_source: str = ""
    profile: Profile | None = None  # activations and work per micro-step (ftkit.plan.profile)
    profile_zero3: Profile | None = None  # LoRA under DeepSpeed ZeRO-3
    calibration: Calibration | None = None  # step-time calibration of this GPU class (ftkit.plan.calibrate)
    run_dir: str = ""  # train.output_dir, resolved (the local tier's default directory hashes it)
    measured_save_s: float | None = None  # earlier attempts of this run directory (the local tier's cadence)
    measured_step_s: float | None = None
    slurm_hosts: bool = False  # the hosts are a Slurm allocation's
    # whether every host of the launch can load DeepSpeed's CPU Adam (prebuilt, or a C++ compiler, ninja and, on a
    # CUDA host, nvcc to build it), as ftkit launch's preflight found (ftkit.run.ops); None: not checked (render,
    # plan): zero.cpu_adam auto then renders torch's AdamW, which needs nothing compiled
    cpu_adam_ok: bool | None = None

    @property
    def model_unknown(self) -> str:
        return "; ".join(p.message for p in self.model_problems)


KnobValue: TypeAlias = Value  # one value of ds_config.json or accelerate.yaml (a recipe value, or a rule's)
_V = TypeVar("_V", bound=KnobValue)


@dataclass(frozen=True)
class Knob:
    value: KnobValue
    why: str  # the rule or source that produced the value


@dataclass(frozen=True)
class LayoutRow:
    """One tensor/sequence-parallel layout as ``ftkit plan`` compares them (:mod:`ftkit.plan.parallel`): the best
    candidate of the recipe's sharding under it, its memory and step time, and the longest sequence it fits."""

    tp: int
    sp: int
    dp: int
    grad_accum: int
    candidate: str  # the candidate the layout would run (its label), "" when none is allowed
    gpu_gb: float
    fits: bool
    step_time_s: float
    tokens_per_s: float
    longest_seq: int  # the longest data.max_seq_len the candidate fits at this micro batch (0: none)
    reason: str  # why chosen, or why not

    @property
    def label(self) -> str:
        parts = [f"TP={self.tp}"] if self.tp > 1 else []
        parts += [f"SP={self.sp}"] if self.sp > 1 else []
        return " x ".join(parts + [f"DP={self.dp}"])


@dataclass
class Plan:
    recipe: Recipe
    hosts: list[tuple[str, int]]  # (host, processes) in rank order
    master_addr: str
    master_port: int
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    stage: int
    offload_optimizer: str
    offload_params: str
    hidden_size: int
    model_config: JSONObject
    knobs: dict[str, Knob] = field(default_factory=dict)
    memory: MemoryReport | None = None  # the memory and step-time plan (ftkit.plan.candidates), when computed
    # host -> the device (slot) indices an --include/--exclude selection kept (empty without a filter): the command
    # builder hands them to the engine (deepspeed --include, else CUDA_VISIBLE_DEVICES on the node)
    devices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # the config.json read for model_config (a model directory's, the hub cache's, or model.config) and its label
    model_config_file: str = ""
    model_config_label: str = ""
    # what the plan could not estimate (a user command's model whose config.json cannot be read): one line each
    unknown: list[str] = field(default_factory=list)
    local_tier: LocalTier | None = None  # the node-local checkpoint tier (ftkit.plan.local_tier), None: off
    local_tier_off: str = ""  # why it is off
    # train.backend auto: the memory and step-time plan across both backends that chose this plan's backend
    backend_report: MemoryReport | None = None
    inputs: PlanInputs | None = None  # what the plan was built from (ftkit.plan.inputs)
    # parallel.tp / parallel.sp resolved (ftkit.plan.parallel): the data-parallel degree is world_size / (tp x sp)
    tp: int = 1
    sp: int = 1
    layouts: list[LayoutRow] = field(default_factory=list)  # parallel.* auto: every layout judged, chosen first

    @property
    def cpu_adam_ok(self) -> bool | None:
        """What the launch's preflight found of DeepSpeed's CPU Adam on every host (:attr:`PlanInputs.cpu_adam_ok`)."""
        return self.inputs.cpu_adam_ok if self.inputs is not None else None

    @property
    def world_size(self) -> int:
        return sum(n for _, n in self.hosts)

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: the ranks that each see their own micro batches (world size / (tp x sp))."""
        return self.world_size // (self.tp * self.sp)

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def procs_per_node(self) -> int:
        return self.hosts[0][1]

    @property
    def uniform(self) -> bool:
        return len({n for _, n in self.hosts}) == 1

    @property
    def is_local(self) -> bool:
        return self.num_nodes == 1 and self.hosts[0][0] in LOCAL_HOSTS

    @property
    def sharding_why(self) -> str:
        """Why the run shards as it does: the ZeRO stage's reason, or FSDP2's resharding choice."""
        knob = "fsdp_reshard_after_forward" if self.recipe.train.backend == "fsdp2" else "zero_optimization.stage"
        return self.knobs[knob].why

    def note(self, knob: str, value: _V, why: str) -> _V:
        self.knobs[knob] = Knob(value, why)
        return value


@dataclass
class MemoryReport:
    shape: ModelShape
    workload: Workload
    choice: Choice  # every candidate the recipe allows, judged, fastest first
    selected: Estimate | None  # the candidate the run will use (auto: the choice; fixed: the recipe's)
    gpu_memory_gb: float
    host_memory_gb: float
    auto: bool
    tight: bool
    host_tight: bool
    room_for_overlap: bool
    suggestions: list[str]
    choice_reason: str
    recipe: Recipe | None = None
    # step-time prediction of every candidate judged (label -> Prediction), and the one-line why of the choice
    predictions: dict[str, Prediction] = field(default_factory=dict)
    speed_reason: str = ""
    activations: str = ""  # where the activation profile came from (ftkit.plan.profile.Profile.line)

    def choice_for(self, stage: int | str, opt: str, strict: bool = True) -> Candidate:
        if self.choice.chosen is None and not strict:
            return self.choice.estimates[-1].candidate
        if self.choice.chosen is None:
            assert self.recipe is not None  # plan_memory sets it
            raise RecipeError(
                self.recipe.problem(
                    "zero.stage",
                    f"auto: nothing fits in cluster.gpu_memory_gb={self.gpu_memory_gb:g} GiB per GPU with "
                    f"{HEADROOM:.0%} headroom; run `ftkit plan` for the table"
                    + ("; try: " + " | ".join(self.suggestions) if self.suggestions else ""),
                )
            )
        return self.choice.chosen.candidate

    def as_dict(self) -> dict[str, object]:
        def est(e: Estimate) -> dict[str, object]:
            return {
                "candidate": e.candidate.label,
                "stage": e.candidate.stage,
                "offload_optimizer": e.candidate.offload_optimizer,
                "offload_params": e.candidate.offload_params,
                "gpu_gib": round(e.total_gb, 3),
                "allocator_gib": round(e.allocator_bytes / 2**30, 3),
                "reserved_gib": round(e.reserved_bytes / 2**30, 3),
                "peak_phase": e.peak_phase,
                "phases_gib": {k: round(v / 2**30, 3) for k, v in e.phases.items()},
                "components_gib": {k: round(v / 2**30, 3) for k, v in e.components.items()},
                "host_ram_gib_per_node": round(e.host_ram_gb_per_node, 3),
                "fits": e.fits,
                "reason": e.reason,
                **(self.predictions[e.candidate.label].as_dict() if e.candidate.label in self.predictions else {}),
            }

        s = self.shape
        return {
            "model": {
                "family": s.family,
                "total_params": s.total_params,
                "trainable_params": self.workload.phi,
                "hidden_size": s.hidden_size,
                "layers": s.num_layers,
                "heads": s.num_heads,
                "kv_heads": s.num_kv_heads,
                "vocab_size": s.vocab_size,
                "largest_layer_params": s.largest_layer_params,
                "count_source": s.source,
            },
            "limits": {
                "gpu_memory_gib": self.gpu_memory_gb,
                "host_memory_gib": self.host_memory_gb,
                "headroom": HEADROOM,
            },
            "activations": self.activations,
            "candidates": [est(e) for e in self.choice.estimates],
            "selected": est(self.selected) if self.selected else None,
            "auto": self.auto,
            "reason": self.choice_reason,
            "speed_reason": self.speed_reason,
            "suggestions": self.suggestions,
        }
