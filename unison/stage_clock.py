"""Echo `dvc repro`'s output and time each stage it runs: `dvc repro 2>&1 | python -m unison.stage_clock`.

DVC prints "Running stage 'name':" when a stage starts; a stage ends when the next starts or the output ends. The
times are printed at the end, and written to reports/stage_times.json when any stage ran.
"""
from __future__ import annotations

import json
import re
import sys
import time

from .data.schemas import atomic_path

START = re.compile(r"^Running stage '([^']+)'")


def main() -> None:
    times: dict[str, float] = {}
    current, since, t0 = None, time.perf_counter(), time.perf_counter()
    for line in sys.stdin:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = START.match(line)
        if m:
            now = time.perf_counter()
            if current:
                times[current] = now - since
            current, since = m.group(1), now
    if current:
        times[current] = time.perf_counter() - since
    if times:
        width = max(map(len, times))
        print("\nstage times:")
        for stage, seconds in times.items():
            print(f"  {stage:<{width}}  {seconds:7.1f} s")
        print(f"  {'total':<{width}}  {time.perf_counter() - t0:7.1f} s")
        tmp = atomic_path("reports/stage_times.json")
        tmp.write_text(json.dumps({k: round(v, 1) for k, v in times.items()}, indent=1) + "\n")
        tmp.replace("reports/stage_times.json")


if __name__ == "__main__":
    main()
