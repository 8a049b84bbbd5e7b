"""An HTTP endpoint on 127.0.0.1 that answers etcd's ``/v3/kv/range`` as told: forwarded to a real
etcd, or an answer no real etcd gives (JSON that is not an object, fields of the wrong type, an
HTTP error). It runs on a thread of the test process: nothing outlives the test."""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional, Tuple

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class FakeEtcd:
    """``answer(body, status=200)`` answers every request so; ``answer_once`` the next one only;
    ``forward()`` (the default when ``real`` is given) passes requests to the real etcd at
    ``real`` ("host:port"). ``requests`` counts the requests answered."""

    def __init__(self, real: Optional[str] = None) -> None:
        self.real = real
        self._lock = threading.Lock()
        self._answer: Optional[Tuple[int, bytes]] = None if real else (200, b"{}")
        self._once: List[Tuple[int, bytes]] = []
        self.requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = fake._respond(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-etcd", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def answer(self, body: bytes, status: int = 200) -> None:
        with self._lock:
            self._answer = (status, body)

    def answer_once(self, body: bytes, status: int = 200) -> None:
        with self._lock:
            self._once.append((status, body))

    def forward(self) -> None:
        with self._lock:
            self._answer = None

    def _respond(self, path: str, body: bytes) -> Tuple[int, bytes]:
        with self._lock:
            self.requests += 1
            told = self._once.pop(0) if self._once else self._answer
        if told is not None:
            return told
        assert self.real is not None
        req = urllib.request.Request(f"http://{self.real}{path}", data=body, method="POST")
        with _OPENER.open(req, timeout=2) as resp:
            return resp.status, resp.read()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "FakeEtcd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
