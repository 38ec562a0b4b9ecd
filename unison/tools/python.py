"""The `python` tool: code run in the bubblewrap sandbox (python_sandbox.py), what it prints as the observation."""
from __future__ import annotations

from ..config import ToolsConfig
from .tool import Tool


def python_handler(settings: ToolsConfig):
    from .python_sandbox import run_python

    def run(code: str) -> tuple[str, str | None]:
        if not code.strip():
            return "error: empty code", "empty_code"
        res = run_python(code, timeout_s=settings.python_timeout_s, memory_mb=settings.python_memory_mb,
                         max_output_chars=settings.python_max_output_chars)
        if res.ok:
            return res.output or "(no output)", None
        kind = ("timeout" if res.error == "timeout" else
                "unavailable" if res.error.startswith("sandbox unavailable") else "error")
        return f"error: {res.error}\n{res.output}".strip(), kind

    return run


TOOL = Tool(
    name="python",
    description="Run Python code in a sandbox and return what it prints.",
    argument="code",
    argument_description="the code to run; print what you need",
    prompt="To compute, write <python>print(expression)</python>.",
    build=lambda settings, resources: python_handler(settings),
    output_cap="python_max_output_chars",
    prefill="\nprint(",
    aliases=("code",),
)
