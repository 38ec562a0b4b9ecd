"""Attempts on the search server (unison/tools/search_server.py), run as its command line runs it: huge requests,
slow-loris clients, and where it listens. They expect its hardened behaviour: 422 for too many queries, too long a
query or too large a topk, 413 for too large a body, and connections whose request head does not arrive in time
dropped (HEAD_TIMEOUT_S, 10 s)."""
from __future__ import annotations

import contextlib
import io
import json
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

import requests

from tests.local_http import free_port
from unison.config import ROOT

from . import CLEANUP, attempt
from .host import local_addresses

SLOW_CLIENTS = 16
HEAD_TIMEOUT_S = 10  # the hardened server's deadline for a whole request head
NORMAL = {"queries": ["Velmora Abbey"], "topk": 2}
ANSWER_S = 10  # a refusal comes at once; an answer this late is not one


class SlowLoris:
    """Clients that open connections to the server and send one header line a second, never ending the head."""

    def __init__(self, host: str, port: int, clients: int):
        self.sockets = [socket.create_connection((host, port)) for _ in range(clients)]
        for s in self.sockets:
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        self.opened, self.dropped = time.monotonic(), {}  # socket index -> seconds after opening that the server closed it
        self.stop = threading.Event()
        threading.Thread(target=self._trickle, daemon=True).start()

    def _trickle(self):
        while not self.stop.wait(1.0):
            for n, s in enumerate(self.sockets):
                if n in self.dropped:
                    continue
                try:
                    if select.select([s], [], [], 0)[0] and not s.recv(4096, socket.MSG_PEEK):
                        raise ConnectionResetError  # the server closed it
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    self.dropped[n] = round(time.monotonic() - self.opened, 1)

    def close(self):
        self.stop.set()
        for s in self.sockets:
            s.close()


def write_corpus(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"p{i}", "title": f"{name} Abbey", "text": f"The {name} Abbey was built in {1700 + i}."}
            for i, name in enumerate(["Velmora", "Quillon", "Brastow", "Ishkar", "Tolvane", "Meridan", "Oskeby", "Praxil"])]
    schema = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@cache
def search_server() -> tuple[str, SlowLoris]:
    """The server's URL, started as `python -m unison.tools.search_server --index ... --port ...` over a small index,
    and slow-loris clients that hold connections to it from the moment it is up."""
    from unison.tools.retrieval import build_index

    folder = Path(tempfile.mkdtemp(prefix="unison-security-search-"))
    CLEANUP.callback(shutil.rmtree, folder, True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        build_index(write_corpus(folder / "corpus.parquet"), folder / "index")
    port, log = free_port(), open(folder / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "unison.tools.search_server", "--index", str(folder / "index"),
                               "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    CLEANUP.callback(lambda: (server.kill(), server.wait(), log.close()))
    url, give_up = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if server.poll() is not None or time.monotonic() > give_up:
            raise RuntimeError(f"the search server did not start: {(folder / 'server.log').read_text()[-300:]}")
        time.sleep(0.2)
    slow = SlowLoris("127.0.0.1", port, SLOW_CLIENTS)
    CLEANUP.callback(slow.close)
    return url, slow


def post(body) -> tuple[int | None, str]:
    """POST /retrieve: the status (None: no answer within ANSWER_S) and what happened, in a few words."""
    url, _ = search_server()
    start = time.monotonic()
    try:
        answer = requests.post(url + "/retrieve", data=body if isinstance(body, bytes) else json.dumps(body),
                               headers={"Content-Type": "application/json"}, timeout=ANSWER_S)
    except requests.Timeout:
        return None, f"no answer within {ANSWER_S} s"
    return answer.status_code, f"{answer.status_code} in {time.monotonic() - start:.2f} s: {answer.text[:50]}"


@attempt("search server", limit_s=150)
def a_request_while_slow_loris_clients_hold_connections():
    """16 clients hold connections to the server, each sending one header line a second and never finishing; then a
    normal request. Contained: the normal request is answered (200) within 5 s."""
    _, slow = search_server()
    start = time.monotonic()
    status, said = post(NORMAL)
    seconds = time.monotonic() - start
    return status == 200 and seconds < 5, f"{SLOW_CLIENTS} slow clients connected; a normal request: {said.split(':')[0]}"


@attempt("search server")
def a_huge_topk():
    """POST topk = 10^9. Contained: refused with 422."""
    status, said = post({"queries": ["Velmora"], "topk": 10**9})
    return status == 422, said


@attempt("search server")
def a_huge_query():
    """POST one query of 200,000 characters. Contained: refused with 422."""
    status, said = post({"queries": ["Velmora " * 25_000]})
    return status == 422, said


@attempt("search server")
def a_huge_body():
    """POST a 4 MiB body (a valid request with a long unknown field). Contained: refused with 413."""
    body = json.dumps({**NORMAL, "padding": "x" * (4 << 20)}).encode()
    status, said = post(body)
    return status == 413, said


@attempt("search server")
def too_many_queries():
    """POST 10,000 queries in one request (about 250 KB). Contained: refused with 422 before any is encoded."""
    status, said = post({"queries": [f"query number {n}" for n in range(10_000)]})
    return status == 422, said


@attempt("search server")
def the_server_listens_on_loopback_only():
    """Connect to the server's port by every non-loopback address of the machine. Contained: refused (it binds
    127.0.0.1 by default)."""
    url, _ = search_server()
    port = int(url.rsplit(":", 1)[1])
    reached = []
    for address in [a for a in local_addresses() if not a.startswith("127.")]:
        try:
            socket.create_connection((address, port), timeout=1).close()
            reached.append(address)
        except OSError:
            pass
    others = [a for a in local_addresses() if not a.startswith("127.")]
    return not reached, f"addresses tried: {others or 'none but loopback'}; reached: {reached or 'none'}"


@attempt("search server")
def slow_loris_connections_are_dropped():
    """The 16 slow clients keep trickling header lines. Contained: the server closes every one of them within its
    head deadline (10 s) plus 5 s of slack, so slow clients hold nothing for long."""
    _, slow = search_server()
    while len(slow.dropped) < SLOW_CLIENTS and time.monotonic() - slow.opened < HEAD_TIMEOUT_S + 5:
        time.sleep(0.2)
    held = SLOW_CLIENTS - len(slow.dropped)
    when = f", after {min(slow.dropped.values())}-{max(slow.dropped.values())} s" if slow.dropped else ""
    return held == 0, f"{len(slow.dropped)} of {SLOW_CLIENTS} dropped{when}; {held} still open after {time.monotonic() - slow.opened:.0f} s"
