"""A Hugging Face hub cache on disk, in the layout huggingface_hub itself writes and reads, and a stand-in hub.

``populate`` lays out ``<cache>/models--org--name/{blobs/<sha>, snapshots/<commit>/<file> -> ../../blobs/<sha>,
refs/<revision>}`` so ``hf_hub_download``/``from_pretrained`` resolve ids from it with ``HF_HUB_OFFLINE=1``,
through their real code. ``FakeHub`` answers HTTP like the hub does for the error cases (status and
``X-Error-Code`` header), for ``HF_ENDPOINT``: this machine cannot reach huggingface.co.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path


def populate(
    cache: Path, repo_id: str, files: dict[str, bytes | Path], revision: str = "main", commit: str = ""
) -> str:
    """Add one snapshot of ``repo_id`` (files by name: bytes or a file to copy) under ``refs/<revision>``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    contents = {n: (v.read_bytes() if isinstance(v, Path) else v) for n, v in files.items()}
    commit = (
        commit
        or hashlib.sha1(
            repr(sorted((n, hashlib.sha1(b).hexdigest()) for n, b in contents.items())).encode()
        ).hexdigest()
    )
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blobs / sha, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def hub_env(home: Path, offline: bool = True) -> dict[str, str]:
    """Environment that points huggingface_hub at ``home`` (HF_HOME, its hub cache) and nowhere else."""
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


class _Handler(http.server.BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, str]] = {}

    def _answer(self) -> None:
        repo = "/".join(self.path.strip("/").split("/")[:2])
        status, code = self.server.answers.get(repo, (404, "RepoNotFound"))  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = _answer
    do_GET = _answer

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def fake_hub(answers: dict[str, tuple[int, str]]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering ``{repo_id: (status, X-Error-Code)}``; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.answers = answers  # type: ignore[attr-defined]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
