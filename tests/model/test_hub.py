"""Hub model ids (issue 16): ``model.path: org/name`` resolved through huggingface_hub's real download/cache code
against a cache laid out here as the library writes it (``models--org--name/{refs,snapshots,blobs}``), with
``HF_HUB_OFFLINE=1``; a checked-in ``model.config`` for CI without network; one-line errors (exit 2) for an
unknown id, a private model without a token, and no network with no cache (a stand-in hub answers as the hub
does, through ``HF_ENDPOINT``: this machine cannot reach huggingface.co)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import run_ftkit
from tests.helpers.hub import fake_hub, hub_env, populate
from tests.helpers.recipes import TINY_LLAMA

ID = "acme/tiny-llama"
WIDE = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256}  # another revision's config


def _recipe(d: Path, model: str = ID, **model_extra: str) -> Path:
    (d / "data.jsonl").write_text('{"text": "hello"}\n')
    body = {
        "model": {"path": model, **model_extra},
        "data": {"train": "./data.jsonl"},
        "train": {"output_dir": "./run", "micro_batch_size": 2, "global_batch_size": 16, "max_steps": 10},
        "cluster": {"gpus_per_node": 8},
    }
    p = d / "recipe.yaml"
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


@pytest.fixture
def hf_home(tmp_path: Path) -> Path:
    """HF_HOME with acme/tiny-llama cached: main -> TINY_LLAMA, branch v2 -> WIDE (another snapshot)."""
    home = tmp_path / "hf"
    populate(home / "hub", ID, {"config.json": json.dumps(TINY_LLAMA).encode()})
    populate(home / "hub", ID, {"config.json": json.dumps(WIDE).encode()}, revision="v2")
    return home


def _hidden_size(plan_json: str) -> int:
    data = json.loads(plan_json)
    return int(data["model"]["hidden_size"])


@pytest.mark.slow  # seconds of CPU: kept out of make test-fast (under a minute on 2 cores)
def test_plan_render_check_with_a_cached_hub_id(tmp_path, hf_home, model_dir):
    env = hub_env(hf_home)
    (tmp_path / "hub").mkdir()
    hub = _recipe(tmp_path / "hub")
    out = run_ftkit("plan", str(hub), "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert _hidden_size(out.stdout) == TINY_LLAMA["hidden_size"]
    ex = run_ftkit("explain", str(hub), env=env)
    assert ex.returncode == 0 and f"{ID}@main/config.json" in ex.stdout, ex.stdout + ex.stderr
    r = run_ftkit("render", str(hub), env=env)
    assert r.returncode == 0, r.stderr
    c = run_ftkit("check", str(hub), env=env)
    assert c.returncode == 0, c.stdout + c.stderr
    # the same configs as the same config.json in a local directory
    local_dir = tmp_path / "local"
    local_dir.mkdir()
    local = _recipe(local_dir, model=str(model_dir))
    assert run_ftkit("render", str(local)).returncode == 0
    for name in ("ds_config.json", "accelerate.yaml"):
        assert (tmp_path / "hub" / "configs" / name).read_text() == (local_dir / "configs" / name).read_text()


def test_pinning_another_revision_picks_that_snapshots_config(tmp_path, hf_home):
    env = hub_env(hf_home)
    commit = (hf_home / "hub" / "models--acme--tiny-llama" / "refs" / "v2").read_text()
    for revision in ("v2", commit):
        out = run_ftkit("plan", str(_recipe(tmp_path, revision=revision)), "--json", env=env)
        assert out.returncode == 0, out.stderr
        assert _hidden_size(out.stdout) == WIDE["hidden_size"], revision
    out = run_ftkit("plan", str(_recipe(tmp_path, revision="main")), "--json", env=env)
    assert _hidden_size(out.stdout) == TINY_LLAMA["hidden_size"]


def test_checked_in_model_config_makes_check_pass_with_no_cache_in_a_fresh_directory(tmp_path):
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    (repo / "configs" / "model-config.json").write_text(json.dumps(TINY_LLAMA))
    recipe = _recipe(repo, config="configs/model-config.json")
    env = hub_env(tmp_path / "empty-hf-home")  # nothing cached, HF_HUB_OFFLINE=1
    r = run_ftkit("render", str(recipe), env=env)
    assert r.returncode == 0, r.stderr
    fresh = tmp_path / "ci-checkout"
    shutil.copytree(repo, fresh)  # what CI sees: the repository, no hub cache, no network
    c = run_ftkit("check", str(fresh / "recipe.yaml"), env=hub_env(tmp_path / "another-empty-home"), cwd=fresh)
    assert c.returncode == 0, c.stdout + c.stderr
    assert not (tmp_path / "another-empty-home").exists() or not any((tmp_path / "another-empty-home").rglob("*.json"))


def _one_line_exit_2(out: subprocess.CompletedProcess, *needles: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_unknown_id_is_one_line_exit_2(tmp_path):
    with fake_hub({}) as url:  # every repo: 404 RepoNotFound (what the hub answers an authenticated caller)
        env = {**hub_env(tmp_path / "home", offline=False), "HF_ENDPOINT": url, "HF_TOKEN": "hf_testtokenvalue"}
        out = run_ftkit("render", str(_recipe(tmp_path, model="acme/no-such-model")), env=env)
    line = _one_line_exit_2(out, "model.path", "acme/no-such-model", "revision main", "no such model", "check the id")
    assert "hf_testtokenvalue" not in out.stderr + out.stdout
    assert line.startswith("ftkit: error: ")
    assert not (tmp_path / "configs").exists()


def test_private_model_without_a_token_is_one_line_exit_2(tmp_path):
    with fake_hub({"acme/private-llama": (401, "RepoNotFound")}) as url:
        env = {**hub_env(tmp_path / "home", offline=False), "HF_ENDPOINT": url}
        env["HF_TOKEN"] = ""  # no token from the environment; the empty HF_HOME has no token file either
        out = run_ftkit("render", str(_recipe(tmp_path, model="acme/private-llama", revision="v1")), env=env)
    _one_line_exit_2(out, "acme/private-llama", "revision v1", "private", "hf auth login", "HF_TOKEN")
    assert not (tmp_path / "configs").exists()


def test_no_network_and_no_cache_is_one_line_exit_2(tmp_path):
    out = run_ftkit("render", str(_recipe(tmp_path)), env=hub_env(tmp_path / "home"))  # offline, empty cache
    _one_line_exit_2(out, ID, "revision main", "not in the hub cache", "HF_HUB_OFFLINE", "model.config")
    assert not (tmp_path / "configs").exists()


@pytest.mark.slow  # huggingface_hub retries an unreachable hub with backoff: about 23 s
def test_unreachable_hub_and_no_cache_is_one_line_exit_2(tmp_path):
    from tests.helpers.runs import free_port

    env = {**hub_env(tmp_path / "home", offline=False), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    out = run_ftkit("check", str(_recipe(tmp_path)), env=env)
    _one_line_exit_2(out, ID, "revision main", "cannot be reached", "hf download", "HF_HUB_OFFLINE=1")


def test_unknown_revision_is_one_line_exit_2(tmp_path):
    with fake_hub({ID: (404, "RevisionNotFound")}) as url:
        env = {**hub_env(tmp_path / "home", offline=False), "HF_ENDPOINT": url}
        out = run_ftkit("plan", str(_recipe(tmp_path, revision="nope")), env=env)
    _one_line_exit_2(out, ID, "revision nope", "no such revision", "model.revision")


def test_a_local_directory_wins_over_a_hub_looking_name(tmp_path, hf_home):
    (tmp_path / "acme" / "tiny-llama").mkdir(parents=True)
    (tmp_path / "acme" / "tiny-llama" / "config.json").write_text(json.dumps(WIDE))
    out = run_ftkit("plan", str(_recipe(tmp_path)), "--json", env=hub_env(hf_home))
    assert out.returncode == 0, out.stderr
    assert _hidden_size(out.stdout) == WIDE["hidden_size"]  # the directory's, not the cached main's


def test_revision_with_a_local_directory_is_a_recipe_error(tmp_path, model_dir):
    out = run_ftkit("render", str(_recipe(tmp_path, model=str(model_dir), revision="main")))
    _one_line_exit_2(out, "model.revision", "applies to a hub id only")


def test_local_paths_do_not_import_huggingface_hub(tmp_path, model_dir):
    probe = textwrap.dedent(
        """
        import sys
        from ftkit.cli.main import main
        try:
            main()
        except SystemExit:
            pass
        print("HUB=" + str("huggingface_hub" in sys.modules), file=sys.stderr)
        """
    )
    recipe = _recipe(tmp_path, model=str(model_dir))
    out = subprocess.run(
        [sys.executable, "-c", probe, "render", str(recipe)], capture_output=True, text=True, timeout=60
    )
    assert "HUB=False" in out.stderr, out.stderr[-2000:]


def test_init_model_fills_model_path_and_sizes_the_template_per_plan(tmp_path, hf_home):
    out = run_ftkit("init", str(tmp_path / "job"), "--model", ID, "--revision", "v2", env=hub_env(hf_home))
    assert out.returncode == 0, out.stderr
    assert "per ftkit plan for this model" in out.stdout, out.stdout
    values = yaml.safe_load((tmp_path / "job" / "recipe.yaml").read_text())
    assert values["model"]["path"] == ID and values["model"]["revision"] == "v2"
    assert values["zero"]["stage"] in (0, 1, 2, 3)  # the plan's concrete choice, not auto
    assert "# Hub branch, tag or commit" in (tmp_path / "job" / "recipe.yaml").read_text()  # comments kept
    (tmp_path / "job" / "data.jsonl").write_text('{"text": "x"}\n')
    plan = run_ftkit(
        "plan",
        str(tmp_path / "job" / "recipe.yaml"),
        "data.train=" + str(tmp_path / "job" / "data.jsonl"),
        env=hub_env(hf_home),
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr  # what init wrote fits, per plan
    # nothing cached and offline: model.path is still filled in, the template is left as shipped, and it says why
    out = run_ftkit("init", str(tmp_path / "job3"), "--model", "acme/other", env=hub_env(tmp_path / "empty"))
    assert out.returncode == 0, out.stderr
    assert "not sized for the model" in out.stdout and "acme/other" in out.stdout
    assert yaml.safe_load((tmp_path / "job3" / "recipe.yaml").read_text())["model"]["path"] == "acme/other"
    out = run_ftkit("init", str(tmp_path / "job2"), "--revision", "v2")
    _one_line_exit_2(out, "--revision needs --model")


def test_launch_warns_when_the_checked_in_config_differs_from_the_models(tmp_path, hf_home):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "model-config.json").write_text(json.dumps(WIDE))  # checked in; main has TINY_LLAMA
    recipe = _recipe(tmp_path, config="configs/model-config.json")
    out = run_ftkit("launch", str(recipe), "--dry-run", env=hub_env(hf_home))
    assert out.returncode == 0, out.stderr
    warning = [x for x in out.stderr.splitlines() if "warning: model.config" in x]
    assert len(warning) == 1 and f"{ID}@main/config.json" in warning[0], out.stderr
    assert "hidden_size" in warning[0] and "intermediate_size" in warning[0]
    (tmp_path / "configs" / "model-config.json").write_text(json.dumps(TINY_LLAMA))  # now the same: no warning
    out = run_ftkit("launch", str(recipe), "--dry-run", env=hub_env(hf_home))
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr


def test_fingerprint_records_the_resolved_hub_commit_and_config(tmp_path, hf_home):
    """A resume on another revision (another snapshot) is refused: the checkpoint holds the recorded weights."""
    from types import SimpleNamespace

    from ftkit.recipe.load import load_recipe
    from ftkit.run.fingerprint import compare, compute

    repo = hf_home / "hub" / "models--acme--tiny-llama"
    recipe = load_recipe(_recipe(tmp_path))
    assert recipe["model.path"] == ID  # a hub id is not resolved against the recipe's directory

    def fp(revision: str) -> dict:
        commit = (repo / "refs" / revision).read_text()
        return compute(
            SimpleNamespace(recipe=recipe, model_config_file=str(repo / "snapshots" / commit / "config.json"))
        )

    main, v2 = fp("main"), fp("v2")
    assert main["model"]["commit"] == (repo / "refs" / "main").read_text()
    assert compare(main, fp("main")).ok
    refused = compare(main, v2).refused
    assert [(c.key, c.verdict) for c in refused] == [("model.path", "impossible")]
    # same content as a model directory: the hash matches a local copy of the same config.json
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "config.json").write_bytes((repo / "snapshots" / main["model"]["commit"] / "config.json").read_bytes())
    from ftkit.run.fingerprint import _model_part

    assert _model_part(str(local))["config_xxh3_128"] == main["model"]["config_xxh3_128"]


def test_dry_run_with_a_hub_id_never_prints_the_token(tmp_path, hf_home):
    env = {**hub_env(hf_home), "HF_TOKEN": "hf_secretvalue123"}
    out = run_ftkit("launch", str(_recipe(tmp_path)), "--dry-run", env=env)
    assert out.returncode == 0, out.stderr
    assert "hf_secretvalue123" not in out.stdout + out.stderr
    assert "HF_HUB_OFFLINE=1" in out.stdout  # the ranks get the head's hub settings
