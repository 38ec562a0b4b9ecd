"""web_search and crawl against a real local HTTP server, with the real disk cache in tmp_path; and a real model episode
that calls <web_search> through the Toolbox."""
from __future__ import annotations

import time

import pytest

from unison.agents.wiring import enabled_tools, make_toolbox, remote_counters
from unison.config import Params, ToolsConfig
from unison.protocol import SYSTEM_PROMPT, system_prompt
from unison.tools.web import Crawl, WebCache, WebSearch, html_to_text

from .local_http import LocalServer

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
    return WebCache(tmp_path / "web-cache")


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
    text, kind = tool("slow | slow | slow")  # same query thrice: all miss the cache at once
    elapsed = time.perf_counter() - t0
    assert kind is None and text.count("\n---\n") == 2 and server.max_in_flight == 3
    assert elapsed < 0.8  # three 0.3 s requests, not one after another


def test_web_search_cache_hit_avoids_a_second_request(server, tmp_path):
    first = WebSearch(server.url + "/search", topk=2, cache=WebCache(tmp_path / "c"))
    assert first("Velmora")[1] is None and len(server.requests) == 1
    again = WebSearch(server.url + "/search", topk=2, cache=WebCache(tmp_path / "c"))  # a new process would see the same
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
    tool = Crawl(max_chars=30, cache=cache)
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


def _params(server_url: str, **tools) -> Params:
    return Params(tools=ToolsConfig(search_url="http://127.0.0.1:9", search_topk=2, search_max_chars=300, python_timeout_s=5,
                                    python_memory_mb=512, python_max_output_chars=512, **tools))


def test_web_tools_are_off_by_default_and_opt_in(server, tmp_path):
    off = _params(server.url, web_search_url="", crawl=False)
    assert enabled_tools(off) == ("search", "python") and system_prompt(enabled_tools(off)) == SYSTEM_PROMPT
    assert set(make_toolbox(off, web_cache_dir=tmp_path).handlers) == {"search", "python"}
    on = _params(server.url, web_search_url=server.url + "/search", crawl=True, web_topk=1)
    assert enabled_tools(on) == ("search", "python", "web_search", "crawl")
    assert "<web_search>" in system_prompt(enabled_tools(on)) and "<crawl>" in system_prompt(enabled_tools(on))
    box = make_toolbox(on, web_cache_dir=tmp_path)
    assert box.call("web_search", "Tarsk") == ("Doc 1 (Title: Tarsk 1) About Tarsk, part 1. (https://example.org/1)", None)
    assert box.call("crawl", f"{server.url}/notes.txt")[0].endswith("plain notes")
    box.call("web_search", "Tarsk")  # answered from the shared cache
    no_faults = dict.fromkeys(("teacher_retries", "teacher_failures", "search_requests", "search_retries", "search_failures"), 0.0)
    assert remote_counters({}, box) == {**no_faults, "web_cache.hits": 1.0, "web_cache.misses": 2.0}
    assert remote_counters({}, make_toolbox(off, web_cache_dir=tmp_path)) == no_faults


def test_episode_calls_web_search_through_the_toolbox(server, base_model_dir, tmp_path):
    from unison.agents.episodes import start_episode
    from unison.agents.runtime import EpisodeSettings, run_episodes
    from unison.llm.hf_backend import HFBackend

    params = _params(server.url, web_search_url=server.url + "/search", web_topk=2)
    tools = enabled_tools(params)
    smol = HFBackend(str(base_model_dir), dtype="float32")
    e = start_episode(smol.tokenizer, "q0", "In which country is Tarsk?", seed=0, scaffold=["web_search", "answer"],
                      system=system_prompt(tools), tools=tools)
    run_episodes([e], smol, make_toolbox(params, web_cache_dir=tmp_path), EpisodeSettings(temperature=0.0, max_tokens_per_turn=16))
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

    tools = enabled_tools(Params(tools=ToolsConfig(web_search_url="http://127.0.0.1:9", crawl=True)))
    ctx = MethodContext(Backend(), Toolbox(), EpisodeSettings(), "t", scaffold={"qa": ["search", "answer"]}, tools=tools)
    e = ctx.solver_episode("q/0", "Who founded Orlen?", 1, "qa")
    assert e.tools == ("search", "python", "web_search", "crawl") and e.scaffold == ["search", "answer"]
    assert stops_for(e.tools) == ["</search>", "</python>", "</web_search>", "</crawl>", "</answer>"]
    assert "<web_search>query</web_search>" in Backend.tokenizer.decode(e.prompt_ids)
    assert student_messages("Who founded Orlen?", [], ctx.system)[0]["content"] == system_prompt(tools) != SYSTEM_PROMPT
    assert MethodContext(Backend(), Toolbox(), EpisodeSettings(), "t").system == SYSTEM_PROMPT  # defaults: the plain protocol
