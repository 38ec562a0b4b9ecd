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
from unison.labeling.evaluation import evaluate_systems, systems_to_evaluate
from unison.labeling.metrics import paired_em, scoring_label
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
        write_table([], rows_path, LABELED, empty_ok=True)
        write_json({"evaluated": False, "why": OFF[system]}, metrics_path)
        print(f"evaluate: {system} not evaluated ({OFF[system]})", flush=True)
        return
    from unison.train.prm import load_prm

    check_toolset(params.tools, layout.TOOLSET, f"evaluate_{system}")
    questions = read_table(layout.RAW_TEST, QUESTION)[: p.max_questions or None]
    with track.stage_run(f"evaluate_{system}", {"seed": params.seed, **p.model_dump(), "teacher_method": g.method,
                                                "episodes_in_flight": g.episodes_in_flight,
                                                "teacher": params.teacher.model_dump(),
                                                "cluster": params.cluster.model_dump()}) as run:
        [(name, rows, m)] = evaluate_systems(params.system_settings(), params.student.tool_format, p,
                                             scoring_label(params.label, p), params.cluster, chosen, questions,
                                             partial(load_prm, layout.PRM, params.prm.precision))
        write_table(rows, rows_path, LABELED)
        write_json({"evaluated": True, **m}, metrics_path)
        run.log_metrics({f"{name}.{k}": v for k, v in m.items()})
        print(f"evaluate: {name} EM {m['em']:.3f} [{m['em_lo']:.3f}, {m['em_hi']:.3f}], accuracy "
              f"({params.label.judge} judge) {m['accuracy']:.3f} [{m['accuracy_lo']:.3f}, {m['accuracy_hi']:.3f}]",
              flush=True)
        if name in model_registry.TRAINED:
            model_registry.register_student(run, name, chosen[0][1], m, params.download.dataset)


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
    paired = {f"{a}_vs_{b}": paired_em(read_table(layout.eval_rows(a), LABELED),
                                       read_table(layout.eval_rows(b), LABELED), label)
              for a, b in PAIRS if a in metrics and b in metrics}
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
