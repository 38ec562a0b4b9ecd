"""Generation: the configured multi-agent teacher with tools on the train questions (N samples each).

The teacher is the `teacher` block (models/teacher, or its server): never the student.
Every question is a flow of its own on one engine (a new one starts whenever fewer than `generate.episodes_in_flight`
episodes are live; no barrier between questions or shards). Each shard of questions is written atomically under
data/.cache/generate/<key>/ as soon as all its questions are done, so a killed run resumes from completed shards
without duplicates; the key (`shard_dir`) covers the settings, the questions, the code, the index and the teacher.
The output is written once, atomically, at the end. A request that fails for good (after its retries) ends its episode
(finish request_failed, counted in the report); the run stops with an error naming the server when llm.max_failed_in_row
requests fail one after another, or before a shard whose failures would pass llm.max_failed_share of all trajectories is
written; the finished shards stay for the next run, and the error carries the retry and failure counters (`counters`,
for the stage to log).
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from .. import layout
from ..config import SPENDING_LIMITS, ClusterConfig, RouteConfig, SystemSettings
from ..data.digest import file_digests
from ..data.schemas import TRAJECTORY, read_table, write_table
from ..llm import teacher_id
from ..teacher_topk import TEACHER_TOPK
from ..teams import by_teacher
from .cluster import Replicas, Workbench, run_system, sum_counters, system_context, workbench_or_replicas
from .episodes import tool_totals
from .methods import StopWhenVerified, run_method
from .runtime import REQUEST_FAILED
from .wiring import demonstrations, fault_counters, remote_counters

PACKAGE = Path(__file__).resolve().parents[1]  # unison/: its sources are part of the shards' key


FAULTS = ("teacher_", "search_")  # the counters an error's note repeats, with what the served models cost
SPENT = (".prompt_tokens", ".completion_tokens", ".cost_usd")


def shard_dir(s: SystemSettings, questions: list[dict], verifier: dict | None = None) -> Path:
    """Shards are valid only for the same settings (less the spending limits and topk), questions and worked examples,
    the same judge settings where generate.stop_at_verified verifies with them (`verifier`), the same code (every .py
    file of the unison package) and the same index and teacher (every file of data/index, models/teacher and
    generate.roles' local model folders, by content): a shard made by other code or other weights is never reused."""
    settings = s.model_dump()
    if not s.chat_top_logprobs:
        settings["generate"].pop("topk")  # scored after the trajectories: a new k re-scores them, never re-generates
    # a larger budget resumes from the shards a smaller one kept
    for llm in (settings["student_engine"], settings["teacher_engine"]):
        for name in SPENDING_LIMITS:
            llm.pop(name, None)
    key = json.dumps([settings, [q["id"] for q in questions], verifier], sort_keys=True)
    key += demonstrations(s.generate)  # the teacher's worked examples: the file's text, not only its name
    code = sorted(PACKAGE.rglob("*.py"))
    roles = [str(spec["model"]) for spec in s.generate.roles.values() if Path(str(spec.get("model", ""))).is_dir()]
    data = [f for d in dict.fromkeys([layout.INDEX, s.teacher_dir, *roles]) for f in sorted(Path(d).rglob("*"))
            if f.is_file()]
    names = [str(f.relative_to(PACKAGE.parent)) for f in code] + [str(f) for f in data]
    key += json.dumps(dict(zip(names, file_digests(code + data))))
    return Path(layout.GENERATE_CACHE) / hashlib.sha256(key.encode()).hexdigest()[:16]


class TooManyFailures(RuntimeError):
    """More episodes ended on a request that failed for good than llm.max_failed_share allows."""


class FailureShare:
    """Counts the trajectories that ended on a request failed for good (finish request_failed) against the share of all
    `total` that llm.max_failed_share allows; `admit` raises TooManyFailures, before a shard that would pass it is
    written (generate) or a system's rows are scored (evaluate, `stage`)."""

    def __init__(self, share: float, total: int, last_failure=lambda: "", stage: str = "generate"):
        self.share, self.total, self.failed, self.last_failure, self.stage = share, total, 0, last_failure, stage

    def admit(self, rows: list[dict]) -> None:
        failed = self.failed + sum(r["finish_reason"] == REQUEST_FAILED for r in rows)
        if failed > self.share * self.total:
            last = self.last_failure()
            raise TooManyFailures(f"{self.stage}: {failed} of {self.total} trajectories ended on a request that "
                                  f"failed for good, more than llm.max_failed_share {self.share:g} allows"
                                  + (f"; the last: {last}" if last else ""))
        self.failed = failed


class ShardWriter:
    """Collects each question's rows as it finishes and writes a shard (atomically) once all its questions are in and
    `failures` admits them; shards fill out of order when questions finish out of order. `pending`: (shard, question)
    in shard order."""

    def __init__(self, pending: list[tuple[int, dict]], paths: list[Path], failures: FailureShare):
        self.shard_of, self.paths, self.failures = [k for k, _ in pending], paths, failures
        self.left = Counter(self.shard_of)
        self.rows: dict[int, dict[int, list[dict]]] = {k: {} for k in self.left}

    def __call__(self, i: int, rows: list[dict]) -> None:
        k = self.shard_of[i]
        self.rows[k][i] = rows
        self.left[k] -= 1
        if not self.left[k]:
            shard = [r for j in sorted(self.rows[k]) for r in self.rows[k].pop(j)]
            self.failures.admit(shard)
            write_shard(shard, self.paths[k])
            print(f"generate: shard {k + 1}/{len(self.paths)} written", flush=True)


def write_shard(rows: list[dict], path: Path) -> None:
    """A shard's trajectories; first, beside them, the chat teacher's top-k rows they carry ("teacher_topk")."""
    topk = [r.pop("teacher_topk") for r in rows if "teacher_topk" in r]
    if topk:
        write_table(topk, path.with_suffix(".topk.parquet"), TEACHER_TOPK)
    write_table(rows, path, TRAJECTORY)


def read_shard(path: Path) -> list[dict]:
    """A shard's trajectories, each with its "teacher_topk" row when the shard has them (write_shard)."""
    rows, beside = read_table(path, TRAJECTORY), path.with_suffix(".topk.parquet")
    if beside.exists():
        topk = {t["id"]: t for t in read_table(beside, TEACHER_TOPK)}
        for r in rows:
            r["teacher_topk"] = topk[r["id"]]
    return rows


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    return {"trajectories": n, "questions": len({r["question_id"] for r in rows}),
            "llm_calls_per_traj": sum(r["n_llm_calls"] for r in rows) / n,
            "tokens_per_traj": sum(r["n_tokens"] for r in rows) / n,
            "tool_calls_per_traj": sum(r["n_tool_calls"] for r in rows) / n,
            "tool_errors": sum(r["tool_errors"] for r in rows),
            "answered_rate": sum(bool(r["final_answer"]) for r in rows) / n,
            "request_failed": sum(r["finish_reason"] == REQUEST_FAILED for r in rows),
            **{f"finish_{k}": v / n for k, v in Counter(r["finish_reason"] for r in rows).items()}, **tool_totals(rows)}


def generate_trajectories(s: SystemSettings, cluster: ClusterConfig, questions: list[dict], shards: Path,
                          stop: StopWhenVerified | None = None) -> tuple[list[dict], dict]:
    """Every question's trajectories (generate.samples each, fewer where `stop` ends a question early), shard by shard
    in `shards` (finished shards reused; the engine starts only when some shard is left to do), in this process or
    over the replicas of cluster.address; (rows in question order, metrics)."""
    g = s.generate
    shards.mkdir(parents=True, exist_ok=True)
    size = g.shard_size
    chunks = [questions[i : i + size] for i in range(0, len(questions), size)]
    paths = [shards / f"shard-{k:05d}.parquet" for k in range(len(chunks))]
    todo = []
    for k, path in enumerate(paths):
        if path.exists():
            print(f"generate: shard {k + 1}/{len(chunks)} already done, reusing", flush=True)
        else:
            todo.append(k)
    counters, wall_s = fault_counters({}, None), 0.0  # the same keys whether this run generated or only reused shards
    if todo:  # start the engine only if some shard is left to do
        where = workbench_or_replicas(s, cluster, s.teacher_dir, teacher=True)
        pending = [(k, q) for k in todo for q in chunks[k]]
        print(f"generate: {len(pending)} questions in {len(todo)} shards x {g.samples} samples"
              + (f" (a question stops at {stop.enough} verified)" if stop else "")
              + f", {g.method}, up to {g.episodes_in_flight} episodes in flight", flush=True)
        failures = FailureShare(s.teacher_engine.max_failed_share, len(questions) * g.samples)
        failures.admit([r for k, path in enumerate(paths) if k not in todo for r in read_table(path, TRAJECTORY)])
        t0 = time.perf_counter()
        try:
            counters = (run_here(s, where, pending, paths, failures, stop) if isinstance(where, Workbench) else
                        run_on_cluster(s, where, [(k, chunks[k]) for k in todo], paths, failures, stop))
        except Exception as error:  # a server gone for good: the finished shards stay; the stage logs the counters
            error.counters = getattr(error, "counters", counters)
            faults = [f"{k}={v:g}" for k, v in error.counters.items() if k.startswith(FAULTS)]
            error.add_note("generate: "
                           + ", ".join(faults + [f"{k}={v:g}" for k, v in error.counters.items() if k.endswith(SPENT)]))
            raise
        wall_s = time.perf_counter() - t0
    rows = [r for path in paths for r in read_shard(path)]
    # timings live in the report, never in the data; a resumed run's report has the keys of an unkilled one's
    return rows, {**summarize(rows), "wall_s": wall_s, **counters}


def teacher_figures(asked: list[dict], rows: list[dict], counters: dict, verified: Callable[[dict], bool]) -> dict:
    """What one teacher answered and cost in generate: the questions it was asked, its trajectories, the questions it
    verified, the tokens it generated (its trajectories') and, served, the tokens and dollars this run paid for (0 for
    answers replayed from the response cache)."""
    correct = {r["question_id"] for r in rows if verified(r)}
    return {"questions": len(asked), "trajectories": len(rows), "verified_questions": len(correct),
            "verified_trajectories": sum(map(verified, rows)),
            "answered": sum(bool(r["final_answer"]) for r in rows),
            "generated_tokens": sum(r["n_tokens"] for r in rows),
            **{key: float(counters.get(f"backend.teacher.{key}", 0.0))
               for key in ("prompt_tokens", "completion_tokens", "cost_usd")}}


def generate_by_teacher(settings_of: Callable[[str], SystemSettings], cluster: ClusterConfig, questions: list[dict],
                        route: RouteConfig, cascade: list[str], verified: Callable[[dict], bool], stop=None,
                        verifier: dict | None = None) -> tuple[list[dict], dict, list[Path]]:
    """Every train question's trajectories from the teacher its route names, or from each teacher of `cascade` in turn
    until one verifies it; (rows in teacher then question order, metrics with each teacher's figures under
    "teachers", the shard folders to remove once the output is written). `settings_of(name)`: a teacher's
    SystemSettings."""
    rows, metrics, counters, shards, wall_s = [], {"teachers": {}}, [], [], 0.0
    left = list(questions)
    plan = ([(name, None) for name in cascade] if cascade else
            list(by_teacher(questions, route, list(dict.fromkeys([route.default, *route.to.values()]))).items()))
    for name, asked in plan:
        asked = left if asked is None else asked
        if not asked:
            metrics["teachers"][name] = teacher_figures([], [], {}, verified)
            continue
        s = settings_of(name)
        folder = shard_dir(s, asked, verifier)
        if len(plan) > 1:
            print(f"generate: teacher {name} on {len(asked)} questions", flush=True)
        got, m = generate_trajectories(s, cluster, asked, folder, stop)
        shards.append(folder)
        rows += got
        counters.append({k: v for k, v in m.items() if k.startswith(("backend.", "teacher_", "search_", "web_"))})
        wall_s += m["wall_s"]
        metrics["teachers"][name] = teacher_figures(asked, got, m, verified)
        if cascade:
            done = {r["question_id"] for r in got if verified(r)}
            left = [q for q in asked if q["id"] not in done]
    return rows, {**summarize(rows), "wall_s": wall_s, **sum_counters(counters), **metrics}, shards


def run_here(s: SystemSettings, workbench: Workbench, pending: list[tuple[int, dict]], paths: list[Path],
             failures: FailureShare, stop: StopWhenVerified | None) -> dict:
    """The pending questions as flows on this process's engine, each shard written once its questions are done; the
    counters of the pieces behind a network (also on the error, when a server fails for good)."""
    g = s.generate
    ctx = system_context(s, workbench.backend, workbench.toolbox, True, teacher_id(s), g.temperature, workbench.roles,
                         s.chat_top_logprobs, workbench.tool_format)
    models = [workbench.backend, *workbench.roles.values()]
    failures.last_failure = lambda: next((m.last_failure for m in models if getattr(m, "last_failure", "")), "")
    try:
        run_method(g.method, [q for _, q in pending], g.samples, ctx, g.episodes_in_flight,
                   on_question=ShardWriter(pending, paths, failures), stop=stop)
    except Exception as error:
        error.counters = remote_counters({"teacher": workbench.backend, **workbench.roles}, workbench.toolbox)
        raise
    return remote_counters({"teacher": workbench.backend, **workbench.roles}, workbench.toolbox)


def run_on_cluster(s: SystemSettings, replicas: Replicas, shards: list[tuple[int, list[dict]]], paths: list[Path],
                   failures: FailureShare, stop: StopWhenVerified | None) -> dict:
    """Each shard on a replica (cluster.address), written here as it comes back (once `failures` admits it); the
    counters summed."""
    g, counters = s.generate, []
    with replicas:
        for j, (rows, c) in replicas.map(run_system, [(qs, g.samples, True, teacher_id(s), g.temperature,
                                                       s.chat_top_logprobs, stop)
                                                      for _, qs in shards]):
            k = shards[j][0]
            failures.admit(rows)
            write_shard(rows, paths[k])
            counters.append(c)
            print(f"generate: shard {k + 1}/{len(paths)} written", flush=True)
    return sum_counters(counters)
