"""Planning: from a recipe's inputs to a Plan (memory per GPU, step time, the fastest candidate that fits) with every
knob's reason.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.calibrate`: Step-time calibration from measured runs: what a run directory measured, and the calibration
  kept beside it.
* :mod:`.candidates`: Memory planning for a recipe: the Workload from the plan, every candidate's estimate, and the
  choice.
* :mod:`.comm`: Communication and step time per optimizer step, for every ZeRO candidate (docs/design.md,
  Communication model).
* :mod:`.fsdp`: The FSDP2 half of a plan (``train.backend: fsdp2``): every field of accelerate.yaml's
  ``fsdp_config`` with its value and why (``ftkit explain`` lists them, the renderer writes them), and the ZeRO
  stage and offloads whose memory the ``fsdp`` section's candidate has (:class:`ftkit.plan.memory.Fsdp2`; the
  planner estimates it like any other).
* :mod:`.inputs`: The edge of planning: everything a plan is built from, read once into a frozen
  :class:`PlanInputs`.
* :mod:`.knobs`: Every knob the rendered configs carry, decided in one place with its reason (docs/design.md,
  Rendering rules).
* :mod:`.load`: The steps every config-producing command shares: load the recipe, plan, render (no writing here).
* :mod:`.local_tier`: The local checkpoint tier of a plan: where on each node, how often, and how much host memory
  it takes.
* :mod:`.memory`: Per-GPU (and per-node host) memory of a fine-tuning run, for every ZeRO stage and offload choice.
* :mod:`.parallel`: Tensor and sequence parallelism in the plan: the layouts a recipe allows, how each fits and
  runs, and ``auto``.
* :mod:`.plan`: From the inputs of a recipe to a Plan: every number the configs need, with its reason.
* :mod:`.profile`: What one training step of the model keeps in memory and does, per sequence length and batch: its
  profile.
* :mod:`.speed`: Step time without communication: GPU work, host overheads, the optimizer step, offload
  (docs/design.md, Communication model; :func:`ftkit.plan.comm.predict` adds the exposed communication).
* :mod:`.types`: The plan's records, below everything else in ``plan/``: the inputs gathered at the edge
  (:class:`PlanInputs`), the result (:class:`Plan`, each knob with its reason) and the memory and step-time report
  (:class:`MemoryReport`).
"""

__all__ = [
    "calibrate",
    "candidates",
    "comm",
    "fsdp",
    "inputs",
    "knobs",
    "load",
    "local_tier",
    "memory",
    "parallel",
    "plan",
    "profile",
    "speed",
    "types",
]
