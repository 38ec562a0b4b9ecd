"""Attempts on the web tools: a crawl reaching inward (loopback, private and metadata addresses in every spelling, by
name, through a redirect, by a rebinding name), other schemes, and servers that answer slowly, hugely or with a bomb."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import zlib
from contextlib import closing
from functools import cache

from tests.local_http import LocalServer, RawServer
from unison.http_client import ResponseCache
from unison.tools import web_fetch
from unison.tools.web import Crawl, WebSearch

from . import CLEANUP, attempt
from .host import local_addresses

CAP = 4_000_000  # tools.web_max_bytes in these attempts


class Listener:
    """A TCP listener on every local address, IPv4 and IPv6, that records the address each connection was made to and
    closes it unanswered: the target of the inward attempts (a connection at all is the breach)."""

    def __init__(self):
        dual = socket.has_dualstack_ipv6()
        self.server = socket.create_server(("::" if dual else "0.0.0.0", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                           dualstack_ipv6=dual)
        self.port, self.reached = self.server.getsockname()[1], []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            self.reached.append(conn.getsockname()[0].removeprefix("::ffff:"))
            conn.close()

    def close(self):
        self.server.close()


@cache
def listener() -> Listener:
    return CLEANUP.enter_context(closing(Listener()))


@cache
def web_cache() -> ResponseCache:
    folder = tempfile.mkdtemp(prefix="unison-security-web-")
    CLEANUP.callback(shutil.rmtree, folder, True)
    return ResponseCache(folder)


def crawl(urls: list[str], timeout_s: float = 3, **settings) -> tuple[list[str], str | None, float]:
    """One crawl call over the URLs: (an observation per URL, the call's error kind, seconds)."""
    tool = Crawl(cache=web_cache(), timeout_s=timeout_s, max_bytes=CAP, retries=settings.pop("retries", 0), **settings)
    start = time.monotonic()
    text, kind = tool(" | ".join(urls))
    return text.split("\n---\n"), kind, time.monotonic() - start


def refused(urls: list[str], **settings) -> tuple[bool, str]:
    """Crawl the URLs: contained when each is blocked (or its name does not resolve), before any connection is made."""
    before = len(listener().reached)
    observations, _, seconds = crawl(urls, **settings)
    reached = listener().reached[before:]
    blocked = [o.split(": blocked: ", 1)[1].split(";")[0] for o in observations if ": blocked: " in o]
    unresolved = [o for o in observations if "cannot resolve" in o]
    other = [o for o in observations if ": blocked: " not in o and o not in unresolved]
    evidence = (f"{len(blocked)} of {len(urls)} blocked in {seconds:.2f} s ({blocked[0] if blocked else '-'})"
                + (f", {len(unresolved)} not resolved" if unresolved else "") + f"; connections made: {len(reached)}")
    return not other and not reached, evidence + (f"; not blocked: {other[0][:100]}" if other else "")


@attempt("crawl: inward")
def crawl_loopback():
    """Crawl http(s)://127.0.0.1 and 127.0.0.2 on a port where a host service listens. Contained: blocked, no
    connection made."""
    port = listener().port
    return refused([f"http://127.0.0.1:{port}/", f"https://127.0.0.1:{port}/", f"http://127.0.0.2:{port}/admin"])


@attempt("crawl: inward")
def crawl_localhost_by_name():
    """Crawl localhost, `localhost.` (with the root dot) and LOCALHOST, resolved by the system resolver. Contained:
    blocked, no connection made."""
    port = listener().port
    return refused([f"http://localhost:{port}/", f"http://localhost.:{port}/", f"http://LOCALHOST:{port}/"])


@attempt("crawl: inward")
def crawl_the_unspecified_address():
    """Crawl 0.0.0.0, `0` and [::] (Linux connects them to the machine itself). Contained: blocked, no connection."""
    port = listener().port
    return refused([f"http://0.0.0.0:{port}/", f"http://0:{port}/", f"http://[::]:{port}/"])


@attempt("crawl: inward")
def crawl_a_decimal_ip():
    """Crawl http://2130706433/ (127.0.0.1 as one decimal number). Contained: blocked, no connection."""
    return refused([f"http://2130706433:{listener().port}/"])


@attempt("crawl: inward")
def crawl_hex_octal_and_short_ips():
    """Crawl 127.0.0.1 spelled 0x7f000001, 0177.0.0.1, 127.1 and 0x7f.1. Contained: blocked, no connection."""
    port = listener().port
    return refused([f"http://{host}:{port}/" for host in ("0x7f000001", "0177.0.0.1", "127.1", "0x7f.1")])


@attempt("crawl: inward")
def crawl_ipv6_loopback():
    """Crawl [::1] and [0:0:0:0:0:0:0:1]. Contained: blocked, no connection."""
    port = listener().port
    return refused([f"http://[::1]:{port}/", f"http://[0:0:0:0:0:0:0:1]:{port}/"])


@attempt("crawl: inward")
def crawl_ipv4_inside_ipv6():
    """Crawl 127.0.0.1 inside IPv6: IPv4-mapped [::ffff:127.0.0.1] and [::ffff:7f00:1], IPv4-compatible [::127.0.0.1],
    NAT64 [64:ff9b::7f00:1] and 6to4 [2002:7f00:1::]. Contained: blocked, no connection."""
    port = listener().port
    hosts = ("::ffff:127.0.0.1", "::ffff:7f00:1", "::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::")
    return refused([f"http://[{host}]:{port}/" for host in hosts])


@attempt("crawl: inward")
def crawl_private_networks():
    """Crawl 10/8, 172.16/12, 192.168/16, CGNAT 100.64/10, IPv6 unique-local and link-local addresses. Contained:
    blocked before connecting (within a second)."""
    hosts = ("10.0.0.1", "10.255.255.254", "172.16.0.1", "192.168.1.1", "100.64.0.1", "[fd00::1]", "[fe80::1]")
    return refused([f"http://{host}/" for host in hosts])


@attempt("crawl: inward")
def crawl_cloud_metadata():
    """Crawl the cloud metadata services: 169.254.169.254 (AWS, GCP, Azure, ...), 169.254.170.2 (ECS task
    credentials), [fd00:ec2::254] (AWS over IPv6), 100.100.100.200 (Alibaba). Contained: blocked, no connection."""
    return refused(["http://169.254.169.254/latest/meta-data/iam/security-credentials/", "http://169.254.170.2/v2/credentials",
                    "http://[fd00:ec2::254]/latest/meta-data/", "http://100.100.100.200/latest/meta-data/"])


@attempt("crawl: inward")
def crawl_the_machines_own_addresses():
    """Crawl the machine by its own name and by every address of its interfaces, where a service listens on all
    interfaces (0.0.0.0). Contained: blocked, no connection. (A machine with a public address on an interface would
    not be: that address is public.)"""
    port = listener().port
    hosts = [socket.gethostname()] + [a for a in local_addresses() if not a.startswith("127.")]
    contained, evidence = refused([f"http://{host}:{port}/" for host in hosts])
    return contained, f"{', '.join(hosts)}: {evidence}"


@attempt("crawl: inward")
def crawl_redirected_inward():
    """A server the crawl may reach (allowed: 127.0.0.1/32) redirects (301, 302, 303, 307, 308) to 127.0.0.2, [::1],
    [::ffff:127.0.0.2], 2130706434 and 169.254.169.254. Contained: every redirect target is blocked, no connection."""
    port = listener().port
    targets = [f"http://127.0.0.2:{port}/", f"http://[::1]:{port}/", f"http://[::ffff:127.0.0.2]:{port}/",
               f"http://2130706434:{port}/", "http://169.254.169.254/latest/meta-data/"]
    codes = (301, 302, 303, 307, 308)
    with LocalServer(lambda req: (codes[int(req["path"][1:]) % 5], "", {"Location": targets[int(req["path"][1:])]})) as server:
        contained, evidence = refused([f"{server.url}/{n}" for n in range(len(targets))], allow_networks=("127.0.0.1/32",))
        redirected = len(server.requests)
    return contained and redirected == len(targets), f"{redirected} redirects sent; {evidence}"


@attempt("crawl: inward")
def crawl_a_rebinding_name():
    """A name whose first lookup gives an allowed address (127.0.0.2, in tools.web_allow_networks here) and every later
    one 127.0.0.1 (not allowed), crawled with a retry: the classic DNS rebinding. The resolver is a stand-in (no DNS
    server can be run for the system resolver here); the connections are real. Contained: no connection ever goes
    to 127.0.0.1."""
    port, answers = listener().port, []

    def lookup(host, port_):
        answers.append("127.0.0.2" if not answers else "127.0.0.1")
        return socket.getaddrinfo(answers[-1], port_, type=socket.SOCK_STREAM)

    before = len(listener().reached)
    real_lookup, web_fetch.lookup = web_fetch.lookup, lookup
    try:
        observations, kind, _ = crawl([f"http://rebind.example:{port}/"], retries=1, backoff_s=0.05, allow_networks=("127.0.0.2/32",))
    finally:
        web_fetch.lookup = real_lookup
    reached = listener().reached[before:]
    outcome = observations[0].split(": blocked: ")[-1].split(";")[0]
    return "127.0.0.1" not in reached, f"lookups gave {answers}; connections went to {reached}; then {kind}: {outcome}"


@attempt("crawl: inward")
def crawl_url_parser_confusion():
    """URLs that name a public host to one reader and 127.0.0.1 to another: userinfo (public.example@127.0.0.1), a
    backslash before @, a fragment holding @, an encoded port. Contained: none reaches the listener, none succeeds."""
    port = listener().port
    urls = [f"http://public.example@127.0.0.1:{port}/", f"http://127.0.0.1:{port}\\@public.example/",
            f"http://127.0.0.1:{port}#@public.example/", f"http://public.example:80@127.0.0.1:{port}/",
            f"http://127.0.0.1%3A{port}/"]
    before = len(listener().reached)
    observations, kind, _ = crawl(urls)
    reached = listener().reached[before:]
    kinds = ["blocked" if ": blocked: " in o else "error" if o.startswith("error") else "page" for o in observations]
    return not reached and "page" not in kinds, f"observations: {kinds}; connections made: {len(reached)}"


@attempt("crawl: inward")
def crawl_other_schemes():
    """Crawl file:///etc/passwd, ftp://, gopher:// (the classic SSRF smuggler), dict://, a scheme-relative //host and
    http:/etc/passwd. Contained: each is refused, no connection made."""
    port = listener().port
    urls = ["file:///etc/passwd", f"ftp://127.0.0.1:{port}/", f"gopher://127.0.0.1:{port}/_GET%20/", f"dict://127.0.0.1:{port}/",
            f"//127.0.0.1:{port}/", "http:/etc/passwd"]
    before = len(listener().reached)
    observations, _, _ = crawl(urls)
    reached = listener().reached[before:]
    refusals = [o for o in observations if "not an http(s) URL" in o]
    return len(refusals) == len(urls) and not reached, f"{len(refusals)} of {len(urls)} refused as not http(s); connections made: {len(reached)}"


def drip(head: bytes):
    """An answer that sends `head`, then a few bytes every 0.5 s for 20 s (in the body, or as headers)."""
    def answer():
        yield head
        for _ in range(40):
            time.sleep(0.5)
            yield b"<p>drip</p>\r\n" if head.endswith(b"\r\n\r\n") else b"X-Drip: 1\r\n"
    return answer


@attempt("web: limits")
def slow_drip_vs_the_total_deadline():
    """Servers that send a few bytes every 0.5 s for 20 s, in the body and in the headers, crawled with a 1 s
    deadline, and as a web_search endpoint. Contained: every call ends as `timeout` within 2 s."""
    with RawServer(drip(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n")) as body, \
            RawServer(drip(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n")) as head:
        observations, kind, seconds = crawl([f"{body.url}/", f"{head.url}/"], timeout_s=1, allow_networks=("127.0.0.1/32",))
        start = time.monotonic()
        _, search_kind = WebSearch(body.url + "/search", cache=web_cache(), timeout_s=1)("drip")
        search_s = time.monotonic() - start
    contained = kind == search_kind == "timeout" and seconds < 2 and search_s < 2
    return contained, f"crawl: {kind} in {seconds:.2f} s; web_search: {search_kind} in {search_s:.2f} s (the servers would drip 20 s)"


@attempt("web: limits")
def many_slow_urls_in_one_call():
    """One crawl call with 24 URLs of a drip-feeding server (three times the 8 threads), under a 1 s deadline.
    Contained: the whole call ends within 2 s."""
    with RawServer(drip(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n")) as server:
        observations, kind, seconds = crawl([f"{server.url}/{n}" for n in range(24)], timeout_s=1, allow_networks=("127.0.0.1/32",))
    timeouts = sum("timed out" in o or "deadline" in o for o in observations)
    return kind == "timeout" and seconds < 2, f"{timeouts} of 24 timed out; the call took {seconds:.2f} s"


def peak_rss_growth(fn):
    """fn()'s result and how far this process's peak resident memory rose above its level before (the peak is reset
    through /proc/self/clear_refs first)."""
    def kib(field: str) -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = kib("VmRSS")
    result = fn()
    return result, (kib("VmHWM") - base) * 1024


@attempt("web: limits")
def a_huge_answer_vs_the_byte_cap():
    """A server streams a 1.5 GiB page; the crawl's cap is 4 MB (and a web_search endpoint does the same). Contained:
    the page is cut and says so, the process's peak memory grows by less than 6 times the cap, the server could send
    less than 64 MiB, the web_search answer is an error."""
    huge = lambda: iter([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"] + [b"x" * 2**20] * 1536)
    with RawServer(huge) as server:
        (observations, kind, _), growth = peak_rss_growth(lambda: crawl([server.url + "/"], allow_networks=("127.0.0.1/32",)))
        cut = "[only the first 4000000 bytes of the page were read" in observations[0]
        _, search_kind = WebSearch(server.url + "/search", cache=web_cache(), max_bytes=CAP)("huge")
        sent = server.sent
    contained = cut and growth < 6 * CAP and sent < 64 * 2**20 and search_kind == "error"
    return contained, f"cut: {cut}; peak memory +{growth / 2**20:.1f} MiB; server sent {sent / 2**20:.1f} MiB; web_search: {search_kind}"


@attempt("web: limits")
def a_gzip_bomb():
    """A page of 256 KB gzip that decodes to 256 MiB, under a 4 MB cap. Contained: cut at the cap, the process's peak
    memory grows by less than 6 times the cap."""
    gzip = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(gzip.compress(b"a" * 2**20) for _ in range(256)) + gzip.flush()

    def answer():
        yield (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb))
        time.sleep(0.05)  # the body arrives whole after the head
        yield bomb
    with RawServer(answer) as server:
        (observations, kind, _), growth = peak_rss_growth(lambda: crawl([server.url + "/"], allow_networks=("127.0.0.1/32",)))
    cut = "[only the first 4000000 bytes of the page were read" in observations[0]
    return cut and growth < 6 * CAP, f"{len(bomb) // 1024} KB on the wire; cut: {cut}; peak memory +{growth / 2**20:.1f} MiB"


@attempt("web: limits")
def endless_and_huge_headers():
    """Servers that send header lines forever, or one header line of 64 MiB. Contained: both crawls fail fast (an
    error, not a hang or a memory spike), and the servers could send only a little."""
    endless = lambda: iter([b"HTTP/1.1 200 OK\r\n"] + [b"X-Pad: %d\r\n" % n for n in range(10**6)])
    long_line = lambda: iter([b"HTTP/1.1 200 OK\r\nX-Long: "] + [b"x" * 2**20] * 64)
    with RawServer(endless) as many, RawServer(long_line) as one:
        observations, kind, seconds = crawl([many.url + "/", one.url + "/"], allow_networks=("127.0.0.1/32",))
        sent = many.sent + one.sent
    errors = [o.split(": ", 2)[-1][:40] for o in observations]
    return kind == "error" and seconds < 2 and sent < 32 * 2**20, f"{errors} in {seconds:.2f} s; servers sent {sent / 2**20:.1f} MiB"


@attempt("web: limits")
def binary_content_types():
    """Pages served as image/png and application/octet-stream (100 MiB each). Contained: refused from the headers,
    before the body is read."""
    def binary(kind: bytes):
        return lambda: iter([b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\n\r\n"] + [b"\0" * 2**20] * 100)
    with RawServer(binary(b"image/png")) as png, RawServer(binary(b"application/octet-stream")) as octets:
        observations, kind, _ = crawl([png.url + "/", octets.url + "/"], allow_networks=("127.0.0.1/32",))
        sent = png.sent + octets.sent
    refusals = sum("is not one of text/html" in o for o in observations)
    return refusals == 2 and sent < 32 * 2**20, f"{refusals} of 2 refused by content type; servers sent {sent / 2**20:.1f} MiB"


@attempt("web: secrets")
def web_search_redirect_carries_the_key_away():
    """The web_search endpoint answers with a redirect to another server. Contained: the redirect is not followed, the
    other server gets no request (so never the X-API-KEY header)."""
    with LocalServer(lambda req: (200, {"organic": []}, None)) as elsewhere, \
            LocalServer(lambda req: (307, "", {"Location": elsewhere.url + "/steal"})) as endpoint:
        os.environ["UNISON_SECURITY_WEB_KEY"] = "k-canary"
        try:
            _, kind = WebSearch(endpoint.url + "/search", api_key_env="UNISON_SECURITY_WEB_KEY", cache=web_cache())("q")
        finally:
            del os.environ["UNISON_SECURITY_WEB_KEY"]
        sent_key = endpoint.requests and endpoint.requests[0]["headers"].get("X-API-KEY") == "k-canary"
        stolen = len(elsewhere.requests)
    return kind == "error" and sent_key and not stolen, f"{kind}; the endpoint got the key: {bool(sent_key)}; requests elsewhere: {stolen}"
