"""A transfer check no weak teacher can hide: a scripted expert of the builtin world (research/expert.py) behind a
fake hosted chat API (the one boundary we fake) teaches the real SmolLM2 student through `dvc repro sft`, and the SFT
student's exact match on held-out test questions, scored by the project's own evaluation, must reach a floor. The demo's
teacher is weaker than its student, so there a regression that halves what SFT transfers would go unseen; here the
teacher is right on every question and the floor sits below what the student measured.

The first test checks the expert itself, in process, on every kind of builtin question (hop1, hop2, math) through the
runtime and the real search and python tools.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import yaml
from transformers import AutoTokenizer

from research.expert import MODEL, ExpertStats, expert_server
from unison.agents.methods import MethodContext, run_method
from unison.agents.runtime import EpisodeSettings
from unison.agents.wiring import make_toolbox
from unison.config import BuiltinWorldConfig, DownloadConfig, ToolsConfig
from unison.data.builtin import generate_world
from unison.data.schemas import QUESTION, read_table
from unison.data.splits import write_splits
from unison.llm.openai_backend import OpenAIBackend
from unison.recipes import merge
from unison.tools.retrieval import build_index

from .projects import copy_project, run, tiny_params

ALL_KINDS = {"n_people": 24, "n_orgs": 8, "n_cities": 8, "n_countries": 4, "train_size": 4, "test_size": 24,
             "mix": {"hop1": 1.0, "hop2": 1.0, "math": 1.0}}


def test_the_fake_expert_answers_hop1_hop2_and_math_by_calling_the_tools_each_needs(tmp_path, tiny_model_dir):
    write_splits(DownloadConfig(builtin=BuiltinWorldConfig(**ALL_KINDS)), 0, tmp_path / "raw")
    build_index(tmp_path / "raw/corpus.parquet", tmp_path / "index", encoder="hash:1024")  # each entity's own passage first
    questions = read_table(tmp_path / "raw/test.parquet", QUESTION)
    stats = ExpertStats()
    with expert_server(questions, stats) as url:
        backend = OpenAIBackend(url, "expert", tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), api="chat",
                                backoff_s=0.01, timeout_s=30)
        ctx = MethodContext(backend, make_toolbox(ToolsConfig(), str(tmp_path / "index")), EpisodeSettings(temperature=0.0), "expert@api")
        rows = {r["question_id"]: r for r in run_method("single", questions, 1, ctx, 8)}
    calls = {"hop1": Counter(search=1), "hop2": Counter(search=2), "math": Counter(python=1)}
    for q in questions:
        row, hop = rows[q["id"]], json.loads(q["meta"])["hop"]
        assert row["final_answer"] == q["answers"][0] and row["finish_reason"] == "answer", row
        assert Counter({t: s["calls"] for t, s in json.loads(row["tool_stats"]).items()}) == calls[hop], row["tool_stats"]
    assert set(Counter(json.loads(q["meta"])["hop"] for q in questions)) == set(calls)
    assert (stats.from_tools, stats.from_record, stats.unknown_questions) == (len(questions), 0, 0)  # every answer read
    assert backend.stats["prompt_tokens"] > 0 and backend.stats["usage_counted_here"] == 0
    assert all(r["teacher"] == f"expert@api (server: {MODEL})" for r in rows.values())


# The tiny overlay's world, student and SFT settings with 48 train questions (1 epoch of 4 a step: 12 optimiser steps) and
# 32 held-out test questions, all 1-hop, taught by the expert on the fake API unscaffolded (it calls its tools on its
# own). sft.lr 2e-4, four times the demo's, so that 12 steps take the student most of the way: 32 train questions at 5e-5
# (8 steps) gave 0.81 and 0.53 on seeds 0 and 1; at 2e-4, 0.88, 0.88 and 0.66 on seeds 0-2, the student naming train
# entities where it should copy from the search result.
TRANSFER = {
    "download": {"builtin": {"train_size": 48, "test_size": 32, "mix": {"hop1": 1.0, "hop2": 0.0, "math": 0.0}}},
    "generate": {"method": "single", "samples": 1, "scaffold": {}},
    "sft": {"lr": 2.0e-4},
    "evaluate": {"max_questions": 0},
}
# The teacher and the SFT student on the test split through the project's evaluation (as stage evaluate scores them),
# one JSON line per system.
EVALUATE_TEACHER_AND_SFT = """
import json
from unison import layout
from unison.config import load_params
from unison.data.schemas import QUESTION, read_table
from unison.labeling.evaluation import evaluate_systems
from unison.labeling.metrics import scoring_label
params = load_params()
p = params.evaluate
questions = read_table(layout.RAW_TEST, QUESTION)[: p.max_questions or None]
systems = [("teacher", layout.TEACHER, params.generate.temperature), ("sft", layout.SFT, p.temperature)]
for name, rows, m in evaluate_systems(params.system_settings(), params.student.tool_format, p, scoring_label(params.label, p), params.cluster, systems,
                                      questions, lambda: None):
    print(json.dumps({"system": name, **{k: m[k] for k in ("em", "em_lo", "em_hi", "questions")}}), flush=True)
"""
# Measured on 2 CPU cores (fp32): seed 0, this test's, 32 of 32 (Wilson 95% [0.89, 1.00]); seeds 1 and 2 (other worlds and
# training orders, a stand-in for another machine's numerics) 30 and 27 of 32 ([0.80, 0.98], [0.68, 0.93]). The floor
# sits below the lowest of those intervals, and a student that absorbs half of what these did (0.50, 0.47, 0.42) fails.
TRANSFER_FLOOR = 0.65


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_student_distilled_from_the_fake_expert_teacher_reaches_the_transfer_floor(tmp_path, base_model_dir):
    t0 = time.time()
    project = copy_project(tmp_path, base_model_dir)
    (project / ".dvc" / "config.local").write_text("[cache]\n    type = hardlink,copy\n")  # the models as links, not copies
    params = merge(tiny_params(), TRANSFER)
    _, train, test = generate_world(BuiltinWorldConfig(**params["download"]["builtin"]), params["seed"])  # as download makes them
    stats = ExpertStats()
    with expert_server(train + test, stats) as url:
        teacher = {"backend": "openai", "api": "chat", "base_url": url, "served_name": "expert"}
        (project / "params.yaml").write_text(yaml.safe_dump(merge(params, {"teacher": teacher}), sort_keys=False))
        run(project, "dvc", "repro", "sft", timeout=1500)
        lines = run(project, "python", "-c", EVALUATE_TEACHER_AND_SFT, timeout=900).stdout.splitlines()
    em = {m["system"]: m for m in map(json.loads, (line for line in lines if line.startswith('{"system"')))}
    print(f"fake expert teacher EM {em['teacher']['em']:.3f}, SFT student EM {em['sft']['em']:.3f} "
          f"[{em['sft']['em_lo']:.3f}, {em['sft']['em_hi']:.3f}] on {em['sft']['questions']} test questions; "
          f"{time.time() - t0:.0f} s")
    assert (stats.from_tools, stats.from_record, stats.unknown_questions) == (len(train) + len(test), 0, 0)  # each answer read
    assert json.loads((project / "reports/sft.json").read_text())["selected"] == len(train)  # every trajectory correct
    assert em["teacher"]["questions"] == em["sft"]["questions"] == 32 and em["teacher"]["em"] == 1.0
    assert em["sft"]["em"] >= TRANSFER_FLOOR
