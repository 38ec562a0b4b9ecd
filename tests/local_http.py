"""A real HTTP server on 127.0.0.1, run in a thread by a test, answering with a test-supplied function.

It records every request and the most requests it ever had in flight at once."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalServer:
    """`respond(request) -> (status, body, headers)`; request = {"method", "path", "json", "headers"}; a dict/list body
    is sent as JSON, a str as text/html unless headers say otherwise."""

    def __init__(self, respond):
        self.respond = respond
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                req = {"method": self.command, "path": self.path, "headers": dict(self.headers),
                       "json": json.loads(raw) if raw else None}
                with server._lock:
                    server.requests.append(req)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, body, headers = server.respond(req)
                finally:
                    with server._lock:
                        server.in_flight -= 1
                data = json.dumps(body).encode() if isinstance(body, (dict, list)) else str(body).encode()
                headers = {"Content-Type": "application/json" if isinstance(body, (dict, list)) else "text/html; charset=utf-8",
                           **(headers or {})}
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            do_GET = do_POST = _handle

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
