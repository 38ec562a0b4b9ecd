"""An MCP server (the mcp SDK's MCPServer, FastMCP before mcp 2) that unison starts over stdio: where staff sit."""
from __future__ import annotations

import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

sys.path.insert(0, str(Path(__file__).parent))
from staff import STAFF  # noqa: E402

directory = MCPServer("directory")


@directory.tool()
def room_of(person: str) -> str:
    """The room a member of staff works in: its floor, a dot, its number."""
    record = STAFF.get(person.strip())
    if record is None:
        return f"no member of staff named {person!r}"
    return record["room"]


if __name__ == "__main__":
    directory.run()
