"""The command line as a user meets it: clean errors (exit 2, file:line, no traceback, nothing written), init,
import-light commands, the shipped package, the generated reference."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import yaml

from ftkit.recipe.reference import json_schema, markdown_reference
from ftkit.recipe.scaffold import RECIPE_TEMPLATES, regenerated
from tests.helpers.cli import run_ftkit
from tests.helpers.paths import REPO

HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "peft")


def _recipe(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(textwrap.dedent(body))
    return p


BASE = """\
model: {path: ./model}
data: {train: ./data.jsonl}
train:
  output_dir: ./run
  micro_batch_size: 2
  global_batch_size: 16
cluster: {gpus_per_node: 8}
"""


@pytest.mark.parametrize(
    "body,expected",
    [
        ("model: {path: ./model\ndata: [\n", "recipe.yaml:2: invalid YAML"),
        (BASE + "zero: {stag: 3}\n", "recipe.yaml:8 zero.stag: unknown key (did you mean 'stage'?)"),
        (
            BASE.replace("micro_batch_size: 2", "micro_batch_size: two"),
            "recipe.yaml:5 train.micro_batch_size: expected int, got text 'two'",
        ),
        (
            BASE.replace("global_batch_size: 16", "global_batch_size: 21"),
            "recipe.yaml:6 train.global_batch_size: 21 is not a multiple of train.micro_batch_size 2",
        ),
        (
            BASE.replace("global_batch_size: 16", "global_batch_size: 24"),
            "recipe.yaml:6 train.global_batch_size: 24 is not divisible by micro_batch_size 2 x world size 8 = 16",
        ),
        (
            BASE + "zero: {stage: 2, offload_params: cpu}\n",
            "recipe.yaml:8 zero.offload_params: parameter offload needs ZeRO stage 3",
        ),
        (BASE.replace("./model", "./nomodel"), "recipe.yaml:1 model.path:"),
    ],
)
def test_bad_recipe_one_line_exit_2_nothing_written(tmp_path, model_dir, body, expected):
    p = _recipe(tmp_path, body)
    for cmd in ("render", "check", "explain", "plan"):
        out = run_ftkit(cmd, str(p), cwd=tmp_path)
        assert out.returncode == 2, (cmd, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr + out.stdout
        lines = [x for x in out.stderr.splitlines() if x.strip()]
        assert any(expected in x for x in lines), (cmd, lines)
        assert all(x.startswith("ftkit: error: ") for x in lines), lines
    assert not (tmp_path / "configs").exists()
    assert not (tmp_path / "run").exists()


def test_missing_model_config_names_the_file(tmp_path, model_dir):
    (model_dir / "config.json").unlink()
    p = _recipe(tmp_path, BASE)
    out = run_ftkit("render", str(p))
    assert out.returncode == 2
    assert "model.path" in out.stderr and "config.json" in out.stderr and "Traceback" not in out.stderr


def test_bad_override_and_all_problems_at_once(tmp_path, model_dir):
    p = _recipe(tmp_path, BASE)
    out = run_ftkit("render", str(p), "train.seed=-1", "zero.offload_optimizer=gpu", "nokey")
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 3, lines
    assert "command line train.seed: must be at least 0; got -1" in out.stderr
    assert "command line zero.offload_optimizer: must be one of none, cpu, nvme, auto; got 'gpu'" in out.stderr
    assert "override 'nokey' is not KEY=VALUE" in out.stderr


def test_init_writes_refuses_and_forces(tmp_path):
    d = tmp_path / "job"
    out = run_ftkit("init", str(d), "--template", "full")
    assert out.returncode == 0, out.stderr
    recipe = (d / "recipe.yaml").read_text()
    assert "# Peak learning rate (AdamW). Default: 0.0002." in recipe
    assert (d / "hostfile").read_text().startswith("# ftkit hostfile")
    (d / "recipe.yaml").write_text("# mine\n")
    again = run_ftkit("init", str(d))
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr
    assert (d / "recipe.yaml").read_text() == "# mine\n"  # nothing overwritten
    assert run_ftkit("init", str(d), "--force").returncode == 0
    assert "lora" in (d / "recipe.yaml").read_text()


@pytest.mark.parametrize("name", sorted(RECIPE_TEMPLATES))
def test_initialised_recipe_validates_and_renders_as_is(tmp_path, name):
    assert run_ftkit("init", str(tmp_path), "-t", name).returncode == 0
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(
        (REPO / "tests/fixtures/model_configs/Meta-Llama-3-8B.json").read_text()
    )
    out = run_ftkit("render", str(tmp_path / "recipe.yaml"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "configs" / "ds_config.json").exists()


@pytest.mark.parametrize("name", sorted(RECIPE_TEMPLATES))
def test_template_comments_are_the_schema_docs_and_schema_accepts_it(name):
    import jsonschema

    text = (REPO / "templates" / RECIPE_TEMPLATES[name][0]).read_text()
    assert regenerated(text) == text, "run `make templates` after changing ftkit/schema.py"
    jsonschema.validate(yaml.safe_load(text), json_schema())


def test_reference_docs_are_current():
    assert (REPO / "docs" / "recipe.md").read_text() == markdown_reference(), "run `make docs`"
    assert json.loads((REPO / "docs" / "recipe.schema.json").read_text()) == json_schema(), "run `make docs`"


_PROBE = """
import sys
from ftkit.cli.main import cli
code = 0
try:
    cli(sys.argv[1:], standalone_mode=False)
except SystemExit as e:
    code = e.code
print("EXIT=" + str(code), file=sys.stderr)
print("HEAVY=" + ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("args", "done"),
    [
        (["--help"], "Usage:"),
        (["init", "{d}/x"], "x/recipe.yaml"),
        (["render", "{r}"], "ds_config.json"),
        (["check", "{r}"], "accelerate.yaml: in sync"),
        (["explain", "{r}"], "zero_optimization.stage"),
        (["plan", "{r}"], "<- this run"),
        (["launch", "{r}", "--dry-run"], "dry run: a launch now starts fresh"),
        (["schema"], '"properties"'),
    ],
)
def test_config_commands_import_no_heavy_stack(tmp_path, model_dir, args, done):
    """Each command runs to its end (exit 0, its own last words printed) without importing the heavy stack: a
    command that stopped early at an error would prove nothing (issue 41 point 5: ``launch --dry-run`` exited 2 on a
    missing data file before reaching the code it checks)."""
    r = _recipe(tmp_path, BASE)
    (tmp_path / "data.jsonl").write_text('{"text": "hello world"}\n')
    if args[0] == "check":  # configs to check against
        assert subprocess.run([sys.executable, "-m", "ftkit", "render", str(r)], capture_output=True).returncode == 0
    argv = [a.format(d=tmp_path, r=r) for a in args]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True, timeout=60
    )
    assert "EXIT=0" in out.stderr.splitlines() and done in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    heavy = [line for line in out.stderr.splitlines() if line.startswith("HEAVY=")]
    assert heavy == ["HEAVY="], out.stderr[-2000:]


def test_every_command_is_listed_and_loaded_only_when_it_runs():
    """``ftkit.cli.main.COMMANDS`` names each command's module; ``ftkit render`` imports no other command's."""
    import importlib

    from ftkit.cli.main import COMMANDS

    for name, module in COMMANDS.items():
        assert importlib.import_module(f"ftkit.cli.{module}").command.name == name
    modules = {p.stem for p in (REPO / "ftkit" / "cli").glob("*.py")} - {"__init__", "main", "options"}
    assert set(COMMANDS.values()) == modules, "a command module missing from COMMANDS"
    probe = (
        "import json, sys\nfrom ftkit.cli.main import cli\ntry:\n    cli(['render', '--help'])\nexcept SystemExit:\n"
        "    pass\nnames = sorted(m for m in sys.modules if m.startswith('ftkit.cli.'))\n"
        "print(json.dumps(names), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    loaded = json.loads(out.stderr.strip().splitlines()[-1])
    assert loaded == ["ftkit.cli.main", "ftkit.cli.options", "ftkit.cli.render"], loaded


def test_every_package_is_in_setup_cfg():
    """A folder of the library missing from setup.cfg's packages would be missing from a plain install."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "ftkit").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, sorted(found - listed)


@pytest.mark.heavy
def test_wheel_ships_templates_and_launch(tmp_path):
    """A plain (non-editable) install must carry templates/ and launch/ as package data. Built from the tracked
    files only (a build/ directory left in the checkout would otherwise leak stale modules into the wheel)."""
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("ftkit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in (
        "ftkit/templates/lora.yaml",
        "ftkit/templates/full.yaml",
        "ftkit/templates/cpu-demo.yaml",
        "ftkit/templates/hostfile",
        "ftkit/launch/train.py",
        "ftkit/launch/fixtures.py",
        "ftkit/cli/main.py",
    ):
        assert want in names, want
    target = tmp_path / "site"
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert inst.returncode == 0, inst.stderr
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ftkit.recipe.scaffold as s; print(s.__file__); print(s.read_template('lora.yaml')[:20])",
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert str(target) in probe.stdout and "# LoRA fine-tuning" in probe.stdout


def test_shell_completion_works():
    """click's completion, as docs/completion.md documents it: the script, and completing a command and a template."""
    import os

    env = {**os.environ, "_FTKIT_COMPLETE": "bash_source"}
    exe = str(Path(sys.executable).parent / "ftkit")  # the console script pip installed, as a user runs it
    script = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=60)
    assert "complete -o nosort -F _ftkit_completion ftkit" in script.stdout, script.stdout[:500]

    def complete(words: str) -> list[str]:
        env = {
            **os.environ,
            "_FTKIT_COMPLETE": "bash_complete",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
        }
        out = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in out.stdout.splitlines() if "," in line]

    assert "render" in complete("ftkit re")
    assert complete("ftkit init --template cp") == ["cpu-demo"]
