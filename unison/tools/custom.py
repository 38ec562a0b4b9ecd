"""Your own tools beside the built-in ones: Python functions (tools.functions, functions.py) and the tools of MCP
servers (tools.mcp, mcp_servers.py), as `Tool`s the protocol, the native format, the chat teacher and every acting stage
use.

The operator's tool code is trusted; the arguments a model chooses are not. Before a call its JSON arguments are
bounded (tools.custom_max_argument_chars) and checked against the tool's schema (no extra keys); the result is cut at
tools.custom_max_output_chars. Each failure is an observation of its own kind that the model sees and the reports count:
argument_too_long, invalid_arguments, tool_error (the tool raised or reported an error), timeout, output_cut,
server_died (an MCP server that stopped: restarted once, then the stage stops).

The tool set of a run is data: generate writes registry.toolset, later stages run registry.check_toolset."""
from __future__ import annotations

import atexit
import json
import re

from ..config import ToolsConfig
from .tool import Tool, json_arguments

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")  # a name that is a tag and a function name everywhere
_loaded: dict = {"key": None, "tools": [], "closers": []}


def closed(parameters: dict) -> dict:
    """A parameters schema that refuses keys it does not name (unless it says otherwise)."""
    return parameters if "additionalProperties" in parameters else {**parameters, "additionalProperties": False}


def signature(parameters: dict) -> str:
    """The arguments as the tag protocol's prompt shows them: {"order_id": string, "include_items"?: boolean}."""
    required = set(parameters.get("required", []))
    fields = [f'"{k}"{"" if k in required else "?"}: {v.get("type", "value") if isinstance(v, dict) else "value"}'
              for k, v in parameters.get("properties", {}).items()]
    return "{" + ", ".join(fields) + "}"


def checked(name: str, parameters: dict, settings: ToolsConfig, run):
    """A handler for a custom tool: the tag's JSON arguments bounded, parsed and checked, then `run(arguments)` ->
    (text, error kind, whole length), its text cut at the output cap."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(closed(parameters))
    cap = settings.custom_max_output_chars

    def handler(arg: str) -> tuple[str, str | None]:
        if len(arg) > settings.custom_max_argument_chars:
            return (f"error: the arguments of {name} are {len(arg)} characters, over the "
                    f"{settings.custom_max_argument_chars} allowed (tools.custom_max_argument_chars)",
                    "argument_too_long")
        try:
            arguments = json_arguments(arg) if arg.strip() else {}
        except json.JSONDecodeError as e:
            return f"error: the arguments of {name} are not a JSON object: {e}", "invalid_arguments"
        except ValueError as e:
            return f"error: the arguments of {name} are {e}", "invalid_arguments"
        problem = min(validator.iter_errors(arguments), key=lambda e: list(map(str, e.absolute_path)), default=None)
        if problem is not None:
            at = "/".join(map(str, problem.absolute_path)) or "the arguments"
            return (f"error: invalid arguments for {name} at {at}: {problem.message[:300]}; expected "
                    f"{signature(parameters)}"), "invalid_arguments"
        text, kind, length = run(arguments)
        if length > cap or len(text) > cap:
            return f"{text[:cap]}\n... (cut at {cap} of {max(length, len(text))} characters)", kind or "output_cut"
        return text, kind

    return handler


def _tool(name: str, description: str, parameters: dict, origin: str, build) -> Tool:
    if not NAME.match(name):
        raise ValueError(f"{origin}: tool name {name!r} is not a name the protocol can write (letters, digits, _)")
    parameters = {"type": "object", "properties": {}, **(parameters or {})}
    prompt = (f"{description.strip().rstrip('.') or name}: write <{name}>{signature(parameters)}</{name}> "
              "with the arguments as a JSON object.")
    return Tool(name=name, description=description.strip(), argument="", argument_description="", prompt=prompt,
                build=build, output_cap="custom_max_output_chars", deadline="custom_timeout_s", parameters=parameters,
                origin=origin)


def _function_tools(settings: ToolsConfig) -> tuple[list[Tool], list]:
    from .functions import FunctionRunner, function_schema

    if not settings.functions:
        return [], []
    schemas = {spec: function_schema(spec)["function"] for spec in settings.functions}
    runner = FunctionRunner(settings.functions, settings.function_workers, settings.function_memory_mb,
                            settings.custom_max_output_chars)

    def build(name, parameters):
        return lambda s, resources: checked(name, parameters, s,
                                            lambda args: runner.call(name, args, s.custom_timeout_s))

    tools = [_tool(f["name"], f.get("description", ""), f["parameters"], f"function {spec}",
                   build(f["name"], f["parameters"]))
             for spec, f in schemas.items()]
    return tools, [runner.close]


def _mcp_tools(settings: ToolsConfig) -> tuple[list[Tool], list]:
    from .mcp_servers import McpServer

    tools, closers = [], []
    for cfg in settings.mcp:
        server = McpServer(cfg)
        closers.append(server.close)

        def build(name, parameters, server=server):
            def run(args, s):
                text, kind = server.call(name, args, s.custom_timeout_s)
                return text[:s.custom_max_output_chars], kind, len(text)
            return lambda s, resources: checked(name, parameters, s, lambda args: run(args, s))

        for t in server.tools():
            parameters = {k: v for k, v in t.input_schema.items() if k != "title"}
            tools.append(_tool(t.name, t.description or "", parameters, f"mcp {cfg.name}", build(t.name, parameters)))
    return tools, closers


def custom_tools(settings: ToolsConfig) -> list[Tool]:
    """The custom tools `settings` declare, loaded once per process (their servers and workers started); another
    declaration replaces them (registry.enabled_tools registers them with the protocol)."""
    key = json.dumps(settings.model_dump(include={"functions", "mcp", "function_workers", "function_memory_mb",
                                                  "custom_max_output_chars"}), sort_keys=True)
    if _loaded["key"] == key:
        return _loaded["tools"]
    close_custom_tools()
    closers: list = []
    try:
        functions, closing = _function_tools(settings)
        closers += closing
        servers, closing = _mcp_tools(settings)
        closers += closing
        tools = functions + servers
        names = [t.name for t in tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tools.functions / tools.mcp: tools named alike: {twice} "
                             f"({[t.origin for t in tools if t.name in twice]})")
    except BaseException:
        for close in closers:
            close()
        raise
    _loaded.update(key=key, tools=tools, closers=closers)
    if tools:
        print(f"custom tools: {', '.join(f'{t.name} ({t.origin})' for t in tools)}", flush=True)
    return tools


@atexit.register
def close_custom_tools() -> None:
    """Stop the servers and workers of the loaded custom tools, and forget them."""
    for close in _loaded["closers"]:
        try:
            close()
        except Exception:  # closing at exit: what failed is gone with the process
            pass
    _loaded.update(key=None, tools=[], closers=[])
