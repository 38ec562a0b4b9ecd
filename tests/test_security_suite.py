"""The security suite's own machinery (security/): its attempts and how a hanging or broken one is reported. The
attempts themselves run under `make security`, not here."""
from __future__ import annotations

import time

from security import Attempt
from security.__main__ import ATTEMPTS, run


def test_at_least_30_attempts_each_saying_what_it_tries_and_what_contained_means():
    names = [a.name for a in ATTEMPTS]
    assert len(names) >= 30 and len(set(names)) == len(names)
    undocumented = [a.name for a in ATTEMPTS if "Contained" not in (a.run.__doc__ or "")]
    assert undocumented == []
    assert {"sandbox: memory", "sandbox: host files", "crawl: inward", "web: limits", "search server",
            "isolation missing", "runtime: tool deadline"} <= {a.kind for a in ATTEMPTS}


def test_an_attempt_that_hangs_or_breaks_is_not_a_pass():
    start = time.monotonic()
    hung = run(Attempt("hangs", "test", lambda: time.sleep(30), limit_s=0.3))
    assert hung["result"] == "NOT CONTAINED" and hung["evidence"] == "did not end within 0.3 s"
    assert time.monotonic() - start < 5  # not waited for
    broken = run(Attempt("breaks", "test", lambda: 1 / 0, limit_s=5))
    assert broken["result"] == "ERROR" and broken["evidence"] == "ZeroDivisionError: division by zero"
    held = run(Attempt("holds", "test", lambda: (True, "held"), limit_s=5))
    assert (held["result"], held["evidence"]) == ("contained", "held")
    escaped = run(Attempt("escapes", "test", lambda: (False, "escaped"), limit_s=5))
    assert escaped["result"] == "NOT CONTAINED"
