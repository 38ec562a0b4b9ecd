"""Stage `evaluate`: the students and the teacher system, scored on the test split with the same tools.

The systems are base, SFT, DPO when enabled, RL, PRM-reranked SFT and the teacher (unison/labeling/evaluation.py). Each
trained student is registered in MLflow's model registry with its metrics (unison/registry.py), and the headline goes
to the pipeline's parent run."""
from __future__ import annotations

from functools import partial

from unison import layout, registry, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import LABELED, QUESTION, atomic_dir, read_table, write_json, write_table
from unison.labeling.evaluation import evaluate_systems, systems_to_evaluate
from unison.labeling.metrics import scoring_label
from unison.report.tables import headline_metrics
from unison.tools.registry import check_toolset
from unison.train.prm import load_prm

OUT = layout.EVAL


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "evaluate")
    p, g = params.evaluate, params.generate
    systems = systems_to_evaluate(p, g.temperature, params.dpo.enabled)
    questions = read_table(layout.RAW_TEST, QUESTION)[: p.max_questions or None]
    metrics: dict[str, dict] = {}
    with track.stage_run("evaluate", {"seed": params.seed, **p.model_dump(), "teacher_method": g.method,
                                      "episodes_in_flight": g.episodes_in_flight,
                                      "teacher": params.teacher.model_dump(),
                                      "cluster": params.cluster.model_dump()}) as run:
        with atomic_dir(OUT) as out:  # reports/eval/ appears whole, with no system left over from an earlier run
            scoring = scoring_label(params.label, p)
            for name, rows, m in evaluate_systems(params.system_settings(), p, scoring, params.cluster, systems,
                                                  questions, partial(load_prm, layout.PRM, params.prm.precision)):
                write_table(rows, out / f"{name}.parquet", LABELED)
                metrics[name] = m
                run.log_metrics({f"{name}.{k}": v for k, v in m.items()})
                print(f"evaluate: {name} EM {m['em']:.3f} [{m['em_lo']:.3f}, {m['em_hi']:.3f}], accuracy "
                      f"({params.label.judge} judge) {m['accuracy']:.3f} [{m['accuracy_lo']:.3f}, "
                      f"{m['accuracy_hi']:.3f}]", flush=True)
        write_json(metrics, layout.METRICS)
        run.log_artifact(layout.METRICS)
        run.log_pipeline_metrics(headline_metrics(metrics))
        for name, model_dir, _ in systems:
            if name in registry.TRAINED:
                registry.register_student(run, name, model_dir, metrics[name])


if __name__ == "__main__":
    stage_main("evaluate", main)
