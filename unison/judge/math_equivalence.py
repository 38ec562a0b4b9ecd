"""Math answer equivalence: a numeric fast path, then math-verify under our own timeout.

math-verify's built-in timeouts use `signal.alarm`, which raises outside the main thread, so we turn
them off (`parsing_timeout=None`, `timeout_seconds=None`) and run it in a small pool of worker
processes instead. A caller waits at most `timeout_s` for a verdict; a worker that overruns (sympy can
hang for ever, e.g. on 9^{9^{9^9}}) is killed and a fresh one is started by the next call. Safe to
call from any thread.

Decided: currency and percent signs, thousands separators and trailing zeros do not matter
("$18.00" = "18", "1,000" = "1000", "50\\%" = "50"); units written as words are left to math-verify.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

WORKERS = 2
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
STARTUP_TIMEOUT_S = 120
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")
THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")


def to_number(text: str) -> Decimal | None:
    """The number `text` spells, ignoring $, %, thousands separators and LaTeX thin spaces; else None."""
    text = text.replace("{,}", ",")
    for noise in ("\\$", "$", "\\%", "%", "\\,", "\\!"):
        text = text.replace(noise, "")
    text = text.strip()
    if THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return Decimal(text) if NUMBER.fullmatch(text) else None


def as_latex(text: str) -> str:
    """Put an answer in math mode for math-verify's LaTeX extractor, unless it already has `$`s."""
    return text if "$" in text.replace("\\$", "") else f"${text}$"


def math_verify_equal(gold: str, prediction: str) -> bool:
    """math-verify's verdict with its signal-based timeouts off: run it where a hang can be killed."""
    from math_verify import parse, verify

    gold_parsed = parse(as_latex(gold), parsing_timeout=None)
    prediction_parsed = parse(as_latex(prediction), parsing_timeout=None)
    if not gold_parsed or not prediction_parsed:
        return False
    return bool(verify(gold_parsed, prediction_parsed, timeout_seconds=None))


def serve() -> None:
    """Worker loop: read JSON [gold, prediction] lines on stdin, write one JSON verdict line each."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints from sympy or math-verify go to stderr, not into the replies
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": we know
    math_verify_equal("1", "1")  # import sympy and math-verify before saying ready
    print(json.dumps("ready"), file=replies, flush=True)
    for line in sys.stdin:
        gold, prediction = json.loads(line)
        try:
            verdict = math_verify_equal(gold, prediction)
        except Exception:  # a parser crash on odd input is a wrong answer, not a dead worker
            verdict = False
        print(json.dumps(verdict), file=replies, flush=True)


class _Worker:
    """A child python running `serve`: a plain subprocess, so the caller's __main__ is never re-imported
    (as multiprocessing's spawn would) and no threads or locks are forked."""

    def __init__(self):
        python_path = os.pathsep.join(filter(None, [PROJECT_ROOT, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from unison.judge.math_equivalence import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": python_path},
        )
        if self._reply(STARTUP_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError(f"math-verify worker did not start within {STARTUP_TIMEOUT_S} s")

    def _reply(self, timeout_s: float):
        """The next reply line, decoded; None if none came within timeout_s or the worker died."""
        readable, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if readable else ""
        return json.loads(line) if line else None

    def ask(self, gold: str, prediction: str, timeout_s: float) -> bool | None:
        """The verdict, or None if it did not come within timeout_s (or the worker died)."""
        try:
            self.process.stdin.write(json.dumps([gold, prediction]) + "\n")
            self.process.stdin.flush()
        except OSError:
            return None
        return self._reply(timeout_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.communicate()  # reaps it and closes the pipes (ignoring a broken stdin)


# Idle workers; None marks a slot whose worker is not started yet (or was killed).
_slots: queue.Queue = queue.Queue()
for _ in range(WORKERS):
    _slots.put(None)


@atexit.register
def _stop_idle_workers() -> None:
    while not _slots.empty():
        worker = _slots.get_nowait()
        if worker is not None:
            worker.kill()


def verify_in_worker(gold: str, prediction: str, timeout_s: float) -> bool | None:
    """math-verify's verdict from a worker process; None if it took longer than timeout_s."""
    worker, verdict = _slots.get(), None
    try:
        worker = worker or _Worker()
        verdict = worker.ask(gold, prediction, timeout_s)
        return verdict
    finally:
        if verdict is None and worker is not None:
            worker.kill()
            worker = None
        _slots.put(worker)


def math_score(prediction: str, answers: list[str], timeout_s: float) -> tuple[bool, float, str]:
    """(correct, score, judge): correct if the prediction equals any gold answer."""
    judge, timed_out = "math:numeric", False
    prediction_number = to_number(prediction)
    for gold in answers:
        gold_number = to_number(gold)
        if gold_number is not None and prediction_number is not None:
            if gold_number == prediction_number:
                return True, 1.0, "math:numeric"
            continue
        judge = "math-verify"
        verdict = verify_in_worker(gold, prediction, timeout_s)
        if verdict:
            return True, 1.0, judge
        timed_out = timed_out or verdict is None
    return False, 0.0, "math-verify:timeout" if timed_out else judge
