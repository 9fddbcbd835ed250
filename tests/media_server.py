"""A tiny HTTP server on 127.0.0.1 (a thread) serving test media: files by path, a slow one, an endless one."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MediaServer:
    """``files``: path -> (content type, body). ``/slow/<path>`` waits ``slow_s`` before the body;
    ``/endless`` streams chunks (no Content-Length) until the client goes; ``/redirect/<path>`` is a 302, as is
    each path of ``redirects`` (to its absolute URL)."""

    def __init__(self, files: dict[str, tuple[str, bytes]], slow_s: float = 5.0) -> None:
        self.files, self.slow_s = files, slow_s
        self.requests: list[str] = []
        self.redirects: dict[str, str] = {}  # path -> absolute Location (a 302 to anywhere)
        self._stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.requests.append(self.path)
                path = self.path
                if path == "/endless":
                    return self._endless()
                if path.startswith("/redirect/") or path in owner.redirects:
                    self.send_response(302)
                    self.send_header("Location", owner.redirects.get(path, path.removeprefix("/redirect")))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                slow = path.startswith("/slow/")
                found = owner.files.get(path.removeprefix("/slow") if slow else path)
                if found is None:
                    self.send_error(404)
                    return None
                kind, body = found
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if slow:
                    owner._stop.wait(owner.slow_s)
                self.wfile.write(body)
                return None

            def _endless(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"\x89" * 65536
                try:
                    while not owner._stop.is_set():
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        time.sleep(0.001)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        return Handler
