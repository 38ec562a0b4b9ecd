"""The `web_search` tool (off by default): a Serper-like endpoint at tools.web_search_url (web.py)."""
from __future__ import annotations

from .tool import Tool


def web_search_handler(settings, resources):
    from .web import WebSearch, web_cache

    return WebSearch(settings.web_search_url, topk=settings.web_topk, max_chars=settings.search_max_chars,
                     api_key_env=settings.web_api_key_env, **web_cache(settings, resources.web_cache_dir))


TOOL = Tool(
    name="web_search",
    description="Search the web; several independent queries run in parallel.",
    argument="query",
    argument_description="the search query",
    prompt="To search the web write <web_search>query</web_search>; several queries can be joined with |.",
    build=web_search_handler,
    parallel=True,
    output_cap="search_max_chars",
    enabled=lambda settings: bool(settings.web_search_url),
)
