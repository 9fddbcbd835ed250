"""A real headless Chromium (Debian ``chromium``) driven over the DevTools protocol (aiohttp's websocket).

``HeadlessChromium(url)`` starts the browser on one page; ``evaluate`` runs JavaScript in it and returns
the value, ``wait_for`` polls a JavaScript condition, ``screenshot`` writes a PNG. ``chromium_or_skip``
skips a test (with the reason) only where the binary is missing or cannot start.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

_LISTENING = re.compile(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/")


class ChromiumUnavailable(RuntimeError):
    """The binary is missing or could not start its DevTools endpoint."""


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class HeadlessChromium:
    """One headless browser process showing ``url``; ``close`` ends it and removes its profile."""

    def __init__(self, url: str, width: int = 1440, height: int = 900, start_timeout: float = 30.0) -> None:
        binary = chromium_binary()
        if binary is None:
            raise ChromiumUnavailable("no chromium binary on PATH (Debian package `chromium`: make setup)")
        self._profile = tempfile.mkdtemp(prefix="kvferry-chromium-")
        args = [
            binary,
            "--headless",
            "--no-sandbox",  # tests run as root in containers
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--hide-scrollbars",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={self._profile}",
            f"--window-size={width},{height}",
            url,
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.stderr: list[str] = []
        self._ids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._port = self._read_port(start_timeout)
        try:
            self._run(self._connect(start_timeout))
            self._call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _read_port(self, timeout: float) -> int:
        """The DevTools port Chromium prints on stderr; its stderr keeps draining into ``self.stderr``."""
        found: list[int] = []
        ready = threading.Event()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.stderr.append(line)
                if not found and (m := _LISTENING.search(line)):
                    found.append(int(m.group(1)))
                    ready.set()
            ready.set()

        threading.Thread(target=drain, name="chromium-stderr", daemon=True).start()
        if not ready.wait(timeout) or not found:
            tail = "".join(self.stderr[-15:])
            self.close()
            raise ChromiumUnavailable(f"chromium did not start its DevTools endpoint:\n{tail}")
        return found[0]

    async def _connect(self, timeout: float) -> None:
        """Attach to the page target (the tab opened on ``url``)."""
        deadline = time.monotonic() + timeout
        while True:
            targets = httpx.get(f"http://127.0.0.1:{self._port}/json/list", timeout=5).json()
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                break
            if time.monotonic() > deadline:
                raise ChromiumUnavailable("chromium opened no page")
            await asyncio.sleep(0.1)
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def _call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        return self._run(asyncio.wait_for(self._send(method, params), timeout))

    async def _send(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        assert self._ws is not None
        call_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = await self._ws.receive()
            if message.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"DevTools connection ended: {message.type}")
            reply = json.loads(message.data)
            if reply.get("id") != call_id:
                continue  # an event, or the answer to an abandoned call
            if "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            result: dict[str, Any] = reply["result"]
            return result

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises awaited)."""
        result = self._call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0, interval: float = 0.1) -> Any:
        """Poll ``expression`` until it is truthy; its value. AssertionError with the page's text at the
        timeout (a bound on a hang, not a timed assertion)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(f"never true in the page: {expression}\npage text:\n{text}")
            time.sleep(interval)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page (the whole scroll height when ``full_page``)."""
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            size = self.evaluate("[document.documentElement.scrollWidth, document.body.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        data = self._call("Page.captureScreenshot", **params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if self._ws is not None:
            self._run(self._ws.close())
        if self._session is not None:
            self._run(self._session.close())
        self._ws = self._session = None
        self._loop.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chromium_or_skip(url: str, **kw: Any) -> HeadlessChromium:
    """A browser on ``url``, or a skip that says why none can run here."""
    try:
        return HeadlessChromium(url, **kw)
    except ChromiumUnavailable as exc:
        pytest.skip(f"headless Chromium cannot run here: {exc}")
