"""Stage `evaluate`: the students and the teacher system scored on the test split with the same tools, a stage each.

    python -m stages.evaluate <system>    stage evaluate_<system>: one system's row (base, teacher, sft, prm_rerank,
                                          dpo, rl); a system params.yaml turns off writes a row that says so
    python -m stages.evaluate             stage evaluate: every row's metrics in reports/metrics.json, the systems
                                          compared question by question in reports/paired.json (exact McNemar on
                                          EM), the headline on the pipeline's run

A row re-runs only when its own inputs change: a new student leaves the teacher's and the base model's rows as DVC
has them. Each trained student is registered in MLflow's model registry with its metrics (unison/model_registry.py)."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from unison import layout, model_registry, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import LABELED, QUESTION, read_table, write_json, write_table
from unison.labeling.evaluation import evaluate_systems, systems_to_evaluate, team_cost, team_rows
from unison.labeling.metrics import paired_em, scoring_label, system_metrics
from unison.report.tables import headline_metrics
from unison.tools.registry import check_toolset

# the comparisons the report makes, (first, second): the first's EM against the second's on the same questions
PAIRS = (("sft", "base"), ("sft", "teacher"), ("dpo", "sft"), ("prm_rerank", "sft"), ("rl", "sft"), ("rl", "teacher"))
OFF = {"teacher": "evaluate.teacher is false", "prm_rerank": "evaluate.rerank_samples is 1",
       "dpo": "dpo.enabled is false"}  # the systems params.yaml can turn off, and the setting that does


def evaluate_system(system: str) -> None:
    """One system's labeled rows and metrics, or, where params.yaml turns it off, an empty row that says why."""
    params = load_params()
    p, g = params.evaluate, params.generate
    chosen = [s for s in systems_to_evaluate(p, g.temperature, params.dpo.enabled) if s[0] == system]
    rows_path, metrics_path = layout.eval_rows(system), layout.eval_metrics(system)
    if not chosen:
        if system == "teacher":
            keep_teacher_rows([])
        write_table([], rows_path, LABELED, empty_ok=True)
        write_json({"evaluated": False, "why": OFF[system]}, metrics_path)
        print(f"evaluate: {system} not evaluated ({OFF[system]})", flush=True)
        return
    from unison.train.prm import load_prm

    check_toolset(params.tools, layout.TOOLSET, f"evaluate_{system}")
    questions = read_table(layout.RAW_TEST, QUESTION)[: p.max_questions or None]
    label = scoring_label(params.label, p)
    with track.stage_run(f"evaluate_{system}", {"seed": params.seed, **p.model_dump(), "teacher_method": g.method,
                                                "episodes_in_flight": g.episodes_in_flight,
                                                **params.model_dump(include={"teacher", "teachers", "cluster"}),
                                                "route": g.route.model_dump(), "cascade": g.cascade}) as run:
        if system == "teacher" and len(params.teacher_names) > 1:
            name, rows, m = "teacher", *evaluate_team(params, questions, label)
        else:
            [(name, rows, m)] = evaluate_systems(params.system_settings(), params.student.tool_format, p, label,
                                                 params.cluster, chosen, questions,
                                                 partial(load_prm, layout.PRM, params.prm.precision))
        if system == "teacher":
            keep_teacher_rows(params.teacher_names if len(params.teacher_names) > 1 else [])
        write_table(rows, rows_path, LABELED)
        write_json({"evaluated": True, **m}, metrics_path)
        run.log_metrics({f"{name}.{k}": v for k, v in m.items()})
        print(f"evaluate: {name} EM {m['em']:.3f} [{m['em_lo']:.3f}, {m['em_hi']:.3f}], accuracy "
              f"({params.label.judge} judge) {m['accuracy']:.3f} [{m['accuracy_lo']:.3f}, {m['accuracy_hi']:.3f}]",
              flush=True)
        if name in model_registry.TRAINED:
            model_registry.register_student(run, name, chosen[0][1], m, params.download.dataset)


def evaluate_team(params, questions: list[dict], label) -> tuple[list[dict], dict]:
    """Each teacher on the test questions (its row in reports/eval/teachers), then the team's row composed from
    theirs (teams.team_rows: the routed teacher's answer, or the cascade's first readable one, with the cost of every
    teacher tried) and its metrics, with its dollars shared out from its teachers' (teams.team_cost)."""
    p, g = params.evaluate, params.generate
    rows_of, metrics_of = {}, {}
    for name in params.teacher_names:
        s = params.system_settings(name)
        [(_, rows, m)] = evaluate_systems(s, params.student.tool_format, p, label, params.cluster,
                                          [("teacher", s.teacher_dir, g.temperature)], questions, lambda: None)
        rows_of[name], metrics_of[name] = rows, m
        Path(layout.TEACHER_EVALS).mkdir(parents=True, exist_ok=True)
        write_table(rows, layout.teacher_rows(name), LABELED)
        write_json(m, layout.teacher_metrics(name))
        print(f"evaluate: teacher {name} EM {m['em']:.3f} [{m['em_lo']:.3f}, {m['em_hi']:.3f}], "
              f"{m['tokens_per_question']:.0f} generated tokens a question", flush=True)
    rows = team_rows(rows_of, questions, g.route, g.cascade)
    wall = sum(m["wall_s_per_question"] * m["questions"] for m in metrics_of.values())
    m = {**system_metrics(rows, wall, label, p.bootstrap, params.seed), **team_cost(rows, metrics_of, rows_of),
         "team": "cascade" if g.cascade else "route",
         "answered_by": {name: sum(r["teacher_name"] == name for r in rows) for name in rows_of}}
    return rows, m


def keep_teacher_rows(names: list[str]) -> None:
    """reports/eval/teachers holds the rows of `names` and their list (names.json), nothing of a teacher no longer
    there: the folder exists, for DVC, whether or not several teachers teach."""
    folder = Path(layout.TEACHER_EVALS)
    folder.mkdir(parents=True, exist_ok=True)
    kept = {Path(layout.teacher_rows(n)).name for n in names} | {Path(layout.teacher_metrics(n)).name for n in names}
    for old in folder.iterdir():
        if old.name not in kept:
            old.unlink()
    write_json(names, folder / "names.json")


def teacher_names() -> list[str]:
    """The teachers evaluate_teacher evaluated one by one (reports/eval/teachers/names.json; [] with one teacher)."""
    return json.loads((Path(layout.TEACHER_EVALS) / "names.json").read_text())


def collect_metrics() -> None:
    """The metrics of the rows that ran, as reports/metrics.json, and their paired comparisons (PAIRS where both ran)
    as reports/paired.json; the headline and each comparison's p-value to the pipeline's run."""
    params = load_params()
    metrics = {}
    for system in layout.SYSTEMS:
        m = json.loads(Path(layout.eval_metrics(system)).read_text())
        if m.pop("evaluated"):
            metrics[system] = m
    label = scoring_label(params.label, params.evaluate)
    rows_of = lambda system: read_table(layout.eval_rows(system), LABELED)
    paired = {f"{a}_vs_{b}": paired_em(rows_of(a), rows_of(b), label)
              for a, b in PAIRS if a in metrics and b in metrics}
    # several teachers: each one's row, and the team (the teacher row) and the students against each
    for name in teacher_names() if "teacher" in metrics else []:
        metrics[f"teacher:{name}"] = json.loads(Path(layout.teacher_metrics(name)).read_text())
        own = read_table(layout.teacher_rows(name), LABELED)
        for system in ("teacher", "sft", "rl"):
            if system in metrics:
                paired[f"{system}_vs_teacher:{name}"] = paired_em(rows_of(system), own, label)
    with track.stage_run("evaluate", {}) as run:
        write_json(metrics, layout.METRICS)
        write_json(paired, layout.PAIRED)
        run.log_artifact(layout.METRICS)
        run.log_pipeline_metrics({**headline_metrics(metrics),
                                  **{f"{name}_p_mcnemar": c["p_mcnemar"] for name, c in paired.items()}})
    print("evaluate: " + ", ".join(f"{name} EM {m['em']:.3f}" for name, m in metrics.items()), flush=True)
    for name, c in paired.items():
        print(f"evaluate: {name.replace('_vs_', ' vs ')} {100 * c['difference']:+.1f} EM points on {c['questions']} "
              f"questions ({c['only_first']} right only in the first, {c['only_second']} only in the second), exact "
              f"McNemar p = {c['p_mcnemar']:.3g}", flush=True)


def main(system: str = "") -> None:
    if system:
        evaluate_system(system)
    else:
        collect_metrics()


if __name__ == "__main__":
    stage_main("evaluate", main, arguments=layout.SYSTEMS)
