"""Your MCP servers as tools (tools.mcp), through the official `mcp` SDK: a stdio server is started by the stage (and
stopped at its end), a streamable HTTP one is connected to; their tools are listed at start-up. Each server's client
lives on one event loop in a thread of its own, so the runtime's tool threads call it as a function. A server that dies
is restarted (reconnected) once, the call it died in a `server_died` observation; the next failure stops the stage
(`ToolServerGone`). A stdio server's stderr goes to data/.cache/tool_logs/mcp-<name>.log."""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from pathlib import Path

from .. import layout
from ..config import McpServerConfig

STARTUP_S = 60.0  # the most a server may take to start and list its tools


class ToolServerGone(RuntimeError):
    """An MCP server that died again after its one restart: the stage stops (nothing partial is kept)."""


class McpServer:
    def __init__(self, cfg: McpServerConfig):
        self.cfg, self.restarts = cfg, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"mcp-{cfg.name}", daemon=True)
        self.thread.start()
        self.lock = threading.Lock()
        self.client = self.stop = self.holder = None
        self.log = None
        if cfg.command:
            Path(layout.TOOL_LOGS).mkdir(parents=True, exist_ok=True)
            self.log = open(Path(layout.TOOL_LOGS) / f"mcp-{cfg.name}.log", "a")
        self._connect()

    def _target(self):
        from mcp import StdioServerParameters
        from mcp.client.stdio import get_default_environment, stdio_client

        if self.cfg.url:
            return self.cfg.url
        command, *args = self.cfg.command
        # the interpreter unison runs in, whatever PATH a scheduler gives the stage
        if command in ("python", "python3"):
            command = sys.executable
        return stdio_client(StdioServerParameters(command=command, args=args,
                                                  env={**get_default_environment(), **self.cfg.env}),
                            errlog=self.log)

    async def _hold(self, ready: asyncio.Future) -> None:
        """Open the client, hand it over, keep it open until `stop` is set."""
        from mcp import Client

        self.stop = asyncio.Event()
        try:
            async with Client(self._target()) as client:
                listed = await client.list_tools()
                ready.set_result((client, listed.tools))
                await self.stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            elif not isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                raise

    def _connect(self) -> None:
        async def start():
            ready = self.loop.create_future()
            self.holder = asyncio.ensure_future(self._hold(ready))
            return await ready

        try:
            self.client, self.listed = asyncio.run_coroutine_threadsafe(start(), self.loop).result(STARTUP_S)
        except Exception as e:
            while isinstance(e, BaseExceptionGroup) and e.exceptions:  # the SDK's task groups wrap the cause
                e = e.exceptions[0]
            where = " ".join(self.cfg.command) or self.cfg.url
            raise ValueError(f"tools.mcp {self.cfg.name!r} ({where}): could not start it and list its tools: "
                             f"{type(e).__name__}: {e}"
                             + (f" (its stderr: {self.log.name})" if self.log else "")) from None

    def tools(self) -> list:
        """The tools it lists that its allow-list keeps (all of them without one); ValueError for an allowed name it
        does not list."""
        names = [t.name for t in self.listed]
        missing = [n for n in self.cfg.tools if n not in names]
        if missing:
            raise ValueError(f"tools.mcp {self.cfg.name!r}: tools {missing} are allowed but the server "
                             f"lists only {names}")
        return [t for t in self.listed if not self.cfg.tools or t.name in self.cfg.tools]

    def _disconnect(self) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
            try:
                asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(self.holder), 10),
                                                 self.loop).result(15)
            except Exception:  # a dead server's client may fail to close: it is gone either way
                pass

    def call(self, name: str, arguments: dict, timeout_s: float) -> tuple[str, str | None]:
        """(text, error kind or None) of one call: its text content, `tool_error` when the tool reported an error,
        `timeout` when it gave no answer in time, `server_died` when the connection broke (the server is restarted,
        once)."""
        client = self.client
        future = asyncio.run_coroutine_threadsafe(client.call_tool(name, arguments), self.loop)
        try:
            result = future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return f"error: {name} gave no answer within {timeout_s:g} s (tools.custom_timeout_s)", "timeout"
        except Exception as e:
            self._restart(client, e)
            return f"error: the server {self.cfg.name} stopped during this call and was restarted", "server_died"
        text = "\n".join(getattr(c, "text", None) or f"[{c.type} content]" for c in result.content)
        return (f"error: {text}", "tool_error") if result.is_error else (text or "(no output)", None)

    def _restart(self, failed_client, error: Exception) -> None:
        with self.lock:
            if self.client is not failed_client:  # another thread restarted it already
                return
            if self.restarts >= 1:
                raise ToolServerGone(f"MCP server {self.cfg.name!r} failed again after its restart: "
                                     f"{type(error).__name__}: {error}") from error
            self.restarts += 1
            print(f"tools.mcp {self.cfg.name!r}: the connection failed ({type(error).__name__}: {error}); "
                  "restarting it once", flush=True)
            self._disconnect()
            try:
                self._connect()
            except ValueError as e:
                raise ToolServerGone(str(e)) from error

    def close(self) -> None:
        self._disconnect()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if self.log:
            self.log.close()
