"""The security suite: attempts to get out of what unison contains, each reported as contained or not.

`make security` (python -m security) runs every attempt against the real parts: the python sandbox (bubblewrap,
cgroups, rlimits), the web tools against real servers on 127.0.0.1, the runtime's tool-call deadline, a stage started
without its isolation, and the search server as a process. It prints a table, writes reports/security.json and
reports/security.md, and exits 1 if any attempt was not contained (an attempt that breaks or hangs counts as not).

An attempt is a plain function registered with `@attempt(kind)`: its docstring says what it tries and what being
contained means, and it returns (contained, evidence), the evidence a few words a reader can check.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable


@dataclass
class Attempt:
    name: str
    kind: str  # the class of attack: "sandbox: memory", "crawl: inward", ...
    run: Callable[[], tuple[bool, str]]
    limit_s: float  # the attempt must end by then: one that hangs is not contained


ATTEMPTS: list[Attempt] = []
CLEANUP = ExitStack()  # servers and processes the attempts share, closed when the suite ends


def attempt(kind: str, limit_s: float = 60):
    """Register the decorated function as an attempt of class `kind`."""
    def register(fn):
        ATTEMPTS.append(Attempt(fn.__name__, kind, fn, limit_s))
        return fn
    return register
