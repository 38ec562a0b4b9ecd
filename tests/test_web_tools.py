"""web_search and crawl against real local HTTP servers, with the real disk cache in tmp_path; and a real model episode
that calls <web_search> through the Toolbox. Crawl refuses 127.0.0.1 by default, so tests that crawl the local server
allow it explicitly (LOCAL)."""
from __future__ import annotations

import time

import pytest

from security.web import drip
from unison.agents.wiring import make_toolbox, remote_counters
from unison.config import ToolsConfig
from unison.http_client import ResponseCache
from unison.tools.registry import SYSTEM_PROMPT, enabled_tools, system_prompt
from unison.tools.web import Crawl, WebSearch, html_to_text

from .local_http import LocalServer

LOCAL = ("127.0.0.1/32",)  # tools.web_allow_networks for tests that crawl their own server

PAGE = """<html><head><title>Tarsk &amp; Velmora</title><style>body {color: red}</style>
<script>var secret = "do not show";</script></head>
<body><h1>Tarsk</h1><p>Tarsk is a   city
in <b>Velmora</b>.</p><ul><li>Founded 1210</li><li>Population 80k</li></ul><noscript>enable js</noscript></body></html>"""


def web(req):
    """Serper-like /search plus a few pages; queries "empty", "boom" and "slow..." misbehave on purpose."""
    if req["method"] == "POST" and req["path"] == "/search":
        q, num = req["json"]["q"], req["json"]["num"]
        if q == "boom":
            return 500, "internal error", None
        if q.startswith("slow"):
            time.sleep(0.3 if q == "slow" else 1.0)
        organic = [] if q == "empty" else [{"title": f"{q} {k}", "link": f"https://example.org/{k}", "snippet": f"About {q}, part {k}."}
                                           for k in range(1, 6)]
        return 200, {"searchParameters": {"q": q}, "organic": organic[:num]}, None
    pages = {"/page": (PAGE, None), "/blank": ("<html><body> </body></html>", None),
             "/notes.txt": ("plain notes", {"Content-Type": "text/plain"})}
    if req["path"] in pages:
        body, headers = pages[req["path"]]
        return 200, body, headers
    return 404, "not found", None


@pytest.fixture
def server():
    with LocalServer(web) as s:
        yield s


@pytest.fixture
def cache(tmp_path):
    return ResponseCache(tmp_path / "web-cache")


def test_web_search_formats_topk_results_and_sends_the_api_key(server, cache, monkeypatch):
    monkeypatch.setenv("UNISON_SERPER_KEY", "k-123")
    tool = WebSearch(server.url + "/search", topk=2, api_key_env="UNISON_SERPER_KEY", cache=cache)
    text, kind = tool("Tarsk")
    assert kind is None
    assert text == ("Doc 1 (Title: Tarsk 1) About Tarsk, part 1. (https://example.org/1)\n"
                    "Doc 2 (Title: Tarsk 2) About Tarsk, part 2. (https://example.org/2)")
    req = server.requests[0]
    assert req["json"] == {"q": "Tarsk", "num": 2} and req["headers"]["X-API-KEY"] == "k-123"


def test_web_search_runs_queries_in_parallel(server, cache):
    tool = WebSearch(server.url + "/search", topk=1, cache=cache)
    t0 = time.perf_counter()
    assert tool("slow-alone")[1] is None
    alone_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    text, kind = tool(" | ".join(["slow-1s"] * 8))  # one query 8 times: all miss the cache at once
    elapsed = time.perf_counter() - t0
    assert kind is None and text.count("\n---\n") == 7
    # each request takes 1 s: on a loaded machine a thread may start after the first has finished, so "overlapping"
    # is at least half of them at once, and the whole call at most half as long as eight queries one after another
    assert server.max_in_flight >= 4 and elapsed < 4 * alone_s


def test_web_search_cache_hit_avoids_a_second_request(server, tmp_path):
    first = WebSearch(server.url + "/search", topk=2, cache=ResponseCache(tmp_path / "c"))
    assert first("Velmora")[1] is None and len(server.requests) == 1
    again = WebSearch(server.url + "/search", topk=2, cache=ResponseCache(tmp_path / "c"))  # a new process would see the same
    assert again("Velmora") == first("Velmora")
    assert len(server.requests) == 1 and again.cache.hits == 1 and again.cache.misses == 0
    assert len(list((tmp_path / "c").glob("*/*.json"))) == 1 and not list((tmp_path / "c").glob("*/*.tmp"))
    WebSearch(server.url + "/search", topk=4, cache=again.cache)("Velmora")  # more results than cached: asks again
    assert len(server.requests) == 2 and again.cache.misses == 1


def test_web_search_errors_are_observations_with_kinds(server, cache):
    tool = WebSearch(server.url + "/search", topk=2, timeout_s=0.2, retries=1, cache=cache, backoff_s=0.01)
    text, kind = tool("slow-1s")
    assert kind == "timeout" and text.startswith("error: web_search 'slow-1s': timed out")
    text, kind = tool("boom")
    assert kind == "error" and "HTTP 500" in text
    assert sum(r["json"]["q"] == "boom" for r in server.requests) == 2  # retried once
    tool("boom")
    assert sum(r["json"]["q"] == "boom" for r in server.requests) == 4  # failures are not cached
    assert tool("empty") == ("no results for 'empty'", "empty_result")
    assert tool(" | ")[1] == "empty_query"
    text, kind = tool("Tarsk | boom")  # one query failed: the others' results still come back
    assert kind == "error" and "Doc 1 (Title: Tarsk 1)" in text


def test_unreachable_web_search_is_an_error_observation(cache):
    from .local_http import free_port

    text, kind = WebSearch(f"http://127.0.0.1:{free_port()}/search", retries=0, cache=cache)("Tarsk")
    assert kind == "error" and "connection failed" in text


def test_html_to_text_drops_scripts_and_keeps_blocks():
    assert html_to_text(PAGE) == "Tarsk & Velmora\nTarsk\nTarsk is a city in Velmora.\nFounded 1210\nPopulation 80k"


def test_crawl_strips_html_truncates_and_caches(server, cache):
    tool = Crawl(max_chars=30, cache=cache, allow_networks=LOCAL)
    text, kind = tool(f"{server.url}/page | {server.url}/notes.txt")
    assert kind is None
    page, notes = text.split("\n---\n")
    assert page == f"Page {server.url}/page\nTarsk & Velmora\nTarsk\nTarsk is"
    assert "secret" not in page and notes == f"Page {server.url}/notes.txt\nplain notes"
    tool(f"{server.url}/page")
    assert len(server.requests) == 2 and cache.hits == 1
    assert tool(f"{server.url}/blank")[1] == "empty_result"
    assert tool(f"{server.url}/missing")[1] == "error"
    assert tool("file:///etc/passwd") == ("error: not an http(s) URL: 'file:///etc/passwd'", "error")


def _tools(server_url: str, **tools) -> ToolsConfig:
    return ToolsConfig(search_url="http://127.0.0.1:9", search_topk=2, search_max_chars=300, python_timeout_s=5,
                       python_memory_mb=512, python_max_output_chars=512, **tools)


def test_web_tools_are_off_by_default_and_opt_in(server, tmp_path):
    off = _tools(server.url, web_search_url="", crawl=False)
    assert enabled_tools(off) == ("search", "python") and system_prompt(enabled_tools(off)) == SYSTEM_PROMPT
    assert set(make_toolbox(off, web_cache_dir=tmp_path).handlers) == {"search", "python"}
    on = _tools(server.url, web_search_url=server.url + "/search", crawl=True, web_topk=1)
    assert enabled_tools(on) == ("search", "python", "web_search", "crawl")
    assert "<web_search>" in system_prompt(enabled_tools(on)) and "<crawl>" in system_prompt(enabled_tools(on))
    box = make_toolbox(on, web_cache_dir=tmp_path)
    assert box.call("web_search", "Tarsk") == ("Doc 1 (Title: Tarsk 1) About Tarsk, part 1. (https://example.org/1)", None)
    assert box.call("crawl", f"{server.url}/notes.txt")[1] == "blocked"  # the default: public addresses only
    box.call("web_search", "Tarsk")  # answered from the shared cache
    no_faults = dict.fromkeys(("teacher_retries", "teacher_failures", "search_requests", "search_retries", "search_failures"), 0.0)
    assert remote_counters({}, box) == {**no_faults, "web_cache.hits": 1.0, "web_cache.misses": 2.0}
    local = make_toolbox(_tools(server.url, crawl=True, web_allow_networks=list(LOCAL)), web_cache_dir=tmp_path)
    assert local.call("crawl", f"{server.url}/notes.txt")[0].endswith("plain notes")
    assert remote_counters({}, make_toolbox(off, web_cache_dir=tmp_path)) == no_faults


@pytest.mark.slow
def test_episode_calls_web_search_through_the_toolbox(server, base_model_dir, tmp_path):
    from unison.agents.episodes import start_episode
    from unison.agents.runtime import EpisodeSettings, run_episodes
    from unison.llm.hf_backend import HFBackend
    from unison.tool_format import TagFormat

    tools_cfg = _tools(server.url, web_search_url=server.url + "/search", web_topk=2)
    tools = enabled_tools(tools_cfg)
    smol = HFBackend(str(base_model_dir), dtype="float32")
    e = start_episode(TagFormat(smol.tokenizer, system_prompt(tools)), "q0", "In which country is Tarsk?", seed=0,
                      scaffold=["web_search", "answer"], tools=tools)
    run_episodes([e], smol, make_toolbox(tools_cfg, web_cache_dir=tmp_path), EpisodeSettings(temperature=0.0, max_tokens_per_turn=16))
    assert e.segments[0].text.startswith("<web_search>") and e.segments[0].text.endswith("</web_search>")
    assert e.segments[1].kind == "obs" and "Doc 1 (Title: " in e.segments[1].text and "(https://example.org/1)" in e.segments[1].text
    assert e.tool_stats["web_search"]["calls"] == 1 and server.requests[0]["path"] == "/search"
    assert e.segments[2].text.startswith("<answer>") and e.finish_reason in ("answer", "max_turns", "length")


def test_enabled_web_tools_reach_acting_agents_and_their_student_rendering(base_model_dir):
    """A method's acting agents get the enabled tools (stop strings, system prompt); its student rendering says so too."""
    from transformers import AutoTokenizer

    from unison.agents.episodes import student_messages
    from unison.agents.methods import MethodContext
    from unison.agents.runtime import EpisodeSettings
    from unison.agents.toolbox import Toolbox
    from unison.protocol import stops_for

    class Backend:
        tokenizer = AutoTokenizer.from_pretrained(base_model_dir)

    tools = enabled_tools(ToolsConfig(web_search_url="http://127.0.0.1:9", crawl=True))
    ctx = MethodContext(Backend(), Toolbox(), EpisodeSettings(), "t", scaffold={"qa": ["search", "answer"]}, tools=tools)
    e = ctx.solver_episode("q/0", "Who founded Orlen?", 1, "qa")
    assert e.tools == ("search", "python", "web_search", "crawl") and e.scaffold == ["search", "answer"]
    assert stops_for(e.tools) == ["</search>", "</python>", "</web_search>", "</crawl>", "</answer>"]
    assert "<web_search>query</web_search>" in Backend.tokenizer.decode(e.prompt_ids)
    assert student_messages("Who founded Orlen?", [], ctx.system)[0]["content"] == system_prompt(tools) != SYSTEM_PROMPT
    assert MethodContext(Backend(), Toolbox(), EpisodeSettings(), "t").system == SYSTEM_PROMPT  # defaults: the plain protocol


# --- crawl's address guard, the total deadline and the body cap -------------------------------------------------------


def fake_dns(monkeypatch, names: dict[str, str]) -> list[str]:
    """Names resolve as `names` says (to real addresses; the connection itself is real); returns the names looked up."""
    import socket

    from unison.tools import web_fetch

    looked_up = []

    def lookup(host, port):
        looked_up.append(host)
        return socket.getaddrinfo(names.get(host, host), port, type=socket.SOCK_STREAM)

    monkeypatch.setattr(web_fetch, "lookup", lookup)
    return looked_up


def test_crawl_refuses_internal_addresses_without_connecting(server, cache, monkeypatch):
    fake_dns(monkeypatch, {"public.example": "127.0.0.1", "intranet.example": "10.1.2.3"})
    port = server.url.rsplit(":", 1)[1]
    refused = {f"http://127.0.0.1:{port}/page": "127.0.0.1 is a loopback address",
               f"http://localhost:{port}/page": "localhost resolves to",
               f"http://2130706433:{port}/page": "resolves to 127.0.0.1",  # 127.0.0.1 as one decimal number
               f"http://[::1]:{port}/page": "::1 is a loopback address",
               f"http://[::ffff:127.0.0.1]:{port}/page": "embeds 127.0.0.1, 127.0.0.1 is a loopback address",
               f"http://public.example:{port}/page": "public.example resolves to 127.0.0.1: 127.0.0.1 is a loopback address",
               "http://intranet.example/": "10.1.2.3 is a private address",
               "http://10.0.0.1/": "private", "http://192.168.1.1/": "private",
               "http://169.254.169.254/latest/meta-data/": "169.254.169.254 is a link-local address",
               "http://100.64.0.1/": "CGNAT", "http://0.0.0.0/": "unspecified", "http://224.0.0.1/": "multicast",
               "http://[fe80::1]/": "link-local", "http://[fd00::1]/": "private", "http://[2002:7f00:1::]/": "embeds 127.0.0.1"}
    tool = Crawl(cache=cache, timeout_s=5)
    t0 = time.perf_counter()
    text, kind = tool(" | ".join(refused))
    assert kind == "blocked" and time.perf_counter() - t0 < 2.5  # refused before any connection (one could wait 5 s); 0.02 s quiet
    for (url, why), obs in zip(refused.items(), text.split("\n---\n")):
        assert obs.startswith(f"error: crawl {url!r}: blocked: ") and why in obs and "tools.web_allow_networks" in obs, obs
    assert server.requests == []
    assert Crawl(cache=cache, allow_networks=LOCAL)(f"http://127.0.0.1:{port}/notes.txt")[1] is None  # when allowed


def test_crawl_resolves_once_and_keeps_the_hostname_for_host_sni_and_certificate(tmp_path, cache, monkeypatch):
    """Connected to the checked address, the request still names the host: Host header, TLS SNI, certificate check."""
    import ssl

    from unison.tools import web_fetch

    cert, key = self_signed_certificate(tmp_path, "public.example")
    sni = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: sni.append(name)
    monkeypatch.setattr(web_fetch, "TLS", ssl.create_default_context(cafile=cert))  # trusts the test's certificate
    looked_up = fake_dns(monkeypatch, {"public.example": "127.0.0.1", "other.example": "127.0.0.1"})
    tls_server = LocalServer(web)
    tls_server.httpd.socket = context.wrap_socket(tls_server.httpd.socket, server_side=True)
    with tls_server as s:
        port = s.url.rsplit(":", 1)[1]
        text, kind = Crawl(cache=cache, allow_networks=LOCAL)(f"https://public.example:{port}/notes.txt")
        assert (text, kind) == (f"Page https://public.example:{port}/notes.txt\nplain notes", None)
        assert s.requests[0]["headers"]["Host"] == f"public.example:{port}" and sni == ["public.example"]
        assert looked_up == ["public.example"]
        text, kind = Crawl(cache=cache, allow_networks=LOCAL)(f"https://other.example:{port}/notes.txt")
        assert kind == "error" and "certificate of other.example is not accepted" in text and len(s.requests) == 1


def self_signed_certificate(tmp_path, name: str) -> tuple[str, str]:
    """PEM files of a self-signed certificate for `name` and of its key."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


def redirects(req):
    """/to-page redirects to /page; /to-metadata and /to-ipv6 to internal addresses; /loop to itself; /image is a PNG."""
    targets = {"/to-page": "/page", "/to-metadata": "http://169.254.169.254/latest/meta-data/", "/loop": "/loop",
               "/to-ipv6": "http://[::1]:9/page", "/to-file": "file:///etc/passwd"}
    if req["path"] in targets:
        return 302, "", {"Location": targets[req["path"]]}
    if req["path"] == "/image":
        return 200, "\x89PNG...", {"Content-Type": "image/png"}
    if req["path"] == "/busy":
        return 429, "slow down", {"Retry-After": "60"}
    return web(req)


def test_crawl_follows_redirects_itself_and_checks_every_target(cache):
    with LocalServer(redirects) as s:
        tool = Crawl(cache=cache, allow_networks=LOCAL, max_chars=20)
        assert tool(f"{s.url}/to-page") == (f"Page {s.url}/to-page\nTarsk & Velmora\nTars", None)
        for path, why in (("/to-metadata", "169.254.169.254 is a link-local address"), ("/to-ipv6", "::1 is a loopback address"),
                          ("/to-file", "not an http(s) URL: 'file:///etc/passwd'")):
            text, kind = tool(s.url + path)
            assert kind == "blocked" and why in text, text
        text, kind = tool(f"{s.url}/loop")
        assert kind == "error" and "too many redirects" in text
        assert [r["path"] for r in s.requests].count("/loop") == 4  # the request and 3 redirects
        text, kind = WebSearch(f"{s.url}/to-page", cache=cache)("Tarsk")  # the endpoint's redirect is not followed
        assert kind == "error" and "at most 0 are followed" in text and s.requests[-1]["path"] == "/to-page"


def test_crawl_refuses_a_content_type_that_is_not_text_and_a_long_retry_after(cache):
    with LocalServer(redirects) as s:
        tool = Crawl(cache=cache, allow_networks=LOCAL, timeout_s=10)
        text, kind = tool(f"{s.url}/image")
        assert kind == "error" and "content type image/png is not one of text/html" in text
        t0 = time.perf_counter()
        text, kind = tool(f"{s.url}/busy")  # Retry-After: 60 s, past the call's 10 s deadline: no retry, no wait
        assert kind == "error" and "HTTP 429" in text and "would pass the deadline" in text
        assert time.perf_counter() - t0 < 3 and [r["path"] for r in s.requests].count("/busy") == 1


def test_a_drip_fed_answer_is_cut_at_the_total_deadline(cache):
    from .local_http import RawServer

    with RawServer(drip(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n")) as body, \
            RawServer(drip(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n")) as headers:
        t0 = time.perf_counter()
        text, kind = Crawl(cache=cache, allow_networks=LOCAL, timeout_s=1)(f"{body.url}/ | {headers.url}/")
        elapsed = time.perf_counter() - t0
        assert kind == "timeout" and text.count("timed out") == 2, text
        assert 0.9 < elapsed < 3.0  # one deadline for the whole call, though every read gets bytes within 0.5 s
        t0 = time.perf_counter()
        text, kind = WebSearch(body.url + "/search", cache=cache, timeout_s=1)("Tarsk")
        assert kind == "timeout" and 0.9 < time.perf_counter() - t0 < 3.0


def peak_rss_growth(fn) -> tuple[object, int]:
    """fn()'s result and how far the process's peak resident memory rose above its level before (Linux: the peak is
    reset through /proc/self/clear_refs, so no earlier peak hides this one)."""
    def kib(field: str) -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = kib("VmRSS")
    result = fn()
    return result, (kib("VmHWM") - base) * 1024


def test_a_huge_or_bomb_answer_is_cut_at_the_cap_without_growing_the_process(cache):
    import zlib

    from .local_http import RawServer

    cap = 4_000_000
    huge = lambda: iter([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"] + [b"x" * 2**20] * 1536)  # 1.5 GiB
    gzip = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb_body = b"".join(gzip.compress(b"a" * 2**20) for _ in range(64)) + gzip.flush()  # 64 MiB of text in ~65 KB

    def bomb():
        yield b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb_body)
        time.sleep(0.05)  # the body arrives after the head: its first read is a whole 64 KiB chunk, ~64 MiB decoded
        yield bomb_body
    with RawServer(huge) as h, RawServer(bomb) as b:
        tool = Crawl(cache=cache, allow_networks=LOCAL, max_bytes=cap, max_chars=120)
        for url in (h.url, b.url):
            (text, kind), growth = peak_rss_growth(lambda: tool(url))
            assert kind is None and growth < 6 * cap, growth  # the body, its text, the cache's JSON: 3.2-3.7x measured
            assert text.startswith(f"Page {url}\n[only the first 4000000 bytes of the page were read (tools.web_max_bytes)]\n")
        assert h.sent < 64 * 2**20  # the server stopped soon after the client left
        text, kind = WebSearch(h.url + "/search", cache=cache, max_bytes=cap)("Tarsk")
        assert kind == "error" and "longer than tools.web_max_bytes (4000000 bytes)" in text
