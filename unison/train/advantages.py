"""Group-relative advantages for the GRPO family (DESIGN §7; docs/seeds.md#gaps-training, #flow-grpo; verl core_algos).

A group is the samples of one prompt (`group_ids[i]` names sample i's group; groups need not be contiguous).
Conventions, as in verl: the std is the unbiased (n-1) one; a group of one has no baseline, so its advantage is
its reward (verl sets mean 0, std 1 for it); a group whose rewards are all equal gets advantage 0, never NaN.
"""
from __future__ import annotations

import torch


def group_indices(group_ids: list) -> list[list[int]]:
    """The sample indices of each group, groups in order of first appearance."""
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def _as_tensor(rewards) -> torch.Tensor:
    return torch.as_tensor(rewards, dtype=torch.float64).flatten()


def grpo(rewards, group_ids: list, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps), std unbiased; a group of one keeps A = r."""
    r = _as_tensor(rewards)
    adv = r.clone()
    for idx in group_indices(group_ids):
        if len(idx) > 1:
            g = r[idx]
            adv[idx] = (g - g.mean()) / (g.std() + eps)
    return adv


def dr_grpo(rewards, group_ids: list) -> torch.Tensor:
    """A_i = r_i - mean_g (Dr.GRPO: no std normalisation); a group of one keeps A = r."""
    r = _as_tensor(rewards)
    adv = r.clone()
    for idx in group_indices(group_ids):
        if len(idx) > 1:
            adv[idx] = r[idx] - r[idx].mean()
    return adv


def leave_one_out_mean(values, group_ids: list) -> torch.Tensor:
    """b_i = mean_{j != i, same group} v_j; 0 for a group of one (no other sample)."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    out = torch.zeros_like(v)
    for idx in group_indices(group_ids):
        if len(idx) > 1:
            out[idx] = (v[idx].sum() - v[idx]) / (len(idx) - 1)
    return out


def rloo(rewards, group_ids: list) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_g) (leave-one-out); a group of one keeps A = r."""
    r = _as_tensor(rewards)
    return r - leave_one_out_mean(r, group_ids)


ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def flow_grpo(question_ids: list, rewards, n_turns: list[int],
              estimator: str = "grpo") -> tuple[torch.Tensor, list[int]]:
    """Flow-GRPO: each planner turn is a sample carrying its rollout's reward, grouped by question over all turns.

    Returns the per-turn advantages (rollouts in order, turns in order) and the rollout index of each turn.
    """
    r = _as_tensor(rewards)
    rollout = [i for i, n in enumerate(n_turns) for _ in range(n)]
    turn_groups = [question_ids[i] for i in rollout]
    return ESTIMATORS[estimator](r[rollout], turn_groups), rollout


def dynamic_sampling_keep(rewards, group_ids: list) -> torch.Tensor:
    """DAPO dynamic sampling: keep[i] = False when sample i's group (of 2 or more) has all-equal rewards."""
    r = _as_tensor(rewards)
    keep = torch.ones(len(r), dtype=torch.bool)
    for idx in group_indices(group_ids):
        if len(idx) > 1 and bool((r[idx] == r[idx[0]]).all()):
            keep[idx] = False
    return keep
