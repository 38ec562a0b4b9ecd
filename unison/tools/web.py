"""The `web_search` and `crawl` tools (off by default), with a disk cache of their answers.

`web_search` POSTs {"q": query, "num": k} to `tools.web_search_url` and reads Serper's {"organic": [{title, link,
snippet}]} (the contract of AFM's caching Serper proxy, docs/seeds.md#afms-tools); queries joined by `|` run in
parallel. `crawl` GETs each URL (several joined by " | ") and strips HTML to text; it fetches only public addresses
(web_fetch.py). One call, all its items, redirects and retries included, ends by `tools.web_timeout_s`, and no answer
is read past `tools.web_max_bytes`. Both follow the runtime's handler contract `fn(arg) -> (observation, error kind or
None)`: failures are observations of kind timeout / error / blocked / empty_result / empty_query. Answers are cached
under `data/.cache/web/` by a hash of (tool, endpoint, query); errors are not cached.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from urllib.parse import urlparse

from .. import layout
from ..config import ToolsConfig
from ..http_client import HTTPFailure, ResponseCache, with_retries
from ..protocol import split_queries
from .web_fetch import ANY_ADDRESS, Answer, Blocked, fetch

HTML_TYPES = ("text/html", "application/xhtml+xml")
TEXT_TYPES = HTML_TYPES + ("text/plain", "text/markdown", "text/csv", "text/xml", "application/xml", "application/json")


class _WebTool:
    """What both tools share: HTTP settings, the cache, and running several arguments in parallel."""

    name = ""

    def __init__(self, endpoint: str, max_chars: int, timeout_s: float, retries: int, cache: ResponseCache | None,
                 backoff_s: float, max_bytes: int):
        self.endpoint, self.max_chars, self.max_bytes = endpoint, max_chars, max_bytes
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.cache = cache or ResponseCache()

    def __call__(self, arg: str) -> tuple[str, str | None]:
        items = self.split(arg)
        if not items:
            return f"error: empty {self.name} input", "empty_query"
        deadline = time.monotonic() + self.timeout_s  # one deadline for the whole call
        with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:
            results = list(pool.map(lambda item: self._one_safely(item, deadline), items))
        kinds = [k for _, k in results]
        failed = [k for k in kinds if k not in (None, "empty_result")]
        kind = failed[0] if failed else None if None in kinds else "empty_result"
        return "\n---\n".join(text for text, _ in results), kind

    def _one_safely(self, item: str, deadline: float) -> tuple[str, str | None]:
        try:
            return self.one(item, deadline)
        except Blocked as e:
            return f"error: {self.name} {item!r}: blocked: {e}", "blocked"
        except HTTPFailure as e:
            return f"error: {self.name} {item!r}: {e.detail}", e.kind
        except ValueError as e:  # a malformed answer (bad JSON), a refused content type, too many redirects
            return f"error: {self.name} {item!r}: {e}", "error"

    def fetch(self, method: str, url: str, deadline: float, **kwargs) -> Answer:
        """web_fetch.fetch with this tool's retries and body cap, all within `deadline`."""
        return with_retries(method, url,
                            lambda: fetch(method, url, deadline=deadline, max_bytes=self.max_bytes, **kwargs),
                            retries=self.retries, backoff_s=self.backoff_s, deadline=deadline)

    def split(self, arg: str) -> list[str]:
        raise NotImplementedError

    def one(self, item: str, deadline: float) -> tuple[str, str | None]:
        raise NotImplementedError


class WebSearch(_WebTool):
    name = "web_search"

    def __init__(self, url: str, topk: int = 3, max_chars: int = 300, timeout_s: float = 15.0, retries: int = 2,
                 api_key_env: str = "", cache: ResponseCache | None = None, backoff_s: float = 0.5,
                 max_bytes: int = 2_000_000):
        super().__init__(url, max_chars, timeout_s, retries, cache, backoff_s, max_bytes)
        self.topk = topk
        key = os.environ.get(api_key_env) if api_key_env else None
        # Serper's key header
        self.headers = {"Content-Type": "application/json", **({"X-API-KEY": key} if key else {})}

    def split(self, arg: str) -> list[str]:
        return split_queries(arg)

    def results(self, query: str, deadline: float) -> list[dict]:
        """Top-k organic results ({title, link, snippet}); a cached answer serves when it holds at least k (as AFM's).

        The endpoint is the operator's (often a caching proxy on loopback), so its address is not checked; it must not
        redirect (a redirect would carry the API key elsewhere)."""
        cached = self.cache.get(self.name, self.endpoint, query, usable=lambda v: v.get("num", 0) >= self.topk)
        if cached is None:
            answer = self.fetch("POST", self.endpoint, deadline, allowed=ANY_ADDRESS, max_redirects=0,
                                headers=self.headers, body=json.dumps({"q": query, "num": self.topk}).encode())
            if answer.cut:
                raise ValueError(f"the answer is longer than tools.web_max_bytes ({self.max_bytes} bytes)")
            found = json.loads(answer.text)
            if not isinstance(found, dict):
                raise ValueError("the answer is not a JSON object")
            cached = {"num": self.topk, "organic": found.get("organic") or []}
            self.cache.put(self.name, self.endpoint, query, cached)
        return cached["organic"][: self.topk]

    def one(self, query: str, deadline: float) -> tuple[str, str | None]:
        hits = self.results(query, deadline)
        if not hits:
            return f"no results for {query!r}", "empty_result"
        return "\n".join(f"Doc {k} (Title: {h.get('title', '')}) {h.get('snippet', '')[: self.max_chars]} "
                         f"({h.get('link', '')})"
                         for k, h in enumerate(hits, 1)), None


class Crawl(_WebTool):
    name = "crawl"

    def __init__(self, max_chars: int = 2000, timeout_s: float = 15.0, retries: int = 2,
                 cache: ResponseCache | None = None, backoff_s: float = 0.5, max_bytes: int = 2_000_000,
                 allow_networks: tuple[str, ...] = ()):
        super().__init__("GET", max_chars, timeout_s, retries, cache, backoff_s, max_bytes)
        # tests and operators only: a model's URL may reach these non-public addresses (a local test server, say)
        self.allowed = tuple(ipaddress.ip_network(n) for n in allow_networks)

    def split(self, arg: str) -> list[str]:
        return [u.strip() for u in arg.split(" | ") if u.strip()]

    def page_text(self, url: str, deadline: float) -> str:
        """The page as plain text (HTML stripped), cached whole; the observation cuts it to `max_chars`."""
        cached = self.cache.get(self.name, self.endpoint, url)
        if cached is None:
            cached = self.read_page(url, deadline)
            self.cache.put(self.name, self.endpoint, url, cached)
        return cached

    def read_page(self, url: str, deadline: float) -> str:
        answer = self.fetch("GET", url, deadline, allowed=self.allowed, content_types=TEXT_TYPES,
                            headers={"User-Agent": "unison-crawl/0.1", "Accept": ", ".join(TEXT_TYPES)})
        if answer.content_type in HTML_TYPES or (not answer.content_type and answer.text.lstrip().startswith("<")):
            text = html_to_text(answer.text)
        else:
            text = answer.text.strip()
        if answer.cut and text:
            return f"[only the first {self.max_bytes} bytes of the page were read (tools.web_max_bytes)]\n{text}"
        return text

    def one(self, url: str, deadline: float) -> tuple[str, str | None]:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            return f"error: not an http(s) URL: {url!r}", "error"
        text = self.page_text(url, deadline)
        if not text:
            return f"no text at {url}", "empty_result"
        return f"Page {url}\n{text[: self.max_chars]}", None


class _TextExtractor(HTMLParser):
    SKIP = {"script", "style", "noscript", "template", "svg"}
    BLOCK = {"p", "div", "br", "li", "ul", "ol", "tr", "table", "h1", "h2", "h3", "h4", "h5", "h6", "title", "section",
             "article", "header", "footer", "nav", "pre", "blockquote", "dt", "dd", "hr"}

    def __init__(self):
        super().__init__()  # convert_charrefs: &amp; etc. arrive decoded
        self.parts: list[str] = []
        self.skip = self.pre = 0

    def handle_starttag(self, tag, attrs):
        self._depth(tag, +1)

    def handle_endtag(self, tag):
        self._depth(tag, -1)

    def _depth(self, tag: str, step: int) -> None:
        if tag in self.SKIP:
            self.skip = max(0, self.skip + step)
        elif tag in self.BLOCK:
            self.parts.append("\n")
            if tag == "pre":
                self.pre = max(0, self.pre + step)

    def handle_data(self, data):
        if not self.skip:  # line breaks in the source are spaces, except inside <pre>
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(html: str) -> str:
    """Visible text of an HTML page: scripts and styles dropped, one line per block, whitespace collapsed."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    lines = (re.sub(r"\s+", " ", line).strip() for line in "".join(parser.parts).split("\n"))
    return "\n".join(line for line in lines if line)


def web_cache(t: ToolsConfig, cache_dir: str | os.PathLike = "") -> dict:
    """The HTTP settings and the answer cache both web tools take."""
    return {"timeout_s": t.web_timeout_s, "max_bytes": t.web_max_bytes,
            "cache": ResponseCache(cache_dir or layout.WEB_CACHE)}
