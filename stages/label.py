"""Stage `label`: judge every trajectory's final answer (rules or an LLM) and label its steps (DESIGN §6)."""
from __future__ import annotations

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import LABELED, TRAJECTORY, read_table, write_json, write_table
from unison.labeling.judging import make_judge
from unison.labeling.labels import check_step_labels, judge_identity, label_metrics, label_trajectories
from unison.teams import counted_by_teacher
from unison.tools.registry import check_toolset

IN, OUT = layout.TRAJECTORIES, layout.LABELED


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "label")
    p, systems = params.label, params.system_settings()
    backends: dict = {}
    judge = make_judge(p, systems, backends)
    judged_by = judge_identity(p, judge)
    with track.stage_run("label", {"seed": params.seed, **p.model_dump(), **judged_by,
                                   "cluster": params.cluster.model_dump()}) as run:
        rows = label_trajectories(read_table(IN, TRAJECTORY), p, systems, params.cluster, judge, backends)
        check_step_labels(rows, OUT)
        write_table(rows, OUT, LABELED)
        metrics = {**label_metrics(rows, p, judge), "teachers": counted_by_teacher(rows, "trajectories", judged=True)}
        tasks = ", ".join(f"{k.removeprefix('accuracy_')} {v:.3f}" for k, v in sorted(metrics.items())
                          if k.startswith("accuracy_"))
        print(f"label: {len(rows)} trajectories, accuracy {metrics['accuracy']:.3f} ({tasks}) by the {p.judge} judge; "
              f"{metrics['steps']} step labels ({p.step_labels}), mean {metrics['step_label_mean']:.3f}", flush=True)
        write_json({**metrics, **judged_by, "judge": p.judge, "step_labels": p.step_labels}, layout.report("label"))
        run.log_metrics(metrics)


if __name__ == "__main__":
    stage_main("label", main)
