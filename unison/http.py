"""HTTP with retries for the remote pieces (the `openai` LLM backend, the web tools): one place for backoff and errors."""
from __future__ import annotations

import re
import time

import requests

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


def _retry_after(response: requests.Response) -> float:
    try:
        return min(float(response.headers.get("Retry-After", 0)), 60.0)
    except ValueError:  # an HTTP date: not worth parsing
        return 0.0


def request(method: str, url: str, *, timeout: float, retries: int = 3, backoff_s: float = 0.5, session=None,
            on_retry=None, **kwargs) -> requests.Response:
    """Send a request; retry connection errors, timeouts, 429 and 5xx with exponential backoff (honouring Retry-After).

    Other 4xx answers raise at once (retrying cannot fix them); `on_retry()` is called before every retry."""
    http = session or requests
    for attempt in range(retries + 1):
        wait = backoff_s * 2**attempt
        try:
            response = http.request(method, url, timeout=timeout, **kwargs)
        except requests.Timeout:
            kind, detail, status = "timeout", f"timed out after {timeout} s", None
        except requests.ConnectionError as e:
            kind, detail, status = "error", f"connection failed: {e}", None
        else:
            if response.status_code < 400:
                return response
            kind, detail, status = "error", f"HTTP {response.status_code}: {response.text[:300]}", response.status_code
            if status != 429 and status < 500:
                raise HTTPFailure(method, url, kind, detail, attempt + 1, status)
            wait = max(wait, _retry_after(response))
        if attempt < retries:
            if on_retry:
                on_retry()
            time.sleep(wait)
    raise HTTPFailure(method, url, kind, detail, retries + 1, status)
