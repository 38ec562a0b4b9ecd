"""Stage `generate`: the teacher's trajectories with tools on the train questions (N samples each), or imported ones.

It runs the configured multi-agent teacher (each of several teachers on the questions generate.route sends it, or in
turn as generate.cascade orders them: agents/generation.py generate_by_teacher) or, with `generate.source` set,
imports SFT trajectories from that file instead (unison/agents/imports.py); with generate.topk > 0 the teacher that
made each trajectory then scores its assistant tokens (unison/teacher_topk.py), or, a chat API teacher, keeps the top
log-probs it returned as it generated."""
from __future__ import annotations

import gc
import shutil
import time
from functools import partial
from pathlib import Path

from unison import layout, track
from unison.agents.episode_traces import sample_traces
from unison.agents.generation import generate_by_teacher
from unison.agents.imports import import_trajectories
from unison.agents.methods import StopWhenVerified
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import QUESTION, TRAJECTORY, read_table, write_json, write_table
from unison.judge import verifies
from unison.llm import teacher_backend
from unison.teacher_topk import TEACHER_TOPK, topk_by_teacher
from unison.tools.registry import enabled_tools, toolset

OUT = Path(layout.TRAJECTORIES)
VERIFIER = {"qa_metric", "f1_threshold", "first_only", "math_timeout_s"}  # the label settings the rule judge reads


def main() -> None:
    params = load_params()
    g = params.generate
    questions = read_table(layout.RAW_TRAIN, QUESTION)
    stop = StopWhenVerified(partial(verifies, params.label), g.stop_at_verified) if g.stop_at_verified else None
    verifier = params.label.model_dump(include=VERIFIER) if stop else None
    with track.stage_run("generate",
                         {**g.model_dump(), **({"verifier": verifier} if stop else {}),
                          **params.model_dump(include={"seed", "llm", "teacher", "teachers", "tools",
                                                       "cluster"})}) as run:
        shards = []
        if g.source:
            t0 = time.perf_counter()
            rows, metrics = import_trajectories(g, enabled_tools(params.tools), params.download.dataset, questions)
            metrics["wall_s"] = time.perf_counter() - t0
        else:
            try:
                rows, metrics, shards = generate_by_teacher(params.system_settings, params.cluster, questions, g.route,
                                                            g.cascade, partial(verifies, params.label), stop, verifier)
            except Exception as error:  # a server gone for good: its retries and failures still reach MLflow
                run.log_metrics(getattr(error, "counters", {}))
                raise
        topk = [r.pop("teacher_topk") for r in rows if "teacher_topk" in r]  # a chat teacher's, kept as it generated
        if g.topk:
            gc.collect()  # the generating engines' memory, before a scoring one starts
            topk, figures = topk_by_teacher(lambda name: teacher_backend(params.system_settings(name)), rows, g.topk,
                                            topk, progress=lambda line: print(line, flush=True))
            for name, counted in figures.pop("teachers").items():
                metrics.setdefault("teachers", {}).setdefault(name, {}).update(counted)
            metrics.update(figures)
        # empty without generate.topk: the output exists either way
        write_table(topk, layout.TOPK, TEACHER_TOPK, empty_ok=True)
        if g.topk:
            metrics["topk_bytes_per_token"] = Path(layout.TOPK).stat().st_size / max(1, metrics["topk_tokens"])
        write_json(toolset(enabled_tools(params.tools)), layout.TOOLSET)
        write_table(rows, OUT, TRAJECTORY)
        n = max(1, len(rows))
        print(f"generate: {len(rows)} trajectories on {len({r['question_id'] for r in rows})} questions, "
              f"{sum(bool(r['final_answer']) for r in rows) / n:.0%} answered; per trajectory "
              f"{sum(r['n_tool_calls'] for r in rows) / n:.1f} tool calls, "
              f"{sum(r['n_tokens'] for r in rows) / n:.0f} tokens", flush=True)
        for name, figures in metrics.get("teachers", {}).items():
            if len(metrics["teachers"]) > 1:
                print(f"generate: teacher {name}: {figures['questions']} questions, {figures['verified_questions']} "
                      f"verified, {figures['generated_tokens']} tokens generated"
                      + (f", ${figures['cost_usd']:.4f} paid" if figures["cost_usd"] else ""), flush=True)
        write_json(metrics, layout.report("generate"))
        run.log_metrics(metrics)
        for ep in sample_traces(rows, n=3, seed=params.seed):
            track.trace_episode(ep)
        run.log_dict(rows[:5], "samples/trajectories.json")
    for folder in shards:
        shutil.rmtree(folder)


if __name__ == "__main__":
    stage_main("generate", main)
