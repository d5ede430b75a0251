"""Headless Chromium driven over the Chrome DevTools Protocol, for tests whose product is a page (the console).

``chromium_path()`` finds Debian's ``chromium`` or installs it (``apt-get install -y chromium``, as root) and
returns None with the reason when it cannot; ``Browser`` starts it with ``--remote-debugging-port=0`` and talks to it
over its websocket (``websockets``' sync client); each ``Page`` is a tab with the Network, Page, Runtime and Log
domains enabled, so a test can wait for the page's scripts, read the DOM, and see every request the page made.

    >>> with Browser(tmp_path) as browser:                        # doctest: +SKIP
    ...     page = browser.new_page(width=1366, height=768)
    ...     page.navigate("http://127.0.0.1:8000/")
    ...     page.wait_until("document.body.dataset.loaded === '1'", what="the console loaded")
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import websockets.sync.client

INSTALL_TIMEOUT_S = 900.0
LAUNCH_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 60.0
_NAMES = ("chromium", "chromium-browser")


def _install() -> str | None:
    """``apt-get install -y chromium``; the reason it could not, or None when it was installed."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available to install it"
    if os.geteuid() != 0:
        return "installing it needs root (apt-get install -y chromium)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` took over {INSTALL_TIMEOUT_S:.0f} s"
        if done.returncode != 0:
            return f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    return None


def chromium_path() -> tuple[str | None, str]:
    """Where Chromium is (installing Debian's ``chromium`` when missing), or (None, why it is not there)."""
    for name in _NAMES:
        if path := shutil.which(name):
            return path, ""
    reason = _install()
    for name in _NAMES:
        if path := shutil.which(name):
            return path, ""
    return None, f"chromium is not installed and could not be installed: {reason or 'apt-get gave no chromium'}"


def require_chromium() -> str:
    """Chromium's path, or skip the test with the reason (printed, so a skipped run says why)."""
    path, reason = chromium_path()
    if path is None:
        print(f"\nSKIP browser tests: {reason}")
        pytest.skip(reason)
    return path


class CdpError(RuntimeError):
    """A DevTools command answered with an error, or a page script threw."""


@dataclass
class Page:
    """One tab, attached with a flat session: commands go through the browser's single websocket."""

    browser: Browser
    session: str
    target: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Network.requestWillBeSent's ``request`` objects (url, method, headers), in order."""
    log: list[str] = field(default_factory=list)
    """Console messages, uncaught exceptions and browser log entries (CSP violations land here)."""
    navigations: int = 0
    """Main-frame navigations (a reload counts one more)."""

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, session=self.session)

    def on_event(self, message: dict[str, Any]) -> None:
        method, params = message["method"], message.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"])
        elif method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.log.append(f"console.{params.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.log.append(f"exception: {details.get('exception', {}).get('description', details.get('text'))}")
        elif method == "Log.entryAdded":
            entry = params["entry"]
            self.log.append(f"log.{entry.get('level')} ({entry.get('source')}): {entry.get('text')}")
        elif method == "Page.frameNavigated" and "parentId" not in params["frame"]:
            self.navigations += 1

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        answer = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True})
        if "exceptionDetails" in answer:
            details = answer["exceptionDetails"]
            raise CdpError(f"{expression!r} threw: {details.get('exception', {}).get('description', details)}")
        return answer["result"].get("value")

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait_until(
            f"location.href === {json.dumps(url)} && document.readyState === 'complete'", what=f"{url} loaded"
        )

    def wait_until(self, expression: str, *, timeout_s: float = 30.0, what: str = "") -> Any:
        """Poll ``expression`` until its JSON value is truthy (a DOM node arrives as {}: test it with !!); its value.
        Raises TimeoutError naming ``what`` and the page log."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except CdpError:
                value = None  # e.g. the document is being replaced
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not {what or expression} after {timeout_s} s; page log: {self.log}")
            time.sleep(0.2)

    def press(self, key: str, *, shift: bool = False) -> None:
        """A key press as the keyboard makes it (``"Tab"``, ``"Enter"``, ``"Escape"``), to the focused element."""
        codes = {"Tab": 9, "Enter": 13, "Escape": 27}
        event = {"key": key, "code": key, "windowsVirtualKeyCode": codes[key], "modifiers": 8 if shift else 0}
        if key == "Enter":
            event["text"] = "\r"
        self.send("Input.dispatchKeyEvent", {"type": "keyDown", **event})
        self.send("Input.dispatchKeyEvent", {"type": "keyUp", **event})

    def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        """Write a PNG of the viewport (or the whole page)."""
        answer = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": full_page})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(answer["data"]))
        return path

    def allow_downloads(self, folder: Path) -> None:
        """Save downloads the page starts into ``folder`` (headless Chromium drops them otherwise)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.browser.send("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(folder)})


class Browser:
    """A headless Chromium process with its own profile under ``workdir``; a context manager that stops it."""

    def __init__(self, workdir: Path, *, executable: str | None = None) -> None:
        self.executable = executable or require_chromium()
        profile = workdir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        self.stderr_path = workdir / "chromium.log"
        args = [
            self.executable,
            "--headless=new",
            "--no-sandbox",  # root in a container; the page is our own
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",  # no update checks, safe-browsing lists, ... from the browser itself
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--disable-dev-shm-usage",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        with self.stderr_path.open("wb") as log:
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start: {self.stderr_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        port, path = port_file.read_text().splitlines()[:2]
        self._stack = ExitStack()  # the connection is a context manager (websockets 17.1 warns otherwise)
        self.socket = self._stack.enter_context(
            websockets.sync.client.connect(f"ws://127.0.0.1:{port}{path}", max_size=None)
        )
        self._next_id = 0
        self.pages: dict[str, Page] = {}

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None) -> dict[str, Any]:
        """One DevTools command; events that arrive meanwhile go to their page."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self.socket.send(json.dumps(message))
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        for answer in self._messages(deadline):
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise CdpError(f"{method}: {answer['error']}")
                result: dict[str, Any] = answer.get("result", {})
                return result
        raise TimeoutError(f"{method}: no answer in {COMMAND_TIMEOUT_S} s")

    def _messages(self, deadline: float) -> Iterator[dict[str, Any]]:
        while time.monotonic() < deadline:
            message = json.loads(self.socket.recv(timeout=max(0.01, deadline - time.monotonic())))
            if "method" in message and message.get("sessionId") in self.pages:
                self.pages[message["sessionId"]].on_event(message)
            yield message

    def new_page(self, *, width: int = 1366, height: int = 768) -> Page:
        """A fresh tab at ``width`` × ``height`` CSS pixels (default: a laptop screen), domains enabled."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session, target)
        self.pages[session] = page
        for domain in ("Page", "Network", "Runtime", "Log"):
            page.send(f"{domain}.enable")
        page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page

    def close(self) -> None:
        stack = getattr(self, "_stack", None)
        if stack is not None:
            stack.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
