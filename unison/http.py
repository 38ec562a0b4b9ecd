"""HTTP with retries for the remote pieces (the `openai` LLM backend, the remote retriever, the web tools): one place for
backoff, Retry-After and errors."""
from __future__ import annotations

import json
import re
import time

import requests
import urllib3

MAX_RETRY_AFTER_S = 60.0
MAX_BODY_BYTES = 64 << 20  # an LLM completion or a search answer; a server sending more is broken or hostile

_USERINFO = re.compile(r"(\w[\w+.-]*://)[^/\s@]*@")
_SECRET_QUERY = re.compile(r"([?&;][^=&;\s]*(?:key|token|secret|password|passwd|pwd|auth|sig|credential)[^=&;\s]*=)[^&;\s'\"#]*",
                           re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URL's user:password@ and every secret-looking query value (key, token, secret, password, auth,
    sig, credential in the name) replaced by ***; for anything logged, recorded or raised that may hold a URL."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


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


def post_json(url: str, body: dict, *, timeout: float, retries: int = 3, backoff_s: float = 0.5, session=None,
              on_retry=None, headers: dict | None = None, max_bytes: int = MAX_BODY_BYTES):
    """POST `body` as JSON and return the decoded answer, each attempt a `post_json_once`, retried by `with_retries`."""
    return with_retries("POST", url, lambda: post_json_once(url, body, timeout=timeout, session=session, headers=headers,
                                                            max_bytes=max_bytes),
                        retries=retries, backoff_s=backoff_s, on_retry=on_retry)


def post_json_once(url: str, body: dict, *, timeout: float, session=None, headers: dict | None = None,
                   max_bytes: int = MAX_BODY_BYTES):
    """One attempt of POSTing `body` as JSON: the decoded answer, or AttemptFailed (for `with_retries`). Bounded: `timeout`
    per connect and per read, the body read within `timeout` in all (a server dripping bytes is a timeout), and at most
    `max_bytes` of it (a longer answer fails at once, HTTPFailure, as does an answer that is not JSON)."""
    http = session or requests
    try:
        response = http.request("POST", url, json=body, headers=headers, timeout=timeout, stream=True)
    except requests.Timeout:
        raise AttemptFailed("timeout", f"timed out after {timeout} s") from None
    except requests.ConnectionError as e:
        raise AttemptFailed("error", f"connection failed: {e}") from None
    with response:
        content = read_body(response, url, timeout, max_bytes)
    if response.status_code >= 400:
        raise AttemptFailed("error", f"HTTP {response.status_code}: {content[:300].decode(errors='replace')}",
                            response.status_code, retry_after_s(response.headers.get("Retry-After")))
    try:
        return json.loads(content)
    except ValueError:
        raise HTTPFailure("POST", url, "error", f"the answer is not JSON: {content[:100]!r}", 1, response.status_code) from None


def read_body(response: requests.Response, url: str, timeout: float, max_bytes: int) -> bytes:
    """The response's body, read within `timeout` seconds in all and up to `max_bytes` (HTTPFailure beyond)."""
    deadline, chunks, size = time.monotonic() + timeout, [], 0
    try:
        while chunk := response.raw.read1(65536, decode_content=True):  # what has arrived, never waiting to fill a buffer
            size += len(chunk)
            if size > max_bytes:
                raise HTTPFailure("POST", url, "error", f"the answer is over {max_bytes} bytes (stopped reading)", 1,
                                  response.status_code)
            if time.monotonic() > deadline:
                raise AttemptFailed("timeout", f"the answer took over {timeout} s to arrive")
            chunks.append(chunk)
    except (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError, OSError) as e:
        kind = "timeout" if isinstance(e, (urllib3.exceptions.ReadTimeoutError, TimeoutError)) else "error"
        raise AttemptFailed(kind, f"reading the answer failed: {e}") from None
    return b"".join(chunks)
