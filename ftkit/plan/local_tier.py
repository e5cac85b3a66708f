"""The local checkpoint tier of a plan: where on each node, how often, and how much host memory it takes.

A checkpoint in the local tier is what HF Trainer + DeepSpeed write for one node (``save_on_each_node`` and
DeepSpeed's ``use_node_local_storage``): the shared files (the model's weights, DeepSpeed's model states, trainer
state) once per node, plus the node's share of the optimizer states. The tier keeps ``checkpoint.local_keep``
committed ones, one more while it is being copied to the run directory, and with ``peer_copies: 1`` the previous
node's part too: that is the host memory it asks for (a RAM disk counts against host memory).

``local_steps: auto`` is the Young/Daly interval: with save cost C (seconds the ranks block per local save) and mean
time between failures M, saving every sqrt(2 C M) seconds minimises the expected time lost to saving plus
recomputing. C is what earlier attempts measured (``save_s`` of local commits in metrics.jsonl), else an estimate
from the checkpoint's size and the RAM disk's speed; the interval in steps uses the measured step time, else the
plan's prediction. It is never more than ``train.save_steps``, the cadence of the durable copies.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from ftkit.recipe.load import Recipe
from ftkit.rundir.layout import RunDir, read_metrics
from ftkit.rundir.spec import LocalTierPlan

GiB = 1 << 30
DEFAULT_ROOT = "/dev/shm"  # a RAM disk on every Linux node: the fastest local tier there is
LOCAL_WRITE_BPS = 2e9  # bytes/s a save writes to /dev/shm (measured here: 2-3 GB/s; NVMe is slower)
SAVE_OVERHEAD_S = 0.5  # what a save costs besides writing (HF's own bookkeeping, the commit's barrier)
HEADROOM = 0.10  # host memory the plan keeps free (the same headroom as for GPU memory)


@dataclass(frozen=True)
class LocalTier:
    dir: str  # a template: {host} becomes the node's name
    steps: int  # a local save every this many optimizer steps
    keep: int
    peer_copies: int
    bytes_per_node: int  # one checkpoint's bytes on one node (estimate)
    why: str  # one line: why on, and the cadence's reason

    @property
    def host_gb_per_node(self) -> float:
        """Host memory (or disk) the tier holds at most on a node: ``keep`` + one being copied + a peer's part."""
        return self.bytes_per_node * (self.keep + 1 + self.peer_copies) / GiB

    def to_json(self) -> LocalTierPlan:
        return {
            "dir": self.dir,
            "steps": self.steps,
            "keep": self.keep,
            "peer_copies": self.peer_copies,
            "bytes_per_node": self.bytes_per_node,
            "host_gb_per_node": round(self.host_gb_per_node, 3),
            "why": self.why,
        }


def shm_bytes(tier: LocalTier | None) -> int:
    """What the tier holds at most of a node's /dev/shm (0: no tier, or one on a disk): checked in the preflight."""
    if tier is None or not (tier.dir == DEFAULT_ROOT or tier.dir.startswith(DEFAULT_ROOT + "/")):
        return 0
    return int(tier.bytes_per_node * (tier.keep + 1 + tier.peer_copies))


def default_dir(run_dir: str, name: str, resolved: bool = False) -> str:
    """``/dev/shm/ftkit-<name>-<hash of the run directory>/{host}``: one directory per run, then per node
    (``resolved``: ``run_dir`` is already its resolved absolute path, as :func:`ftkit.plan.inputs.gather` gives it)."""
    path = run_dir if resolved else str(Path(run_dir).resolve())
    digest = hashlib.sha1(path.encode()).hexdigest()[:8]
    return f"{DEFAULT_ROOT}/ftkit-{name}-{digest}/{{host}}"


def checkpoint_bytes_per_node(
    total_params: int, trainable_params: int, weight_bytes: int, stage: int, world_size: int, per_node: int
) -> int:
    """One checkpoint's bytes on a node: the model's weights as HF saves them (the adapter alone for LoRA), the
    module states DeepSpeed saves (at ZeRO-3 as each rank's shard), and the node's share of the fp32 master weights
    and Adam's two moments (12 bytes per trainable parameter)."""
    lora = trainable_params < total_params
    hf_weights = (trainable_params * 4) if lora else total_params * weight_bytes
    module_states = total_params * weight_bytes * (per_node / world_size if stage == 3 else 1)
    optimizer = 12 * trainable_params * per_node / world_size
    return int(hf_weights + module_states + optimizer) + (1 << 20)  # rng, scheduler, trainer state


def young_daly_steps(save_cost_s: float, mtbf_hours: float, step_time_s: float, limit: int) -> tuple[int, str]:
    """The Young/Daly interval sqrt(2 C M) in optimizer steps, between 1 and ``limit`` (train.save_steps)."""
    interval_s = math.sqrt(2 * save_cost_s * mtbf_hours * 3600)
    steps = max(1, min(limit, round(interval_s / max(step_time_s, 1e-6))))
    why = (
        f"Young/Daly: sqrt(2 x {save_cost_s:.3g} s save x {mtbf_hours:g} h MTBF) = {interval_s:.0f} s = {steps} "
        f"step(s) of {step_time_s:.3g} s" + (f" (at most train.save_steps={limit})" if steps == limit else "")
    )
    return steps, why


def plan_local_tier(
    recipe: Recipe,
    *,
    num_nodes: int,
    per_node: int,
    world_size: int,
    stage: int,
    total_params: int | None,
    trainable_params: int | None,
    weight_bytes: int,
    host_memory_gb: float | None,
    host_used_gb: float,
    step_time_s: float | None,
    measured_save_s: float | None = None,
    measured_step_s: float | None = None,
    run_dir: str | None = None,
) -> tuple[LocalTier | None, str]:
    """The local tier for this run, or None and why it is off (one line)."""
    c = recipe.checkpoint
    if c.local_dir is None:
        return None, "checkpoint.local_dir: null (every save goes to the run directory)"
    if recipe.train.backend != "deepspeed":
        return None, f"train.backend {recipe.train.backend}: the node-local tier knows DeepSpeed's checkpoints only"
    if total_params is None or trainable_params is None:
        if c.local_dir == "auto":
            return None, "auto: the model's size is unknown, so the tier's memory cannot be planned"
        size = 0
    else:
        size = checkpoint_bytes_per_node(total_params, trainable_params, weight_bytes, stage, world_size, per_node)
    need_gb = size * (c.local_keep + 1 + c.peer_copies) / GiB
    room = None if host_memory_gb is None else host_memory_gb * (1 - HEADROOM) - host_used_gb
    if c.local_dir == "auto":
        if room is not None and need_gb > room:
            return None, (
                f"auto: the tier needs {need_gb:.1f} GiB of host memory per node, {room:.1f} GiB is left "
                "(cluster.host_memory_gb less 10% and the plan's offload): off; set checkpoint.local_dir to local NVMe"
            )
        directory = default_dir(run_dir or recipe.train.output_dir, recipe.name, resolved=run_dir is not None)
        where = f"auto: {need_gb:.2f} GiB per node fits in host memory"
    else:
        directory = str(c.local_dir)
        where = f"checkpoint.local_dir ({need_gb:.2f} GiB per node)"
    save_steps = int(recipe.train.save_steps)
    if c.local_steps == "auto":
        cost = measured_save_s if measured_save_s is not None else SAVE_OVERHEAD_S + size / LOCAL_WRITE_BPS
        step = measured_step_s or step_time_s or 1.0
        steps, cadence = young_daly_steps(cost, float(recipe.resilience.mtbf_hours), step, save_steps)
        if measured_save_s is None:
            cadence += " (save cost estimated from the checkpoint's size: nothing measured yet)"
    else:
        steps, cadence = min(int(c.local_steps), save_steps), "checkpoint.local_steps"
    return LocalTier(directory, steps, int(c.local_keep), int(c.peer_copies), size, f"{where}; {cadence}"), ""


def measured_costs(run_dir: str | Path) -> tuple[float | None, float | None]:
    """(median seconds the ranks blocked per local save, median seconds per optimizer step) from earlier attempts'
    metrics.jsonl; None where nothing was measured."""
    try:
        rows = read_metrics(RunDir(run_dir).metrics)
    except OSError:
        return None, None
    saves = [float(m["save_s"]) for m in rows if m.get("tier") == "local" and isinstance(m.get("save_s"), (int, float))]
    times = [(m["attempt"], m["step"], m["time"]) for m in rows if "loss" in m and isinstance(m.get("time"), float)]
    gaps = [
        (t2 - t1) / (s2 - s1)
        for (a1, s1, t1), (a2, s2, t2) in zip(times, times[1:], strict=False)
        if a1 == a2 and s2 > s1 and t2 > t1
    ]
    return (statistics.median(saves) if saves else None), (statistics.median(gaps) if gaps else None)


def local_tier_line(t: LocalTier | None, off: str) -> str:
    """``ftkit plan``'s line for the local tier: where, how often, the host memory per node, or why it is off."""
    if t is None:
        return f"local checkpoint tier: off ({off})"
    held = f"{t.keep} kept + 1 being copied" + (" + the previous node's part" if t.peer_copies else "")
    return (
        f"local checkpoint tier: {t.dir}, a save every {t.steps} step(s), copies to the run directory every "
        f"train.save_steps; {t.host_gb_per_node:.2f} GiB host memory per node ({held}); {t.why}"
    )
