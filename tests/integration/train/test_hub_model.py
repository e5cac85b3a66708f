"""A hub model id trained for real: 2 CPU ranks of the fixtures model, served from a hub cache laid out as
huggingface_hub writes it (``HF_HUB_OFFLINE=1``), pinned to a revision the ranks must honour. Resolving ids, the
cache and the one-line errors are tests/model/test_hub.py.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.hub import hub_env, populate

ID = "acme/tiny-llama"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_launch_of_a_hub_id_loads_the_pinned_revision(tmp_path, fx):
    from tests.helpers.runs import RUN_ENV, RUN_TIMEOUT_S, assert_no_process_left, ftkit, losses, mp_lock
    from tests.helpers.runs import write_recipe as recipe_for

    home = tmp_path / "hf"
    files = {f.name: f for f in fx["model"].iterdir() if f.is_file()}
    # only refs/v1: a rank that ignored model.revision (and asked for main) could not load it offline
    commit = populate(home / "hub", ID, files, revision="v1")
    recipe = recipe_for(tmp_path, fx, model__path=ID, model__revision="v1", train__max_steps=4, train__save_steps=4)
    with mp_lock():
        r = ftkit("launch", str(recipe), env={**RUN_ENV, **hub_env(home)}, timeout=RUN_TIMEOUT_S)
    run = tmp_path / "run"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_no_process_left(run)
    assert sorted(losses(run)) == [1, 2, 3, 4]
    spec = json.loads((run / "ftkit" / "spec.json").read_text())
    assert (spec["model_path"], spec["model_revision"], spec["tokenizer_revision"]) == (ID, "v1", "v1")
    assert spec["fingerprint"]["model"]["commit"] == commit
