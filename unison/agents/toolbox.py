"""The tools an agent episode may call, behind one `call`: the handlers of tools/registry.py's definitions."""
from __future__ import annotations

from ..config import ToolsConfig
from ..tools.registry import TOOLS, enabled_tools
from ..tools.tool import ToolResources


class Toolbox:
    """The tools params.yaml turns on (`settings`), their handlers built from their definitions; every call returns an
    observation string and its error kind (None if it worked).

    Error kinds: timeout, error, blocked, empty_result, empty_query, empty_code, unavailable, unknown_tool; your tools'
    argument_too_long, invalid_arguments, tool_error, output_cut, server_died (tools/custom.py); and the runtime's
    unparsable, malformed, exception. The runtime gives up on a call after its tool's deadline (`deadline_for`:
    a `timeout` observation)."""

    def __init__(self, retriever=None, settings: ToolsConfig | None = None, web_cache_dir: str = ""):
        self.retriever, self.settings = retriever, settings or ToolsConfig()
        resources = ToolResources(retriever, web_cache_dir)
        self.handlers = {name: TOOLS[name].build(self.settings, resources) for name in enabled_tools(self.settings)}

    @property
    def call_deadline_s(self) -> float:
        return self.settings.call_deadline_s

    def call(self, tool: str, arg: str) -> tuple[str, str | None]:
        handler = self.handlers.get(tool)
        return handler(arg) if handler else (f"error: unknown tool {tool}", "unknown_tool")

    def deadline_for(self, tool: str) -> float:
        return TOOLS[tool].deadline_s(self.settings) if tool in TOOLS else self.call_deadline_s
