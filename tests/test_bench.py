"""The rollout benchmark's bookkeeping: the shared report file, episode counts and tool timing (no engine needed)."""
from __future__ import annotations

import json

from bench.bench_rollout import TimedToolbox, episodes_per_trajectory, format_table, save_report
from unison.agents.runtime import Toolbox


def test_save_report_merges_under_its_key(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"sft": {"steps_per_s": 0.1}, "rollout": {"old": True}}))
    save_report({"runtime_vs_plain": 0.5}, path)
    assert json.loads(path.read_text()) == {"sft": {"steps_per_s": 0.1}, "rollout": {"runtime_vs_plain": 0.5}}
    fresh = tmp_path / "sub" / "bench.json"
    save_report({"x": 1}, fresh)
    assert json.loads(fresh.read_text()) == {"rollout": {"x": 1}}


def test_episodes_per_trajectory():
    assert episodes_per_trajectory("single", {}) == 1
    assert episodes_per_trajectory("debate", {"agents": 3, "rounds": 2, "aggregator": "vote"}) == 6
    assert episodes_per_trajectory("debate", {"agents": 4, "rounds": 3, "aggregator": "llm"}) == 13


def test_timed_toolbox_counts_calls_and_passes_results_through():
    box = TimedToolbox(Toolbox(retriever=None))
    assert box.call("search", "x") == ("error: search is not available", "unavailable")
    assert box.call("shell", "ls")[1] == "unknown_tool"
    assert box.calls == 2 and box.seconds >= 0


def test_format_table_names_every_measurement():
    part = {"prompt_tokens": 400, "tokens": 100, "wall_s": 2.0, "tokens_per_s": 50.0}
    result = {"workload": {"method": "single"}, "plain": {**part, "sequences": 4, "max_tokens": 25},
              "runtime": {**part, "episodes": 4, "llm_fraction": 0.9}, "sequential": {**part, "trajectories": 2, "projected_wall_s": 8.0},
              "runtime_vs_plain": 0.5, "runtime_vs_sequential": 4.0}
    table = format_table(result)
    assert "4 seqs x 25 tok" in table and "LLM 90% of wall" in table and "runtime / sequential = 4.00x" in table
