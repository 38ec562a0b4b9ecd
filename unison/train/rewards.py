"""RL rewards: verifiable, format, ET-Agent efficiency, AgentArk PRMVR (DESIGN §7;
docs/seeds.md#et-agents-efficiency-reward, #agentarks-rl-reward-prmvr).

Scalar rewards are per sample with `group_ids` naming the sample's prompt (as in advantages.py). Token rewards are
(batch, tokens) over response positions, with loss_mask = 1 on generated tokens and 0 on tool observations and padding.
"""
from __future__ import annotations

import math
import re

import torch

from ..config import LabelConfig
from ..judge import score
from ..protocol import final_answer, parse_tool_call, split_queries
from ..tools.registry import TOOLS
from .advantages import group_indices, leave_one_out_mean

# ---------------------------------------------------------------------------------------------------------- format

_OBSERVATION = re.compile(r"\s*<result>.*?</result>", re.DOTALL)
_TAG = re.compile(r"<(/?)([A-Za-z_][A-Za-z0-9_]*)>")


def check_format(text: str, tools: tuple[str, ...] | None = None) -> tuple[bool, str]:
    """(ok, reason): each <result> answers a tool call, tags balanced (no self-nesting), calls parse, one final
    <answer>.

    Observations are cut out first; the content of a tool call or an answer is opaque (code may contain "<b>").
    """
    tools = tuple(TOOLS) if tools is None else tools
    parts = _OBSERVATION.split(text)
    if any(parse_tool_call(before, tools) is None for before in parts[:-1]):
        return False, "observation without a tool call before it"
    body = "".join(parts)
    stack: list[tuple[str, int]] = []
    for m in _TAG.finditer(body):
        closing, name = m.group(1) == "/", m.group(2)
        if stack and (stack[-1][0] in TOOLS or stack[-1][0] == "answer") and not (closing and name == stack[-1][0]):
            continue
        if not closing:
            if any(name == open_name for open_name, _ in stack):
                return False, f"nested <{name}>"
            stack.append((name, m.end()))
            continue
        if not stack or stack[-1][0] != name:
            return False, f"unbalanced </{name}>"
        _, start = stack.pop()
        if name in TOOLS and not _tool_call_ok(name, body[start : m.start()], tools):
            return False, f"unparseable <{name}> call"
    if stack:
        return False, f"unclosed <{stack[-1][0]}>"
    answers = len(re.findall(r"<answer>.*?</answer>", body, re.DOTALL))
    if answers != 1:
        return False, f"{answers} <answer> blocks"
    if body.rsplit("</answer>", 1)[1].strip():
        return False, "text after </answer>"
    return True, ""


def _tool_call_ok(tool: str, arg: str, tools: tuple[str, ...]) -> bool:
    if tool not in tools or not arg.strip():
        return False
    return bool(split_queries(arg)) if TOOLS[tool].parallel else True


def format_reward(text: str, tools: tuple[str, ...] | None = None) -> float:
    """f_fmt = -1 if the response breaks the protocol (check_format) else 0 (ET-Agent)."""
    return 0.0 if check_format(text, tools)[0] else -1.0


def count_tool_calls(text: str, tools: tuple[str, ...] | None = None) -> int:
    """Properly paired tool tags <t>...</t> outside observations (ET-Agent's tool count t_i)."""
    body = "".join(_OBSERVATION.split(text))
    return sum(len(re.findall(rf"<{t}>.*?</{t}>", body, re.DOTALL)) for t in (TOOLS if tools is None else tools))


def judge_response(task: str, text: str, ground_truth: list[str], label: LabelConfig, tools: tuple[str, ...]) -> dict:
    """One response's per-sample reward parts: correct and s (the label judge on its final <answer>), f_fmt, tool
    calls."""
    correct, s, _ = score(task, final_answer(text), list(ground_truth), label)
    return {"correct": float(correct), "verifiable": float(s), "format": format_reward(text, tools),
            "tool_calls": count_tool_calls(text, tools)}


# ------------------------------------------------------------------------------------------ ET-Agent efficiency

def sigma_factor(step: int, total_steps: int) -> float:
    """Linear sigma decay: max(0, (T - step) / (T - 1)) for 1-based steps; 0 when T <= 1 (ET-Agent ray_trainer)."""
    return max(0.0, (total_steps - step) / (total_steps - 1)) if total_steps > 1 else 0.0


def efficiency_rewards(scores: list[float], tool_calls: list[int], lengths: list[int], format_rewards: list[float],
                       group_ids: list, sigma_tool: float = 0.2, sigma_len: float = 0.5) -> dict[str, list[float]]:
    """r_i = s_i * f_tool * f_len + f_fmt, f_tool = 2/(1+exp(sigma_tool*(t_i - mean t))), f_len =
    2/(1+exp(sigma_len*(z_i - mean z))).

    Means and the z-score of response lengths (population std; all equal => z = 0) run over the sample's group.
    Pass sigmas already multiplied by sigma_factor(step, T); sigma 0 gives f = 1, i.e. r = s + f_fmt.
    Returns every component per sample: reward, f_tool, f_len, f_fmt.
    """
    n = len(scores)
    out = {"reward": [0.0] * n, "f_tool": [1.0] * n, "f_len": [1.0] * n, "f_fmt": [float(f) for f in format_rewards]}
    for idx in group_indices(group_ids):
        t_mean = sum(tool_calls[i] for i in idx) / len(idx)
        lens = [lengths[i] for i in idx]
        l_mean = sum(lens) / len(lens)
        l_std = math.sqrt(sum((x - l_mean) ** 2 for x in lens) / len(lens))
        z = [(x - l_mean) / l_std if l_std > 0 else 0.0 for x in lens]
        z_mean = sum(z) / len(z)
        for i, zi in zip(idx, z):
            out["f_tool"][i] = 2 / (1 + math.exp(sigma_tool * (tool_calls[i] - t_mean)))
            out["f_len"][i] = 2 / (1 + math.exp(sigma_len * (zi - z_mean)))
            out["reward"][i] = scores[i] * out["f_tool"][i] * out["f_len"][i] + out["f_fmt"][i]
    return out


# ------------------------------------------------------------------------------------------------ AgentArk PRMVR

def prm_step_rewards(p_good: list[list[float]]) -> list[list[float]]:
    """r_k = p1 - p0 = 2 * p1 - 1, in [-1, 1], from the PRM's probability p1 that step k is good (its 2-class softmax:
    p0 = 1 - p1), one list of steps per trajectory as PRM.step_scores gives them."""
    return [[2 * p - 1 for p in steps] for steps in p_good]


def soft_min(step_rewards: torch.Tensor, step_valid: torch.Tensor, temperature: float = 0.1,
             weighted: bool = True) -> torch.Tensor:
    """w_k * r_k with w = softmax(-r / T) over a row's valid steps (sum ~ min_k r_k); w = 1 when not weighted."""
    valid = step_valid.bool()
    r = torch.where(valid, step_rewards.float(), torch.zeros_like(step_rewards, dtype=torch.float32))
    if not weighted:
        return r
    w = torch.softmax(torch.where(valid, -r / temperature, torch.full_like(r, -math.inf)), -1)
    return torch.where(valid, w * r, torch.zeros_like(r))


def last_generated(loss_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last generated token (loss_mask = 1); -1 for a row without any."""
    positions = torch.arange(loss_mask.shape[-1]).expand_as(loss_mask)
    return torch.where(loss_mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values


def step_ends(separator_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Step-end tokens: generated separator tokens (decoding ends with a blank line) and each row's last generated
    token."""
    ends = separator_mask.bool() & loss_mask.bool()
    last = last_generated(loss_mask)
    rows = (last >= 0).nonzero().squeeze(-1)
    ends[rows, last[rows]] = True
    return ends


def step_token_counts(ends: torch.Tensor, loss_mask: torch.Tensor, width: int) -> torch.Tensor:
    """n_k: generated tokens of step k strictly before its end token (tool observations not counted), (batch, width)."""
    counts = torch.zeros(len(ends), width)
    for i, (row_ends, row_gen) in enumerate(zip(ends.bool().tolist(), loss_mask.bool().tolist())):
        k = n = 0
        for is_end, is_gen in zip(row_ends, row_gen):
            if is_end:
                counts[i, k], k, n = n, k + 1, 0
            elif is_gen:
                n += 1
    return counts


def prmvr_token_rewards(step_rewards: torch.Tensor, ends: torch.Tensor, loss_mask: torch.Tensor, solved: list[float],
                        group_ids: list, mode: str = "PRMVR", baseline: str = "token", vr_coef: float = 1.0,
                        temperature: float = 0.1, weighted: bool = True) -> torch.Tensor:
    """Token rewards: (w_k r_k - b_k) at the k-th step end, + vr_coef * (VR_i - mean_{j!=i} VR_j) at the last generated
    token.

    step_rewards (batch, >= steps) holds r_k of a row's steps in order; `ends` = step_ends(...); VR = solved - 1.
    baseline "step": b_k = mean_{j!=i} P_j / S_j; "token": b_k = n_k * mean_{j!=i} P_j / mean_{j!=i} L_j, where
    P = sum_k w_k r_k, S = number of steps, L = generated tokens, n_k = step_token_counts. Mode: PRM, VR or PRMVR.
    """
    gen, ends = loss_mask.bool(), ends.bool()
    n_steps = ends.sum(-1)
    width = step_rewards.shape[-1]
    if bool((n_steps > width).any()):
        raise ValueError(f"step_rewards has {width} columns but a row has {int(n_steps.max())} steps")
    valid = torch.arange(width) < n_steps.unsqueeze(-1)
    rewards = torch.zeros(loss_mask.shape, dtype=torch.float32)
    if "PRM" in mode:
        process = soft_min(step_rewards, valid, temperature, weighted)
        total = process.sum(-1)
        if baseline == "step":
            b = leave_one_out_mean(total / n_steps.clamp(min=1), group_ids).unsqueeze(-1).expand(-1, width)
        elif baseline == "token":
            others_len = leave_one_out_mean(gen.sum(-1).float(), group_ids)
            others_reward = leave_one_out_mean(total, group_ids)
            per_token = torch.where(others_len > 0, others_reward / others_len.clamp(min=1e-12), 0.0)
            b = per_token.unsqueeze(-1) * step_token_counts(ends, gen, width)
        else:
            raise ValueError(f"baseline must be 'step' or 'token', got {baseline!r}")
        rewards[ends] = (process - b.float())[valid]
    if "VR" in mode:
        vr = torch.as_tensor(solved, dtype=torch.float32) - 1
        bonus = vr_coef * (vr - leave_one_out_mean(vr, group_ids))
        last = last_generated(loss_mask)
        rows = (last >= 0).nonzero().squeeze(-1)
        rewards[rows, last[rows]] += bonus[rows].float()
    return rewards


def returns_to_go(token_rewards: torch.Tensor, loss_mask: torch.Tensor, ends: torch.Tensor | None = None,
                  token_kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(returns, advantages): G_t = sum_{t' >= t} (r_t' - kl_coef * kl_t'); A = G on generated tokens, 0 at step ends if
    given.

    The sum runs through tool observations (which carry no reward), so tokens before a tool call see later rewards.
    """
    gen = loss_mask.bool()
    r = token_rewards.float()
    if token_kl is not None and kl_coef:
        r = r - kl_coef * torch.where(gen, token_kl.float(), torch.zeros_like(r))
    returns = r.flip(-1).cumsum(-1).flip(-1)
    keep = gen if ends is None else gen & ~ends.bool()
    return returns, torch.where(keep, returns, torch.zeros_like(returns))
