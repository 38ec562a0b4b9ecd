"""Your Python functions as tools (tools.functions): each loaded by its spec ("imports/tools.py:lookup_order" or
"mypkg.tools:convert"), its schema from its type hints and docstring (transformers' `get_json_schema`), its calls run
in a few worker processes (`FunctionRunner`) so that a call that hangs is killed at its deadline and its worker
replaced, and one that exhausts its memory or dies takes only its worker with it."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import resource
import select
import signal
import subprocess
import sys
from pathlib import Path


def load_function(spec: str):
    """The function a `tools.functions` entry names: a file path relative to the project (its folder importable) or a
    module; ValueError naming the entry when it cannot be loaded."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no file {where} (relative to the project root)")
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            module_name = f"unison_tools_{path.stem}"
            module = sys.modules.get(module_name)
            if module is None or getattr(module, "__file__", None) != str(path):
                loader = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(loader)
                sys.modules[module_name] = module
                loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        function = getattr(module, name)
    except Exception as e:
        raise ValueError(f"tools.functions {spec!r}: cannot load it: {type(e).__name__}: {e}") from None
    if not callable(function):
        raise ValueError(f"tools.functions {spec!r}: {name} is not a function")
    return function


def function_schema(spec: str) -> dict:
    """The OpenAI function schema of a `tools.functions` entry, from its type hints and Google-style docstring."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(load_function(spec))
    except ValueError:
        raise
    except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tools.functions {spec!r}: no schema from its type hints and docstring: {e}") from None
    schema["function"].pop("return", None)
    return schema


def render_value(value) -> str:
    """A function's return value as the observation's text: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def serve(specs: list[str], memory_mb: int, max_chars: int) -> None:
    """A worker (`python -m unison.tools.functions`): load the functions, then answer each line [name, arguments] of its
    stdin with a line [ok, text cut at `max_chars`, the text's whole length]; what the functions print goes to
    stderr."""
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    functions = {spec.rpartition(":")[2]: load_function(spec) for spec in specs}
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        name, arguments = json.loads(line)
        try:
            text, ok = render_value(functions[name](**arguments)), True
        except BaseException as e:  # the function's failure is the caller's observation
            text, ok = f"{type(e).__name__}: {e}", False
        answers.write(json.dumps([ok, text[:max_chars], len(text)]) + "\n")
        answers.flush()


class FunctionRunner:
    """`workers` processes that each hold every function; a call takes an idle one."""

    def __init__(self, specs: list[str], workers: int, memory_mb: int, max_chars: int):
        self.command = [sys.executable, "-m", __name__, str(memory_mb), str(max_chars), *specs]
        self.idle: queue.Queue = queue.Queue()
        self.running: set = set()
        for _ in range(max(1, workers)):
            self.idle.put(self._start())

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                   start_new_session=True)  # its own process group: what a function starts goes with it
        self.running.add(process)
        if process.stdout.readline() != "ready\n":
            self._stop(process)
            raise ValueError(f"tools.functions: a worker could not load {self.command[5:]} (its error is above)")
        return process

    @staticmethod
    def _stop(process: subprocess.Popen) -> None:
        """Kill a worker and every process it started (its process group)."""
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(5)

    def _replace(self, process: subprocess.Popen) -> subprocess.Popen:
        self._stop(process)
        self.running.discard(process)
        return self._start()

    def call(self, name: str, arguments: dict, timeout_s: float) -> tuple[str, str | None, int]:
        """(text, error kind or None, the result's whole length) of one call; a call still running after `timeout_s` is
        killed with its worker (a `timeout`), one whose worker dies is a `tool_error`."""
        process = self.idle.get()
        try:
            process.stdin.write(json.dumps([name, arguments]) + "\n")
            process.stdin.flush()
            if not select.select([process.stdout], [], [], timeout_s)[0]:
                process = self._replace(process)
                return (f"error: {name} gave no answer within {timeout_s:g} s; it was stopped (tools.custom_timeout_s)",
                        "timeout", 0)
            line = process.stdout.readline()
            if not line:
                raise BrokenPipeError
            ok, text, length = json.loads(line)
        except (BrokenPipeError, OSError):
            code = process.poll()
            process = self._replace(process)
            return (f"error: {name} ended its process (exit code {code}; tools.function_memory_mb bounds its memory)",
                    "tool_error", 0)
        finally:
            self.idle.put(process)
        return (text, None, length) if ok else (f"error: {name} raised {text}", "tool_error", length)

    def close(self) -> None:
        for process in list(self.running):
            self._stop(process)
        self.running.clear()


if __name__ == "__main__":
    serve(sys.argv[3:], int(sys.argv[1]), int(sys.argv[2]))
