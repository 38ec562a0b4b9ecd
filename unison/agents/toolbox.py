"""The tools an agent episode may call (search, sandboxed python, and the web tools when enabled), behind one `call`."""
from __future__ import annotations

from ..protocol import split_queries


class Toolbox:
    """The tools an episode may call; every call returns an observation string and its error kind (None if it worked).

    Error kinds: timeout, error, blocked, empty_result, empty_query, empty_code, unavailable, unknown_tool (and the
    runtime's unparsable, exception). The runtime gives up on a call after `call_deadline_s` (a `timeout` observation)."""

    def __init__(self, retriever=None, python_params: dict | None = None, search_max_chars: int = 300, extra: dict | None = None,
                 call_deadline_s: float = 60.0):
        self.retriever, self.call_deadline_s = retriever, call_deadline_s
        self.python_params = python_params or {}
        self.search_max_chars = search_max_chars
        self.handlers = {"search": lambda arg: self.search(split_queries(arg)), "python": self.python, **(extra or {})}

    def call(self, tool: str, arg: str) -> tuple[str, str | None]:
        handler = self.handlers.get(tool)
        return handler(arg) if handler else (f"error: unknown tool {tool}", "unknown_tool")

    def search(self, queries: list[str]) -> tuple[str, str | None]:
        if self.retriever is None:
            return "error: search is not available", "unavailable"
        if not queries:
            return "error: empty search query", "empty_query"
        hits = self.retriever.search(queries)
        blocks = []
        for q, docs in zip(queries, hits):
            lines = [f"Doc {k + 1} (Title: {d['title']}) {d['text'][: self.search_max_chars]}" for k, d in enumerate(docs)]
            blocks.append("\n".join(lines) if lines else f"no results for {q!r}")
        return "\n---\n".join(blocks), None if any(hits) else "empty_result"

    def python(self, code: str) -> tuple[str, str | None]:
        from ..tools.python_sandbox import run_python

        if not code.strip():
            return "error: empty code", "empty_code"
        res = run_python(code, **self.python_params)
        if res.ok:
            return res.output or "(no output)", None
        kind = "timeout" if res.error == "timeout" else "unavailable" if res.error.startswith("sandbox unavailable") else "error"
        return f"error: {res.error}\n{res.output}".strip(), kind
