"""Headless Chromium (Debian's package) driven over the DevTools protocol, for tests that look at a page as a person
would: load it, collect console errors and every network request, query the DOM, take a screenshot, print it.

The protocol runs over ``--remote-debugging-pipe`` (JSON messages ending in NUL on file descriptors 3 and 4), so no
port is opened and no websocket client is needed: the standard library is enough.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--mute-audio",
)


def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing (root only; others skip)."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.geteuid() != 0:
        pytest.skip("needs Debian's chromium (apt-get install chromium, as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = "apt-get update -q && apt-get install -y -q --no-install-recommends chromium"
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=900, env=env)
    found = shutil.which("chromium")
    if r.returncode != 0 or not found:
        pytest.fail(f"installing chromium failed: {(r.stdout + r.stderr)[-2000:]}")
    return found


class DevTools:
    """One headless browser; :meth:`call` sends a command and returns its result, :attr:`events` keeps the rest."""

    def __init__(self, exe: str, user_data_dir: Path, log: Path):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:  # the child reads commands on fd 3 and writes answers on fd 4
            a = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [exe, *FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe", "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                pass_fds=(3, 4),
                preexec_fn=fds,  # noqa: PLW1509 - single-threaded at this point of the test
                start_new_session=True,
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self._next = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._incoming: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                self._incoming.put(None)
                return
            buf += chunk
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                self._incoming.put(json.loads(msg))

    def _pump(self, timeout: float) -> bool:
        try:
            msg = self._incoming.get(timeout=timeout)
        except queue.Empty:
            return False
        if msg is None:
            raise AssertionError("chromium closed the DevTools pipe")
        if "id" in msg:
            self._answers[msg["id"]] = msg
        else:
            self.events.append(msg)
        return True

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None, timeout: float = 60):
        self._next += 1
        n = self._next
        msg: dict[str, Any] = {"id": n, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while n not in self._answers:
            if time.monotonic() > end:
                raise AssertionError(f"no answer to {method} within {timeout}s")
            self._pump(0.2)
        answer = self._answers.pop(n)
        if "error" in answer:
            raise AssertionError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def wait_event(self, method: str, session: str | None = None, timeout: float = 60) -> dict[str, Any]:
        end = time.monotonic() + timeout
        seen = 0
        while True:
            for e in self.events[seen:]:
                if e.get("method") == method and (session is None or e.get("sessionId") == session):
                    return e
            seen = len(self.events)
            if time.monotonic() > end:
                raise AssertionError(f"no {method} within {timeout}s")
            self._pump(0.2)

    def settle(self, seconds: float) -> None:
        """Collect events for a while (late console messages, late requests)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._pump(0.05)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", timeout=10)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def browser(tmp: Path) -> Iterator[DevTools]:
    d = DevTools(chromium(), tmp / "chromium-profile", tmp / "chromium.log")
    try:
        yield d
    finally:
        d.close()


class Visit:
    """What loading one page showed: console errors, requests, the DOM facts asked for, a screenshot, a PDF."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.facts: Any = None


def visit(d: DevTools, url: str, facts_js: str, screenshot: Path, pdf: Path | None = None, width: int = 1100) -> Visit:
    """Open ``url`` in a new tab, wait for its load event, evaluate ``facts_js`` (its JSON value comes back), save a
    full-page screenshot (and the printed page as a PDF)."""
    target = d.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    s = d.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
        d.call(method, session=s)
    d.call(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        session=s,
    )
    start = len(d.events)
    d.call("Page.navigate", {"url": url}, session=s)
    d.wait_event("Page.loadEventFired", session=s)
    d.settle(1.0)
    v = Visit()
    for e in d.events[start:]:
        if e.get("sessionId") != s:
            continue
        p = e.get("params", {})
        if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
            v.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif e["method"] == "Runtime.exceptionThrown":
            v.errors.append(str(p.get("exceptionDetails", {}).get("text")))
        elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
            v.errors.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        elif e["method"] == "Network.requestWillBeSent":
            v.requests.append(p.get("request", {}).get("url", ""))
    got = d.call("Runtime.evaluate", {"expression": facts_js, "returnByValue": True}, session=s)
    if "exceptionDetails" in got:
        raise AssertionError(f"the facts script failed: {got['exceptionDetails']}")
    v.facts = got["result"].get("value")
    shot = d.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=s)
    screenshot.write_bytes(base64.b64decode(shot["data"]))
    if pdf is not None:
        printed = d.call("Page.printToPDF", {"printBackground": False}, session=s, timeout=120)
        pdf.write_bytes(base64.b64decode(printed["data"]))
    d.call("Target.closeTarget", {"targetId": target})
    return v
