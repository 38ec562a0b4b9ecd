"""python -m security [-k WORD ...]: run the attempts (those whose name or class contains a WORD), print a row per
attempt as it ends, write reports/security.json and reports/security.md, exit 1 if any was not contained."""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import threading
import time
from datetime import datetime, timezone

from unison.config import ROOT

from . import ATTEMPTS, CLEANUP, Attempt, custom_tools, host, runtime, sandbox, servers, web  # noqa: F401  registers the attempts, in this order

REPORTS = ROOT / "reports"
COLUMNS = (("attempt", 44), ("class", 22), ("result", 13), ("seconds", 7))


def run(a: Attempt) -> dict:
    """The attempt's row; it runs in a thread of its own, so one that hangs is reported, not waited for."""
    outcome = {}

    def target():
        try:
            outcome["contained"], outcome["evidence"] = a.run()
        except Exception as e:  # the attempt itself broke: not a pass
            outcome["error"] = f"{type(e).__name__}: {e}"

    start = time.monotonic()
    thread = threading.Thread(target=target, name=a.name, daemon=True)
    thread.start()
    thread.join(a.limit_s)
    if thread.is_alive():
        result, evidence = "NOT CONTAINED", f"did not end within {a.limit_s:g} s"
    elif "error" in outcome:
        result, evidence = "ERROR", outcome["error"][:400]
    else:
        result, evidence = "contained" if outcome["contained"] else "NOT CONTAINED", outcome["evidence"]
    return {"attempt": a.name, "class": a.kind, "result": result, "evidence": evidence,
            "seconds": round(time.monotonic() - start, 1), "what": inspect.cleandoc(a.run.__doc__ or "")}


def line(row: dict) -> str:
    cells = [str(row[name]).ljust(width) for name, width in COLUMNS]
    return " ".join(cells) + " " + row["evidence"]


def markdown(rows: list[dict], summary: dict) -> str:
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")
    out = ["# Security suite", "", f"`make security` on {summary['when']}, {summary['machine']}: {summary['contained']} of "
           f"{summary['attempts']} attempts contained, in {summary['seconds']} s. What each attempt tries: security/*.py "
           "(its docstring), also in reports/security.json.", "",
           "| attempt | class | result | evidence | s |", "|---|---|---|---|---|"]
    out += [f"| {r['attempt']} | {r['class']} | {'**NOT CONTAINED**' if r['result'] != 'contained' else 'contained'}"
            f"{' (error)' if r['result'] == 'ERROR' else ''} | {cell(r['evidence'])} | {r['seconds']} |" for r in rows]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", nargs="*", default=[], help="run only attempts whose name or class contains one of these")
    args = parser.parse_args()
    chosen = [a for a in ATTEMPTS if not args.k or any(k in a.name or k in a.kind for k in args.k)]
    start = time.monotonic()
    print(" ".join(name.ljust(width) for name, width in COLUMNS) + " evidence", flush=True)
    rows = []
    with CLEANUP:
        for a in chosen:
            rows.append(run(a))
            print(line(rows[-1]), flush=True)
    failed = [r for r in rows if r["result"] != "contained"]
    summary = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "attempts": len(rows),
               "contained": len(rows) - len(failed), "seconds": round(time.monotonic() - start, 1),
               "machine": f"{platform.node()}, Linux {platform.release()}, {os.cpu_count()} CPUs, uid {os.geteuid()}"}
    REPORTS.mkdir(exist_ok=True)
    (REPORTS / "security.json").write_text(json.dumps({"summary": summary, "attempts": rows}, indent=2) + "\n")
    (REPORTS / "security.md").write_text(markdown(rows, summary))
    print(f"\n{summary['contained']} of {summary['attempts']} attempts contained in {summary['seconds']} s"
          + (f"; NOT CONTAINED: {', '.join(r['attempt'] for r in failed)}" if failed else "")
          + "; reports/security.md, reports/security.json", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
