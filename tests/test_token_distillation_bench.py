"""research/token_distillation's reading of an rl run's reports, the rl params of each row, and a stopped row going on where
it stopped."""
from __future__ import annotations

import csv
import json

import pytest

from research.token_distillation import rl_figures


def write_run(project, steps: int, probe_every: int, start: float) -> None:
    """An rl run's reports as stages/rl writes them: the probe's start on step 1's row, its value on probed steps only."""
    (project / "reports").mkdir(parents=True, exist_ok=True)
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


def episode(*turns: str, finish: str = "answer", calls: int = 1) -> dict:
    """An evaluation row's fields that `endings` reads: the rendering after the prompt as assistant and tool turns."""
    student = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    student += [{"role": "assistant" if k % 2 == 0 else "tool", "content": t} for k, t in enumerate(turns)]
    return {"student": student, "finish_reason": finish, "n_tool_calls": calls}


def write_eval(project) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (project / "reports/bench_eval.json").write_text(json.dumps({"em": 0.5, "em_lo": 0.4, "em_hi": 0.6, "questions": 8}))
    pq.write_table(pa.Table.from_pylist([episode("<search>x</search>", "r", "<answer>y</answer>")] * 8),
                   project / "reports/bench_eval.parquet")


def test_endings_count_the_episodes_whose_last_turn_writes_a_tool_result_itself():
    from research.token_distillation import endings

    rows = [episode("<search>x</search>", "doc", "<answer>y</answer>"),
            episode("<search>x</search>", "doc", "<tool_response>\ndoc", finish="length"),
            episode("<tool_response> in a first turn", "doc", "<answer>y</answer>"),  # not its last turn: not counted
            episode("<search>x</search>", "doc", "<search>x</search>", "doc", finish="max_tool_calls", calls=3)]
    assert endings(rows) == {"answered": 0.5, "wrote_tool_response": 1, "cut_at_length": 1, "at_tool_call_limit": 1,
                             "tool_calls": 1.5}


def fake_demo(root):
    for folder in ("data/raw", "models/base", "models/sft", "models/rl", "models/teacher", "reports"):
        (root / folder).mkdir(parents=True)
    (root / "params.yaml").write_text("rl: {steps: 1, loss: {}, opd: {}}\n")
    (root / "teacher").mkdir()
    return root


def test_a_row_stopped_part_way_goes_on_in_its_copy_and_a_finished_row_is_read_back_for_the_same_setup_only(tmp_path, monkeypatch):
    """The stages are stood in for (research.token_distillation.run): the first rl run dies part-way, as a killed stage
    does; the same command again keeps the copy (what the stopped run left in it stays) and runs rl again there; a
    third time nothing runs; another --set starts a new copy."""
    import research.token_distillation as td

    demo, work = fake_demo(tmp_path / "demo"), tmp_path / "work"
    calls = []

    def stage(project, *cmd):
        calls.append(cmd[-1])
        if cmd[-1] == "stages.rl":
            (project / "data/.cache").mkdir(exist_ok=True)
            if calls.count("stages.rl") == 1:
                (project / "data/.cache/left-by-the-stopped-run").touch()
                raise RuntimeError("killed")
            write_run(project, steps=2, probe_every=1, start=1.0)
        else:
            write_eval(project)
        return 1.0

    monkeypatch.setattr(td, "run", stage)
    args = (demo, work, demo / "teacher", 2, 0.5, 8)
    with pytest.raises(RuntimeError, match="killed"):
        td.row("sft_opd", *args, {"rl.lr": 5e-5}, False)
    assert (work / "sft_opd@2/data/.cache/left-by-the-stopped-run").exists()
    first = td.row("sft_opd", *args, {"rl.lr": 5e-5}, False)
    assert (work / "sft_opd@2/data/.cache/left-by-the-stopped-run").exists()  # the same copy went on
    assert first["em"] == 0.5 and first["probe_curve"] == [[0, 1.0], [1, 0.5], [2, 1.0 / 3]]
    assert calls.count("stages.rl") == 2
    assert td.row("sft_opd", *args, {"rl.lr": 5e-5}, False) == first and calls.count("stages.rl") == 2
    td.row("sft_opd", *args, {"rl.lr": 1e-5}, False)  # another setup: a fresh copy, trained again
    assert calls.count("stages.rl") == 3 and not (work / "sft_opd@2/data/.cache/left-by-the-stopped-run").exists()


def test_an_opd_row_has_no_outcome_term_unless_set_and_the_opd_rl_row_runs_opd_then_rl_in_one_run(tmp_path, monkeypatch):
    """What each row's rl run runs with, read from the copy's params.yaml when its rl stage starts (the stages are
    stood in for): `--set` wins over the row's own settings; OPD -> RL is one run, its first half OPD."""
    import yaml

    import research.token_distillation as td

    demo, seen = fake_demo(tmp_path / "demo"), []

    def stage(project, *cmd):
        if cmd[-1] == "stages.rl":
            rl = yaml.safe_load((project / "params.yaml").read_text())["rl"]
            seen.append((rl["loss"]["objective"], rl["opd"].get("outcome_weight"), rl["steps"], rl["opd"].get("steps")))
            (project / "models/rl").mkdir(exist_ok=True)
            write_run(project, steps=rl["steps"], probe_every=1, start=1.0)
        else:
            write_eval(project)
        return 1.0

    monkeypatch.setattr(td, "run", stage)
    args = (demo, tmp_path / "work", demo / "teacher", 4, 0.5, 8)
    td.row("sft_opd", *args, {}, False)
    td.row("base_opd", *args, {"rl.opd.outcome_weight": 1.0}, False)
    td.row("sft_opd_rl", *args, {"rl.opd.outcome_weight": 0.5}, False)
    assert seen == [("opd", 0.0, 4, None), ("opd", 1.0, 4, None), ("reward", 0.5, 4, 2)]
    with pytest.raises(SystemExit, match="needs a budget of 2 steps or more"):
        td.row("sft_opd_rl", demo, tmp_path / "work", demo / "teacher", 1, 0.5, 8, {}, False)


def test_each_methods_em_line_runs_over_its_budgets_from_the_student_it_starts_from_at_zero_seconds():
    from research.token_distillation import em_lines

    def scored(em, train_s=None):
        return {"em": em, "em_lo": em - 0.1, "em_hi": em + 0.1, **({} if train_s is None else {"train_s": train_s})}

    rows = {"teacher": scored(0.97), "sft": scored(0.28), "sft_rl@32": scored(0.32, 4000.0), "sft_rl@8": scored(0.27, 900.0),
            "sft_opd_rl@8": scored(0.33, 800.0), "base_opd@8": scored(0.0, 990.0)}
    lines = em_lines(rows)
    assert set(lines) == {"sft_rl", "sft_opd_rl", "base_opd"}
    assert [(x, em) for x, em, _, _ in lines["sft_rl"]] == [(0.0, 0.28), (900.0, 0.27), (4000.0, 0.32)]
    assert [x for x, *_ in lines["sft_opd_rl"]] == [0.0, 800.0]
    assert [x for x, *_ in lines["base_opd"]] == [990.0]  # the base student was not scored: no start point


def test_a_seeded_row_trains_in_its_own_copy_with_that_seed(tmp_path, monkeypatch):
    import yaml

    import research.token_distillation as td

    demo, seen = fake_demo(tmp_path / "demo"), []

    def stage(project, *cmd):
        if cmd[-1] == "stages.rl":
            seen.append((project.name, yaml.safe_load((project / "params.yaml").read_text())["seed"]))
            write_run(project, steps=2, probe_every=1, start=1.0)
        else:
            write_eval(project)
        return 1.0

    monkeypatch.setattr(td, "run", stage)
    args = (demo, tmp_path / "work", demo / "teacher", 2, 0.5, 8, {}, False)
    td.row("sft_rl", *args, seed=1)
    td.row("sft_rl", *args, seed=2)
    td.row("sft_rl", *args, seed=1)  # read back from its copy
    assert seen == [("sft_rl@2-seed1", 1), ("sft_rl@2-seed2", 2)]
    assert td.split_key("sft_opd_rl@8-seed12") == ("sft_opd_rl", 8, 12) and td.split_key("sft") == ("sft", None, None)


def test_rows_over_seeds_give_each_methods_spread_and_its_paired_difference_from_rl():
    from research.token_distillation import across_seeds, em_lines

    def scored(em, train_s=100.0):
        return {"em": em, "em_lo": em - 0.1, "em_hi": em + 0.1, "train_s": train_s}

    rows = {"sft": scored(0.28), "sft_rl@8-seed0": scored(0.27), "sft_rl@8-seed1": scored(0.30, 300.0),
            "sft_opd_rl@8-seed0": scored(0.335), "sft_opd_rl@8-seed1": scored(0.25), "sft_opd@8-seed1": scored(0.1),
            "base_opd@8-seed0": scored(0.0), "base_opd@8-seed1": scored(0.02), "sft_rl@32": scored(0.325)}
    summary = across_seeds(rows)
    assert set(summary) == {"sft_rl@8", "sft_opd_rl@8", "base_opd@8"}  # one seed, or none: no spread to give
    assert summary["sft_rl@8"]["em_mean"] == pytest.approx(0.285) and summary["sft_rl@8"]["train_s_mean"] == 200.0
    hybrid = summary["sft_opd_rl@8"]
    assert (hybrid["em_min"], hybrid["em_max"], hybrid["seeds"]) == (0.25, 0.335, [0, 1])
    assert hybrid["vs_rl_min"] == pytest.approx(-0.05) and hybrid["vs_rl_max"] == pytest.approx(0.065)
    assert hybrid["vs_rl_mean"] == pytest.approx(0.0075)
    assert "vs_rl_mean" not in summary["base_opd@8"]  # no base_rl rows with these seeds
    assert "vs_rl_mean" not in summary["sft_rl@8"]
    lines = em_lines(rows)
    assert [x for x, *_ in lines["sft_rl-seed1"]] == [0.0, 300.0] and [em for _, em, *_ in lines["sft_rl"]] == [0.28, 0.325]
