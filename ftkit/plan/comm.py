"""Communication and step time per optimizer step, for every ZeRO candidate (docs/design.md, Communication model).

Bytes are predicted **in the unit DeepSpeed's comms logger reports** (``deepspeed.comm.comms_logger.comms_dict``):
the message size of each call, i.e. the tensor DeepSpeed hands to the collective — the whole bucket for
``all_reduce`` and ``reduce_scatter_tensor``, the per-rank *input* for ``all_gather_into_tensor`` — summed over the
calls of one optimizer step on one rank. Notation: Ψ parameters, Φ trainable, N ranks, G ranks per node, GA
micro-steps per optimizer step, b bytes per element on the wire (the training dtype: DeepSpeed's
``communication_data_type`` defaults to it), ⌈x⌉_N = N·⌈x/N⌉ (ZeRO-3 pads every tensor to a multiple of N).
What DeepSpeed 0.19 does (read in ``runtime/zero/stage_1_and_2.py`` and ``stage3.py``, and measured on 2 CPU ranks
by tests/integration/plan/test_comm_measured.py; tests/plan/test_comm.py pins the logged numbers):

==========  =====================================================  =============================================
stage       gradients                                             parameters
==========  =====================================================  =============================================
0           all_reduce bΦ once per optimizer step                 –
1           all_reduce bΦ once per optimizer step (at the         all_gather_into_tensor bΦ/N once per step
            boundary: gradients accumulate unreduced)             (the updated partition)
2           all_reduce bΦ every micro-step (GA×)                  all_gather_into_tensor bΦ/N once per step
3           reduce_scatter_tensor b·Σ⌈numel⌉_N every micro-step   all_gather_into_tensor b·Σ⌈numel/N⌉ of the
            (trainable tensors only)                              non-persistent tensors every micro-step in
                                                                  forward (and again in backward for those
                                                                  last used further back than
                                                                  stage3_max_reuse_distance elements); the
                                                                  persistent ones (numel ≤ stage3_param_
                                                                  persistence_threshold) once per step, after
                                                                  the optimizer (``_post_step``)
==========  =====================================================  =============================================

plus one small all_reduce per step (the gradient norm: 4 bytes at stage 1/2, 8 at stage 3). LoRA: Φ is the
adapters, frozen weights are still gathered at stage 3. ZeRO++ (stage 3, across nodes): hpZ keeps a secondary
partition per node so the backward gather stays inside the node (+bΨ/G memory); qwZ gathers int8 weights
(1 byte per element plus a 4-byte scale per 2048); qgZ replaces the reduce-scatter with a hierarchical int4
all-to-all (0.5Φ intra-node, 0.5Φ/G across nodes). ZeRO++ is not measured here (its kernels need CUDA): those
volumes follow the ZeRO++ paper.

FSDP2 (``train.backend: fsdp2``, Accelerate 1.15's ``fully_shard`` layout, measured on 2 CPU ranks under HF Trainer
by tests/integration/plan/test_fsdp2_traffic.py) gathers by unit, not by tensor: each decoder layer, the input
embedding (untied), the tail (final norm and LM head, with the embedding when tied; never resharded) and the root's
leftovers. Per micro-step it all-gathers every unit in forward (bΨ) and, resharding after forward, every unit but
the tail and root again in backward; it reduce-scatters each unit's trainable gradients once per optimizer step
(Accelerate's no_sync keeps them unsharded across the micro-steps of gradient accumulation).

Time: a collective of logger size M on n ranks moves M·f bus bytes, f = 2(n−1)/n for all-reduce, (n−1)/n for
reduce-scatter (input size) and (n−1) for all-gather (M is one rank's input; NCCL's busbw convention), at the bus
bandwidth of the slowest link it crosses (a group spanning nodes is limited by min(intra per GPU, inter per node):
NCCL runs one ring per NIC), plus a latency per ring step. Compute and host overheads are :mod:`ftkit.plan.speed`'s.
Exposed communication is what does not fit under the compute it can overlap with (see :func:`predict`).

Everything here is arithmetic on the standard library (import-light controller).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypedDict

from ftkit.plan.memory import PRECISION_BYTES, Candidate, Fsdp2, Workload
from ftkit.plan.speed import Calibration, Engine, Parts, gpu_class, step_parts
from ftkit.rundir.env import ftkit_cache
from ftkit.rundir.sections import ClusterSection

# ------------------------------------------------------------------------------------------------ hardware tables

# Dense (no sparsity) peak TFLOP/s in bf16/fp16 per GPU, from the vendors' data sheets; fp32 training uses TF32.
GPU_PEAK_TFLOPS: dict[str, tuple[float, float, str]] = {
    # name: (bf16/fp16 dense, tf32 dense, description)
    "h100": (989.0, 494.0, "H100 SXM"),
    "h100-pcie": (756.0, 378.0, "H100 PCIe"),
    "h200": (989.0, 494.0, "H200 SXM"),
    "a100": (312.0, 156.0, "A100 80GB"),
    "a100-40": (312.0, 156.0, "A100 40GB"),
    "l40s": (362.0, 183.0, "L40S"),
    "a10": (125.0, 62.5, "A10"),
    "l4": (121.0, 60.0, "L4"),
    "v100": (125.0, 15.7, "V100 (fp16 tensor cores; no bf16)"),
    "cpu": (0.2, 0.1, "a CPU rank (gloo; order of magnitude only)"),
}
# by gpu_memory_gb when cluster.gpu is auto (first whose memory is >= the recipe's, within 10%)
_GPU_BY_MEMORY = ((24, "a10"), (40, "a100-40"), (48, "l40s"), (80, "h100"), (141, "h200"))


@dataclass(frozen=True)
class Network:
    """Bus bandwidths (GB/s, 1e9 bytes) and per-step latencies (µs) of the two kinds of link."""

    name: str
    intra_gbs: float  # per GPU, inside a node (NVLink, PCIe)
    inter_gbs: float  # per node, all NICs together
    intra_latency_us: float
    inter_latency_us: float
    source: str = "preset"
    doc: str = ""


# Effective bus bandwidth ≈ 80% of the line rate (what nccl-tests reaches with large messages).
NETWORK_PRESETS: dict[str, Network] = {
    n.name: n
    for n in (
        Network("nvlink-ib400", 360.0, 320.0, 5, 10, doc="NVLink 4 (H100/H200 HGX) + 8 x 400 Gb/s InfiniBand per node"),
        Network("nvlink-ib200", 200.0, 160.0, 5, 10, doc="NVLink 3 (A100 HGX) + 8 x 200 Gb/s InfiniBand per node"),
        Network("nvlink-eth100", 360.0, 10.0, 5, 30, doc="NVLink + one 100 Gb/s Ethernet NIC per node"),
        Network("pcie-ib100", 20.0, 10.0, 10, 10, doc="PCIe 4 through the host + one 100 Gb/s InfiniBand NIC per node"),
        Network("pcie-eth25", 20.0, 2.5, 10, 50, doc="PCIe 4 through the host + one 25 Gb/s Ethernet NIC per node"),
        Network("eth10", 20.0, 1.0, 10, 50, doc="PCIe inside the node + one 10 Gb/s Ethernet NIC per node"),
        # measured here (benchmarks/step_time.py): ~2 ms per all-reduce call of gloo + DeepSpeed's CPU path
        Network("loopback", 2.0, 1.0, 1000, 1000, doc="CPU ranks over gloo (shared memory/TCP on one host)"),
    )
}
DEFAULT_NETWORK = "nvlink-ib400"
# Communication under compute is not free: NCCL kernels take SMs and memory bandwidth from the matmuls, and ZeRO-3
# fetches/releases per module. This share of the overlapped communication time still shows in the step.
OVERLAP_COST = 0.2
# ZeRO++ must win by this much to be chosen: qwZ/qgZ quantize weights and gradients on the wire (numerics change),
# hpZ costs memory; on a fast network they are not worth it (the issue: "recommended when the inter-node link is
# the bottleneck").
ZEROPP_MARGIN = {"quantized": 0.10, "hpz": 0.02}


def ranking_time(p: Prediction) -> float:
    """The step time ``auto`` ranks by: the prediction, with ZeRO++'s margin added."""
    c = p.candidate
    if isinstance(c, ZeroPP):
        return p.step_time_s * (1 + ZEROPP_MARGIN["quantized" if c.qwz or c.qgz else "hpz"])
    return p.step_time_s


BANDWIDTH_FILE_ENV = "FTKIT_BANDWIDTH_FILE"
BANDWIDTH_FILE_VERSION = 1


def bandwidth_file() -> Path:
    """Where ``ftkit doctor --bandwidth`` writes its measurement: $FTKIT_BANDWIDTH_FILE, else
    ``$XDG_CACHE_HOME/ftkit/bandwidth.json`` (``~/.cache/ftkit/bandwidth.json``).

    Format (JSON object)::

        {"version": 1, "measured_at": "2026-11-23T19:00:00Z", "hosts": ["node0", "node1"],
         "intra_node_gbs": 350.0, "inter_node_gbs": 45.0,          # bus bandwidth, GB/s (intra per GPU, inter per node)
         "intra_latency_us": 5.0, "inter_latency_us": 12.0}        # optional

    It applies to a plan whose host names equal ``hosts`` (in any order); without ``hosts`` it applies to every plan.
    """
    env = os.environ.get(BANDWIDTH_FILE_ENV)
    if env:
        return Path(env)
    return ftkit_cache() / "bandwidth.json"


def read_bandwidth_file(hosts: list[str], path: Path | None = None) -> Network | None:
    """The measured network for these hosts, or None (no file, another cluster's, or unreadable: a stated default
    is better than a traceback in ``ftkit plan``)."""
    p = path or bandwidth_file()
    try:
        data = json.loads(p.read_text())
        if not isinstance(data, dict) or data.get("version") != BANDWIDTH_FILE_VERSION:
            return None
        if data.get("hosts") is not None and sorted(data["hosts"]) != sorted(hosts):
            return None
        intra, inter = float(data["intra_node_gbs"]), float(data["inter_node_gbs"])
        if not (intra > 0 and inter > 0 and math.isfinite(intra) and math.isfinite(inter)):
            return None
        return Network(
            "measured",
            intra,
            inter,
            float(data.get("intra_latency_us", 5)),
            float(data.get("inter_latency_us", 10)),
            source=f"measured ({p}{', ' + str(data['measured_at']) if data.get('measured_at') else ''})",
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_network(cluster: ClusterSection, hosts: list[str]) -> Network:
    """Measured file > the recipe (cluster.intra_node_gbs/inter_node_gbs over cluster.network's preset) > default."""
    measured = read_bandwidth_file(hosts)
    if measured is not None:
        return measured
    name = cluster.network
    if name == "auto":
        name = "loopback" if cluster.accelerator == "cpu" else DEFAULT_NETWORK
        source = f"default ({name}: cluster.network is auto)"
    else:
        source = f"cluster.network {name}"
    base = NETWORK_PRESETS[name]
    intra, inter = cluster.intra_node_gbs, cluster.inter_node_gbs
    if intra is not None or inter is not None:
        source += " with cluster." + " and cluster.".join(
            k for k, v in (("intra_node_gbs", intra), ("inter_node_gbs", inter)) if v is not None
        )
    return Network(
        name,
        float(intra) if intra is not None else base.intra_gbs,
        float(inter) if inter is not None else base.inter_gbs,
        base.intra_latency_us,
        base.inter_latency_us,
        source=source,
        doc=base.doc,
    )


def resolve_gpu(cluster: ClusterSection) -> tuple[str, str]:
    """(table key, where it came from)."""
    gpu = cluster.gpu
    if gpu != "auto":
        return gpu, "cluster.gpu"
    if cluster.accelerator == "cpu":
        return "cpu", "cluster.accelerator cpu"
    mem = float(cluster.gpu_memory_gb)
    for size, name in _GPU_BY_MEMORY:
        if mem <= size * 1.1:
            return name, f"guessed from cluster.gpu_memory_gb {mem:g} (set cluster.gpu)"
    return "h200", f"guessed from cluster.gpu_memory_gb {mem:g} (set cluster.gpu)"


# ------------------------------------------------------------------------------------------------ ZeRO++ candidates


@dataclass(frozen=True)
class ZeroPP(Candidate):
    """A ZeRO-3 candidate with ZeRO++'s options: hpZ (secondary partition of ``hpz`` ranks, one node), qwZ, qgZ."""

    hpz: int = 1
    qwz: bool = False
    qgz: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage != 3:
            raise ValueError("ZeRO++ needs ZeRO stage 3")

    @property
    def label(self) -> str:
        opts = [o for o, on in (("hpZ", self.hpz > 1), ("qwZ", self.qwz), ("qgZ", self.qgz)) if on]
        return super().label.replace("ZeRO-3", "ZeRO-3 + " + "/".join(opts), 1) if opts else super().label


def zeropp_candidates(gpus_per_node: int, num_nodes: int) -> list[ZeroPP]:
    """ZeRO++ candidates worth planning: only across nodes (hpZ's group is one node; qgZ's is hierarchical)."""
    if num_nodes < 2 or gpus_per_node < 2:
        return []
    return [ZeroPP(3, hpz=gpus_per_node), ZeroPP(3, hpz=gpus_per_node, qwz=True, qgz=True)]


def zeropp_memory_bytes(c: Candidate, w: Workload) -> int:
    """hpZ's secondary partition: the k-bit weights split over the node (ZeRO++ paper: +2Ψ/G in bf16)."""
    if isinstance(c, ZeroPP) and c.hpz > 1:
        return w.k * math.ceil(w.psi / c.hpz)
    return 0


# ------------------------------------------------------------------------------------------------ bytes per step


@dataclass(frozen=True)
class Collective:
    """Σ over one optimizer step of one kind of call on one rank, in the comms logger's unit."""

    op: str  # DeepSpeed's record name (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single)
    logger_bytes: int
    calls: int
    group: int  # ranks in the group
    scope: str  # "intra" (the group is one node) | "inter" (it spans nodes)
    what: str
    overlap: str = "none"  # what compute it can hide under: none | backward | forward+backward
    micro_steps: int = 1  # the micro-steps it is spread over (GA for per-micro-step traffic)

    @property
    def bus_factor(self) -> float:
        n = self.group
        if n <= 1:
            return 0.0
        if self.op == "all_reduce":
            return 2 * (n - 1) / n
        if self.op == "all_gather_into_tensor":
            return float(n - 1)  # the logger's size is one rank's input; the output is n times that
        return (n - 1) / n  # reduce_scatter (input size), all_to_all

    @property
    def bus_bytes(self) -> float:
        return self.logger_bytes * self.bus_factor


@dataclass(frozen=True)
class Traffic:
    collectives: tuple[Collective, ...]
    host_bytes: int = 0  # offload: host <-> GPU copies per step per GPU

    def logger_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.op] = out.get(c.op, 0) + c.logger_bytes
        return out

    def by_scope(self, scope: str) -> int:
        return sum(c.logger_bytes for c in self.collectives if c.scope == scope)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bucket_calls(tensors: list[int], bucket: int) -> int:
    """Calls one gradient reduction takes: DeepSpeed fills its bucket in backward order and reduces it when the
    next tensor would overflow it (a tensor larger than the bucket goes alone)."""
    calls, acc = 0, 0
    for x in reversed(tensors):
        if acc and acc + x > bucket:
            calls, acc = calls + 1, 0
        acc += x
    return calls + (1 if acc else 0)


def tp_view(w: Workload) -> Workload:
    """The data-parallel side of a tensor-parallel workload: the 1/tp of the model one rank holds, sharded and
    reduced over the world_size / tp data-parallel ranks (a node's ranks split into tp groups). ``w`` without
    tensor parallelism is returned as it is."""
    if w.tp == 1:
        return w
    tp, shape = w.tp, w.shape
    part = replace(
        shape,
        total_params=_ceil_div(shape.total_params, tp),
        largest_layer_params=_ceil_div(shape.largest_layer_params, tp),
        largest_tensor_params=_ceil_div(shape.largest_tensor_params, tp),
        tensors=(),
    )
    lora = _ceil_div(w.lora_params, tp) if w.lora_params is not None else None
    return replace(
        w,
        shape=part,
        lora_params=lora,
        world_size=max(1, w.world_size // tp),
        gpus_per_node=max(1, w.gpus_per_node // tp),
        tp=1,
    )


def parallel_collectives(w: Workload, grad_accum: int, comm_bytes: int | None = None) -> list[Collective]:
    """Tensor and sequence parallelism's traffic per optimizer step on one rank, inside a node (its groups never span
    nodes), on the critical path (nothing hides it). TP (Megatron-style, as transformers' tp_plan and DeepSpeed
    AutoTP split a decoder layer): an all-reduce of b·s·h after attention and after the MLP in forward, and two of
    the same size for their inputs' gradients in backward. SP (DeepSpeed Ulysses): an all-to-all of q, k, v into the
    attention and one of its output back, each way, per layer. Gradient checkpointing repeats forward's."""
    out: list[Collective] = []
    kb = comm_bytes if comm_bytes is not None else PRECISION_BYTES[w.precision]
    b, s, h, layers = w.micro_batch_size, w.seq_len, w.shape.hidden_size, w.shape.num_layers
    passes = 3 if w.gradient_checkpointing else 2  # forward (again under recompute) and backward
    if w.tp > 1:
        calls = 2 * layers * passes * grad_accum
        msg = b * (s // w.sp) * h * kb
        what = f"tensor parallelism: 2 all-reduces of b·s·h per layer and pass ({passes} passes), tp {w.tp}"
        out.append(Collective("all_reduce", msg * calls, calls, w.tp, "intra", what, micro_steps=grad_accum))
    if w.sp > 1:
        h_kv = w.shape.num_kv_heads * w.shape.head_dim if w.shape.num_kv_heads and w.shape.head_dim else h
        per_layer = b * (s // w.sp) * (2 * h + 2 * h_kv) * kb  # q, k, v in; the attention's output back
        calls = 4 * layers * passes * grad_accum
        what = f"Ulysses sequence parallelism: all-to-alls of q, k, v and the output per layer and pass, sp {w.sp}"
        out.append(
            Collective(
                "all_to_all_single",
                per_layer * layers * passes * grad_accum,
                calls,
                w.sp,
                "intra",
                what,
                micro_steps=grad_accum,
            )
        )
    return out


def traffic(
    c: Candidate,
    w: Workload,
    grad_accum: int = 1,
    *,
    comm_bytes: int | None = None,
    persistence_threshold: int | None = None,
    max_reuse_distance: int = 1_000_000_000,
    lora_tensors: list[int] | None = None,
    reduce_bucket_size: int | None = None,
) -> Traffic:
    """Bytes per optimizer step on one rank, by collective: the data-parallel side's (:func:`_dp_traffic`, over
    the data-parallel ranks of the rank's 1/tp of the model) and tensor and sequence parallelism's
    (:func:`parallel_collectives`)."""
    dp = _dp_traffic(
        c,
        tp_view(w),
        grad_accum,
        comm_bytes=comm_bytes,
        persistence_threshold=persistence_threshold,
        max_reuse_distance=max_reuse_distance,
        lora_tensors=lora_tensors,
        reduce_bucket_size=reduce_bucket_size,
    )
    extra = parallel_collectives(w, grad_accum, comm_bytes)
    return Traffic((*dp.collectives, *extra), dp.host_bytes) if extra else dp


def _dp_traffic(
    c: Candidate,
    w: Workload,
    grad_accum: int = 1,
    *,
    comm_bytes: int | None = None,
    persistence_threshold: int | None = None,
    max_reuse_distance: int = 1_000_000_000,
    lora_tensors: list[int] | None = None,
    reduce_bucket_size: int | None = None,
) -> Traffic:
    """Bytes per optimizer step on one rank, by collective (module docstring's table).

    ``comm_bytes``: bytes per element on the wire (default: the training dtype). ``persistence_threshold``:
    stage3_param_persistence_threshold in elements (default 10·h, the plan's). ``lora_tensors``: the adapter
    tensor sizes (default: Φ as one tensor). ``reduce_bucket_size`` (elements; default the workload's) sets how
    many calls a gradient reduction takes, which only matters for the latency term.
    """
    bucket = max(1, reduce_bucket_size or w.reduce_bucket())
    b = comm_bytes if comm_bytes is not None else PRECISION_BYTES[w.precision]
    n, g, ga = w.world_size, w.local_ranks, grad_accum
    if isinstance(c, Fsdp2):
        return _fsdp2_traffic(c, w, ga, b, lora_tensors)
    scope = "inter" if w.num_nodes > 1 else "intra"
    phi = w.phi
    out: list[Collective] = []
    host = 0
    if n == 1:
        return Traffic((), host_bytes=_host_bytes(c, w))
    if c.stage in (0, 1, 2):
        per = ga if c.stage == 2 else 1
        grads = (lora_tensors or [phi]) if w.lora_params is not None else [t.numel for t in w.shape.tensors] or [phi]
        calls = bucket_calls(grads, bucket) * per
        out.append(Collective("all_reduce", b * phi * per, calls, n, scope, "gradients", "backward", micro_steps=per))
        out.append(Collective("all_reduce", 4, 1, n, scope, "gradient norm"))
        if c.stage >= 1:
            out.append(Collective("all_gather_into_tensor", b * _ceil_div(phi, n), 1, n, scope, "updated partition"))
        return Traffic(tuple(out), host_bytes=_host_bytes(c, w))

    # stage 3: per tensor, ⌈numel/N⌉ per rank
    h = w.shape.hidden_size
    thr = persistence_threshold if persistence_threshold is not None else 10 * h
    base = [t.numel for t in w.shape.tensors] or [w.shape.total_params]
    adapters = (lora_tensors if lora_tensors is not None else [phi]) if w.lora_params is not None else []
    order = base + adapters  # adapters are used with their layers; their size is small either way
    persistent = sum(_ceil_div(x, n) for x in order if x <= thr)
    gathered = [x for x in order if x > thr]
    fwd = sum(_ceil_div(x, n) for x in gathered)
    # backward re-gathers what was released: a tensor used again more than max_reuse_distance elements later
    # (forward goes through everything after it, backward comes back: ~2 x the elements behind it)
    regathered, behind = [], 0
    for x in reversed(gathered):
        if 2 * behind > max_reuse_distance:
            regathered.append(x)
        behind += x
    bwd = sum(_ceil_div(x, n) for x in regathered)
    trainable = adapters if w.lora_params is not None else base
    rs = sum(n * _ceil_div(x, n) for x in trainable)
    pp = c if isinstance(c, ZeroPP) else None
    wire_w = 1.0 if pp and pp.qwz else b  # qwZ: int8 weights
    scale = (4 / 2048) if pp and pp.qwz else 0.0
    out.append(
        Collective(
            "all_gather_into_tensor",
            int(fwd * (wire_w + scale)) * ga,
            len(gathered) * ga,  # one call per module fetch (tensors of a module are coalesced; close enough)
            n,
            scope,
            "parameters, forward" + (" (int8, qwZ)" if pp and pp.qwz else ""),
            "forward+backward",
        )
    )
    if bwd:
        if pp and pp.hpz > 1:  # hpZ: from the secondary partition inside the node
            sec = sum(_ceil_div(x, pp.hpz) for x in regathered)
            out.append(
                Collective(
                    "all_gather_into_tensor",
                    b * sec * ga,
                    len(regathered) * ga,
                    pp.hpz,
                    "intra",
                    "parameters, backward (hpZ)",
                    "forward+backward",
                )
            )
        else:
            out.append(
                Collective(
                    "all_gather_into_tensor",
                    int(bwd * (wire_w + scale)) * ga,
                    len(regathered) * ga,
                    n,
                    scope,
                    "parameters, backward",
                    "forward+backward",
                )
            )
    if persistent:
        out.append(Collective("all_gather_into_tensor", b * persistent, 1, n, scope, "persistent parameters"))
    if pp and pp.qgz and w.num_nodes > 1:
        half = sum(trainable) // 2  # int4
        calls = bucket_calls(trainable, bucket) * ga
        for size, group, where in ((half, g, "intra"), (half // g, w.num_nodes, "inter")):
            what = f"gradients int4 (qgZ), {'in node' if where == 'intra' else 'across nodes'}"
            out.append(
                Collective("all_to_all_single", size * ga, calls, group, where, what, "backward", micro_steps=ga)
            )
    else:
        calls = bucket_calls(trainable, bucket) * ga
        out.append(
            Collective("reduce_scatter_tensor", b * rs * ga, calls, n, scope, "gradients", "backward", micro_steps=ga)
        )
    out.append(Collective("all_reduce", 8, 1, n, scope, "gradient norm"))
    host = _host_bytes(c, w, ga)
    return Traffic(tuple(out), host_bytes=host)


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


@dataclass(frozen=True)
class Fsdp2Units:
    """The parameters of each FSDP2 unit Accelerate wraps (elements, unpadded)."""

    layers: tuple[int, ...]  # each decoder layer: resharded after forward when the recipe says so
    embedding: int  # the input embedding's own unit (0 when tied: it joins the tail)
    tail: int  # final norm and LM head (and the tied embedding): kept gathered from forward to backward
    root: int  # anything else: the root unit, kept gathered too

    @property
    def resharded(self) -> list[int]:
        return [x for x in (*self.layers, self.embedding) if x]

    @property
    def kept(self) -> list[int]:
        return [x for x in (self.tail, self.root) if x]


def fsdp2_units(w: Workload) -> Fsdp2Units:
    """FSDP2's units from the model's tensors by name (a decoder layer is ``...layers.N.``): Accelerate's
    ``fsdp2_prepare_model`` wraps each layer, the untied input embedding, then the tail, then the root."""
    layers: dict[int, int] = {}
    embedding = tail = root = 0
    tensors = w.shape.tensors
    for t in tensors:
        m = _LAYER_RE.search(t.name)
        if m:
            layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + t.numel
        elif t.kind == "embedding" and not w.shape.tied_embeddings and "embed_tokens" in t.name:
            embedding += t.numel
        elif t.kind in ("embedding", "norm") or t.name.startswith("lm_head") or "embed" in t.name:
            tail += t.numel
        else:
            root += t.numel
    if not tensors:  # no per-tensor shape: the layers' share of the parameters, the rest in the tail
        per = w.shape.total_params // max(1, w.shape.num_layers + 1)
        return Fsdp2Units(tuple([per] * w.shape.num_layers), 0, w.shape.total_params - per * w.shape.num_layers, 0)
    return Fsdp2Units(tuple(layers[i] for i in sorted(layers)), embedding, tail, root)


def _fsdp2_traffic(c: Fsdp2, w: Workload, ga: int, b: int, lora_tensors: list[int] | None) -> Traffic:
    """FSDP2's collectives per optimizer step on one rank (module docstring): per-unit all-gathers every
    micro-step, per-unit reduce-scatters once per step; logger bytes as for ZeRO-3 (a gather's per-rank input)."""
    n = w.world_size
    if n == 1:
        return Traffic((), host_bytes=_host_bytes(c, w, ga))
    scope = "inter" if w.num_nodes > 1 else "intra"
    u = fsdp2_units(w)
    units = [*u.resharded, *u.kept]
    out = [
        Collective(
            "all_gather_into_tensor",
            b * sum(_ceil_div(x, n) for x in units) * ga,
            len(units) * ga,
            n,
            scope,
            "parameters, forward (per FSDP2 unit)",
            "forward+backward",
        )
    ]
    if c.stage == 3:  # resharded after forward: gathered again for backward
        out.append(
            Collective(
                "all_gather_into_tensor",
                b * sum(_ceil_div(x, n) for x in u.resharded) * ga,
                len(u.resharded) * ga,
                n,
                scope,
                "parameters, backward (per FSDP2 unit)",
                "forward+backward",
            )
        )
    if w.lora_params is not None:  # the adapters, in the units of the layers they belong to
        trainable = lora_tensors if lora_tensors is not None else [w.phi]
        calls = len(u.layers) or 1
    else:
        trainable, calls = units, len(units)
    rs = sum(n * _ceil_div(x, n) for x in trainable)
    out.append(Collective("reduce_scatter_tensor", b * rs, calls, n, scope, "gradients (per FSDP2 unit)", "backward"))
    out.append(Collective("all_reduce", 8, 1, n, scope, "gradient norm"))
    return Traffic(tuple(out), host_bytes=_host_bytes(c, w, ga))


def _host_bytes(c: Candidate, w: Workload, ga: int = 1) -> int:
    """Offload: gradients to the host (fp32) and updated k-bit weights back, per step; parameter offload fetches
    the k-bit partition for every forward and backward."""
    n, k, phi = w.world_size, w.k, w.phi
    part = _ceil_div(phi, n) if c.stage else phi
    out = 0
    if c.offload_optimizer != "none":
        out += part * (4 + k) * (ga if c.stage >= 2 else 1)
    if c.offload_params != "none":
        out += 2 * k * _ceil_div(w.psi, n) * ga
    return out


# ------------------------------------------------------------------------------------------------ time


class Assumptions(TypedDict, total=False):
    """What a step-time prediction rests on: the GPU's peak and assumed efficiency, the network, the overlaps."""

    gpu: str
    gpu_doc: str
    gpu_source: str
    peak_tflops: float
    mfu: float
    flops_per_token: float
    network: str
    network_source: str
    intra_node_gbs: float
    inter_node_gbs: float
    intra_latency_us: float
    inter_latency_us: float
    overlap_comm: bool
    pcie_gbs: float
    overlap_cost: float
    hbm_gbs: float
    launch_us: float
    activations: str  # where the profile came from (traced, closed form)
    calibration: str  # "uncalibrated" or the calibration's line
    calibration_error: float
    parts_s: dict[str, float]


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    traffic: Traffic
    compute_s: float  # everything but communication and offload: GPU work and host overheads (calibrated)
    comm_s: float  # all communication, as if nothing overlapped
    exposed_comm_s: float
    host_s: float  # offload's host work: the CPU optimizer and PCIe copies
    step_time_s: float
    tokens_per_step: int  # all ranks
    assumptions: Assumptions = field(default_factory=lambda: Assumptions())  # what the numbers rest on
    gpu_s: float = 0.0  # the parts of compute_s
    overhead_s: float = 0.0
    uncalibrated: Parts | None = field(default=None, compare=False)  # before calibration (for calibrating)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def logger_bytes(self) -> dict[str, int]:
        return self.traffic.logger_bytes()

    @property
    def inter_share(self) -> float:
        """Share of the step spent in exposed communication."""
        return self.exposed_comm_s / self.step_time_s if self.step_time_s else 0.0

    def as_dict(self) -> dict[str, object]:
        t = self.traffic
        return {
            "comm_bytes_per_step": {
                "intra": t.by_scope("intra"),
                "inter": t.by_scope("inter"),
                "by_collective": t.logger_bytes(),
                "host": t.host_bytes,
                "unit": "bytes per GPU per optimizer step, as DeepSpeed's comms logger counts them (message sizes)",
            },
            "compute_s": round(self.compute_s, 6),
            "comm_s": round(self.comm_s, 6),
            "exposed_comm_s": round(self.exposed_comm_s, 6),
            "gpu_s": round(self.gpu_s, 6),
            "overhead_s": round(self.overhead_s, 6),
            "offload_s": round(self.host_s, 6),
            "step_time_s": round(self.step_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "assumptions": self.assumptions,
        }


def flops_per_token(w: Workload) -> float:
    """Training FLOPs per token: (6Ψ + 12·L·h·s) full fine-tuning, 8/16 with full recompute (one more forward);
    LoRA skips the frozen weights' gradients: 4Ψ (+2Ψ recompute) + 6Φ. The attention term (QKᵀ and AV, 2·2·s·h
    per layer in forward) scales the same way."""
    s, h, layers = w.seq_len, w.shape.hidden_size, w.shape.num_layers
    attn_fwd = 4 * layers * h * s
    passes = 4 if w.gradient_checkpointing else 3  # forward + backward (2x forward) [+ recomputed forward]
    if w.lora_params is None:
        dense = 2 * w.psi * passes
    else:
        dense = 2 * w.shape.total_params * (passes - 1) + 6 * w.lora_params
    return dense + attn_fwd * passes


def _collective_s(c: Collective, net: Network) -> float:
    if c.group <= 1 or c.logger_bytes == 0:
        return 0.0
    if c.scope == "intra":
        bw, lat = net.intra_gbs, net.intra_latency_us
    else:
        bw, lat = min(net.intra_gbs, net.inter_gbs), net.inter_latency_us
    steps = 2 * (c.group - 1) if c.op == "all_reduce" else (c.group - 1)
    return c.bus_bytes / (bw * 1e9) + c.calls * steps * lat * 1e-6


def predict(
    c: Candidate,
    w: Workload,
    grad_accum: int,
    net: Network,
    gpu: str,
    *,
    overlap_comm: bool,
    gpu_source: str = "",
    comm_bytes: int | None = None,
    persistence_threshold: int | None = None,
    lora_tensors: list[int] | None = None,
    reduce_bucket_size: int | None = None,
    max_reuse_distance: int = 1_000_000_000,
    calibration: Calibration | None = None,
    cpu_adam: bool = True,
) -> Prediction:
    """Step time = GPU work + host overheads (:mod:`ftkit.plan.speed`, calibrated when ``calibration`` is of this GPU
    class) + exposed communication + offload's host work.

    Overlap: with overlap_comm the gradient reduction hides under the backward pass (2/3 of a micro-step's GPU work;
    ZeRO-1 only under the last micro-step's); ZeRO-3's and FSDP2's prefetched gathers hide under forward and backward
    whatever overlap_comm says. Communication that exceeds its window, and the rest (after the optimizer step), is
    exposed; hidden communication still costs :data:`OVERLAP_COST` of its time.
    """
    t = traffic(
        c,
        w,
        grad_accum,
        comm_bytes=comm_bytes,
        persistence_threshold=persistence_threshold,
        lora_tensors=lora_tensors,
        reduce_bucket_size=reduce_bucket_size,
        max_reuse_distance=max_reuse_distance,
    )
    peak_bf16, peak_tf32, gpu_doc = GPU_PEAK_TFLOPS[gpu]
    peak = (peak_tf32 if w.precision == "fp32" else peak_bf16) * 1e12
    cls = gpu_class(gpu)
    dpw = tp_view(w)  # the rank's 1/tp of the model over the data-parallel ranks (w itself without TP)
    n = dpw.world_size
    part_phi = _ceil_div(dpw.phi, n) if c.stage else dpw.phi
    part_psi = _ceil_div(dpw.psi, n) if c.stage == 3 else dpw.psi
    fsdp = isinstance(c, Fsdp2)
    units = fsdp2_units(dpw) if fsdp else None
    engine = Engine(
        "fsdp2" if fsdp else "deepspeed",
        c.stage,
        c.offload_optimizer,
        c.offload_params,
        fsdp_units=len(units.resharded) + len(units.kept) if units is not None else 0,
        cpu_adam=cpu_adam,
    )
    prof = w.profile_for(c)
    raw = step_parts(
        prof,
        seq_len=w.seq_len // w.sp,
        micro_batch=w.micro_batch_size,
        grad_accum=grad_accum,
        k=w.k,
        peak_flops=peak,
        cls=cls,
        engine=engine,
        trainable_part=part_phi,
        weight_part=part_psi,
        attn_scale=float(w.sp),
        work_share=1 / w.tp,
    )
    cal = calibration if calibration is not None and calibration.gpu_class == gpu else None
    parts = raw.scaled(cal)
    compute = parts.gpu_s + parts.host_s
    micro = parts.gpu_s / grad_accum  # the GPU's micro-step: what communication can hide under
    backward = micro * 2 / 3
    total = 0.0
    exposed = 0.0
    hidden_bwd = {"backward": 0.0, "forward+backward": 0.0}
    for col in t.collectives:
        s = _collective_s(col, net)
        total += s
        # CPU ranks: gloo runs collectives on the cores that compute, nothing overlaps
        if col.overlap == "none" or (col.overlap == "backward" and not overlap_comm) or gpu == "cpu":
            exposed += s
        else:
            hidden_bwd[col.overlap] += s
    # per micro-step windows; ZeRO-1 reduces once: it only has the last backward to hide under
    grad_calls = max((col.micro_steps for col in t.collectives if col.overlap == "backward"), default=1)
    bwd_comm = hidden_bwd["backward"] / max(grad_calls, 1)
    fb_comm = hidden_bwd["forward+backward"] / grad_accum
    # both kinds share the same link: their sum hides under the micro-step's compute, the gradients' under backward
    per_micro_exposed = max(0.0, fb_comm + bwd_comm - micro, bwd_comm - backward)
    per_micro_exposed += OVERLAP_COST * min(fb_comm + bwd_comm, micro)
    exposed += per_micro_exposed * grad_accum if grad_calls > 1 or fb_comm else per_micro_exposed
    host = parts.offload_s
    step = compute + exposed + host
    tokens = w.micro_batch_size * (w.seq_len // w.sp) * grad_accum  # this rank's share of each sequence
    model_flops = flops_per_token(w) * tokens / w.tp
    assumptions: Assumptions = {
        "gpu": gpu,
        "gpu_doc": gpu_doc,
        "gpu_source": gpu_source,
        "peak_tflops": peak / 1e12,
        "mfu": model_flops / (step * peak) if step > 0 else 0.0,
        "flops_per_token": flops_per_token(w),
        "network": net.name,
        "network_source": net.source,
        "intra_node_gbs": net.intra_gbs,
        "inter_node_gbs": net.inter_gbs,
        "intra_latency_us": net.intra_latency_us,
        "inter_latency_us": net.inter_latency_us,
        "overlap_comm": overlap_comm,
        "pcie_gbs": cls.pcie_gbs,
        "overlap_cost": OVERLAP_COST,
        "hbm_gbs": cls.hbm_gbs,
        "launch_us": cls.launch_us,
        "activations": f"{prof.source}",
        "calibration": "uncalibrated" if cal is None else f"GPU x{cal.gpu_scale:.3g}, host x{cal.host_scale:.3g}",
        "calibration_error": cal.error if cal is not None else -1.0,
        "parts_s": {k: round(v, 6) for k, v in parts.detail.items()},
    }
    return Prediction(
        c,
        t,
        compute,
        total,
        exposed,
        host,
        step,
        tokens * w.world_size // w.tp,  # a tensor-parallel group shares its tokens
        assumptions,
        gpu_s=parts.gpu_s,
        overhead_s=parts.host_s,
        uncalibrated=raw,
    )


# ------------------------------------------------------------------------------------------------ from a plan


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover
