"""Attempts through your tools (tools.functions): the arguments a model chooses for an operator's function, and a
function call that never ends or floods. The function is trusted; what the model sends it, and how long it may hold
the stage, are not."""
from __future__ import annotations

import os
import tempfile
import textwrap
import time
from pathlib import Path

from . import CLEANUP, attempt

TOOLS = textwrap.dedent('''
    import os
    import subprocess
    import time

    CALLED = os.environ["UNISON_SECURITY_CALLED"]


    def lookup(key: str) -> str:
        """Look a key up (and leave a mark that the function ran).

        Args:
            key: the key
        """
        with open(CALLED, "a") as f:
            f.write(key[:20] + "\\n")
        return "value"


    def hang_with_children(seconds: int) -> str:
        """Start two sleeping children, then sleep.

        Args:
            seconds: how long
        """
        for _ in range(2):
            subprocess.Popen(["sleep", str(seconds)])
        time.sleep(seconds)
        return "woke"


    def flood(megabytes: int) -> str:
        """Return a huge text.

        Args:
            megabytes: its size
        """
        return "x" * (megabytes * 2**20)
''')


def toolbox():
    """A toolbox with the functions above, 1 s per call, made once for the suite."""
    if not hasattr(toolbox, "box"):
        from unison.agents.toolbox import Toolbox
        from unison.config import ToolsConfig
        from unison.tools.custom import close_custom_tools

        folder = Path(tempfile.mkdtemp(prefix="unison-security-tools-"))
        (folder / "security_tools.py").write_text(TOOLS)
        os.environ["UNISON_SECURITY_CALLED"] = str(folder / "called")
        functions = [f"{folder / 'security_tools.py'}:{name}" for name in ("lookup", "hang_with_children", "flood")]
        toolbox.box, toolbox.called = Toolbox(settings=ToolsConfig(functions=functions, custom_timeout_s=1.0, function_workers=1)), folder / "called"
        CLEANUP.callback(close_custom_tools)
    return toolbox.box, toolbox.called


def calls_made(called: Path) -> int:
    return len(called.read_text().splitlines()) if called.exists() else 0


@attempt("your tools: arguments")
def arguments_outside_the_schema():
    """Send a function arguments its schema refuses: a 10 MB string, an extra key, a wrong type, a list, JSON nested
    100,000 deep, no JSON at all. Contained: each is an error observation of its own kind and the function never runs."""
    box, called = toolbox()
    before = calls_made(called)
    hostile = ['{"key": "' + "x" * 10_000_000 + '"}', '{"key": "a", "__class__": "os.system"}', '{"key": 5}', '["key"]',
               "[" * 100_000 + "]" * 100_000, "key=a; rm -rf /"]
    kinds = [box.call("lookup", arg)[1] for arg in hostile]
    ran = calls_made(called) - before
    return ran == 0 and all(kinds), f"kinds: {kinds}; the function ran {ran} times"


@attempt("your tools: time")
def a_function_that_hangs_and_leaves_children():
    """Call a function that starts two children and sleeps an hour, with 1 s allowed. Contained: a timeout observation
    within a few seconds, the worker and both children gone, and the next call answered by a new worker."""
    import psutil

    box, _ = toolbox()
    t0 = time.perf_counter()
    text, kind = box.call("hang_with_children", '{"seconds": 3600}')
    took = time.perf_counter() - t0
    time.sleep(0.5)
    sleepers = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[:2] == ["sleep", "3600"]]
    after = box.call("lookup", '{"key": "after"}')
    contained = kind == "timeout" and took < 5 and not sleepers and after == ("value", None)
    return contained, f"{kind} in {took:.1f} s; sleeping children left: {len(sleepers)}; next call: {after[0]}"


@attempt("your tools: output")
def a_function_that_floods_its_output():
    """Call a function that returns 200 MB of text. Contained: an output_cut observation of about the cap
    (tools.custom_max_output_chars), the whole length said, the stage's memory not holding the 200 MB."""
    import psutil

    box, _ = toolbox()
    rss = psutil.Process().memory_info().rss
    text, kind = box.call("flood", '{"megabytes": 200}')
    grown = (psutil.Process().memory_info().rss - rss) / 2**20
    return kind == "output_cut" and len(text) < 2100 and grown < 50, f"{kind}, {len(text)} chars kept; stage +{grown:.0f} MiB"
