"""Per-call overhead of your tools (tools.functions, tools.mcp): one lookup called through the toolbox as a function tool
(a worker process), an MCP stdio tool and an MCP streamable-HTTP tool, against the same lookup called directly in Python,
in the same run; p50 and p99 of `--calls` calls each after a warm-up. The target: MCP stdio under 5 ms at p50. Merges the
figures into reports/bench.json under "custom_tools".

    python -m bench.bench_custom_tools [--calls 500]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_rollout import save_report

TOOL = textwrap.dedent('''
    import sys

    TABLE = {f"person {k}": f"B-{1000 + k}" for k in range(100)}


    def badge_number(person: str) -> str:
        """Look up a badge number.

        Args:
            person: the person's name
        """
        return TABLE[person]


    if __name__ == "__main__":
        from mcp.server.mcpserver import MCPServer

        server = MCPServer("bench")
        server.tool()(badge_number)
        if len(sys.argv) > 1:
            server.run(transport="streamable-http", port=int(sys.argv[1]))
        else:
            server.run()
''')


def percentiles(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": sum(ordered) / len(ordered) * 1e3, "calls": len(ordered)}


def timed(call, calls: int, warmup: int = 20) -> dict:
    for k in range(warmup):
        call(k)
    seconds = []
    for k in range(calls):
        t0 = time.perf_counter()
        call(k)
        seconds.append(time.perf_counter() - t0)
    return percentiles(seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args(argv)
    from unison.agents.toolbox import Toolbox
    from unison.config import McpServerConfig, ToolsConfig
    from unison.tools.custom import close_custom_tools

    folder = Path(tempfile.mkdtemp(prefix="bench-tools-"))
    (folder / "bench_tool.py").write_text(TOOL)
    sys.path.insert(0, str(folder))
    import bench_tool

    arguments = lambda k: json.dumps({"person": f"person {k % 100}"})  # noqa: E731
    figures = {"direct": timed(lambda k: bench_tool.badge_number(f"person {k % 100}"), args.calls)}
    port = free_port()
    http = subprocess.Popen([sys.executable, str(folder / "bench_tool.py"), str(port)], stderr=subprocess.DEVNULL)
    try:
        for _ in range(150):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.2)
        settings = {
            "function": ToolsConfig(functions=[f"{folder / 'bench_tool.py'}:badge_number"], function_workers=1),
            "mcp_stdio": ToolsConfig(mcp=[McpServerConfig(name="bench", command=[sys.executable, str(folder / "bench_tool.py")])]),
            "mcp_http": ToolsConfig(mcp=[McpServerConfig(name="bench", url=f"http://127.0.0.1:{port}/mcp")]),
        }
        for name, s in settings.items():
            box = Toolbox(settings=s)
            assert box.call("badge_number", arguments(3)) == ("B-1003", None), name
            figures[name] = timed(lambda k: box.call("badge_number", arguments(k)), args.calls)
            close_custom_tools()
    finally:
        http.kill()
    for name, f in figures.items():
        extra = "" if name == "direct" else f", {f['p50_ms'] - figures['direct']['p50_ms']:.3f} ms over a direct call at p50"
        print(f"custom tools: {name:10s} p50 {f['p50_ms']:.3f} ms, p99 {f['p99_ms']:.3f} ms{extra}", flush=True)
    print(f"custom tools: MCP stdio p50 {figures['mcp_stdio']['p50_ms']:.2f} ms (target < 5 ms): "
          f"{'met' if figures['mcp_stdio']['p50_ms'] < 5 else 'missed'}", flush=True)
    save_report({"measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), **figures},
                key="custom_tools")


if __name__ == "__main__":
    main()
