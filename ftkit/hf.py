"""``ftkit.hf``: what a training script calls to run under ``ftkit launch`` (the rank's services live in
:mod:`ftkit.launch.services`; this is their public face).

Under ``ftkit launch`` every rank finds its run in the environment (``FTKIT_RUN_DIR``, ``FTKIT_ATTEMPT``,
``FTKIT_RESUME``). A script that wants to be explicit (``ftkit launch --no-inject``) uses::

    import ftkit.hf
    args = ftkit.hf.training_arguments(my_option=...)       # the recipe's values, plus yours where it is silent
    trainer = Trainer(model, args, train_dataset=..., callbacks=ftkit.hf.callbacks())
    trainer.train(resume_from_checkpoint=ftkit.hf.resume_checkpoint())
    ftkit.hf.save_final(trainer)

and a loop without HF Trainer reports its steps and saves through :func:`step`, :func:`checkpoint` and :func:`final`,
resuming from :func:`resume_checkpoint` / :func:`resume_step`. An unmodified script gets the same through the import
hook (:mod:`ftkit.launch.hook`). Importing this module is cheap (no torch or transformers).
"""

from __future__ import annotations

from ftkit.launch.services import (
    active,
    apply,
    callbacks,
    checkpoint,
    commit_final,
    context,
    final,
    recipe_arguments,
    record_changes,
    resume_checkpoint,
    resume_step,
    save_final,
    spec,
    start,
    step,
    stopped_at,
    training_arguments,
)

__all__ = [
    "active",
    "apply",
    "callbacks",
    "checkpoint",
    "commit_final",
    "context",
    "final",
    "recipe_arguments",
    "record_changes",
    "resume_checkpoint",
    "resume_step",
    "save_final",
    "spec",
    "start",
    "step",
    "stopped_at",
    "training_arguments",
]
