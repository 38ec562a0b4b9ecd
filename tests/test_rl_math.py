"""The RL core against hand-computed values: advantages, the clipped policy loss, rewards (format, efficiency, PRMVR).

Tiny tensors only; every expected number is worked out by hand in the comment next to it.
"""
from __future__ import annotations

import math

import pytest
import torch

from unison.train.advantages import dr_grpo, dynamic_sampling_keep, flow_grpo, grpo, leave_one_out_mean, rloo
from unison.train.policy_loss import aggregate, entropy_from_logits, kl_k3, policy_loss, token_logprobs
from unison.train.rewards import (
    check_format,
    count_tool_calls,
    efficiency_rewards,
    format_reward,
    prm_step_rewards,
    prmvr_token_rewards,
    returns_to_go,
    sigma_factor,
    soft_min,
    step_ends,
    step_token_counts,
)

close = lambda a, b, tol=1e-4: torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)

# ------------------------------------------------------------------------------------------------- advantages

# group a = [1, 0, 0, 0]: mean 0.25, unbiased var (0.75² + 3·0.25²)/3 = 0.75/3 = 0.25, std 0.5
# group b = [2, 4]: mean 3, unbiased std sqrt((1 + 1)/1) = √2
IDS = ["a", "b", "a", "a", "b", "a"]
R = [1.0, 2.0, 0.0, 0.0, 4.0, 0.0]


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    # a: (1-0.25)/0.5 = 1.5, (0-0.25)/0.5 = -0.5; b: ∓1/√2 = ∓0.70711
    assert close(grpo(R, IDS), [1.5, -0.70711, -0.5, -0.5, 0.70711, -0.5])


def test_dr_grpo_drops_the_std():
    # a: 1-0.25 = 0.75, 0-0.25 = -0.25; b: 2-3 = -1, 4-3 = 1
    assert close(dr_grpo(R, IDS), [0.75, -1.0, -0.25, -0.25, 1.0, -0.25])


def test_rloo_subtracts_the_mean_of_the_others():
    # a: 1 - (0+0+0)/3 = 1, 0 - (1+0+0)/3 = -1/3; b: 2-4 = -2, 4-2 = 2
    assert close(rloo(R, IDS), [1.0, -2.0, -1 / 3, -1 / 3, 2.0, -1 / 3])
    # leave-one-out means themselves: a: 0, 1/3, 1/3, 1/3; b: 4, 2
    assert close(leave_one_out_mean(R, IDS), [0.0, 4.0, 1 / 3, 1 / 3, 2.0, 1 / 3])


@pytest.mark.parametrize("estimator", [grpo, dr_grpo, rloo])
def test_group_of_one_keeps_its_reward_and_equal_rewards_give_zero(estimator):
    # a group of one has no baseline (verl: mean 0, std 1): A = r
    assert close(estimator([0.7], ["x"]), [0.7])
    # all-equal rewards: r - mean = 0, std 0 -> 0/(0+eps) = 0, never NaN
    adv = estimator([1.0, 1.0, 1.0], ["g", "g", "g"])
    assert not torch.isnan(adv).any() and close(adv, [0.0, 0.0, 0.0])


def test_flow_grpo_broadcasts_the_rollout_reward_to_every_turn_grouped_by_question():
    # rollouts: q (reward 1, 3 turns), p (0, 2 turns), q (0, 1 turn), p (0, 2 turns)
    # q's turn samples: [1, 1, 1, 0]: mean 0.75, unbiased var (3·0.25² + 0.75²)/3 = 0.25, std 0.5
    #   -> (1-0.75)/0.5 = 0.5 for the three turns of rollout 0, (0-0.75)/0.5 = -1.5 for rollout 2
    # p's turn samples: all 0 -> 0
    adv, rollout = flow_grpo(["q", "p", "q", "p"], [1.0, 0.0, 0.0, 0.0], [3, 2, 1, 2])
    assert rollout == [0, 0, 0, 1, 1, 2, 3, 3]
    assert close(adv, [0.5, 0.5, 0.5, 0.0, 0.0, -1.5, 0.0, 0.0])


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    # a = [1, 0] mixed: keep; b = [1, 1] equal: drop; c = [0.5] alone: kept (verl keeps groups of one)
    keep = dynamic_sampling_keep([1.0, 0.0, 1.0, 1.0, 0.5], ["a", "a", "b", "b", "c"])
    assert keep.tolist() == [True, True, False, False, True]


# ------------------------------------------------------------------------------------------------ policy loss

def one_token(ratio: float, adv: float, **kw):
    old = torch.zeros(1, 1)
    return policy_loss(old + math.log(ratio), old, torch.tensor([adv]), torch.ones(1, 1), **kw)


def test_clip_higher_is_asymmetric():
    # ratio 1.25, A = +1: clip-higher keeps 1.25 < 1.28 -> loss = -A·1.25 = -1.25, nothing clipped
    loss, m = one_token(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert close(loss, -1.25) and m["clip_frac"] == 0.0
    # the same token under symmetric 0.2 clipping is cut at 1.2: max(-1.25, -1.2) = -1.2, clipped
    loss, m = one_token(1.25, 1.0, clip_low=0.2, clip_high=0.2)
    assert close(loss, -1.2) and m["clip_frac"] == 1.0
    # ratio 1.35, A = +1: cut at 1.28 -> -1.28
    assert close(one_token(1.35, 1.0)[0], -1.28)
    # ratio 0.7, A = -1: unclipped 0.7, clipped at 1-0.2 = 0.8 -> max(0.7, 0.8) = 0.8
    assert close(one_token(0.7, -1.0)[0], 0.8)
    # approx_kl = mean(old - new) = -ln 1.25 = -0.22314
    assert close(one_token(1.25, 1.0)[1]["approx_kl"], -0.22314)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # ratio e² = 7.389, A = -1: PPO gives max(7.389, 1.28) = 7.389; dual clip c = 3 caps it at -A·c = 3
    assert close(one_token(math.exp(2), -1.0)[0], math.exp(2))
    loss, m = one_token(math.exp(2), -1.0, dual_clip=3.0)
    assert close(loss, 3.0) and m["dual_clip_frac"] == 1.0
    # positive advantages are never dual-clipped: ratio e², A = +1 -> -1.28
    assert close(one_token(math.exp(2), 1.0, dual_clip=3.0)[0], -1.28)
    with pytest.raises(ValueError):
        one_token(1.0, 1.0, dual_clip=1.0)


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token_mean: (1+2+3+4)/4 = 2.5
    assert close(aggregate(loss, mask, "token_mean"), 2.5)
    # seq_mean_token_mean: mean(6/3, 4/1) = 3
    assert close(aggregate(loss, mask, "seq_mean_token_mean"), 3.0)
    # seq_mean_token_sum_norm, L = 5: mean(6/5, 4/5) = 1.0; default L = width 3: mean(6/3, 4/3) = 5/3
    assert close(aggregate(loss, mask, "seq_mean_token_sum_norm", max_len=5), 1.0)
    assert close(aggregate(loss, mask, "seq_mean_token_sum_norm"), 5 / 3)
    with pytest.raises(ValueError):
        aggregate(loss, mask, "sum")


def test_padding_and_empty_rows_never_count_and_give_no_nan():
    nan = float("nan")
    # ratio 1 everywhere it counts, so each counted token's loss is -A: row 0 A = 1 (2 tokens), row 1 A = 4 (1 token)
    logp = torch.tensor([[-1.0, -2.0, nan, nan], [-3.0, nan, nan, nan], [nan, nan, nan, nan]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, nan, 5.0], [-3.0, 7.0, nan, nan], [nan, 1.0, 2.0, nan]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 2 has no loss token at all
    adv = torch.tensor([1.0, 4.0, nan])
    # token_mean: (-1 - 1 - 4)/3 = -2; seq_mean_token_mean: mean(-2/2, -4/1) = -2.5 (row 2 is not a sequence)
    # seq_mean_token_sum_norm, L = 4: mean(-2/4, -4/4) = -0.75
    for agg, want in [("token_mean", -2.0), ("seq_mean_token_mean", -2.5), ("seq_mean_token_sum_norm", -0.75)]:
        loss, m = policy_loss(logp, old, adv, mask, agg=agg, max_len=4)
        assert close(loss, want), agg
        assert all(not math.isnan(v) for v in m.values())
    loss.backward()
    assert not torch.isnan(logp.grad).any() and (logp.grad[mask == 0] == 0).all()
    # a batch without any loss token: 0, not NaN
    loss, _ = policy_loss(logp.detach(), old, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0


def test_kl_to_reference():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    # policy == reference: k3 = e⁰ - 0 - 1 = 0, so the KL term adds nothing
    loss, m = policy_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), ref_logp=logp, kl_coef=0.5)
    assert m["kl_ref"] == 0.0 and close(loss, -1.0)
    # logp = ln 0.5, ref = ln 0.25: d = ln 0.5, k3 = 0.5 - ln 0.5 - 1 = 0.19315; A = 0, coef 0.1 -> 0.019315
    assert close(kl_k3(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))), 0.19315)
    loss, m = policy_loss(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.5)]]), torch.tensor([0.0]),
                          torch.ones(1, 1), ref_logp=torch.tensor([[math.log(0.25)]]), kl_coef=0.1)
    assert close(loss, 0.019315) and close(m["kl_ref"], 0.19315)


def test_token_logprobs_and_entropy():
    # logits (0, ln 3) -> p = (1/4, 3/4): log p(1) = ln 0.75 = -0.28768
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert close(token_logprobs(logits, torch.tensor([[1]])), [[-0.28768]])
    # uniform over 4 tokens: H = ln 4 = 1.38629
    assert close(entropy_from_logits(torch.zeros(1, 1, 4)), [[1.38629]])
    _, m = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), logits=torch.zeros(1, 1, 4))
    assert close(m["entropy"], 1.38629)


# ---------------------------------------------------------------------------------------------------- rewards

def test_sigma_decays_linearly_to_zero():
    # T = 5: (5-1)/4 = 1, (5-3)/4 = 0.5, (5-5)/4 = 0, step 6 -> max(0, -1/4) = 0; T = 1 -> 0
    assert [sigma_factor(s, 5) for s in (1, 3, 5, 6)] == [1.0, 0.5, 0.0, 0.0]
    assert sigma_factor(1, 1) == 0.0


def test_efficiency_reward():
    # one group of 3: scores 1, 1, 0; tool calls 1, 3, 2 (mean 2); lengths 10, 20, 30 (mean 20, pop std √(200/3),
    # z = -√1.5, 0, +√1.5 = -1.22474, 0, 1.22474); sample 2 breaks the format (f_fmt = -1)
    # s0: f_tool = 2/(1+e^(0.2·-1)) = 2/1.81873 = 1.09967; f_len = 2/(1+e^(0.5·-1.22474)) = 2/1.54207 = 1.29696
    #     r = 1.09967 · 1.29696 = 1.42623
    # s1: f_tool = 2/(1+e^0.2) = 2/2.22140 = 0.90033; f_len = 1 -> r = 0.90033
    # s2: f_tool = 1, f_len = 2/(1+e^0.61237) = 0.70304; r = 0 · ... - 1 = -1
    out = efficiency_rewards([1.0, 1.0, 0.0], [1, 3, 2], [10, 20, 30], [0.0, 0.0, -1.0], ["g"] * 3, 0.2, 0.5)
    assert close(out["f_tool"], [1.09967, 0.90033, 1.0])
    assert close(out["f_len"], [1.29696, 1.0, 0.70304])
    assert close(out["reward"], [1.42623, 0.90033, -1.0])
    assert out["f_fmt"] == [0.0, 0.0, -1.0]


def test_efficiency_reward_at_sigma_zero_is_the_seeds_disabled_case():
    # σ = 0 (ET-Agent's released stage scripts): f_tool = f_len = 1, so r = s + f_fmt
    out = efficiency_rewards([1.0, 0.5, 0.0], [0, 5, 2], [3, 90, 7], [0.0, -1.0, 0.0], ["g"] * 3, 0.0, 0.0)
    assert out["reward"] == [1.0, -0.5, 0.0]
    # equal lengths: z = 0 for all (no division by a zero std) -> f_len = 1
    assert efficiency_rewards([1.0, 1.0], [1, 1], [5, 5], [0.0, 0.0], ["g", "g"])["f_len"] == [1.0, 1.0]


GOOD = "<think>who?</think><search>Ann | Bob</search>\n<result>\nAnn is 3\n</result>\n<answer>3</answer>"


@pytest.mark.parametrize("text, ok", [
    (GOOD, True),
    # a tool call inside <think>, answered there
    ("<think>look <search>q</search>\n<result>\nr\n</result>\n so</think><answer>y</answer>", True),
    # tool-call and answer contents are opaque; observations are cut out
    ("<python>print('<b>')</python>\n<result>\n<b>\n</result>\n<answer>1</answer>", True),
    ("<think>x</think><answer>a</answer><answer>b</answer>", False),  # two answers
    ("<think>x</think>", False),  # no answer
    ("<answer>a</answer> and more", False),  # text after the final answer
    ("<think>x<answer>y</answer>", False),  # unclosed <think>
    ("<think><think>x</think></think><answer>y</answer>", False),  # self-nesting
    ("</think><answer>y</answer>", False),  # close without open
    ("<search> | </search>\n<result>\nerror\n</result>\n<answer>y</answer>", False),  # no query in the call
    ("<think>x</think>\n<result>\nr\n</result>\n<answer>y</answer>", False),  # an observation without a call
])
def test_format_check(text, ok):
    assert check_format(text)[0] is ok
    assert format_reward(text) == (0.0 if ok else -1.0)


def test_format_rejects_tools_not_enabled_and_counts_calls():
    text = "<python>1+1</python>\n<result>\n2\n</result>\n<answer>2</answer>"
    assert check_format(text, ("python",))[0] and not check_format(text, ("search",))[0]
    # two real calls; the tags quoted inside the observation are not calls
    text = "<search>a</search>\n<result>\n<search>fake</search>\n</result>\n<python>1</python>\n<result>\n1\n</result>\n<answer>1</answer>"
    assert count_tool_calls(text) == 2


def test_prm_step_reward_and_soft_min():
    # logits (0, ln 3) -> p = (0.25, 0.75): r = p1 - p0 = 0.5; (ln 3, 0) -> -0.5; one list of steps per trajectory
    p = torch.softmax(torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]]), -1)
    assert close(prm_step_rewards([p[:, 1].tolist()]), [(p[:, 1] - p[:, 0]).tolist()])
    assert close(prm_step_rewards([[0.75, 0.25]]), [[0.5, -0.5]])
    r = torch.tensor([[0.2, 0.8, -0.4, 9.9]])
    valid = torch.tensor([[True, True, True, False]])
    # T = 0.1: w = softmax(-2, -8, 4) = (0.00247, 0.0000061, 0.99753); Σ w·r = -0.39852 ≈ min = -0.4; padding 0
    sm = soft_min(r, valid, 0.1)
    assert close(sm.sum(), -0.39852) and sm[0, 3] == 0
    # T -> 0: exactly the minimum
    assert close(soft_min(r, valid, 1e-3).sum(), -0.4, 1e-6)
    # disabled: weights 1 (PURE's --disable_weighted_reward), the raw step rewards
    assert close(soft_min(r, valid, weighted=False), [[0.2, 0.8, -0.4, 0.0]])


# Three samples of prompt "a" and an empty row of prompt "b", 8 positions each:
#   row 0: gen gen gen tool tool gen gen pad; separators at 1 and at the tool token 4 (ignored) -> ends 1, 6
#          steps: [0] end 1 -> n = 1; [2, (3, 4 tool), 5] end 6 -> n = 2; L = 5 generated tokens
#   row 1: 4 generated, separator at 2 -> ends 2, 3; n = 2, 0; L = 4
#   row 2: 6 generated, no separator -> end 5; n = 5; L = 6
#   row 3: nothing generated -> no steps
MASK = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0], [0] * 8])
SEPS = torch.zeros(4, 8, dtype=torch.bool)
SEPS[0, 1] = SEPS[0, 4] = SEPS[1, 2] = True
STEP_R = torch.tensor([[0.5, -0.5], [0.2, 0.4], [0.6, 99.0], [99.0, 99.0]])  # 99 = beyond a row's steps
GROUPS = ["a", "a", "a", "b"]
ENDS = step_ends(SEPS, MASK)


def at(*entries):
    out = torch.zeros(4, 8)
    for row, pos, value in entries:
        out[row, pos] = value
    return out


def test_step_ends_and_step_token_counts():
    assert ENDS.nonzero().tolist() == [[0, 1], [0, 6], [1, 2], [1, 3], [2, 5]]
    assert step_token_counts(ENDS, MASK, 2).tolist() == [[1, 2], [2, 0], [5, 0], [0, 0]]


def test_prm_rewards_with_step_baseline():
    # unweighted P = Σ r: 0, 0.6, 0.6; S = 2, 2, 1 -> P/S = 0, 0.3, 0.6
    # leave-one-out baselines: (0.3+0.6)/2 = 0.45, (0+0.6)/2 = 0.3, (0+0.3)/2 = 0.15
    # row 0: 0.5-0.45 = 0.05 at 1, -0.5-0.45 = -0.95 at 6; row 1: 0.2-0.3 = -0.1 at 2, 0.4-0.3 = 0.1 at 3; row 2: 0.45 at 5
    got = prmvr_token_rewards(STEP_R, ENDS, MASK, [1, 0, 1, 1], GROUPS, mode="PRM", baseline="step", weighted=False)
    assert close(got, at((0, 1, 0.05), (0, 6, -0.95), (1, 2, -0.1), (1, 3, 0.1), (2, 5, 0.45)))


def test_prm_rewards_with_token_baseline():
    # per-token rate of the others: row 0 (0.6+0.6)/(4+6) = 0.12; row 1 (0+0.6)/(5+6) = 0.054545; row 2 0.6/9 = 0.066667
    # row 0: 0.5 - 0.12·1 = 0.38, -0.5 - 0.12·2 = -0.74; row 1: 0.2 - 0.054545·2 = 0.090909, 0.4 - 0 = 0.4
    # row 2: 0.6 - 0.066667·5 = 0.266667
    got = prmvr_token_rewards(STEP_R, ENDS, MASK, [1, 0, 1, 1], GROUPS, mode="PRM", baseline="token", weighted=False)
    assert close(got, at((0, 1, 0.38), (0, 6, -0.74), (1, 2, 0.090909), (1, 3, 0.4), (2, 5, 0.266667)))


def test_verifiable_reward_at_the_last_generated_token():
    # solved 1, 0, 1 -> VR = solved - 1 = 0, -1, 0; leave-one-out means -0.5, 0, -0.5
    # -> 0.5 at row 0's token 6, -1 at row 1's token 3, 0.5 at row 2's token 5; the empty row gets nothing
    got = prmvr_token_rewards(STEP_R, ENDS, MASK, [1, 0, 1, 1], GROUPS, mode="VR")
    assert close(got, at((0, 6, 0.5), (1, 3, -1.0), (2, 5, 0.5)))
    # PRMVR adds both: row 0's last token -0.74 + 0.5 = -0.24 (coef 1), or -0.74 + 2·0.5 = 0.26 (coef 2)
    got = prmvr_token_rewards(STEP_R, ENDS, MASK, [1, 0, 1, 1], GROUPS, baseline="token", weighted=False)
    assert close(got[0, 6], -0.24) and close(got[0, 1], 0.38)
    got = prmvr_token_rewards(STEP_R, ENDS, MASK, [1, 0, 1, 1], GROUPS, baseline="token", weighted=False, vr_coef=2.0)
    assert close(got[0, 6], 0.26)
    with pytest.raises(ValueError):
        prmvr_token_rewards(STEP_R[:, :1], ENDS, MASK, [1, 0, 1, 1], GROUPS)


def test_returns_run_through_tool_observations_and_step_ends_are_zeroed():
    # row 0 of PRMVR (token baseline): 0.38 at 1, -0.24 at 6
    # returns = reverse cumsum: 0.14, 0.14, -0.24 (2..6), 0 at 7
    rewards = at((0, 1, 0.38), (0, 6, -0.24))
    returns, adv = returns_to_go(rewards, MASK, ENDS)
    assert close(returns[0], [0.14, 0.14, -0.24, -0.24, -0.24, -0.24, -0.24, 0.0])
    # advantages: generated tokens only, step ends (1, 6) zeroed; token 2, before the tool call, sees the later -0.24
    assert close(adv[0], [0.14, 0, -0.24, 0, 0, -0.24, 0, 0])
    # --nomask_separator_adv: the step ends keep their return
    assert close(returns_to_go(rewards, MASK)[1][0], [0.14, 0.14, -0.24, 0, 0, -0.24, -0.24, 0])
    # a per-token KL penalty 0.1 on generated tokens: returns at 6 = -0.34, at 5 = -0.44, at 2 = -0.54 (tools free)
    _, adv = returns_to_go(rewards, MASK, token_kl=torch.ones(4, 8), kl_coef=0.1)
    assert close(adv[0, [2, 5, 6]], [-0.54, -0.44, -0.34])
