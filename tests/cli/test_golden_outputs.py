"""`ftkit render`, `ftkit plan --json` and `ftkit explain` are pinned, byte for byte, for a matrix of recipes: ZeRO 0-3
x optimizer offload x precision x topology x LoRA, on Llama-3-8B's config. A refactoring must leave every file as it
is; a change of behaviour regenerates them on purpose (``FTKIT_UPDATE_GOLDEN=1``) and shows in the diff.
"""

from __future__ import annotations

import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftkit.cli.main import cli
from tests.helpers.paths import GOLDEN, MODEL_CONFIGS

OUTPUTS = GOLDEN / "outputs"
# the local tier's default directory hashes the run directory's absolute path, which lies under tmp_path
TIER_HASH = re.compile(r"(/dev/shm/ftkit-golden-)[0-9a-f]{8}")
MODEL = MODEL_CONFIGS / "Meta-Llama-3-8B.json"

STAGES = (0, 1, 2, 3)
OFFLOAD = ("none", "cpu")
PRECISION = ("bf16", "fp16", "fp32")
TOPOLOGY = ("1x8", "2x8")
LORA = (False, True)


def cases() -> list[tuple[int, str, str, str, bool]]:
    return [
        (z, o, p, t, lora)
        for z in STAGES
        for o in OFFLOAD
        for p in PRECISION
        for t in TOPOLOGY
        for lora in LORA
        if not (z == 0 and o != "none")  # DeepSpeed offloads from stage 1 on
    ]


def _id(case: tuple[int, str, str, str, bool]) -> str:
    z, o, p, t, lora = case
    return f"z{z}-{o}-{p}-{t}-{'lora' if lora else 'full'}"


def _recipe(tmp_path: Path, case: tuple[int, str, str, str, bool]) -> Path:
    z, o, p, t, lora = case
    nodes, gpus = (int(x) for x in t.split("x"))
    (tmp_path / "model").mkdir()
    shutil.copy(MODEL, tmp_path / "model" / "config.json")
    peft = "peft:\n  method: lora\n  r: 16\n  alpha: 32\n  target_modules: [q_proj, v_proj]\n" if lora else ""
    body = textwrap.dedent(
        f"""\
        name: golden
        model:
          path: ./model
          gradient_checkpointing: true
        data:
          train: ./data.jsonl
          max_seq_len: 2048
        train:
          output_dir: ./run
          precision: {p}
          micro_batch_size: 1
          global_batch_size: {64 * nodes}
          max_steps: 100
        zero:
          stage: {z}
          offload_optimizer: {o}
        cluster:
          num_nodes: {nodes}
          gpus_per_node: {gpus}
          gpu_memory_gb: 80
          host_memory_gb: 1024
          master_addr: 10.0.0.1
          network: nvlink-ib400
        """
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(body + peft)
    return path


def outputs(tmp_path: Path, case: tuple[int, str, str, str, bool]) -> dict[str, str]:
    _recipe(tmp_path, case)
    runner = CliRunner()
    out: dict[str, str] = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the outputs name paths relative to here: the same on every machine
    try:
        for name, args in (
            ("render.txt", ["render", "recipe.yaml", "-o", "configs"]),
            ("plan.json", ["plan", "recipe.yaml", "--json"]),
            ("explain.txt", ["explain", "recipe.yaml"]),
        ):
            r = runner.invoke(cli, args, catch_exceptions=False, env={"FTKIT_BANDWIDTH_FILE": str(tmp_path / "none")})
            out[name] = f"exit {r.exit_code}\n{r.output}".replace(str(tmp_path), "<tmp>")
            out[name] = TIER_HASH.sub(r"\1<hash>", out[name])
        for f in ("ds_config.json", "accelerate.yaml"):
            path = tmp_path / "configs" / f
            out[f] = path.read_text().replace(str(tmp_path), "<tmp>") if path.exists() else "(not written)\n"
    finally:
        os.chdir(cwd)
    return out


@pytest.mark.parametrize("case", cases(), ids=[_id(c) for c in cases()])
def test_outputs_match_the_golden_files(case, tmp_path):
    for name, text in outputs(tmp_path, case).items():
        golden = OUTPUTS / _id(case) / name
        if os.environ.get("FTKIT_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.is_file(), f"{golden} is missing: run with FTKIT_UPDATE_GOLDEN=1"
        assert golden.read_text() == text, f"{golden} differs: rerun with FTKIT_UPDATE_GOLDEN=1 if intended"
