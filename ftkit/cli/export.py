"""ftkit export: the trained model out of a committed checkpoint, for from_pretrained, proven by its logits."""

from __future__ import annotations

import click

from ftkit.errors import Problem, UserError
from ftkit.export import export, verify_export


@click.command(
    "export",
    epilog="""\b
Reads one committed checkpoint (its commit record verified, every byte), whatever wrote it:
ZeRO-0..3 with or without offload, DeepSpeed's universal checkpoint (--universal), the
run's final/, LoRA (merged into the base model by default, or --adapter). Writes sharded
safetensors with the index, config, generation config, tokenizer, a README model card
(provenance and verdict), ftkit_export.json and a commit record. Weights are streamed:
host memory holds about one tensor, not the model. Then the export is loaded with
from_pretrained and its logits compared with the checkpoint loaded independently
(DeepSpeed's zero_to_fp32; PEFT's merge for LoRA): max |diff| <= 1e-5 (bf16/fp16: against
the same weights rounded alike). Everything is written beside DIR and renamed into place
at the end: a refused or failed export leaves DIR as it was.

\b
Exit codes:
  0   exported (and verified unless --no-verify); --verify: the export checks out
  2   bad option, RUN is not a run directory, DIR exists and is not empty (see --force),
      or DIR would overlap the checkpoint or a name the run uses, or lie in a run's own
      state (its ftkit/, logs/, records: never, even with --force)
  5   the checkpoint is not committed, fails verification (the reason is printed), or
      has a layout export cannot read yet (FSDP2); a LoRA merge whose base model's weights
      changed since training (by content); --verify: its source changed or is gone
  11  the run, still training, deleted the checkpoint (its rotation) before the export
      could hold it: not damaged; export a newer one (a held checkpoint is read to the end)
  12  no space left on the device
  13  --verify: a file of the export differs from the export's commit record
  15  the export's logits differ from the checkpoint's (nothing is put in place)

\b
Examples:
  ftkit export runs/demo                          # final/ if the run finished, else the newest checkpoint
  ftkit export runs/demo --checkpoint 800 -o out/step800 --dtype bf16 --max-shard-size 2GB
  ftkit export runs/lora --adapter                # the LoRA adapter alone (default: merged)
  ftkit export runs/shrunk --checkpoint latest --universal
  ftkit export --verify out/step800               # re-check an earlier export
""",
)
@click.argument("run_dir", required=False, metavar="RUN", type=click.Path(path_type=str))
@click.option(
    "--checkpoint",
    "checkpoint",
    default=None,
    metavar="N|latest|final",
    help="Which checkpoint: a step, latest (the newest committed) or final. Default: final/ when the run finished "
    "(committed), else latest.",
)
@click.option(
    "-o",
    "--out",
    "out",
    type=click.Path(path_type=str),
    default=None,
    help="Directory to write (default: RUN/exports/<checkpoint>). Must not exist or be empty, unless --force.",
)
@click.option("--merge-lora", "merge_lora", is_flag=True, help="LoRA: merge the adapter into the base model (default).")
@click.option("--adapter", is_flag=True, help="LoRA: write PEFT's adapter files only (PeftModel.from_pretrained).")
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default=None,
    help="Weights dtype. Default: the run's train.precision.",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Largest safetensors file (5GB = 5e9 bytes, 2GiB = 2^31); a larger tensor gets a file of its own.",
)
@click.option(
    "--universal",
    is_flag=True,
    help="Read the checkpoint's DeepSpeed universal checkpoint (written when ftkit continued on fewer hosts) "
    "instead of its ZeRO shards.",
)
@click.option("--no-verify", "no_verify", is_flag=True, help="Skip the logits check (it loads the model twice).")
@click.option("--force", is_flag=True, help="Replace a non-empty DIR (atomically, once the new export is complete).")
@click.option(
    "--verify",
    "verify_dir",
    type=click.Path(path_type=str),
    default=None,
    metavar="DIR",
    help="Re-check an earlier export instead: its files against its commit record, then its logits against the "
    "checkpoint it came from. Writes nothing.",
)
def command(
    run_dir: str | None,
    checkpoint: str | None,
    out: str | None,
    merge_lora: bool,
    adapter: bool,
    dtype: str | None,
    max_shard_size: str,
    universal: bool,
    no_verify: bool,
    force: bool,
    verify_dir: str | None,
) -> None:
    """Export RUN's trained model from a committed checkpoint to a directory from_pretrained loads."""

    if verify_dir is not None:
        if run_dir is not None:
            raise UserError(Problem("give either RUN (export) or --verify DIR (re-check), not both", key="--verify"))
        verify_export(verify_dir, note=click.echo)
        return
    if run_dir is None:
        raise UserError(Problem("missing RUN (the run's train.output_dir), or --verify DIR", key="RUN"))
    if merge_lora and adapter:
        raise UserError(Problem("--merge-lora and --adapter exclude each other", key="--adapter"))
    lora = "adapter" if adapter else ("merge" if merge_lora else None)
    export(
        run_dir,
        checkpoint,
        out,
        lora=lora,
        dtype=dtype,
        max_shard_size=max_shard_size,
        universal=universal,
        verify=not no_verify,
        force=force,
        note=click.echo,
    )
