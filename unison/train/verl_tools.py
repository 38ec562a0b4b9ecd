"""unison's tools for verl: a tool config (multi_turn.tool_config_path) and the BaseTool it names, which verl's agent
loop worker builds and unison_agent (unison.train.verl_agent) calls.

Every tool an episode may call (search, python, and web_search / crawl when params.yaml enables them) is one entry whose
class, UnisonTool, runs the call through unison's own Toolbox: search over the search server at tools.search_url (its
POST /retrieve), python in the bubblewrap sandbox, with the limits of params.yaml's `tools` section, which the entry's
config carries. The answer is the observation block the in-house runtime appends ("\\n<result>\\n...\\n</result>\\n").
verl's initialize_tools_from_config builds each entry as UnisonTool(config, tool_schema); UnisonTool exists only where
verl is importable, the schemas, the config and run_tool everywhere.
"""
from __future__ import annotations

import asyncio

from ..agents.runtime import timed_call
from ..agents.toolbox import Toolbox
from ..agents.wiring import make_toolbox
from ..config import ToolsConfig
from ..protocol import observation
from ..tools.registry import TOOLS, call_argument

CLASS_NAME = f"{__name__}.UnisonTool"


def tool_config(tools: tuple[str, ...], settings: ToolsConfig) -> dict:
    """verl's tool config (the YAML at multi_turn.tool_config_path): one native UnisonTool entry per tool."""
    if not settings.search_url and "search" in tools:
        raise ValueError("params.yaml tools.search_url: rl.trainer verl searches over a search server (python -m "
                         "unison.tools.search_server), but tools.search_url is empty")
    return {"tools": [{"class_name": CLASS_NAME, "config": {"type": "native", "tools": settings.model_dump()},
                       "tool_schema": TOOLS[t].schema()} for t in tools]}


def run_tool(toolbox: Toolbox, tool: str, parameters: dict) -> tuple[str, str | None]:
    """(the observation block, the error kind or None) of one call with verl's parsed JSON arguments."""
    if TOOLS[tool].structured:  # a custom tool: its arguments as JSON, checked when it runs
        argument = call_argument(parameters, tool)
    else:
        name = TOOLS[tool].argument
        argument = parameters.get(name) if isinstance(parameters, dict) else None
        if not isinstance(argument, str):
            return observation(f"error: {tool} needs a string `{name}`"), "unparsable"
    text, error, _ = timed_call(toolbox, tool, argument)
    return observation(text), error


try:
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse
except ImportError:  # verl is not installed (the CPU lock): the config is still written and tested
    BaseTool = None

if BaseTool is not None:

    class UnisonTool(BaseTool):
        """One of unison's tools (named by its schema) over a Toolbox built from the entry's `tools` settings."""

        def __init__(self, config: dict, tool_schema):
            super().__init__(config, tool_schema)
            self.toolbox = make_toolbox(ToolsConfig(**config["tools"]))

        async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[ToolResponse, float, dict]:
            text, error = await asyncio.to_thread(run_tool, self.toolbox, self.name, parameters)
            return ToolResponse(text=text), 0.0, {"tool_error": float(error is not None)}
