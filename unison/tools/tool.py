"""What defines a tool (`Tool`), and what its handler may share with others (`ToolResources`); tools/registry.py lists
the built-in ones."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ToolsConfig

Handler = Callable[[str], tuple[str, "str | None"]]  # the call's one argument -> (observation, error kind or None)
MAX_ARGUMENT_DEPTH = 32  # a call's JSON arguments nested deeper than this are unusable: no tool's parameters need more
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # a string (skipped whole) or a bracket


def nesting_depth(text: str) -> int:
    """How deep the brackets of JSON text nest outside its strings, read without recursion whatever the depth."""
    depth = deepest = 0
    for token in _JSON_TOKEN.findall(text):
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in ("]", "}"):
            depth -= 1
    return deepest


def json_arguments(text: str, max_depth: int = MAX_ARGUMENT_DEPTH):
    """A call's JSON arguments parsed: ValueError when they nest deeper than `max_depth` (checked before parsing),
    json.JSONDecodeError (a ValueError) when they are no JSON."""
    if nesting_depth(text) > max_depth:
        raise ValueError(f"JSON nested more than {max_depth} deep")
    return json.loads(text)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str  # what the tool does, for its JSON schema
    argument: str  # its one parameter ("query", "code", "url")
    argument_description: str
    prompt: str  # the sentence of the tag protocol's system prompt that teaches the tool
    build: Callable[[ToolsConfig, "ToolResources"], Handler]  # the handler, from params.yaml's tools section
    parallel: bool = False  # several calls in one turn run together (the tag protocol joins their arguments with |)
    output_cap: str = ""  # the tools.* setting that caps its observation
    deadline: str = "call_deadline_s"  # the tools.* setting after which the runtime gives up on a call
    prefill: str = ""  # what the scaffold writes after the opening tag, before the model's argument
    aliases: tuple[str, ...] = ()  # other names seeds and imported records call it by
    enabled: Callable[[ToolsConfig], bool] = lambda settings: True  # whether params.yaml turns it on
    # a tool of yours: its arguments' JSON schema (a call's tag holds them as a JSON object)
    parameters: dict | None = None
    origin: str = "builtin"  # where it comes from: builtin, function <spec>, mcp <server>

    @property
    def structured(self) -> bool:
        """Whether a call's argument is a JSON object of named arguments (your tools) rather than one string."""
        return self.parameters is not None

    def schema(self) -> dict:
        """Its OpenAI function schema."""
        parameters = self.parameters if self.structured else {
            "type": "object",
            "properties": {self.argument: {"type": "string", "description": self.argument_description}},
            "required": [self.argument]}
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": parameters}}

    def deadline_s(self, settings: ToolsConfig) -> float:
        """Seconds after which the runtime gives up on a call, under `settings`."""
        return float(getattr(settings, self.deadline))


@dataclass
class ToolResources:
    """What handlers share: the retriever (search), the web cache folder."""
    retriever: object = None
    web_cache_dir: str = ""
