"""The `search` tool: dense retrieval over the project's faiss index (or a search server), the top passages of each
query."""
from __future__ import annotations

from ..protocol import split_queries
from .tool import Tool

SEPARATOR = "\n---\n"  # between the results of a call's queries; never inside one (a passage's own is shortened)


def search(retriever, queries: list[str], max_chars: int) -> tuple[str, str | None]:
    if retriever is None:
        return "error: search is not available", "unavailable"
    if not queries:
        return "error: empty search query", "empty_query"
    hits = retriever.search(queries)
    return (SEPARATOR.join(passages(q, docs, max_chars) for q, docs in zip(queries, hits)),
            None if any(hits) else "empty_result")


def passages(query: str, docs: list[dict], max_chars: int) -> str:
    """One query's result: a line per passage, cut at `max_chars`."""
    lines = [f"Doc {k + 1} (Title: {d['title']}) {d['text'][:max_chars]}".replace(SEPARATOR, "\n--\n")
             for k, d in enumerate(docs)]
    return "\n".join(lines) if lines else f"no results for {query!r}"


TOOL = Tool(
    name="search",
    description="Search the knowledge base: the name of the person, place or organisation the question is about; "
                "several independent queries run in parallel.",
    argument="query",
    argument_description="the search query",
    prompt="To look facts up write <search>query</search>, where the query is the name of the person, place "
           "or organisation the question is about; several independent queries can be joined with | and "
           "run in parallel.",
    build=lambda settings, resources: lambda arg: search(resources.retriever, split_queries(arg),
                                                         settings.search_max_chars),
    parallel=True,
    output_cap="search_max_chars",
    aliases=("wiki_search",),
)
