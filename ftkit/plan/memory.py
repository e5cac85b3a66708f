"""Per-GPU (and per-node host) memory of a fine-tuning run, for every ZeRO stage and offload choice.

The planner calls :func:`estimate_all` for a :class:`Workload`, then :func:`choose` picks the fastest candidate
that fits (in the order of docs/design.md, Memory planning) and gives every other one a reason; :func:`suggestions`
says what would make a run fit when nothing does. :func:`rank_partition` gives the exact per-rank element counts
DeepSpeed allocates, which a test checks against a real 2-process run.

Notation (ZeRO paper): Ψ parameters in the model (base + LoRA adapters), Φ trainable parameters (Ψ for full
fine-tuning, the adapters for LoRA), N ranks (world size), g ranks per node, k bytes per 16-bit value (2 for
bf16/fp16, 4 when training in fp32), L DeepSpeed's "largest layer" (``ModelShape.largest_layer_params``).

Model states per GPU, Adam, bytes (ZeRO paper for mixed precision, full fine-tuning: stage 0 16Ψ, stage 1
4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N). ftkit counts the same terms plus the fp32 gradient partition
DeepSpeed materialises for the optimizer step (4 bytes per trainable parameter; DeepSpeed's own estimators count
it too, the paper treats it as transient):

=========  ===================  =====================  ==========================  ==========================
stage      weights (k-bit)      gradients (k-bit)      optimizer: fp32 master 4 +  stage-3 working set
                                                       Adam m,v 8 + fp32 grad 4
=========  ===================  =====================  ==========================  ==========================
0          kΨ                   kΦ                     16Φ (fp32 training: 8Φ)     –
1          kΨ                   kΦ                     16Φ/N                        –
2          kΨ                   kΦ/N                   16Φ/N                        –
3          kΨ/N                 kΦ/N                   16Φ/N                        2kL + k·prefetch bucket
=========  ===================  =====================  ==========================  ==========================

So full fine-tuning in bf16 costs 2Ψ+2Ψ+16Ψ/N at stage 1, 2Ψ + 18Ψ/N at stage 2 (exactly DeepSpeed's
``estimate_zero2_model_states_mem_needs``) and 20Ψ/N + 4L at stage 3. Offloading the optimizer moves the
optimizer column and the stage-2/3 gradient partition to host RAM (stage 1/2 also keep a pinned k-bit staging
copy of the partition there); offloading parameters (stage 3) moves the weight partition. NVMe offload keeps the
fp32 states (or the parameter partitions) on disk and needs pinned swap buffers in RAM.

On top of model states ftkit counts what DeepSpeed's estimators leave out, and takes the peak over the phases of a
step, not the sum of everything (measured on an H200: the sum made ftkit 44-57% high):

* activations and the loss's temporaries from the model's :class:`~ftkit.plan.profile.Profile`: traced from the real
  HF model (bytes autograd saves, the most bytes live at once in forward and backward), or the closed form counted
  for HF decoders with SDPA (``ftkit.plan.profile``). At ZeRO-3 with LoRA the profile is traced with DeepSpeed's
  ZeRO-3 linear, which keeps the inputs of frozen layers too.
* the phases: **forward/backward** (weights, the gradient buffers that exist before backward, the optimizer's
  resident states, stage 3's gathered layer and prefetch, buckets, the activation peak, the largest gradient tensor
  before its hook takes it), the **end of backward** (all gradients, no activations) and the **optimizer step**
  (weights, gradients, states and the step's fp32 gradient partition). The allocator peak is the largest.
* communication buckets: stage 1/2 gradient reduction buffers ``k·reduce_bucket_size`` (two with overlap_comm,
  DeepSpeed double-buffers them); stage 3 one ``k·reduce_bucket_size`` buffer. ``allgather_bucket_size`` costs
  nothing: DeepSpeed gathers straight into its flat parameter buffer with ``all_gather_into_tensor``.
* **reserved**: PyTorch's caching allocator holds more than it hands out (:data:`RESERVED_FACTOR` of the allocator
  peak, measured), and the **device total** adds the CUDA context, cuBLAS workspace and NCCL buffers
  (:data:`CONTEXT_BYTES`, measured). ``fits`` is decided on the device total.

Host RAM per node is the larger of two moments that do not overlap: loading (each of the g local ranks
materialises the weights, ``g·load_bytes·Ψ``; at stage 3 under zero.Init one layer at a time, ``g·load_bytes·L``,
as DeepSpeed's estimator assumes) and training (g × the per-rank offloaded states and buffers).

Everything here is arithmetic: no torch, no DeepSpeed (import-light controller).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from ftkit.model.shape import ModelShape, TensorSpec
from ftkit.plan.profile import Profile, closed_form
from ftkit.recipe.rules import offload_problems

GiB = 1024**3

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OFFLOAD_TARGETS = ("none", "cpu", "nvme")

# Measured on an H200 (tests/plan/data/h200-2026-11-27.json, from ../shared/gpu/measurements-2026-11-27.json): the
# caching allocator's reserved peak was 1.093, 1.125 and 1.059 x its allocated peak (ZeRO-2, ZeRO-3, LoRA ZeRO-3), and
# nvidia-smi showed 1.29-1.67 GiB more than reserved (CUDA context, cuBLAS workspace, NCCL buffers).
RESERVED_FACTOR = 1.09
CONTEXT_BYTES = int(1.45 * GiB)
# FSDP2's device total was 1.1 GiB above ZeRO-2's on the same model (16.26 against 15.17 GiB) though it holds less
# (fp32 parameters but no 16-bit copy); not explained by the allocator model (no allocator numbers were read for it):
# an allowance of 4 bytes per parameter it updates (its fp32 gradients' size) until measured (docs/accuracy.md).
FSDP2_ALLOWANCE_PER_PARAM = 4

# DeepSpeed defaults used by the NVMe and sub-group terms (deepspeed/runtime/zero/offload_config.py, config.py).
SUB_GROUP_SIZE = 1_000_000_000
NVME_OPTIMIZER_BUFFER_COUNT = 4  # offload_optimizer.buffer_count
NVME_PARAM_BUFFER_COUNT = 5  # offload_param.buffer_count
NVME_PARAM_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size (elements)

# ------------------------------------------------------------------------------------------------ candidates


def zero_label(stage: int, offload_optimizer: str = "none", offload_params: str = "none") -> str:
    """How ftkit names a ZeRO configuration everywhere (plan tables, launch summaries, ftkit init's note):
    ``ZeRO-3 + optimizer offload (cpu) + param offload (cpu)``."""
    parts = [f"ZeRO-{stage}"]
    if offload_optimizer != "none":
        parts.append(f"optimizer offload ({offload_optimizer})")
    if offload_params != "none":
        parts.append(f"param offload ({offload_params})")
    return " + ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """One ZeRO configuration: stage plus where the optimizer states and (stage 3) the parameters live."""

    stage: int
    offload_optimizer: str = "none"
    offload_params: str = "none"

    def __post_init__(self) -> None:
        # These are invariants of candidates ftkit builds itself; recipe mistakes are reported by the recipe loader.
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {self.stage}")
        if self.offload_optimizer not in OFFLOAD_TARGETS or self.offload_params not in OFFLOAD_TARGETS:
            raise ValueError(f"offload targets must be one of {OFFLOAD_TARGETS}")
        problems = offload_problems(self.stage, self.offload_optimizer, self.offload_params)
        if problems:
            raise ValueError(problems[0][1])

    @property
    def label(self) -> str:
        return zero_label(self.stage, self.offload_optimizer, self.offload_params)

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class Fsdp2(Candidate):
    """PyTorch FSDP2 (``train.backend: fsdp2``). Memory on ZeRO's model of the same sharding: resharding after
    forward holds ZeRO-3's memory; without it the gathered parameters stay from forward to backward (ZeRO-2's peak);
    parameter offload keeps parameters, gradients and optimizer states in host memory (ZeRO-3 with both offloads).
    Traffic is FSDP2's own, by unit (measured: :func:`ftkit.plan.comm.fsdp2_units`)."""

    @property
    def label(self) -> str:
        name = "FSDP2" if self.stage == 3 else "FSDP2 (no reshard after forward)"
        return name + (" + offload (cpu)" if self.offload_params != "none" else "")


def fsdp2_candidate(reshard_after_forward: bool, offload_params: bool) -> Fsdp2:
    """The FSDP2 candidate of the ``fsdp`` section's two memory choices."""
    if offload_params:
        return Fsdp2(3, "cpu", "cpu")
    return Fsdp2(3 if reshard_after_forward else 2)


def fsdp2_candidates(include_offload: bool = True) -> list[Candidate]:
    """Every FSDP2 candidate, fastest first (offload only where there is device memory to save: cuda)."""
    out: list[Candidate] = [fsdp2_candidate(False, False), fsdp2_candidate(True, False)]
    return out + ([fsdp2_candidate(True, True)] if include_offload else [])


def candidates(include_stage0: bool = False, include_nvme: bool = True) -> list[Candidate]:
    """All candidates, fastest first (docs/design.md, Memory planning): ZeRO-1 → ZeRO-2 → ZeRO-2 + optimizer
    offload → ZeRO-3 → ZeRO-3 + optimizer offload → ZeRO-3 + param offload (with the optimizer offloaded too, the
    usual pairing), then the NVMe variants, slowest of all.

    Stage 0 (plain data parallel) is optional: with several ranks ZeRO-1 costs the same communication and less
    memory, so it only wins for a single rank.
    """
    order = [
        Candidate(1),
        Candidate(2),
        Candidate(2, "cpu"),
        Candidate(3),
        Candidate(3, "cpu"),
        Candidate(3, "cpu", "cpu"),
    ]
    if include_stage0:
        order.insert(0, Candidate(0))
    if include_nvme:
        order += [Candidate(3, "nvme"), Candidate(3, "nvme", "cpu"), Candidate(3, "nvme", "nvme")]
    return order


# ------------------------------------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Workload:
    """Everything the estimate depends on besides the candidate. Bucket sizes are elements, as in ds_config."""

    shape: ModelShape
    world_size: int = 1  # N: total ranks
    gpus_per_node: int = 1  # g: ranks per node
    micro_batch_size: int = 1  # b: sequences per rank per step
    seq_len: int = 2048  # s: tokens per sequence
    precision: str = "bf16"  # bf16 | fp16 | fp32
    lora_params: int | None = None  # trainable adapter parameters; None = full fine-tuning
    gradient_checkpointing: bool = False
    eager_attention: bool = False  # attention materialises the s×s scores (config.json's attn_implementation eager)
    reduce_bucket_size: int | None = None  # None: h² (docs/design.md, Rendering rules)
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int | None = None  # None: int(0.9·h²)
    stage3_max_live_parameters: int = 1_000_000_000
    overlap_comm: bool | None = None  # None: docs/design.md, Rendering rules (true at stage 3, false at 1/2)
    pin_memory: bool = True  # offloaded states in page-locked host memory
    load_bytes_per_param: int | None = None  # bytes per weight while loading; None: k (loaded in training dtype)
    grad_accum: int = 1  # micro-steps per optimizer step (gradients some engines hold across them)
    accelerator: str = "cuda"  # cuda | cpu: a CPU rank has no CUDA context nor caching allocator
    profile: Profile | None = None  # activations and work per micro-step (None: the closed form, ftkit.plan.profile)
    profile_zero3: Profile | None = None  # LoRA at DeepSpeed ZeRO-3 (its linear keeps frozen layers' inputs)
    lora_dropout: float = 0.0
    # parallel.tp / parallel.sp: tensor- and sequence-parallel degrees (ftkit.plan.parallel). With tp > 1 the
    # ZeRO/FSDP2 states shard over world_size / tp data-parallel ranks, each holding 1/tp of every layer; with sp > 1
    # each rank holds seq_len / sp tokens of every sequence (ZeRO still shards over every rank, as DeepSpeed's ALST)
    tp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {self.precision!r}")
        for name in ("world_size", "gpus_per_node", "micro_batch_size", "seq_len", "tp", "sp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def k(self) -> int:
        """Bytes per weight/gradient value in the training dtype."""
        return PRECISION_BYTES[self.precision]

    @property
    def psi(self) -> int:
        """Ψ: parameters held by the model, adapters included."""
        return self.shape.total_params + (self.lora_params or 0)

    @property
    def phi(self) -> int:
        """Φ: trainable parameters."""
        return self.lora_params if self.lora_params is not None else self.shape.total_params

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.world_size / self.gpus_per_node)

    @property
    def local_ranks(self) -> int:
        """Ranks on one node (the last node may be partial; size for the full ones)."""
        return min(self.gpus_per_node, self.world_size)

    def reduce_bucket(self) -> int:
        return self.reduce_bucket_size if self.reduce_bucket_size is not None else self.shape.hidden_size**2

    def prefetch_bucket(self) -> int:
        if self.stage3_prefetch_bucket_size is not None:
            return self.stage3_prefetch_bucket_size
        return int(0.9 * self.shape.hidden_size**2)

    def overlap(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    def profile_for(self, c: Candidate) -> Profile:
        """The activation profile the candidate's engine runs: ZeRO-3's own for LoRA under DeepSpeed stage 3."""
        if c.stage == 3 and not isinstance(c, Fsdp2) and self.lora_params is not None and self.profile_zero3:
            return self.profile_zero3
        if self.profile is not None:
            return self.profile
        return closed_form(
            self.shape,
            self.k,
            gradient_checkpointing=self.gradient_checkpointing,
            eager_attention=self.eager_attention,
            lora_dropout=self.lora_dropout,
            why="no profile given",
        )


# ------------------------------------------------------------------------------------------------ the estimate


@dataclass(frozen=True)
class Estimate:
    """Memory of one candidate: bytes per GPU by component, host RAM per node, and the verdict.

    ``fits``/``reason`` are filled in by :func:`judge` (or :func:`choose`) against a machine's limits.
    Sizes in GiB (2**30 bytes); ``components`` and ``host_components`` in bytes.
    """

    candidate: Candidate
    components: dict[str, int]  # the device total by component, at the phase that peaks (+ reserved, context)
    host_components: dict[str, int]
    pinned_bytes_per_node: int = 0  # the part of the offload terms that is page-locked (cannot be swapped out)
    nvme_bytes_per_node: int = 0
    fits: bool = True
    reason: str = ""
    notes: tuple[str, ...] = field(default=(), compare=False)
    # model states as DeepSpeed's estimators count them (weights, gradient and fp32 partitions, stage 3's gathered
    # largest layer), whatever the phase; and the allocator's bytes at each phase of a step
    states: dict[str, int] = field(default_factory=dict, compare=False)
    phases: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def total_bytes(self) -> int:
        """The device total: what nvidia-smi shows at the peak (allocator peak + reserved + CUDA context)."""
        return sum(self.components.values())

    @property
    def allocator_bytes(self) -> int:
        """``torch.cuda.max_memory_allocated()``'s prediction: the largest phase."""
        return max(self.phases.values()) if self.phases else self.total_bytes

    @property
    def reserved_bytes(self) -> int:
        """``torch.cuda.max_memory_reserved()``'s prediction."""
        return self.allocator_bytes + self.components.get("reserved", 0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k]) if self.phases else ""

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GiB

    @property
    def model_states_bytes(self) -> int:
        """Weights + gradients + optimizer states (+ stage 3's gathered largest layer): what DeepSpeed estimates."""
        c = self.states or self.components
        return c["weights"] + c["gradients"] + c["optimizer_states"] + c["largest_layer"]

    @property
    def host_ram_bytes_per_node(self) -> int:
        h = self.host_components
        return max(h.get("load_peak", 0), sum(v for key, v in h.items() if key != "load_peak"))

    @property
    def host_ram_gb_per_node(self) -> float:
        return self.host_ram_bytes_per_node / GiB

    @property
    def pinned_gb_per_node(self) -> float:
        return self.pinned_bytes_per_node / GiB

    @property
    def nvme_gb_per_node(self) -> float:
        return self.nvme_bytes_per_node / GiB

    def summary(self) -> str:
        parts = ", ".join(f"{key} {value / GiB:.2f}" for key, value in self.components.items() if value)
        host = self.host_ram_gb_per_node
        return f"{self.candidate.label}: {self.total_gb:.1f} GiB/GPU ({parts}); host {host:.1f} GiB/node"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _flat_partition(numel: int, world_size: int) -> int:
    """Stage 1/2: DeepSpeed pads a flat group to a multiple of 2·N (nccl_start_alignment_factor × N), splits evenly."""
    alignment = 2 * world_size
    return _ceil_div(numel, alignment) * alignment // world_size


def tp_activation_share(shape: ModelShape, tp: int) -> float:
    """The share of a layer's saved activations one of ``tp`` tensor-parallel ranks keeps. Of HF Llama's
    s·b·(24h + 8I) bytes per layer (docs/design.md, Memory planning), the two norms' inputs and the residual stream,
    about 8h, stay whole on every rank; the attention and MLP insides, 16h + 8I, split (an estimate from the counts,
    not measured under TP)."""
    h, i = shape.hidden_size, shape.intermediate_size or 4 * shape.hidden_size
    whole, split = 8 * h, 16 * h + 8 * i
    return (whole + split / tp) / (whole + split)


def activation_bytes(w: Workload, c: Candidate | None = None) -> int:
    """Bytes autograd keeps from forward to backward (the profile's ``saved``), per GPU."""
    prof = w.profile_for(c or Candidate(2))
    return prof.activation_bytes(w.seq_len, w.micro_batch_size)


def activation_peak_bytes(w: Workload, c: Candidate | None = None) -> int:
    """The most bytes live at once in forward or backward besides the model states: activations, the loss's fp32
    logits and cross-entropy temporaries, the gradients of activations (the profile's ``peak``)."""
    prof = w.profile_for(c or Candidate(2))
    return prof.peak_bytes(w.seq_len, w.micro_batch_size)


def logits_bytes(w: Workload, c: Candidate | None = None) -> int:
    """What the peak holds beyond the saved activations: mostly the loss's fp32 logits and temporaries."""
    return max(0, activation_peak_bytes(w, c) - activation_bytes(w, c))


def estimate(c: Candidate, w: Workload) -> Estimate:
    """Bytes per GPU and per node for candidate ``c`` (formulas in the module docstring)."""
    k, n, g = w.k, w.world_size, w.local_ranks
    psi, phi = w.psi, w.phi
    L = w.shape.largest_layer_params  # noqa: N806 - the paper's symbol
    tp = w.tp
    if tp > 1:  # each rank holds 1/tp of every layer; ZeRO/FSDP2 shard that over the data-parallel ranks
        n, psi, phi, L = w.world_size // tp, _ceil_div(psi, tp), _ceil_div(phi, tp), _ceil_div(L, tp)  # noqa: N806
    full_ft = w.lora_params is None
    mixed = k == 2
    opt_on_gpu = c.offload_optimizer == "none"
    fsdp = isinstance(c, Fsdp2)
    ga = w.grad_accum

    # per-rank element counts, padded as DeepSpeed pads them (rank_partition has the exact per-tensor version)
    if c.stage == 3:
        tensors = w.shape.tensors if tp == 1 else ()
        base = _stage3_partition(tensors, n) if tensors else _ceil_div(_ceil_div(w.shape.total_params, tp), n)
        adapters = 0 if full_ft else _ceil_div(phi, n)  # adapter tensors are small: one ceil for all of them
        part_psi = base + adapters
        part_phi = base if full_ft else adapters
    else:
        part_psi = psi
        part_phi = phi if c.stage == 0 else _flat_partition(phi, n)

    host: dict[str, int] = {}
    nvme = 0
    notes: list[str] = []

    # weights resident on the GPU: FSDP2 keeps fp32 masters as its (sharded) parameters (Accelerate upcasts them)
    if fsdp:
        weights = 4 * part_psi if c.offload_params == "none" else 0
    elif c.stage < 3:
        weights = k * psi
    else:
        weights = k * part_psi if c.offload_params == "none" else 0

    # optimizer states resident on the GPU: fp32 master + exp_avg + exp_avg_sq (FSDP2: Adam's two, its parameters are
    # the masters); stage 0's bf16 optimizer also keeps fp32 gradients; plain Adam in fp32 training has no master copy
    if not opt_on_gpu:
        resident_opt, step_tmp = 0, 0
    elif fsdp:
        resident_opt, step_tmp = 8 * part_phi, 0  # torch's fused AdamW: no temporaries
    elif c.stage == 0:
        resident_opt, step_tmp = (16 if mixed else 8) * phi, 0
    else:
        resident_opt, step_tmp = 12 * part_phi, 4 * part_phi  # + the fp32 gradient partition the step makes

    # gradients: those that exist when backward starts (kept across micro-steps, or a persistent buffer), and all of
    # them at its end. Stage 0/1 keep param.grad; stage 2 a partition (reduced every micro-step); stage 3 a flat
    # partition buffer for its whole life; FSDP2 fp32 sharded gradients, unsharded across gradient accumulation
    # (Accelerate's no_sync). With optimizer offload the partitions are on the host.
    if fsdp:
        grads_end = 4 * part_phi if c.offload_params == "none" else 0
        grads_start = k * phi if ga > 1 else 0
        grads_end = max(grads_end, grads_start)
    elif c.stage <= 1:
        grads_end = k * phi
        grads_start = k * phi if ga > 1 and c.stage == 1 else 0
    elif c.stage == 2:
        grads_end = k * part_phi if opt_on_gpu else 0
        grads_start = grads_end if ga > 1 else 0
    else:
        grads_end = grads_start = k * part_phi if opt_on_gpu else 0

    # stage 3 (and FSDP2 resharding after forward): the largest layer gathered whole (params + grads), plus the
    # prefetched parameters; FSDP2 without resharding keeps every unit's 16-bit parameters from forward to backward
    if fsdp and c.stage == 2:
        largest, prefetch = k * psi, 0
    elif c.stage == 3:
        largest = 2 * k * L
        live_budget = max(0, w.stage3_max_live_parameters - L)
        prefetch = k * min(w.prefetch_bucket(), live_budget, max(0, psi - L))
    else:
        largest = prefetch = 0
    # stage 1/2 double-buffer the gradient reduction bucket with overlap_comm; stage 3 keeps one (stage3.py)
    buckets = 0 if fsdp else k * w.reduce_bucket() * (2 if c.stage in (1, 2) and w.overlap(c.stage) else 1)
    allowance = FSDP2_ALLOWANCE_PER_PARAM * part_phi if fsdp and w.accelerator != "cpu" else 0

    prof = w.profile_for(c)
    s_, b_ = w.seq_len // w.sp, w.micro_batch_size  # sequence parallelism: the rank's share of every sequence
    saved = prof.activation_bytes(s_, b_)
    peak = max(saved, prof.peak_bytes(s_, b_))
    if tp > 1:  # tensor parallelism splits the layers' inner activations; the loss's logits stay whole
        kept = int(saved * tp_activation_share(w.shape, tp))
        peak, saved = peak - (saved - kept), kept
    first_grad = prof.largest_grad_bytes if full_ft else 0
    fixed = weights + resident_opt + largest + prefetch + buckets + allowance
    fwd_bwd = fixed + grads_start + peak + first_grad
    bwd_end = fixed + grads_end + int(prof.peak.layer(s_, b_))
    step = weights + resident_opt + step_tmp + grads_end + buckets + allowance
    phases = {"forward/backward": fwd_bwd, "end of backward": bwd_end, "optimizer step": step}
    top = max(phases, key=lambda x: phases[x])
    comp: dict[str, int] = {"weights": weights}
    if top == "forward/backward":
        comp.update(gradients=grads_start + first_grad, optimizer_states=resident_opt)
        comp.update(largest_layer=largest, prefetch=prefetch, activations=saved, logits=peak - saved)
    elif top == "end of backward":
        comp.update(gradients=grads_end, optimizer_states=resident_opt, largest_layer=largest, prefetch=prefetch)
        comp.update(activations=phases[top] - fixed - grads_end, logits=0)
    else:
        comp.update(gradients=grads_end, optimizer_states=resident_opt + step_tmp, largest_layer=0, prefetch=0)
        comp.update(activations=0, logits=0)
    comp["comm_buckets"] = buckets
    if allowance:
        comp["fsdp2_allowance"] = allowance
    cuda = w.accelerator != "cpu"
    comp["reserved"] = int(phases[top] * (RESERVED_FACTOR - 1)) if cuda else 0
    comp["context"] = CONTEXT_BYTES if cuda else 0
    states = {
        "weights": weights if not fsdp else (k * part_psi if c.offload_params == "none" else 0),
        "gradients": (k * phi if c.stage <= 1 else k * part_phi if opt_on_gpu else 0),
        "optimizer_states": (16 if (mixed or c.stage) else 8) * (part_phi if c.stage else phi) if opt_on_gpu else 0,
        "largest_layer": largest,
    }

    # host RAM per node
    load_bytes = w.load_bytes_per_param if w.load_bytes_per_param is not None else k
    host["load_peak"] = g * load_bytes * (L if c.stage == 3 else w.shape.total_params)
    pinned = 0
    if c.offload_optimizer == "cpu":
        per_rank = 16 * part_phi + k * part_phi  # fp32 master, m, v, fp32 grads + k-bit grad/param staging
        host["optimizer_offload"] = g * per_rank
        pinned += g * per_rank if w.pin_memory else 0
    elif c.offload_optimizer == "nvme":
        nvme += g * 12 * part_phi  # fp32 master, m, v swapped to disk
        swap = NVME_OPTIMIZER_BUFFER_COUNT * min(SUB_GROUP_SIZE, part_phi) * 4
        per_rank = swap + (4 + k) * part_phi  # swap buffers, fp32 + k-bit gradient partitions
        host["optimizer_swap"] = g * per_rank
        pinned += g * swap
        notes.append("NVMe swap buffers sized from DeepSpeed defaults (buffer_count 4, sub_group_size 1e9)")
    if c.offload_params == "cpu":
        host["param_offload"] = g * k * part_psi
        pinned += g * k * part_psi if w.pin_memory else 0
    elif c.offload_params == "nvme":
        nvme += g * k * part_psi
        swap = NVME_PARAM_BUFFER_COUNT * NVME_PARAM_BUFFER_SIZE * k
        host["param_swap"] = g * swap
        pinned += g * swap
    return Estimate(
        c,
        comp,
        host,
        pinned_bytes_per_node=pinned,
        nvme_bytes_per_node=nvme,
        notes=tuple(notes),
        states=states,
        phases=phases,
    )


def estimate_all(w: Workload, cands: Iterable[Candidate] | None = None) -> list[Estimate]:
    """Estimates for ``cands`` (default: :func:`candidates`), in that order."""
    return [estimate(c, w) for c in (cands if cands is not None else candidates())]


# ------------------------------------------------------------------------------------------------ choosing


def judge(est: Estimate, gpu_memory_gb: float, host_memory_gb: float | None, headroom: float = 0.1) -> Estimate:
    """Set ``fits``/``reason`` for one estimate: GPU total and host RAM must stay below (1 − headroom) × capacity.

    ``host_memory_gb`` None skips the host check (unknown machine). NVMe capacity is not checked here: ftkit does
    not know the disk; the plan prints ``nvme_gb_per_node``.
    """
    gpu_limit = gpu_memory_gb * (1 - headroom)
    problems = []
    if est.total_gb > gpu_limit:
        problems.append(
            f"needs {est.total_gb:.1f} GiB per GPU, limit {gpu_limit:.1f} GiB "
            f"({gpu_memory_gb:g} GiB less {headroom:.0%} headroom)"
        )
    if host_memory_gb is not None:
        host_limit = host_memory_gb * (1 - headroom)
        if est.host_ram_gb_per_node > host_limit:
            problems.append(f"needs {est.host_ram_gb_per_node:.1f} GiB host RAM per node, limit {host_limit:.1f} GiB")
    if problems:
        return replace(est, fits=False, reason="; ".join(problems))
    return replace(est, fits=True, reason=f"fits: {est.total_gb:.1f} of {gpu_limit:.1f} GiB per GPU")


@dataclass(frozen=True)
class Choice:
    """Result of :func:`choose`: the chosen estimate (None if nothing fits) and every estimate with its reason."""

    chosen: Estimate | None
    estimates: tuple[Estimate, ...]

    @property
    def rejected(self) -> list[tuple[Candidate, str]]:
        """Candidates ranked before the chosen one (or all, if none fits) and why each was rejected."""
        out = []
        for est in self.estimates:
            if self.chosen is not None and est.candidate == self.chosen.candidate:
                break
            out.append((est.candidate, est.reason))
        return out


def choose(
    estimates: Sequence[Estimate], gpu_memory_gb: float, host_memory_gb: float | None, headroom: float = 0.1
) -> Choice:
    """The first estimate (in the order given: fastest first) that fits; every other one gets a reason.

    Candidates after the chosen one are "not needed", not rejected: they may fit too, but are slower.
    """
    judged = [judge(e, gpu_memory_gb, host_memory_gb, headroom) for e in estimates]
    chosen = next((e for e in judged if e.fits), None)
    out = []
    passed = False
    for e in judged:
        if chosen is not None and e.candidate == chosen.candidate:
            out.append(replace(e, reason=f"chosen: fastest option that fits ({e.reason.removeprefix('fits: ')})"))
            passed = True
        elif passed and chosen is not None:  # passed: chosen was met
            out.append(replace(e, reason=f"not needed: {chosen.candidate.label} is faster and fits"))
        else:
            out.append(e)
    chosen = next((e for e in out if chosen is not None and e.candidate == chosen.candidate), None)
    return Choice(chosen, tuple(out))


def largest_fitting_micro_batch(w: Workload, fits: Callable[[Workload], bool]) -> int:
    """The largest micro batch below ``w.micro_batch_size`` for which ``fits`` holds, 0 if not even 1 does. Memory
    grows with the micro batch, so a bisection finds it in log2(micro batch) tries (trying every smaller one took
    minutes for ``train.micro_batch_size=1000000``)."""
    if w.micro_batch_size <= 1 or not fits(replace(w, micro_batch_size=1)):
        return 0
    lo, hi = 1, w.micro_batch_size  # lo fits; hi is not known to
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(replace(w, micro_batch_size=mid)) else (lo, mid)
    return lo


def suggestions(
    w: Workload,
    gpu_memory_gb: float,
    host_memory_gb: float | None,
    headroom: float = 0.1,
    lora_params: int | None = None,
    max_nodes: int = 64,
) -> list[str]:
    """What would make some candidate fit, one change at a time (empty list if something fits already).

    Tried in this order: gradient checkpointing, a smaller micro batch (keep the global batch with more gradient
    accumulation), more nodes (up to ``max_nodes``), LoRA (``lora_params`` trainable, when given and the run is
    a full fine-tune), a shorter sequence.
    """

    def best(v: Workload) -> Estimate | None:
        return choose(estimate_all(v), gpu_memory_gb, host_memory_gb, headroom).chosen

    if best(w) is not None:
        return []
    out: list[str] = []
    if not w.gradient_checkpointing:
        e = best(replace(w, gradient_checkpointing=True))
        if e:
            out.append(f"enable gradient checkpointing (model.gradient_checkpointing: true): {e.summary()}")
    mb = largest_fitting_micro_batch(w, lambda v: best(v) is not None)
    if mb:
        e = best(replace(w, micro_batch_size=mb))
        assert e is not None  # largest_fitting_micro_batch saw it fit
        out.append(
            f"lower train.micro_batch_size to {mb} (raise gradient accumulation to keep the global batch): "
            f"{e.summary()}"
        )
    for nodes in range(w.num_nodes + 1, max_nodes + 1):
        v = replace(w, world_size=nodes * w.gpus_per_node)
        e = best(v)
        if e:
            out.append(f"use {nodes} nodes ({v.world_size} GPUs): {e.summary()}")
            break
    if lora_params is not None and w.lora_params is None:
        e = best(replace(w, lora_params=lora_params))
        if e:
            out.append(f"fine-tune with LoRA ({lora_params:,} trainable parameters) instead: {e.summary()}")
    for seq in (w.seq_len // 2, w.seq_len // 4):
        if seq >= 128:
            e = best(replace(w, seq_len=seq))
            if e:
                out.append(f"shorten data.max_seq_len to {seq}: {e.summary()}")
                break
    if not out:
        # no single change is enough: stack them, cheapest first, and say how far that gets
        v = w
        steps = []
        stack: list[tuple[str, Callable[[Workload], Workload]]] = [
            ("gradient checkpointing", lambda x: replace(x, gradient_checkpointing=True)),
            ("micro batch 1", lambda x: replace(x, micro_batch_size=1)),
        ]
        if lora_params is not None and w.lora_params is None:
            stack.append((f"LoRA ({lora_params:,} trainable)", lambda x: replace(x, lora_params=lora_params)))
        for label, change in stack:
            v = change(v)
            steps.append(label)
            e = best(v)
            if e:
                out.append(f"combine {' + '.join(steps)}: {e.summary()}")
                return out
        for nodes in range(w.num_nodes + 1, max_nodes + 1):
            e = best(replace(v, world_size=nodes * w.gpus_per_node))
            if e:
                out.append(f"combine {' + '.join(steps)} + {nodes} nodes: {e.summary()}")
                return out
        out.append("nothing fits even with all of: " + ", ".join(steps) + f", {max_nodes} nodes; use larger GPUs")
    return out


# ------------------------------------------------------------------------------------------------ exact per rank


@dataclass(frozen=True)
class RankPartition:
    """Elements one rank holds, as DeepSpeed allocates them (every rank holds the same counts).

    ``param_partition`` is the k-bit parameters a rank keeps between forward passes: its ZeRO-3 partition
    (Σ ``param.ds_tensor.numel()``), or the whole model below stage 3.
    """

    fp32_master: int
    exp_avg: int
    exp_avg_sq: int
    param_partition: int


def _stage3_partition(numels: Iterable[int] | Iterable[TensorSpec], world_size: int) -> int:
    """ZeRO-3 partitions every tensor on its own: ⌈numel/N⌉ elements per rank (the last rank's tail is padding)."""
    total = 0
    for t in numels:
        total += _ceil_div(t.numel if isinstance(t, TensorSpec) else t, world_size)
    return total


def rank_partition(
    stage: int, world_size: int, trainable_groups: Sequence[Sequence[int]], frozen: Sequence[int] = ()
) -> RankPartition:
    """Per-rank element counts of fp32 master weights, Adam's exp_avg/exp_avg_sq and the parameter partition.

    ``trainable_groups``: the optimizer's param groups, each a list of trainable tensor sizes (HF Trainer makes
    two: with and without weight decay, see :func:`trainer_param_groups`); ``frozen``: sizes of frozen tensors.

    DeepSpeed 0.19's partitioning, read from its source:

    * stage 1/2 (``stage_1_and_2.py``): each group is flattened and padded up to a multiple of
      ``nccl_start_alignment_factor (2) × N``, then split into N equal partitions; the fp32 master partition and
      Adam's states have that size. (``zero_optimization.parameter_alignment`` is off by default; it would pad
      every tensor too.) Parameters stay whole on every rank.
    * stage 3 (``partition_parameters.py``, ``stage3.py``): each parameter is padded to a multiple of N and split,
      so a rank holds ⌈numel/N⌉ of every tensor; the fp32 master partition is the sum over trainable tensors.
    * stage 0: nothing is partitioned.
    """
    trainable = [n for group in trainable_groups for n in group]
    if stage == 0:
        master = sum(trainable)
        params = master + sum(frozen)
    elif stage in (1, 2):
        master = sum(_flat_partition(sum(group), world_size) for group in trainable_groups if sum(group))
        params = sum(trainable) + sum(frozen)
    elif stage == 3:
        master = _stage3_partition(trainable, world_size)
        params = master + _stage3_partition(frozen, world_size)
    else:
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    return RankPartition(fp32_master=master, exp_avg=master, exp_avg_sq=master, param_partition=params)


# HF Trainer's get_decay_parameter_names: no weight decay for biases and normalisation weights
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def trainer_param_groups(tensors: Iterable[TensorSpec] | Iterable[tuple[str, int]]) -> list[list[int]]:
    """Split trainable tensors into HF Trainer's two optimizer groups (weight decay / none), dropping empty ones.

    Accepts ``TensorSpec``s or ``(name, numel)`` pairs. ZeRO pads each group separately, so the grouping changes
    stage 1/2 counts by up to 2N−1 elements per group.
    """
    decay: list[int] = []
    no_decay: list[int] = []
    for t in tensors:
        name, numel = (t.name, t.numel) if isinstance(t, TensorSpec) else t
        (no_decay if no_weight_decay(name) else decay).append(numel)
    return [g for g in (decay, no_decay) if g]


def no_weight_decay(name: str) -> bool:
    """True for parameters HF Trainer puts in its no-weight-decay group (biases, norm weights)."""
    return any(p.search(name.lower()) for p in _NO_DECAY)
