"""bench/token_distillation's reading of an rl run's reports, and its joining of phases (OPD, then RL) into one row."""
from __future__ import annotations

import csv
import json

from bench.token_distillation import joined, rl_figures


def write_run(project, steps: int, probe_every: int, start: float) -> None:
    """An rl run's reports as stages/rl writes them: the probe's start on step 1's row, its value on probed steps only."""
    (project / "reports").mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "episodes": 4, "response_tokens": 10.0, "kl_teacher": 0.5 / step, "probe_kl": "", "probe_kl_start": ""}
        if step % probe_every == 0 or step == steps:
            row["probe_kl"] = start / (step + 1)
        rows.append(row)
    rows[0]["probe_kl_start"] = start
    with open(project / "reports/rl_curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    report = {"steps": steps, "rollout_s_total": 10.0, "reward_s_total": 1.0, "train_s_total": 5.0, "teacher_tokens_total": 100}
    (project / "reports/rl.json").write_text(json.dumps(report))


def test_the_probe_curve_keeps_the_steps_it_was_measured_at(tmp_path):
    write_run(tmp_path, steps=5, probe_every=2, start=1.2)
    figures = rl_figures(tmp_path)
    assert figures["probe_curve"] == [[0, 1.2], [2, 1.2 / 3], [4, 1.2 / 5], [5, 1.2 / 6]]
    assert figures["train_s"] == 16.0 and figures["student_tokens"] == 200 and len(figures["kl_curve"]) == 5


def test_joined_phases_count_steps_on_and_drop_the_later_start_probe(tmp_path):
    write_run(tmp_path / "opd", steps=4, probe_every=2, start=1.0)
    write_run(tmp_path / "rl", steps=4, probe_every=4, start=0.2)
    both = joined([rl_figures(tmp_path / "opd"), rl_figures(tmp_path / "rl")])
    assert both["probe_curve"] == [[0, 1.0], [2, 1.0 / 3], [4, 0.2], [8, 0.04]]
    assert both["rl_steps"] == 8 and both["train_s"] == 32.0 and both["teacher_tokens"] == 200
