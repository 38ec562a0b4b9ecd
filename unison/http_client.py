"""HTTP with retries for the remote pieces (the `openai` LLM backend, the remote retriever, the web tools): one place
for backoff, Retry-After and errors."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import requests
import urllib3
import urllib3.connection

from .data.schemas import atomic_path
from .redaction import redact

MAX_RETRY_AFTER_S = 60.0
MAX_BODY_BYTES = 64 << 20  # an LLM completion or a search answer; a server sending more is broken or hostile

class HTTPFailure(RuntimeError):
    """A request that failed for good; `kind` is "timeout" or "error" (the tool error kinds), the message names the URL
    (credentials redacted)."""

    def __init__(self, method: str, url: str, kind: str, detail: str, attempts: int, status: int | None = None):
        url, detail = redact(url), redact(detail)  # a connection error's text repeats the path and query
        super().__init__(f"{method} {url} failed after {attempts} attempt{'s' * (attempts != 1)}: {detail}")
        self.url, self.kind, self.detail, self.attempts, self.status = url, kind, detail, attempts, status


class AttemptFailed(Exception):
    """One failed attempt: a timeout or connection error (no status), or an HTTP error status with its Retry-After."""

    def __init__(self, kind: str, detail: str, status: int | None = None, retry_after_s: float = 0.0):
        super().__init__(detail)
        self.kind, self.detail, self.status, self.retry_after_s = kind, detail, status, retry_after_s


def retry_after_s(value: str | None) -> float:
    """Seconds a Retry-After header asks for, capped at MAX_RETRY_AFTER_S; 0 when absent or an HTTP date."""
    try:
        return min(float(value or 0), MAX_RETRY_AFTER_S)
    except ValueError:  # an HTTP date: not worth parsing
        return 0.0


def retryable(failure: AttemptFailed) -> bool:
    """A timeout, a connection error, a 429 or a 5xx: worth another attempt (other statuses are the request's fault)."""
    return failure.status is None or failure.status == 429 or failure.status >= 500


def with_retries(method: str, url: str, attempt, *, retries: int, backoff_s: float, deadline: float | None = None,
                 on_retry=None):
    """`attempt()`'s result, retrying each AttemptFailed that is a timeout, a connection error, a 429 or a 5xx, with
    exponential backoff (`backoff_s × 2^n`, or the server's Retry-After when longer); other statuses fail at once.

    With a `deadline` (a time.monotonic() value) no wait runs past it: a retry that could only start after it is not
    made, so the deadline bounds the whole call, retries included. `on_retry()` is called before every retry."""
    for n in range(retries + 1):
        try:
            return attempt()
        except AttemptFailed as e:
            failure = e
        if not retryable(failure):
            raise HTTPFailure(method, url, failure.kind, failure.detail, n + 1, failure.status)
        if n == retries:
            break
        wait = max(backoff_s * 2**n, failure.retry_after_s)
        if deadline is not None and time.monotonic() + wait >= deadline:
            failure.detail += f" (no retry: waiting {wait:g} s would pass the deadline)"
            break
        if on_retry:
            on_retry()
        time.sleep(wait)
    raise HTTPFailure(method, url, failure.kind, failure.detail, n + 1, failure.status)


def shared_deadlines(deadline: float, attempts: int):
    """Each attempt's deadline in turn: an equal share of the time left before the request's `deadline` among the
    attempts left, so a replica that hangs leaves time for a retry on another and the request still ends by
    `deadline`."""
    for left in range(attempts, 0, -1):
        now = time.monotonic()
        yield now + max(0.0, deadline - now) / left


def watched_session():
    """A requests.Session whose attempts `post_json_once` can cut at their deadline, headers included (one per thread:
    a Session is a connection pool, not safe to share between threads)."""
    import requests.adapters

    class Adapter(requests.adapters.HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = _WATCHED_POOLS

        def proxy_manager_for(self, proxy, **kwargs):
            manager = super().proxy_manager_for(proxy, **kwargs)
            manager.pool_classes_by_scheme = _WATCHED_POOLS
            return manager

    s = requests.Session()
    s.mount("http://", Adapter())
    s.mount("https://", Adapter())
    return s


class Watchdog:
    """Shuts the socket of the current thread's attempt when its time is up: a server dripping its status line, headers
    or body a byte at a time holds each socket read under any per-read timeout, but not past this."""

    def __init__(self, seconds: float):
        self.seconds, self.fired, self.conn, self._lock = seconds, False, None, threading.Lock()
        self._timer = threading.Timer(seconds, self.cut)
        self._timer.daemon = True

    def __enter__(self):
        _current.watchdog = self
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        _current.watchdog = None

    def watch(self, conn) -> None:
        with self._lock:
            self.conn = conn
            if self.fired:
                self._shut()

    def cut(self) -> None:
        with self._lock:
            self.fired = True
            self._shut()

    def _shut(self) -> None:
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_current = threading.local()  # the Watchdog of this thread's attempt in flight, if any


class _WatchedConnection:
    """A urllib3 connection that hands itself to the current attempt's Watchdog as it sends and before it reads."""

    def request(self, *args, **kwargs):
        if (watchdog := getattr(_current, "watchdog", None)) is not None:
            watchdog.watch(self)
        return super().request(*args, **kwargs)

    def getresponse(self, *args, **kwargs):
        if (watchdog := getattr(_current, "watchdog", None)) is not None:
            watchdog.watch(self)  # shuts the socket at once if the time ran out while connecting or sending
        return super().getresponse(*args, **kwargs)


class _HTTPConnection(_WatchedConnection, urllib3.connection.HTTPConnection):
    pass


class _HTTPSConnection(_WatchedConnection, urllib3.connection.HTTPSConnection):
    pass


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


_WATCHED_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


def post_json(url: str, body: dict, *, timeout: float, retries: int = 3, backoff_s: float = 0.5, session=None,
              on_retry=None, headers: dict | None = None, max_bytes: int = MAX_BODY_BYTES):
    """POST `body` as JSON and return the decoded answer, each attempt a `post_json_once`, retried by `with_retries`;
    `timeout` bounds the whole call: connecting, headers, body and every retry."""
    deadline = time.monotonic() + timeout
    return with_retries("POST", url, lambda: post_json_once(url, body, deadline=deadline, session=session,
                                                            headers=headers, max_bytes=max_bytes),
                        retries=retries, backoff_s=backoff_s, deadline=deadline, on_retry=on_retry)


def post_json_once(url: str, body: dict, *, deadline: float, session=None, headers: dict | None = None,
                   max_bytes: int = MAX_BODY_BYTES):
    """One attempt of POSTing `body` as JSON: the decoded answer, or AttemptFailed (for `with_retries`). Bounded as a
    whole: connecting, sending, the status line, headers and body all by `deadline` (a time.monotonic() value; a server
    dripping bytes is a timeout), and at most `max_bytes` of body (a longer answer fails at once, HTTPFailure, as does
    an answer that is not JSON)."""
    seconds = deadline - time.monotonic()
    if seconds <= 0:
        raise AttemptFailed("timeout", "no time left before the deadline")
    own = session is None
    http = session or watched_session()
    try:
        with Watchdog(seconds) as watchdog:
            try:
                response = http.request("POST", url, json=body, headers=headers, timeout=seconds, stream=True)
                with response:
                    content = read_body(response, url, deadline, max_bytes)
            except (requests.RequestException, AttemptFailed) as e:
                if watchdog.fired:
                    http.close()  # no shut socket goes back to the pool for the next attempt
                if watchdog.fired or isinstance(e, requests.Timeout):
                    raise AttemptFailed("timeout", f"no complete answer within {seconds:.3g} s") from None
                if isinstance(e, AttemptFailed):
                    raise
                raise AttemptFailed("error", f"connection failed: {e}") from None
            if watchdog.fired:  # cut mid-headers, http.client takes what came as the whole head and an empty body
                http.close()
                raise AttemptFailed("timeout", f"no complete answer within {seconds:.3g} s")
    finally:
        if own:
            http.close()
    if response.status_code >= 400:
        raise AttemptFailed("error", f"HTTP {response.status_code}: {content[:300].decode(errors='replace')}",
                            response.status_code, retry_after_s(response.headers.get("Retry-After")))
    try:
        return json.loads(content)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else "not JSON"
        raise HTTPFailure("POST", url, "error", f"the answer is {why}: {content[:100]!r}", 1,
                          response.status_code) from None


def read_body(response: requests.Response, url: str, deadline: float, max_bytes: int) -> bytes:
    """The response's body, read by `deadline` (time.monotonic()) and up to `max_bytes` (HTTPFailure beyond)."""
    chunks, size = [], 0
    try:
        # what has arrived, never waiting to fill a buffer
        while chunk := response.raw.read1(65536, decode_content=True):
            size += len(chunk)
            if size > max_bytes:
                raise HTTPFailure("POST", url, "error", f"the answer is over {max_bytes} bytes (stopped reading)", 1,
                                  response.status_code)
            if time.monotonic() > deadline:
                raise AttemptFailed("timeout", "the answer was still arriving at the deadline")
            chunks.append(chunk)
    except (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError, OSError) as e:
        kind = "timeout" if isinstance(e, (urllib3.exceptions.ReadTimeoutError, TimeoutError)) else "error"
        raise AttemptFailed(kind, f"reading the answer failed: {e}") from None
    return b"".join(chunks)


class ResponseCache:
    """JSON answers on disk by content, one file per (tool, endpoint, query) under <root>/<2 hex>/<sha256>.json, written
    atomically; counts hits and misses. The web tools' cache (data/.cache/web) and the openai backend's
    (data/.cache/llm)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def _path(self, tool: str, endpoint: str, query: str) -> Path:
        digest = hashlib.sha256(json.dumps([tool, endpoint, query]).encode()).hexdigest()
        return self.root / digest[:2] / f"{digest}.json"

    def get(self, tool: str, endpoint: str, query: str, usable=lambda value: True):
        """The cached answer if there is one and `usable(answer)`, else None (a miss)."""
        try:
            value = json.loads(self._path(tool, endpoint, query).read_text())
        except (OSError, ValueError):  # absent, or cut short by a crash outside atomic writes
            value = None
        hit = value is not None and usable(value)
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1
        return value if hit else None

    def put(self, tool: str, endpoint: str, query: str, value) -> None:
        path = self._path(tool, endpoint, query)
        tmp = atomic_path(path)
        try:
            tmp.write_text(json.dumps(value))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
