"""An MCP server (the mcp SDK's low-level Server, over stdio) with one tool, `python`: code run in unison's bubblewrap
sandbox under the project's params.yaml (tools.python_*), what it prints returned. It lists the tool with the schema
the student was trained on (its tools.json entry): a student copies what it sees, and pydantic's generated schema
(with "title": "pythonArguments") made the served student call a tool named pythonArguments."""
from __future__ import annotations

import asyncio

import mcp_types as types
from mcp.server import Server
from mcp.server.stdio import stdio_server

from unison.config import load_params
from unison.tools.python import python_handler
from unison.tools.python_sandbox import start_sandbox
from unison.tools.registry import schemas

settings = load_params().tools
start_sandbox(settings.sandbox_isolation, settings.python_memory_mb, settings.python_total_memory_mb)  # or refuse
run_code = python_handler(settings)
PYTHON = schemas(("python",))[0]["function"]


async def list_tools(_context, _params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[types.Tool(name="python", description=PYTHON["description"],
                                                   input_schema=PYTHON["parameters"])])


async def call_tool(_context, params: types.CallToolRequestParams) -> types.CallToolResult:
    if params.name != "python":
        return types.CallToolResult(content=[types.TextContent(text=f"error: no tool {params.name!r}")], is_error=True)
    text, error = await asyncio.to_thread(run_code, str((params.arguments or {}).get("code", "")))
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=error is not None)


async def main() -> None:
    server = Server("sandbox", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    asyncio.run(main())
