"""Where a recipe's model ``config.json`` comes from: a local directory, a checked-in file, or the Hugging Face hub.

``model.path`` is a local directory when one exists there (relative to the recipe), else a hub id ``org/name``
when it looks like one. For a hub id the controller needs only ``config.json``: it is resolved through
``huggingface_hub``'s own download and cache code (``hf_hub_download``: one small file, never the weights), which
honours ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and a token from the usual places (``HF_TOKEN``, the file
``hf auth login`` writes). ``huggingface_hub`` is imported only when an id is resolved, so local paths stay
import-light (it costs about 0.2 s). ``model.config`` names a checked-in copy of ``config.json`` that plan, render and
check read instead of fetching (CI without network); ``ftkit launch`` compares it with the real one.

Failures end in one :class:`~ftkit.errors.ModelConfigError` line naming the id, the revision and the fix.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Protocol

from ftkit.errors import ModelConfigError, Problem
from ftkit.model.shape import load_config_file, load_model_config

DEFAULT_REVISION = "main"
# The hub's repo-id grammar (huggingface_hub.utils.validate_repo_id): namespace/name, letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def looks_like_hub_id(value: str) -> bool:
    """``org/name`` with the hub's characters: not absolute, not ``./x``, no ``..``, no ``--``, no scheme."""
    return bool(_HUB_ID.fullmatch(value)) and ".." not in value and "--" not in value and not value.endswith(".git")


def is_hub_id(value: str | None, base: str | os.PathLike[str] | None = None) -> bool:
    """True when ``value`` names a hub model: it looks like an id and no such local directory exists under ``base``
    (a directory that exists wins, as in ``from_pretrained``)."""
    if not value or not looks_like_hub_id(value):
        return False
    local = os.path.join(os.fspath(base), value) if base is not None else value
    return not os.path.isdir(os.path.expanduser(local))


@dataclass(frozen=True)
class ConfigSource:
    """The ``config.json`` a plan reads: ``file`` on disk, and ``label`` as messages and notes name it."""

    file: str
    label: str
    hub_id: str | None = None
    revision: str | None = None


class ModelKeys(Protocol):
    """The recipe's ``model`` section as this module reads it (``ftkit.rundir.sections.ModelSection``)."""

    @property
    def path(self) -> str: ...

    @property
    def revision(self) -> str | None: ...

    @property
    def config(self) -> str | None: ...


def _revision(model: ModelKeys) -> str:
    return model.revision or DEFAULT_REVISION


def model_is_hub(model: ModelKeys) -> bool:
    """The recipe's model is a hub id (the loader left it unresolved; a local path is absolute by then)."""
    path = model.path
    return bool(path) and not os.path.isabs(path) and looks_like_hub_id(path)


def config_source(
    model: ModelKeys, *, base: str | os.PathLike[str] | None = None, checked_in: bool = True
) -> ConfigSource:
    """The config.json plan/render/check read: ``model.config`` when set (and ``checked_in``), the local model
    directory's, or the hub's (resolved into the local cache, fetched when the hub is reachable). ``base``: the
    recipe's directory, where a local ``model.path`` was looked for (named when the hub has no such id either)."""
    path = model.path
    if checked_in and model.config:
        return ConfigSource(model.config, model.config)
    if model_is_hub(model):
        rev = _revision(model)
        try:
            file = hub_config_file(path, rev)
        except ModelConfigError as e:  # say that a directory of that name was looked for too (a typo, or a hub id?)
            if base is None or not e.problems:
                raise
            msg = e.problems[0].message.replace(": ", f": no directory {os.path.join(base, path)}, and ", 1)
            raise ModelConfigError(Problem(msg)) from None
        return ConfigSource(file, f"{path}@{rev}/config.json", hub_id=path, revision=rev)
    return ConfigSource(os.path.join(path, "config.json"), os.path.join(path, "config.json"))


def _no_cache_fix(repo_id: str, revision: str) -> str:
    rev = "" if revision == DEFAULT_REVISION else f" --revision {revision}"
    return (
        f"run `hf download {repo_id} config.json{rev}` where the hub is reachable (same HF_HOME/HF_HUB_CACHE), "
        "or set model.config to a checked-in config.json; HF_HUB_OFFLINE=1 skips the hub's retries"
    )


def hub_config_file(repo_id: str, revision: str = DEFAULT_REVISION) -> str:
    """Path of ``config.json`` for ``repo_id`` at ``revision`` in the hub cache, downloading it if needed.

    Raises ModelConfigError (one line: id, revision, what went wrong, the fix) for an unknown id, a private or
    gated model without access, an unknown revision, a repository without config.json, and no network with no
    cached copy. The token is never printed.
    """
    try:
        from huggingface_hub import constants, get_token, hf_hub_download
        from huggingface_hub import errors as hf_errors
    except ImportError as exc:  # pragma: no cover - huggingface_hub ships with transformers
        raise _error(
            repo_id, revision, f"huggingface_hub is not importable ({exc})", "pip install huggingface_hub"
        ) from None
    # The library logs each retry of an unreachable hub ("Retrying in 8s", about 23 s in all) on stderr: the
    # user gets ftkit's one line instead.
    log = logging.getLogger("huggingface_hub")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return hf_hub_download(repo_id, "config.json", revision=revision)
    except hf_errors.GatedRepoError:
        raise _error(
            repo_id,
            revision,
            "gated model: your account has not been granted access",
            f"accept the conditions at {constants.ENDPOINT}/{repo_id} and log in (`hf auth login` or HF_TOKEN)",
        ) from None
    except hf_errors.RepositoryNotFoundError:
        if get_token() is None:
            raise _error(
                repo_id,
                revision,
                "no such model on the hub, or it is private and no token is set",
                "check the id; for a private model log in with `hf auth login` or set HF_TOKEN",
            ) from None
        raise _error(
            repo_id,
            revision,
            "no such model on the hub (or your token cannot see it)",
            "check the id and that your token has read access to it",
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise _error(
            repo_id,
            revision,
            "no such revision",
            "set model.revision to an existing branch, tag or commit",
        ) from None
    except hf_errors.LocalEntryNotFoundError as exc:
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else "the hub cannot be reached"
            + (f" ({type(exc.__cause__).__name__})" if exc.__cause__ is not None else "")
        )
        raise _error(
            repo_id,
            revision,
            f"config.json is not in the hub cache ({constants.HF_HUB_CACHE}) and {why}",
            _no_cache_fix(repo_id, revision),
        ) from None
    except hf_errors.EntryNotFoundError:
        raise _error(
            repo_id, revision, "the repository has no config.json", "point model.path at a transformers model"
        ) from None
    except hf_errors.HFValidationError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise _error(repo_id, revision, f"invalid id or revision: {first}", "use org/name") from None
    except hf_errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        raise _error(repo_id, revision, f"the hub answered HTTP {status}", "retry later, or set model.config") from None
    except OSError as exc:
        raise _error(
            repo_id, revision, f"cannot read the hub cache: {exc.strerror or exc}", "check HF_HOME/HF_HUB_CACHE"
        ) from None
    finally:
        log.setLevel(level)


def _error(repo_id: str, revision: str, what: str, fix: str) -> ModelConfigError:
    return ModelConfigError(Problem(f"{repo_id} (revision {revision}): {what} [{fix}]"))


def checked_in_drift(model: ModelKeys, base: str | os.PathLike[str] | None = None) -> str | None:
    """For ``ftkit launch``: a one-line warning when ``model.config`` differs from the model's actual config.json
    (the ranks load the real one), or cannot be compared; None when it is not set or matches."""
    checked = model.config
    if not checked:
        return None

    try:
        mine = load_config_file(checked)
        actual_src = config_source(model, base=base, checked_in=False)
        actual = load_config_file(actual_src.file) if actual_src.hub_id else load_model_config(model.path)
    except ModelConfigError as e:
        return f"ftkit: warning: model.config {checked}: cannot compare with the model's config.json: {e.lines()[0]}"
    if mine == actual:
        return None
    keys = sorted(k for k in set(mine) | set(actual) if mine.get(k, _MISSING) != actual.get(k, _MISSING))
    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    return (
        f"ftkit: warning: model.config {checked} differs from {actual_src.label} ({shown}); the ranks load the "
        "model's own config.json [copy it over the checked-in file and re-render]"
    )


_MISSING = object()
