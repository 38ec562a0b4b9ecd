"""One HTTP exchange for the web tools, bounded: a checked address, a total deadline and a cap on the decoded body.

A model chooses crawl's URLs, so `fetch` resolves the host once, refuses any address that is not public (unless the
caller allows its network) and connects to the checked address itself: the Host header, TLS SNI and the certificate
check still name the host, and no second lookup can rebind it. Redirects are followed here, each target checked the
same way. A watchdog shuts the connection at the deadline, whatever it is doing (TLS, headers, body), and the body is
read in chunks up to `max_bytes` decoded bytes (gzip and deflate are decoded under the same cap).
"""
from __future__ import annotations

import codecs
import http.client
import ipaddress
import socket
import ssl
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from ..http_client import AttemptFailed, retry_after_s

MAX_REDIRECTS = 3
CHUNK_BYTES = 64 * 1024
REDIRECTS = (301, 302, 303, 307, 308)
CGNAT = ipaddress.ip_network("100.64.0.0/10")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
ANY_ADDRESS = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
TLS = ssl.create_default_context()
_lookups = ThreadPoolExecutor(max_workers=8, thread_name_prefix="web-dns")  # getaddrinfo has no timeout of its own


class Blocked(Exception):
    """A URL the fetch refuses to touch (a scheme, an address); the message says why."""


@dataclass
class Answer:
    """A successful answer (status < 400, after any redirects)."""

    content_type: str  # the media type, lower case, without parameters; "" when the server sent none
    text: str  # the body, decoded by its charset (UTF-8 when it names none)
    cut: bool  # the body was longer than max_bytes and was cut there


def address_problem(ip: str) -> str | None:
    """Why a fetch must not connect to this address (loopback, private, ...), or None for a public one."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if addr.version == 6:
        embedded = addr.ipv4_mapped or addr.sixtofour
        if embedded is None and (addr in NAT64 or (addr in IPV4_COMPATIBLE and int(addr) > 1)):  # not :: or ::1
            embedded = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if embedded is not None and address_problem(str(embedded)):
            return f"{addr} embeds {embedded}, {address_problem(str(embedded))}"
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "site_local", "reserved"):
        if getattr(addr, f"is_{kind}", False):
            return f"{addr} is a {kind.replace('_', '-')} address"
    if addr in CGNAT:
        return f"{addr} is a shared (CGNAT, 100.64.0.0/10) address"
    if not addr.is_global:
        return f"{addr} is not a global address"
    return None


def lookup(host: str, port: int) -> list[tuple]:
    """getaddrinfo's (family, type, proto, canonname, sockaddr) stream-socket entries for host:port."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def fetch(method: str, url: str, *, deadline: float, max_bytes: int, allowed: tuple = (), headers: dict | None = None,
          body: bytes | None = None, max_redirects: int = MAX_REDIRECTS,
          content_types: tuple[str, ...] | None = None) -> Answer:
    """One request by `deadline` (time.monotonic()), following up to `max_redirects` redirects; `allowed`: networks
    (ipaddress) it may reach although they are not public.

    Raises Blocked (a refused URL or address), AttemptFailed (a timeout, a connection error, an HTTP status >= 400)
    or ValueError (a content type outside `content_types`, an unsupported Content-Encoding, too many redirects)."""
    for _ in range(max_redirects + 1):
        status, location, answer = _exchange(method, url, deadline, max_bytes, allowed, headers, body, content_types)
        if answer is not None:
            return answer
        url = urljoin(url, location)
        if status == 303 or (status in (301, 302) and method == "POST"):
            method, body = "GET", None
    raise ValueError(f"too many redirects (the last to {url}; at most {max_redirects} are followed)")


def _exchange(method, url, deadline, max_bytes, allowed, headers, body, content_types):
    """(status, Location, None) for a redirect, else (status, None, the Answer)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Blocked(f"not an http(s) URL: {url!r}")
    https, host = parts.scheme == "https", parts.hostname
    port = parts.port or (443 if https else 80)
    addresses = _checked_addresses(host, port, allowed, deadline)
    sock = _connect(addresses, deadline)
    guard, lock = sock.dup(), threading.Lock()  # the same connection: shutting it wakes any blocked read

    def cut_at_deadline():
        with lock:
            if guard.fileno() != -1:
                guard.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), cut_at_deadline)
    watchdog.daemon = True
    watchdog.start()
    conn = (http.client.HTTPSConnection(host, port, context=TLS) if https else http.client.HTTPConnection(host, port))
    try:
        conn.sock = TLS.wrap_socket(sock, server_hostname=host) if https else sock  # SNI and certificate: the host
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, body=body, headers={"Accept-Encoding": "gzip, deflate", **(headers or {})})
        response = conn.getresponse()
        if response.status in REDIRECTS and response.getheader("Location"):
            return response.status, response.getheader("Location"), None
        content_type = response.headers.get_content_type() if response.getheader("Content-Type") else ""
        charset = _known_charset(response.headers.get_content_charset())
        if response.status >= 400:
            text = _read_body(response, 300, deadline)[0].decode(charset, "replace")
            raise AttemptFailed("error", f"HTTP {response.status}: {text}", response.status,
                                retry_after_s(response.getheader("Retry-After")))
        if content_types is not None and content_type and content_type not in content_types:
            raise ValueError(f"content type {content_type} is not one of {', '.join(content_types)}")
        data, cut = _read_body(response, max_bytes, deadline)
        return response.status, None, Answer(content_type, data.decode(charset, "replace"), cut)
    except ssl.SSLCertVerificationError as e:  # not worth a retry
        raise ValueError(f"the TLS certificate of {host} is not accepted: {e.verify_message}") from None
    except (OSError, http.client.HTTPException) as e:
        if time.monotonic() >= deadline:
            raise AttemptFailed("timeout", f"timed out: no complete answer from {host} by the deadline") from None
        raise AttemptFailed("error", f"connection failed: {type(e).__name__}: {e}") from None
    finally:
        watchdog.cancel()
        with lock:
            guard.close()
        conn.close()
        sock.close()


def _checked_addresses(host: str, port: int, allowed: tuple, deadline: float) -> list[tuple]:
    """The host's addresses, looked up once (within the deadline); Blocked if one is neither public nor allowed."""
    try:
        addresses = _lookups.submit(lookup, host, port).result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise AttemptFailed("timeout", f"timed out looking up {host}") from None
    except OSError as e:
        raise AttemptFailed("error", f"connection failed: cannot resolve {host}: {e}") from None
    for *_, (ip, *_) in addresses:
        problem = address_problem(ip)
        if problem and not any(ipaddress.ip_address(ip.split("%", 1)[0]) in net for net in allowed):
            via = "" if host == ip else f"{host} resolves to {ip}: "
            raise Blocked(f"{via}{problem}; only public addresses are fetched (tools.web_allow_networks)")
    return addresses


def _connect(addresses: list[tuple], deadline: float) -> socket.socket:
    """A TCP connection to the first of the checked addresses that answers before the deadline."""
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AttemptFailed("timeout", "timed out before connecting")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    if isinstance(error, TimeoutError):
        raise AttemptFailed("timeout", "timed out connecting")
    raise AttemptFailed("error", f"connection failed: {error}")


def _known_charset(name: str | None) -> str:
    try:
        return codecs.lookup(name or "utf-8").name
    except LookupError:  # a server's made-up charset: read it as UTF-8
        return "utf-8"


def _read_body(response: http.client.HTTPResponse, max_bytes: int, deadline: float) -> tuple[bytearray, bool]:
    """Up to `max_bytes` decoded bytes of the body, read in chunks; and whether there was more (wire or decoded)."""
    encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
    if encoding not in ("identity", "gzip", "x-gzip", "deflate"):
        raise ValueError(f"unsupported Content-Encoding {encoding!r}")
    decoder = None if encoding == "identity" else zlib.decompressobj(47)  # 47: a gzip or zlib header, detected
    data, wire = bytearray(), 0
    while len(data) <= max_bytes and wire <= max_bytes:
        chunk = response.read1(CHUNK_BYTES)
        if time.monotonic() >= deadline:
            raise AttemptFailed("timeout", "timed out: the body was not complete by the deadline")
        if not chunk:
            return data, False
        wire += len(chunk)
        if decoder is None:
            data += chunk
        elif not decoder.eof:
            try:
                data += decoder.decompress(chunk, max_bytes + 1 - len(data))
            except zlib.error as e:
                raise ValueError(f"the {encoding} body does not decode: {e}") from None
    del data[max_bytes:]
    return data, True
