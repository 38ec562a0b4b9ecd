"""Every built-in tool an agent may call, defined once (`Tool`): its name and description, its JSON-schema parameters,
whether several calls of it run together in one turn, the settings that cap its output and bound its time, the text the
tag protocol teaches it by, and its handler. The system prompt, the chat teacher's and the native student's schemas,
verl's tool config, the rewards and the scaffold all read these definitions.

Adding a built-in tool: a module beside search.py defining `TOOL` (a tool.Tool), its name in `_builtin` below, and its
tests. Your own tools (tools.functions, tools.mcp: custom.py) join `TOOLS` when a stage first asks for the enabled
tools; a call of one writes its arguments as a JSON object: <lookup_order>{"order_id": "A-17"}</lookup_order>.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ToolsConfig
from ..protocol import ROLE_TAGS, split_queries
from .custom import custom_tools
from .tool import Tool, json_arguments


def _builtin() -> dict[str, Tool]:
    from . import crawl, python, search, web_search

    return {t.name: t for t in (search.TOOL, python.TOOL, web_search.TOOL, crawl.TOOL)}


BUILTIN = _builtin()
TOOLS = dict(BUILTIN)  # the built-in tools and the custom ones this process loaded (`register`)
DEFAULT_TOOLS = tuple(name for name, t in BUILTIN.items() if t.enabled(ToolsConfig()))
ALIASES = {alias: t.name for t in BUILTIN.values() for alias in (t.name, *t.aliases)}  # a seed's tool name -> the tool

INTRO = "You answer questions using tools."
OUTRO = ("Each tool call is answered by <result>...</result>. You may reason inside <think>...</think>. End with "
         "<answer>short answer</answer>.")
# The role tags a student distilled from a planning teacher writes besides the base protocol, told in its system prompt
# (in its SFT renderings, and wherever it is prompted after: pareto, rl, evaluate).
STUDENT_RULES = {
    "chain_of_agents": "You may also write <plan> for the next steps, <reflection> to rate tool results, "
                       "<suggested_answer> for a candidate answer and <double_check> to score it from 1 (wrong) to 4 "
                       "(correct) before <answer>.",
    "gap": "First write a plan of sub-tasks with their dependencies in <plan>...</plan>; independent "
           "tasks are searched together in one <search> with their queries joined by |.",
}


def enabled_tools(settings: ToolsConfig) -> tuple[str, ...]:
    """The tools params.yaml turns on: the built-in ones in BUILTIN's order, then yours (loaded, and their servers
    started, on the first call; registered with the protocol)."""
    custom = custom_tools(settings)
    register(custom)
    return tuple(name for name, t in BUILTIN.items() if t.enabled(settings)) + tuple(t.name for t in custom)


def register(tools: list[Tool]) -> None:
    """Make custom tools known to the protocol: their names, tags and scaffold; replaces custom tools loaded before."""
    if [t for t in TOOLS.values() if t.origin != "builtin"] == tools:
        return
    for name in [n for n, t in TOOLS.items() if t.origin != "builtin"]:
        del TOOLS[name], ALIASES[name], SCAFFOLD[name]
    for t in tools:
        if t.name in TOOLS or t.name in SCAFFOLD:
            clash = TOOLS[t.name].origin if t.name in TOOLS else "a tag of the protocol"
            raise ValueError(f"tool {t.name!r} ({t.origin}) has the name of {clash}: rename one")
        TOOLS[t.name], ALIASES[t.name] = t, t.name
        key = scaffold_key(t.name)  # forced, the call is written up to its one string's value, which ends at its quote
        SCAFFOLD[t.name] = ((f'<{t.name}>{{"{key}": "', f'"}}</{t.name}>', '"') if key else
                            (f"<{t.name}>", f"</{t.name}>", "\n"))


def scaffold_key(tool: str) -> str | None:
    """The one required string argument of a custom tool, which a scaffold's prefill opens; None for any other tool."""
    parameters = TOOLS[tool].parameters or {}
    required = parameters.get("required", [])
    if len(required) == 1 and (parameters.get("properties", {}).get(required[0]) or {}).get("type") == "string":
        return required[0]
    return None


def system_prompt(tools: tuple[str, ...] = DEFAULT_TOOLS, method: str = "") -> str:
    """The tag protocol's system prompt: a sentence per tool the episode may call, then the role tags students of
    teacher `method` write."""
    default = [BUILTIN[t].prompt for t in DEFAULT_TOOLS if t in tools]
    extra = [TOOLS[t].prompt for t in TOOLS if t in tools and t not in DEFAULT_TOOLS]
    return " ".join([INTRO, *default, OUTRO, *extra] + ([STUDENT_RULES[method]] if method in STUDENT_RULES else []))


SYSTEM_PROMPT = system_prompt()


# Scaffold: per forced tag, the text the runtime prefills, the closing tag, and where the content ends (a query or an
# expression is one line; an answer ends at a blank line). The runtime closes a tag the model leaves open.
SCAFFOLD = {**{t.name: (f"<{t.name}>{t.prefill}", f"</{t.name}>", "\n") for t in BUILTIN.values()},
            "answer": ("<answer>", "</answer>", "\n\n"), **{t: (f"<{t}>", f"</{t}>", f"</{t}>") for t in ROLE_TAGS}}


def schemas(tools: tuple[str, ...]) -> list[dict]:
    return [TOOLS[t].schema() for t in tools]


def call_argument(arguments, tool: str = "") -> str:
    """A function call's argument as the tag holds it, from its JSON-string or mapping `arguments`: a custom tool's
    arguments as one JSON object (checked when it runs); a built-in tool's one argument (query, code or url; a list of
    queries joined by " | "), ValueError when there is not exactly one usable argument or its JSON nests too deep."""
    if tool in TOOLS and TOOLS[tool].structured:
        return arguments.strip() if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            parsed = json_arguments(arguments)
        except json.JSONDecodeError:  # text, not JSON: the argument as written
            parsed = None
        if isinstance(parsed, str) and parsed.strip():  # a JSON string (vLLM's hermes parser on a small model)
            return parsed.strip()
        if not isinstance(parsed, dict):
            return arguments.strip()
        arguments = parsed
    value = next(iter(arguments.values())) if isinstance(arguments, dict) and len(arguments) == 1 else None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = " | ".join(v.strip() for v in value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected one argument (a query, code or a url), got {arguments!r:.80}")
    return value.strip()


def calls_as_tag(calls: list[tuple[str, object]]) -> str:
    """OpenAI-style function calls [(name, arguments)] as the protocol's tag: one call, or several calls of one parallel
    tool in one tag (the one conversion of imported records, a chat teacher's and a native student's tool calls);
    ValueError otherwise."""
    tags = []
    for name, _ in calls:
        if name not in ALIASES:
            raise ValueError(f"function {name!r} has no tool in the student protocol (known: {', '.join(ALIASES)})")
        tags.append(ALIASES[name])
    if not calls or (len(calls) > 1 and (len(set(tags)) > 1 or not TOOLS[tags[0]].parallel)):
        raise ValueError(f"calls {tags}: a turn holds one call, or several calls of one search tool")
    return f"<{tags[0]}>{' | '.join(call_argument(a, tags[0]) for _, a in calls)}</{tags[0]}>"


def tag_arguments(tool: str, arg: str) -> list[str]:
    """The calls a tag's argument holds: a parallel tool's queries joined by |, else the argument as one call."""
    return split_queries(arg) if TOOLS[tool].parallel else [arg]


def call_arguments(tool: str, arg: str):
    """A call's arguments as a function call carries them: a custom tool's JSON object (its text, when it is no JSON
    object), a built-in tool's {parameter: argument}."""
    if not TOOLS[tool].structured:
        return {TOOLS[tool].argument: arg}
    try:
        parsed = json_arguments(arg)
    except ValueError:
        return arg
    return parsed if isinstance(parsed, dict) else arg


# ------------------------------------------------------------------------------------------------ the tool set as data

def toolset(tools: tuple[str, ...]) -> dict[str, dict]:
    """The schemas of `tools` by name: what a stage's agents were shown."""
    return {t: TOOLS[t].schema()["function"] for t in tools}


def check_toolset(settings: ToolsConfig, path, stage: str) -> None:
    """Refuse a stage whose tools differ from those generate recorded at `path`, naming those that changed, unless
    tools.accept_changed_tools; a run from before the record was kept passes."""
    path = Path(path)
    if not path.is_file():
        return
    recorded, now = json.loads(path.read_text()), toolset(enabled_tools(settings))
    added, removed = sorted(set(now) - set(recorded)), sorted(set(recorded) - set(now))
    changed = sorted(t for t in set(now) & set(recorded) if now[t] != recorded[t])
    if (added or removed or changed) and not settings.accept_changed_tools:
        said = "; ".join(f"{what}: {', '.join(names)}" for what, names in (("added", added), ("removed", removed),
                                                                           ("changed", changed)) if names)
        raise ValueError(f"{stage}: its tools differ from those the trajectories were generated with ({path}): {said}. "
                         "Re-run generate, or set tools.accept_changed_tools: true to go on")
