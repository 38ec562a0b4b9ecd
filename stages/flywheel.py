"""Stage `flywheel`: distillation rounds after the pipeline (ET-Agent's data flywheel; STaR's \
rejection-sampling rounds)."""
from __future__ import annotations

import shutil
from pathlib import Path

from unison import layout, model_registry, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import write_json
from unison.flywheel import cache_dir, plot, publish_rounds, round_zero, run_rounds
from unison.model_card import evaluation, facts, write_card
from unison.tools.registry import check_toolset

REPORT, PLOT = Path(layout.FLYWHEEL_REPORT), Path(layout.FLYWHEEL_PLOT)


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "flywheel")
    n, system = params.flywheel.rounds, params.system_settings()
    sections = (params.flywheel, system, params.student.tool_format, params.label, params.sft, params.evaluate)
    with track.stage_run("flywheel", {**params.flywheel.model_dump(), "teacher_method": params.generate.method}) as run:
        first, base = round_zero(system)
        # hashing the models costs seconds: only when rounds run
        rounds, work = [first], cache_dir(*sections) if n else None
        children = []
        for k, row in enumerate(run_rounds(*sections, work), start=1):
            rounds.append(row)
            with track.child_run(run, f"flywheel round {k}", {"round": k, "teacher": row["teacher"]}) as child:
                child.log_metrics({key: v for key, v in row.items() if isinstance(v, (int, float))})
            children.append(child)
            print(f"flywheel: round {k}: teacher EM {row['teacher_em']:.3f}, student EM {row['student_em']:.3f}",
                  flush=True)
        if n == 0:
            print("flywheel: flywheel.rounds is 0; reports/flywheel.json holds the pipeline's own round", flush=True)
        publish_rounds(work, n)
        for row in rounds[1:]:  # each round's student was scored here: its card is the scored one
            scores = {key.removeprefix("student_"): v for key, v in row.items() if key.startswith("student_")}
            data = [f"{layout.FLYWHEEL_DATA}/round-{row['round']}.parquet"]
            training = {"round": row["round"], "teacher": row["teacher"], "sft steps": row["sft_steps"]}
            write_card(row["student"], facts(params, "flywheel", data, training),
                       evaluation(scores, params.download.dataset))
        for child, row in zip(children, rounds[1:]):  # once published: a resumed run registers a reused round once
            model_registry.register_student(child, f"flywheel-round-{row['round']}", row["student"],
                                      {key.removeprefix("student_"): v for key, v in row.items()
                                       if key.startswith("student_")}, params.download.dataset)
        write_json({"base": base, "rounds": rounds}, REPORT)
        plot(rounds, base, PLOT)
        run.log_metrics({f"round{r['round']}.{key}": v for r in rounds for key, v in r.items()
                         if isinstance(v, (int, float))})
        run.log_pipeline_metrics({f"flywheel_{key}": v for key, v in rounds[-1].items()
                                  if key in ("round", "teacher_em", "student_em")})
        run.log_artifact(str(PLOT))
    if work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    stage_main("flywheel", main)
