"""One description per setting: params.yaml's comment on each setting is its Field description in unison/config,
wrapped. `sync(text)` rewrites those comments and keeps everything else (values, section comments, the comments of
free-form maps' entries); `python -m unison.params_doc` rewrites params.yaml; a test checks the file is in sync."""
from __future__ import annotations

import re
import sys
import textwrap
import typing
from pathlib import Path

from pydantic import BaseModel

from .config import Params

COLUMN = 30  # where a setting's comment starts
WIDTH = 120
KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][A-Za-z_0-9]*):(?P<rest>.*)$")
CONTINUATION = re.compile(r"^\s+#   ")


def nested_model(annotation) -> type[BaseModel] | None:
    """The config model a field holds (its section or sub-section), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def commented(head: str, description: str) -> list[str]:
    """`head` (indent, key and value) with `description` as its comment, wrapped at WIDTH."""
    at = max(COLUMN, len(head) + 2)
    lines = textwrap.wrap(description, width=max(40, WIDTH - at - 2), break_on_hyphens=False) or [""]
    rest = textwrap.wrap(" ".join(lines[1:]), width=max(40, WIDTH - at - 4), break_on_hyphens=False)
    return [f"{head:<{at}}# {lines[0]}"] + [f"{'':<{at}}#   {line}" for line in rest]


def without_comment(rest: str) -> str:
    """A YAML line's value part: up to a ` #` outside quotes."""
    quote = None
    for k, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and k and rest[k - 1] in " \t":
            return rest[:k].rstrip()
    return rest.rstrip()


def sync(text: str) -> str:
    """params.yaml's text with every setting's comment made its Field description (settings without one keep theirs)."""
    lines, out, stack, i = text.splitlines(), [], [], 0  # stack: (indent, the model of that level's keys, or None)
    while i < len(lines):
        line, i = lines[i], i + 1
        match = KEY.match(line)
        if not match:
            out.append(line)
            continue
        indent, key, rest = len(match["indent"]), match["key"], match["rest"]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        model = stack[-1][1] if stack else Params
        field = model.model_fields.get(key) if model is not None else None
        value = without_comment(rest)
        stack.append((indent, nested_model(field.annotation) if field is not None else None))
        leaf = field is not None and nested_model(field.annotation) is None
        if not leaf or not field.description:
            out.append(line)
            continue
        while i < len(lines) and CONTINUATION.match(lines[i]):  # the old comment's continuation lines
            i += 1
        out += commented(f"{match['indent']}{key}:{value}", field.description)
    return "\n".join(out) + "\n"


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "params.yaml")
    path.write_text(sync(path.read_text()))
    print(f"{path}: comments synced from unison/config's descriptions")


if __name__ == "__main__":
    main()
