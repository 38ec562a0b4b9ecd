"""verl's custom reward function over unison's judges: reward.custom_reward_function.path =
pkg://unison.train.verl_reward, .name = compute_score (verl/trainer/ppo/reward.py imports it; its reward manager calls
it once per response).

verl calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=) with the row's
reward_model.ground_truth and extra_info (unison's verl export puts the task in extra_info.ability), plus
`reward.custom_reward_function.reward_kwargs` as keyword arguments: the weights and judge settings that stages/rl.py
copies from params.yaml. The reward is the in-house loop's r = verifiable_weight * s + format_weight * f_fmt
(unison.train.rl.score_episodes) for the same response. The ET-Agent efficiency term and the PRM are relative to a
response's group, which a per-response call does not see, so stages/rl.py refuses rl.reward.efficiency_weight or
rl.reward.prm_weight > 0 with rl.trainer verl.
"""
from __future__ import annotations

from ..config import LabelConfig
from .rewards import judge_response


def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, verifiable_weight: float = 1.0,
                  format_weight: float = 1.0, label: dict | None = None, tools=("search", "python"), **kwargs) -> dict:
    """{"score": r, and its parts}: verl keeps "score" as the reward and logs the other keys (reward_extra_info)."""
    task = (extra_info or {}).get("ability")
    if task is None:
        raise ValueError(f"verl row of {data_source!r}: extra_info has no `ability` (the task); re-run "
                         "the export stage")
    answers = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    parts = judge_response(task, solution_str, answers, LabelConfig(**(label or {})), tuple(tools))
    return {"score": verifiable_weight * parts["verifiable"] + format_weight * parts["format"], **parts}
