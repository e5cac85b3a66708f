"""The edge of planning: everything a plan is built from, read once into a frozen :class:`PlanInputs`.

What is read here, and nowhere else in ``plan/``: the hostfile (or the Slurm allocation and the environment), the
model's ``config.json`` (a directory, a checked-in copy or the hub cache) and its parameter counts (the meta device
for an unknown family), the model's profile (:func:`ftkit.plan.profile.load_profile`: a cache, or a trace in a
subprocess), the bandwidth file ``ftkit doctor --bandwidth`` writes, the calibration stored beside the run
(:mod:`ftkit.plan.calibrate`) and the run directory's earlier metrics. :func:`ftkit.plan.plan.plan_from` then builds
the plan from the record without I/O.
"""

from __future__ import annotations

import os
from pathlib import Path

from ftkit.cluster.hostfile import apply_filters, parse_hostfile
from ftkit.cluster.slurm import allocation_hosts, in_allocation, job_port
from ftkit.errors import Problem, RecipeError, UserError
from ftkit.model.config import config_source
from ftkit.model.shape import (
    ModelShape,
    count_params,
    count_params_meta,
    hidden_size,
    load_config_file,
    load_model_config,
    lora_tensors,
)
from ftkit.plan.calibrate import stored_calibration
from ftkit.plan.comm import resolve_gpu, resolve_network
from ftkit.plan.local_tier import measured_costs
from ftkit.plan.memory import PRECISION_BYTES
from ftkit.plan.profile import Loaded, Request, closed_form, load_profile, request_for
from ftkit.plan.types import PlanInputs
from ftkit.recipe.load import CLI, DEFAULT, Recipe
from ftkit.rundir.records import JSONObject


def resolve_cluster(
    recipe: Recipe, include: str | None = None, exclude: str | None = None
) -> tuple[list[tuple[str, int]], dict[str, tuple[int, ...]]]:
    """The (host, slots) list in rank order, and the device indices a slot selection kept on each host.

    ``--include 'w0:1,3'`` on ``w0 slots=4`` gives ``[("w0", 2)]`` and ``{"w0": (1, 3)}``: two ranks, on devices 1
    and 3. With a filter every kept host is in the dict (as DeepSpeed, which sets each node's visible devices to
    its selection); without one the dict is empty and the ranks use devices ``0..n-1`` (of what is visible).
    """
    hostfile = recipe.cluster.hostfile
    if recipe.cluster.engine == "slurm":  # the allocation's nodes (ftkit launch refuses outside one)
        if include or exclude:
            raise RecipeError(Problem("--include/--exclude do not apply to engine slurm (use sbatch -w/-x)", file=CLI))
        if in_allocation(os.environ):
            return allocation_hosts(os.environ, recipe.cluster.gpus_per_node), {}
        return [(f"node{i}", recipe.cluster.gpus_per_node) for i in range(recipe.cluster.num_nodes)], {}
    if hostfile is None:
        if include or exclude:
            raise RecipeError(Problem("--include/--exclude need a hostfile (cluster.hostfile or --hostfile)", file=CLI))
        n = recipe.cluster.num_nodes
        if n == 1:
            return [("localhost", recipe.cluster.gpus_per_node)], {}
        return [(f"node{i}", recipe.cluster.gpus_per_node) for i in range(n)], {}

    hf = parse_hostfile(hostfile)
    if include or exclude:
        hf = apply_filters(hf, include=include, exclude=exclude)
    # This machine by any of its names (127.0.0.1, its hostname, its FQDN) is started locally, no ssh.
    local = hf.num_nodes == 1 and hf.is_local_only
    hosts = [("localhost" if local else h.name, h.slots) for h in hf.hosts]
    devices = {name: h.slot_indices for (name, _), h in zip(hosts, hf.hosts, strict=True)} if include or exclude else {}
    return hosts, devices


def master_port(recipe: Recipe) -> int:
    """The recipe's port; under Slurm with the default port, one of the job's own (two jobs may share a node)."""
    port = recipe.cluster.master_port
    if recipe.cluster.engine == "slurm" and recipe.sources.get("cluster.master_port", DEFAULT) == DEFAULT:
        return job_port(os.environ, port)
    return port


def _model(recipe: Recipe) -> tuple[JSONObject, str, str, tuple[Problem, ...], int]:
    """(config.json, its file, its label, why it could not be read, hidden size)."""
    source = None
    try:
        source = config_source(recipe.model, base=recipe.base_dir)
        cfg = (
            load_config_file(source.file)
            if source.hub_id or recipe.model.config
            else load_model_config(recipe.model.path)
        )
        return cfg, source.file, source.label, (), hidden_size(cfg)
    except UserError as e:  # ModelConfigError: build_plan re-anchors it at the recipe's model.path line
        problems = tuple(e.problems) or (Problem(str(e)),)
        return {}, source.file if source else "", source.label if source else "", problems, 0


def model_shape(recipe: Recipe, cfg: JSONObject, file: str, label: str) -> ModelShape:
    """Closed form for known families; the meta device (imports transformers, ~seconds) for anything else."""
    path = recipe.model.path
    shape = count_params(cfg, source=label or f"{path}/config.json")
    return shape if shape is not None else count_params_meta(file or path)


def profile_request(recipe: Recipe, cfg: JSONObject) -> Request:
    """What the model's profile depends on for this recipe (the cache key hashes it)."""
    r = recipe
    lora: JSONObject | None = None
    if r.peft is not None:
        lora = {
            "r": int(r.peft.r),
            "alpha": float(r.peft.alpha),
            "dropout": float(r.peft.dropout),
            "target_modules": list(r.peft.target_modules),
        }
    return request_for(cfg, r.train.precision, bool(r.model.gradient_checkpointing), lora)


def profiles(recipe: Recipe, cfg: JSONObject, shape: ModelShape) -> Loaded:
    """The model's activation and work profile for this recipe: traced (cached), else the closed form."""
    r = recipe
    k = PRECISION_BYTES[r.train.precision]
    inputs: list[int] = []
    if r.peft is not None:
        try:  # the input widths of the adapted modules (lora_A is r x in): the closed form's dropout term
            inputs = [x // r.peft.r for x in lora_tensors(shape, r.peft.r, r.peft.target_modules)[0::2]]
        except UserError:
            inputs = []
    eager = str(cfg.get("_attn_implementation") or cfg.get("attn_implementation") or "") == "eager"
    gc = bool(r.model.gradient_checkpointing)
    dropout = float(r.peft.dropout) if r.peft is not None else 0.0
    base = closed_form(
        shape, k, gradient_checkpointing=gc, eager_attention=eager, lora_inputs=inputs, lora_dropout=dropout, why=""
    )
    return load_profile(profile_request(recipe, cfg), shape, base)


def gather(
    recipe: Recipe,
    *,
    include: str | None = None,
    exclude: str | None = None,
    hosts: list[tuple[str, int]] | None = None,
    devices: dict[str, tuple[int, ...]] | None = None,
    with_memory: bool = True,
    calibrate: bool = True,
) -> PlanInputs:
    """Read everything the plan of ``recipe`` needs (module docstring). ``with_memory=False``: no parameter counts,
    no profile (the plan then estimates no memory). ``calibrate=False``: no calibration (planning a measured run
    for a calibration, ftkit.plan.plan)."""
    if hosts is None:
        hosts, devices = resolve_cluster(recipe, include, exclude)
    devices = {h: d for h, d in (devices or {}).items() if h in {name for name, _ in hosts}}
    cfg, file, label, problems, h = _model(recipe)
    shape = prof = prof3 = None
    if with_memory and not problems:
        shape = model_shape(recipe, cfg, file, label)
        loaded = profiles(recipe, cfg, shape)
        prof, prof3 = loaded.default, loaded.zero3
    gpu, gpu_source = resolve_gpu(recipe.cluster)
    network = resolve_network(recipe.cluster, [name for name, _ in hosts])
    save_s, step_s = measured_costs(recipe.train.output_dir)
    cal = stored_calibration(recipe.train.output_dir, gpu) if calibrate else None
    return PlanInputs(
        recipe=recipe,
        hosts=tuple(hosts),
        devices=devices,
        master_port=master_port(recipe),
        model_config=cfg,
        model_config_file=file,
        model_config_label=label,
        model_problems=problems,
        hidden_size=h,
        shape=shape,
        network=network,
        gpu=gpu,
        gpu_source=gpu_source,
        profile=prof,
        profile_zero3=prof3,
        calibration=cal,
        run_dir=str(Path(recipe.train.output_dir).resolve()),
        measured_save_s=save_s,
        measured_step_s=step_s,
        slurm_hosts=recipe.cluster.engine == "slurm",
    )
