"""Stage `rl`: GRPO-family RL of the SFT student on the Pareto-selected prompts (data/rl/level*.parquet), live rollouts.

A killed run resumes from data/.cache/rl-checkpoint/<key>, the key hashing every setting and input that changes results.
rl.trainer verl hands the stage to verl's trainer over the export's data/export/verl parquet
(unison/train/verl_trainer.py); its config and checkpoints go to data/.cache/verl/<key>, which a re-run resumes
(trainer.resume_mode auto).
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from unison import layout, track
from unison.agents.wiring import demonstrations, make_role_backends, make_toolbox
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import LABELED, QUESTION, read_table, write_json
from unison.model_card import facts, write_card
from unison.teams import routed_teacher
from unison.tool_format import student_format
from unison.tools.registry import check_toolset, enabled_tools
from unison.train.launch import is_main_process, run_distributed
from unison.train.loop import checkpoint_path, run_key, write_records_csv
from unison.train.opd import TeacherTeam, prompt_key
from unison.train.prm import load_prm
from unison.train.rl import RLSetup, load_rl_data, train_rl
from unison.train.rollout import PlannerRollout, SoloRollout

CURVE_CSV = Path(layout.RL_CURVE)
VERL_DATA, VERL_WORK = Path(layout.VERL_DATA), Path(layout.VERL_WORK)


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "rl")
    rl = params.rl
    if rl.trainer == "verl":
        return main_verl(params)
    if run_distributed("rl", params.train, rl.deepspeed_config):
        return
    settings = {"seed": params.seed, **rl.model_dump(), **params.model_dump(include={"llm", "tools", "label", "train"}),
                "tool_format": params.student.tool_format}
    if rl.student_role == "agentflow_planner":  # the fixed modules and the flow change what the planner learns
        settings |= {"roles": params.generate.roles, "agentflow": params.generate.agentflow.model_dump()}
    several = rl.scores_with_teacher and params.generating_teachers() != ["teacher"]
    if several:  # which teacher scores which prompt
        settings |= {"teachers": {n: params.teacher_block(n).model_dump() for n in params.generating_teachers()},
                     "route": params.generate.route.model_dump(), "cascade": params.generate.cascade}
    with track.stage_run("rl", settings) as run:
        paths = sorted(Path(layout.RL_DATA).glob("level*.parquet"),
                       key=lambda q: int(q.stem[5:]) if q.stem[5:].isdigit() else 0)
        rows = load_rl_data(paths)
        model_dirs = ([layout.SFT] + ([layout.PRM] if rl.reward.prm_weight > 0 else [])
                      + ([layout.teacher_dir(n) for n in params.generating_teachers()] if rl.scores_with_teacher
                         else []))
        inputs = (paths + sorted(q for d in model_dirs for q in Path(d).iterdir() if q.is_file())
                  + ([Path(layout.RAW_TRAIN), Path(layout.LABELED)] if several else []))
        print(f"rl: {len(rows)} prompts in {len(paths)} level file(s), {rl.steps} steps x "
              f"{rl.rollout.prompts_per_step} prompts x {rl.rollout.group_size} rollouts, objective {rl.loss.objective}"
              + (f" after {rl.opd.steps} OPD steps" if rl.opd.steps else "") + ", estimator "
              f"{rl.loss.estimator}, rollouts on {rl.rollout.backend}"
              + (f", the student as AgentFlow's planner beside {sorted(params.generate.roles)}"
                 if rl.student_role == "agentflow_planner" else ""),
              flush=True)
        setup = rl_setup(params, rows)
        records = train_rl(layout.SFT, rows, setup, layout.RL,
                           checkpoint_path("rl", {**settings, "worked_examples": setup.worked_examples}, inputs),
                           on_step=lambda record: run.log_metrics(record, step=record["step"]))
        if not is_main_process():  # another process of a launched run: rank 0 writes
            return
        write_records_csv(records, CURVE_CSV)
        first, last = records[0], records[-1]
        distilled = [r for r in records if "kl_teacher" in r]  # rl.loss.objective opd, or rl.opd.steps' first steps
        metrics = {"steps": len(records), "prompts": len(rows), "first_reward": first["reward_total"],
                   "final_reward": last["reward_total"], "first_accuracy": first["accuracy"],
                   "final_accuracy": last["accuracy"], "final_tool_call_rate": last["tool_call_rate"],
                   "mean_kept_groups": sum(r["kept_groups"] for r in records) / len(records),
                   **{f"{k}_total": sum(r[k] for r in records) for k in ("rollout_s", "reward_s", "train_s")},
                   **({"first_kl_teacher": distilled[0]["kl_teacher"], "final_kl_teacher": distilled[-1]["kl_teacher"],
                       "teacher_tokens_total": sum(r["teacher_tokens"] for r in distilled)}
                      if distilled else {}),
                   **({"probe_kl_start": first["probe_kl_start"], "final_probe_kl": last["probe_kl"]}
                      if "probe_kl_start" in first else {}),
                   # several teachers: the probe's KL to each (teachers.<name>.probe_kl_start, .probe_kl)
                   **{k: v for record in (first, last) for k, v in record.items() if k.startswith("teachers.")}}
        write_json(metrics, layout.report("rl"))
        write_card(layout.RL, facts(params, "rl", paths, {
            "objective": rl.loss.objective, "estimator": rl.loss.estimator, "steps": len(records),
            "prompts per step": rl.rollout.prompts_per_step, "group size": rl.rollout.group_size}))
        run.log_metrics(metrics)


def rl_setup(params, rows: list[dict]) -> RLSetup:
    """The run's settings as one bundle; rank 0, which rolls out and scores, also gets how the student acts (alone
    with its toolbox, or as AgentFlow's planner beside its fixed modules: rl.student_role), the PRM
    (rl.reward.prm_weight > 0) and the teacher (on-policy distillation, the probe)."""
    rl, rank0 = params.rl, is_main_process()
    tools = enabled_tools(params.tools)
    return RLSetup(
        rl=rl, label=params.label, llm=params.llm, tools=tools, acting=student_acting(params, tools) if rank0 else None,
        prm=load_prm(layout.PRM, params.prm.precision) if rl.reward.prm_weight > 0 and rank0 else None,
        teacher=opd_teacher(params, rows) if rl.scores_with_teacher and rank0 else None,
        worked_examples=(demonstrations(params.generate)
                         if rl.scores_with_teacher and rl.opd.teacher_context == "worked_examples" else ""),
        gradient_checkpointing=params.train.gradient_checkpointing)


def student_acting(params, tools: tuple[str, ...], model_dir: str = layout.SFT) -> SoloRollout | PlannerRollout:
    """How the student in `model_dir` rolls out its RL episodes: alone in its tool format, or as AgentFlow's planner."""
    toolbox = make_toolbox(params.tools)
    if params.rl.student_role == "agentflow_planner":
        return PlannerRollout(toolbox, tools, make_role_backends(params.generate.roles, params.teacher_engine(),
                                                                 params.seed), params.generate.agentflow)
    return SoloRollout(toolbox, tools, student_format(params.student.tool_format,
                                                      AutoTokenizer.from_pretrained(model_dir), tools,
                                                      params.generate.method))


def opd_teacher(params, rows: list[dict]):
    """What scores the student's tokens (on-policy distillation, the probe): the teacher block's backend, or, where
    several teachers teach, a TeacherTeam sending each RL prompt to its question's teacher (question_teachers). Each
    scores the very tokens when it has the student's vocabulary, else the student's text through the character
    alignment (unison/token_alignment.py)."""
    from unison.llm import teacher_backend

    names = params.generating_teachers()
    if names == ["teacher"]:
        return teacher_backend(params.system_settings())
    of_question = question_teachers(params)
    routes = {prompt_key(r["prompt"]): of_question[r["extra_info"]["question_id"]] for r in rows}
    print("rl: on-policy distillation from " + ", ".join(f"{n} ({sum(v == n for v in routes.values())} prompts)"
                                                         for n in names), flush=True)
    return TeacherTeam({name: teacher_backend(params.system_settings(name)) for name in names}, routes)


def question_teachers(params) -> dict[str, str]:
    """Each train question's teacher: the one generate.route sends it to; in a cascade, the first whose trajectory of
    it verified (data/labeled), else the cascade's last."""
    questions = read_table(layout.RAW_TRAIN, QUESTION)
    cascade = params.generate.cascade
    if not cascade:
        return {q["id"]: routed_teacher(q, params.generate.route) for q in questions}
    verified = {(r["question_id"], r["teacher_name"]) for r in read_table(layout.LABELED, LABELED) if r["correct"]}
    return {q["id"]: next((n for n in cascade if (q["id"], n) in verified), cascade[-1]) for q in questions}


def main_verl(params) -> None:
    """rl.trainer verl: write verl's config (tool config + main_ppo overrides), run verl, models/rl from its last
    step."""
    from unison.train.verl_trainer import require_verl, run_verl, write_verl_config

    require_verl()
    tools = enabled_tools(params.tools)
    settings = {"seed": params.seed, **params.rl.model_dump(),
                **params.model_dump(include={"llm", "tools", "label", "export"})}
    with track.stage_run("rl", settings) as run:
        paths = sorted(VERL_DATA.glob("level*.parquet"))
        if not paths:
            raise FileNotFoundError(f"rl.trainer verl trains on {VERL_DATA}/level*.parquet: run the export stage first")
        key = run_key(settings, paths + sorted(q for q in Path(layout.SFT).iterdir() if q.is_file()))
        work = VERL_WORK / key
        overrides = write_verl_config(params.rl, params.llm, params.label, params.tools, params.export.verl_agent,
                                      [str(p.resolve()) for p in paths], str(Path(layout.SFT).resolve()), work, tools)
        print(f"rl: verl over {len(paths)} level file(s), {params.rl.verl.nnodes} node(s) x "
              f"{params.rl.verl.gpus_per_node} GPUs; config in {work}", flush=True)
        records = run_verl(overrides, work, params.rl.steps, layout.RL)
        write_records_csv(records, CURVE_CSV)
        metrics = {"trainer": "verl", "steps": len(records), "first_reward": records[0]["reward_total"],
                   "final_reward": records[-1]["reward_total"]}
        write_json(metrics, layout.report("rl"))
        write_card(layout.RL, facts(params, "rl", paths, {"trainer": "verl", "steps": len(records)}))
        run.log_metrics(metrics)


if __name__ == "__main__":
    stage_main("rl", main)
