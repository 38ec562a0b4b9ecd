"""AgentFlow's two retrieval tools whose answers differ from unison's `search` and `crawl`, as function tools the
agentflow recipe declares (tools.functions). AgentFlow puts an LLM after each (it picks pages; it summarises chunks);
these return what that LLM would read, so the observation is the corpus's or the page's own text."""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np

from .. import layout
from ..config import load_params

CHUNK_WORDS, CHUNK_OVERLAP, TOP_CHUNKS = 200, 20, 10  # Web_RAG_Search_Tool's chunk_size, chunk_overlap and top_k


@functools.cache
def _retriever():
    from .retrieval import make_retriever

    return make_retriever(layout.INDEX, load_params().tools)


def wikipedia_rag_search(query: str) -> str:
    """Search the Wikipedia passages of the recipe's corpus and return the relevant pages with their titles, URLs \
and text.

    Args:
        query: The search query for Wikipedia.
    """
    hits = _retriever().search([query])[0]
    pages = [{"title": h["title"], "url": "https://en.wikipedia.org/wiki/" + h["title"].replace(" ", "_"),
              "retrieved_information": h["text"]} for h in hits]
    return json.dumps({"query": query, "relevant_pages": pages}, ensure_ascii=False)


def chunks(text: str, size: int = CHUNK_WORDS, overlap: int = CHUNK_OVERLAP) -> list[str]:
    """`text` as windows of `size` words, each starting `size - overlap` words after the last."""
    words = text.split()
    return [" ".join(words[start:start + size]) for start in range(0, max(len(words) - overlap, 1), size - overlap)]


@functools.cache
def _page_reader():
    """(crawl, the index's encoder, the deadline of one fetch), built once per worker."""
    from .retrieval import load_encoder
    from .web import Crawl, web_cache

    tools = load_params().tools
    meta = json.loads((Path(layout.INDEX) / "meta.json").read_text())
    return (Crawl(allow_networks=tuple(tools.web_allow_networks), **web_cache(tools)),
            load_encoder(meta["encoder"], meta["query_prefix"], meta["passage_prefix"]), tools.web_timeout_s)


def web_rag_search(query: str, url: str) -> str:
    """Read a web page and return its passages most relevant to a query, ranked by the index's encoder.

    Args:
        query: The question to find on the page.
        url: The page's http(s) URL.
    """
    crawl, encoder, timeout_s = _page_reader()
    pieces = chunks(crawl.page_text(url, time.monotonic() + timeout_s))
    if not pieces or not pieces[0]:
        return f"no text at {url}"
    scores = encoder.encode(pieces, passages=True) @ encoder.encode([query])[0]
    best = np.argsort(-scores, kind="stable")[:TOP_CHUNKS]
    return "\n".join(f"Chunk [{rank + 1}]\n{pieces[k]}" for rank, k in enumerate(best))
