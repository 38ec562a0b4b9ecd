"""The `crawl` tool (off by default): a public web page as text (web.py, web_fetch.py)."""
from __future__ import annotations

from .tool import Tool


def crawl_handler(settings, resources):
    from .web import Crawl, web_cache

    return Crawl(max_chars=settings.web_max_chars, allow_networks=tuple(settings.web_allow_networks),
                 **web_cache(settings, resources.web_cache_dir))


TOOL = Tool(
    name="crawl",
    description="Fetch a web page and read its text.",
    argument="url",
    argument_description="the page's http(s) URL",
    prompt="To read a web page write <crawl>url</crawl>.",
    build=crawl_handler,
    output_cap="web_max_chars",
    aliases=("crawl_page",),
    enabled=lambda settings: settings.crawl,
)
