"""Stage `pareto`: K rollouts per train question by the SFT student, then ET-Agent group-wise Pareto sampling of RL \
prompts."""
from __future__ import annotations

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import QUESTION, atomic_dir, read_table, write_json
from unison.tools.registry import check_toolset
from unison.train.curriculum import PLOT, plot_front, rl_curriculum
from unison.train.pareto import write_rl_data

OUT = layout.RL_DATA


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "pareto")
    p = params.pareto
    questions = read_table(layout.RAW_TRAIN, QUESTION)[: p.max_questions or None]
    with track.stage_run("pareto", {"seed": params.seed, **p.model_dump(),
                                    "episodes_in_flight": params.generate.episodes_in_flight,
                                    "cluster": params.cluster.model_dump()}) as run:
        rows, groups, metrics = rl_curriculum(p, params.system_settings(), params.student.tool_format, params.label,
                                              params.cluster, questions)
        with atomic_dir(OUT) as tmp:
            write_rl_data(rows, tmp)
        plot_front(groups)
        write_json(metrics, layout.report("pareto"))
        run.log_metrics(metrics)
        run.log_artifact(PLOT)
        print(f"pareto: {metrics['kept_groups']} of {metrics['questions']} questions kept "
              f"({metrics['mixed_groups']} mixed, {metrics['fallback_groups']} fallback); student pass@1 "
              f"{metrics['student_pass1']:.3f} pass@{p.k} {metrics['student_passk']:.3f}; "
              f"{metrics['rollout_s']:.0f} s of rollouts", flush=True)


if __name__ == "__main__":
    stage_main("pareto", main)
