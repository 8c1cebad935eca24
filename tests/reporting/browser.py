"""A small driver for headless Chromium over the DevTools protocol, for the report page's browser test.

Chromium is started with ``--remote-debugging-pipe``: it reads protocol messages (JSON, each ended by a NUL
byte) on file descriptor 3 and writes its answers and events on descriptor 4, so no websocket library and
no network port are needed. Only what the test uses is here: open a page, evaluate JavaScript, collect
console errors and uncaught exceptions, take a full-page screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_chromium() -> str | None:
    """The browser to drive: ``$RLHFKIT_CHROMIUM``, else the first of :data:`BINARIES` on the PATH."""
    explicit = os.environ.get("RLHFKIT_CHROMIUM")
    if explicit:
        return explicit
    return next((path for path in map(shutil.which, BINARIES) if path), None)


class Chromium:
    """One headless browser with one page: ``with Chromium(binary) as browser: browser.open(url)``."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1000, timeout: float = 60.0):
        self.timeout, self.width, self.height = timeout, width, height
        self.events: list[dict[str, Any]] = []
        self._buffer, self._next_id, self.session = b"", 0, None
        self._profile = tempfile.mkdtemp(prefix="rlhfkit-chromium-")
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()

        def wire() -> None:  # in the child, before exec: the pipe ends on the descriptors Chromium expects
            os.dup2(to_browser_read, 3)
            os.dup2(from_browser_write, 4)

        args = [
            binary,
            "--headless",
            "--remote-debugging-pipe",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            "--mute-audio",
            f"--user-data-dir={self._profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.process = subprocess.Popen(
            args,
            pass_fds=(3, 4, to_browser_read, from_browser_write),
            preexec_fn=wire,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.call("Browser.close", session=None)
        except (OSError, TimeoutError, RuntimeError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    # -- the protocol ------------------------------------------------------------------------------------

    def call(
        self, method: str, params: dict | None = None, session: str | None | bool = True
    ) -> dict[str, Any]:
        """Send one command (to the page's session unless ``session`` is None) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        target = self.session if session is True else session
        if target:
            message["sessionId"] = target
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        answer = self._read_until(lambda m: m.get("id") == self._next_id)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def _read_until(self, done, timeout: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if done(message):
                    return message
                self.events.append(message)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe")
            self._buffer += chunk

    def wait_for_event(self, method: str) -> dict[str, Any]:
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        return self._read_until(lambda m: m.get("method") == method)

    # -- what the test does ------------------------------------------------------------------------------

    def open(self, url: str) -> None:
        """A new page at ``url``, loaded (its scripts have run)."""
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=None)["targetId"]
        self.session = self.call(
            "Target.attachToTarget", {"targetId": target, "flatten": True}, session=None
        )["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", {"url": url})
        self.wait_for_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a JavaScript exception raises RuntimeError)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors seen so far."""
        out = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                out.append(json.dumps(params.get("args", []))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                out.append(params["entry"].get("text", ""))
        return out

    def screenshot(self, path: str | Path) -> bytes:
        """The whole page (not only the window) as a PNG written to ``path``; returns the bytes."""
        height = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": min(height, 16000), "deviceScaleFactor": 1, "mobile": False},
        )
        data = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])
        Path(path).write_bytes(data)
        return data
