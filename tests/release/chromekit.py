"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
commands on fd 3, replies on fd 4, each a JSON text ended by NUL), with the standard library
only: open a page, evaluate JavaScript in it, take a screenshot. Debian's ``chromium``;
the flags keep it off the network and out of any profile."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


class Chromium:
    """One browser and one page. Use as a context manager."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        binary = shutil.which("chromium")
        assert binary, "chromium is missing: apt-get install chromium (./dev test does)"
        self.profile = tempfile.TemporaryDirectory(prefix="sf-chromium-")
        to_browser_r, self._out = os.pipe()
        self._in, from_browser_w = os.pipe()

        def wire() -> None:
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen(
            [binary, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile.name}",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=wire, pass_fds=(3, 4))  # after wire: the pipe ends, kept at exec
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Page.enable", session=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        with_suppress(lambda: self.call("Browser.close", timeout=10))
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        for fd in (self._in, self._out):
            with_suppress(lambda fd=fd: os.close(fd))
        self.profile.cleanup()

    def call(self, method: str, *, session: bool = False, timeout: float = 60,
             **params: Any) -> dict[str, Any]:
        """Send one command; its result (raises AssertionError on a protocol error)."""
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return dict(reply.get("result", {}))

    def _read(self, deadline: float) -> dict[str, Any]:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self._in], [], [], left)[0], \
                "chromium did not answer in time"
            chunk = os.read(self._in, 1 << 20)
            assert chunk, "chromium closed its pipe"
            self._buffer += chunk
        text, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(text))

    def open(self, url: str) -> None:
        """Navigate and wait until the document has loaded."""
        self.call("Page.navigate", session=True, url=url)
        self.until("document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression,
                           returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def until(self, expression: str, timeout: float = 30) -> Any:
        """The first truthy value of ``expression``, polled every 0.1 s."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"never true in {timeout} s: {expression}"
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


def with_suppress(fn: Any) -> None:
    with contextlib.suppress(OSError, AssertionError):
        fn()
