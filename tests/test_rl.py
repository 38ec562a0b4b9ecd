"""The RL stage on a tiny model: real rollouts, rewards, masks, updates and exact resume (DESIGN §7).

`answerer` is the tiny random model taught (a few seconds of SFT) to answer "<answer>Paris</answer>" or
"<answer>Rome</answer>" about equally often, so a group of rollouts has mixed rewards and RL has something to move.
"""
from __future__ import annotations

import functools
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from unison.agents.runtime import Episode, Segment
from unison.agents.toolbox import Toolbox
from unison.config import LabelConfig, LLMConfig
from unison.data.schemas import RL_ROW, DataError, write_table
from unison.protocol import chat_prompt, question_messages
from unison.tool_format import TagFormat
from unison.tools.registry import SYSTEM_PROMPT
from unison.train.batches import collate, logprobs_of
from unison.train.pareto import rl_rows
from unison.train.policy_loss import token_logprobs
from unison.train.rl import (
    RLConfig,
    RLSetup,
    batch_loss,
    build_samples,
    collect_step,
    load_rl_data,
    needs_old_logp,
    score_episodes,
    step_prompts,
    train_on,
    train_rl,
)
from unison.train.rollout import SoloRollout, episode_view

LABEL = LabelConfig(qa_metric="subem", f1_threshold=0.8, first_only=False, math_timeout_s=5)
QUESTION = "What is the capital of France?"


def make_rows(n: int = 2, levels=(1, 2)) -> list[dict]:
    groups = [{"question_id": f"q{i}", "task": "qa", "tool_calls": [0, 1], "correctness": [0.0, 1.0], "score_tool": 0.25,
               "score_corr": 0.25, "front": 0, "crowding": 1.0} for i in range(n)]
    questions = {f"q{i}": {"id": f"q{i}", "source": "test", "task": "qa", "question": QUESTION, "answers": ["Paris"]} for i in range(n)}
    return rl_rows(groups, [levels[i % len(levels)] for i in range(n)], questions)


@pytest.fixture(scope="module")
def answerer(tiny_model_dir, tmp_path_factory):
    """The tiny model after SFT on two answers to the same prompt (so it samples either)."""
    return teach_answers(tiny_model_dir, tmp_path_factory.mktemp("answerer"))


def teach_answers(model_dir, path, answers=("Paris", "Rome")):
    """`model_dir` after a few seconds of SFT on "<answer>Paris</answer>" and "<answer>Rome</answer>" (or `answers`) to
    QUESTION, saved to `path`. Trained once per model and answers in a test process (the same weights every time)."""
    model, tok = taught(str(model_dir), tuple(answers))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@functools.cache
def taught(model_dir: str, answers: tuple[str, ...]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = chat_prompt(tok, question_messages(QUESTION, SYSTEM_PROMPT))
    seqs = [prompt + tok(f"<answer>{a}</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    ids = torch.tensor(seqs)
    labels = ids.clone()
    labels[:, : len(prompt)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(60):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, tok


def rl_config(**kw) -> RLConfig:
    """These tests' settings, with `kw` over them (a group's keys, e.g. rollout={...}, over the group's)."""
    base = dict(steps=1, lr=2e-3, warmup_ratio=1.0, weight_decay=0.0, micro_batch_size=3, checkpoint_every=1, seed=0,
                loss={"estimator": "grpo"},
                rollout={"group_size": 4, "prompts_per_step": 2, "temperature": 1.0, "max_turns": 2,
                         "max_tokens_per_turn": 12, "dynamic_sampling": False, "backend": "transformers"})
    return RLConfig(**{**base, **{k: {**base.get(k, {}), **v} if isinstance(v, dict) else v for k, v in kw.items()}})


def rl_setup(cfg, tok, **kw) -> RLSetup:
    """The bundle these tests run RL with: both tools in the tag protocol (`tok`'s), no retriever, 512-token
    episodes."""
    return RLSetup(cfg, LABEL, LLMConfig(max_model_len=512), ("search", "python"),
                   acting=SoloRollout(Toolbox(), ("search", "python"), TagFormat(tok)), **kw)


def run(model_dir, cfg, tmp_path, name, rows=None, on_step=None, teacher=None):
    from transformers import AutoTokenizer

    setup = rl_setup(cfg, AutoTokenizer.from_pretrained(model_dir), teacher=teacher)
    return train_rl(str(model_dir), rows or make_rows(), setup, str(tmp_path / name / "out"),
                    str(tmp_path / name / "ckpt"), on_step=on_step)


def state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def p_paris(model_dir) -> float:
    """P(first answer token = 'Paris' | prompt + '<answer>') under the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prefix = chat_prompt(tok, question_messages(QUESTION, SYSTEM_PROMPT)) + tok("<answer>", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        probs = model(torch.tensor([prefix])).logits[0, -1].softmax(-1)
    return probs[tok("Paris", add_special_tokens=False)["input_ids"][0]].item()


def test_one_step_moves_the_policy_toward_the_rewarded_answer(answerer, tmp_path):
    records = run(answerer, rl_config(lr=1e-4, reward={"format_weight": 0.0}), tmp_path, "one")  # reward: 1 for Paris, else 0; a small
    # step (Adam moves every weight by ~lr at once: 1e-3 overshoots on this tiny model)
    rec = records[0]
    assert rec["episodes"] == 8 and 0 < rec["accuracy"] < 1, rec  # mixed outcomes: something to learn
    assert rec["clip_frac"] == 0.0 and rec["samples"] == 8  # one epoch, one mini-batch: ratio 1 everywhere
    before, after = state(answerer), state(tmp_path / "one" / "out")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert p_paris(tmp_path / "one" / "out") > p_paris(answerer)


def test_the_lr_schedule_decays_over_every_optimiser_step_when_a_step_makes_several(answerer, tmp_path):
    """rl.mini_batches 2: two optimiser steps a step, so 2 steps decay the lr linearly over 4 updates, to half after
    the first step (not to 0 there, leaving the second step's updates none)."""
    records = run(answerer, rl_config(steps=2, mini_batches=2, warmup_ratio=0.0, schedule="linear", lr=1e-4,
                                      checkpoint_every=0), tmp_path, "two")
    assert [r["lr"] for r in records] == pytest.approx([5e-5, 0.0])


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_same_weights(answerer, tmp_path):
    cfg = rl_config(steps=2)
    straight = run(answerer, cfg, tmp_path, "straight")

    def kill(rec):  # in step 2, after step 1's checkpoint (written once step 1's record is logged)
        if rec["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(answerer, cfg, tmp_path, "resumed", on_step=kill)
    assert not (tmp_path / "resumed" / "out").exists()
    trained = []  # the steps the second run works (rollouts and an update): a restart would work both again
    resumed = run(answerer, cfg, tmp_path, "resumed", on_step=lambda rec: trained.append(rec["step"]))
    assert trained == [2]  # it read the checkpoint of step 1
    a, b = state(tmp_path / "straight" / "out"), state(tmp_path / "resumed" / "out")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["reward_total"] for r in resumed] == [r["reward_total"] for r in straight] and len(resumed) == 2


def episode(prompt, parts, answer_key="e") -> Episode:
    e = Episode(key=answer_key, prompt_ids=prompt, seed=0, format=TagFormat(None))  # a view's episode: never run
    for kind, text, ids in parts:
        e.segments.append(Segment(kind, text, ids))
    return e


def test_tool_observations_get_no_gradient_but_later_tokens_keep_the_advantage():
    # prompt [1 2 3], sampled [10 11], observation [20 21 22], sampled [12 13]; a group of two with rewards 1 and 0
    e1 = episode([1, 2, 3], [("gen", "", [10, 11]), ("obs", "", [20, 21, 22]), ("gen", "", [12, 13])])
    e2 = episode([1, 2, 3], [("gen", "", [14, 15])])
    views = [episode_view(e1), episode_view(e2)]
    assert views[0].loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    samples, kept = build_samples(views, {"groups": [0, 0], "total": [1.0, 0.0]}, rl_config())
    a = 0.5 / math.sqrt(0.5)  # grpo: (1 - 0.5) / std([1, 0], unbiased) = 0.70711
    # target-aligned (position t scores token t+1): tokens 10 11 | 20 21 22 | 12 13
    assert samples[0]["advantages"] == pytest.approx([0, 0, a, a, 0, 0, 0, a, a], abs=1e-5)  # grpo eps 1e-6
    assert samples[0]["loss_mask"] == [0, 0, 1, 1, 0, 0, 0, 1, 1] and kept == 1.0
    batch = collate(samples, pad_id=0)
    logits = torch.randn(2, 10, 30, requires_grad=True)
    batch["old_logp"] = token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:]).detach()  # on-policy: ratio 1, nothing clipped
    loss, _ = batch_loss(logits[:, :-1], batch, rl_config())
    loss.backward()
    grad = logits.grad[0].abs().sum(-1)  # logits at position t predict token t+1
    assert grad[[0, 1, 4, 5, 6]].tolist() == [0, 0, 0, 0, 0]  # prompt and observation targets: no gradient
    assert (grad[[2, 3, 7, 8]] > 0).all()  # sampled tokens before and after the observation both learn
    assert (logits.grad[1, 4:] == 0).all() and (logits.grad[1, 2:4] != 0).any()  # the second row's padding never counts
    # one update per step (needs_old_logp false): no old_logp in the batch, the loss's own log-probs stand in, detached
    on_policy = logits.detach().clone().requires_grad_(True)
    loss_without, metrics = batch_loss(on_policy[:, :-1], {k: v for k, v in batch.items() if k != "old_logp"}, rl_config())
    loss_without.backward()
    assert loss_without.item() == pytest.approx(loss.item(), abs=1e-7) and metrics["approx_kl"] == 0.0
    assert torch.allclose(on_policy.grad, logits.grad, atol=1e-7)
    assert not needs_old_logp(rl_config()) and needs_old_logp(rl_config(ppo_epochs=2)) and needs_old_logp(rl_config(mini_batches=2))
    assert not needs_old_logp(rl_config(loss={"objective": "opd"}))  # its teacher term reads the loss's own log-probs too


def test_padding_never_counts(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = rl_config()
    torch.manual_seed(1)
    samples = [{"ids": torch.randint(0, 1000, (n,)).tolist(), "loss_mask": m, "advantages": a} for n, m, a in
               ((6, [0, 1, 1, 0, 1], [0, 1.0, 1.0, 0, 1.0]), (9, [0, 0, 1, 1, 1, 1, 0, 0], [0, 0, -0.5, -0.5, -0.5, -0.5, 0, 0]))]
    for s in samples:
        s["old_logp"] = [-11.0] * (len(s["ids"]) - 1)

    def loss_of(batch_samples, pad_id):
        batch = collate(batch_samples, pad_id)
        with torch.no_grad():
            _, logits = logprobs_of(model, batch, cfg.rollout.temperature)
            return batch_loss(logits, batch, cfg)[0].item()

    together = loss_of(samples, 0)
    assert together == pytest.approx(loss_of(samples, 4242), abs=1e-6)  # what sits in the padding is irrelevant
    n = [sum(s["loss_mask"]) for s in samples]  # token_mean: the batch loss is the token-weighted mean of the rows
    assert together == pytest.approx((loss_of(samples[:1], 0) * n[0] + loss_of(samples[1:], 0) * n[1]) / sum(n), abs=1e-5)


def test_the_micro_batch_size_changes_the_speed_not_the_update(tiny_model_dir):
    """One sample a micro-batch (each row in full) or all in one (their shared first tokens run once): the same
    gradient up to float rounding, read from AdamW's first moment after the step."""
    import random

    from transformers import AutoModelForCausalLM

    from unison.train.loop import Trainer

    torch.manual_seed(2)
    prefix = torch.randint(0, 1000, (24,)).tolist()  # over MIN_SHARED_PREFIX: the shared-prefix path runs
    samples = []
    for n in (5, 9, 7, 12, 6, 8):
        ids = prefix + torch.randint(0, 1000, (n,)).tolist()
        mask = [0] * len(prefix) + [1] * (n - 1)
        samples.append({"ids": ids, "loss_mask": mask, "advantages": [random.Random(n).choice((-1.0, 1.0))] * len(mask)})

    def first_moments(micro_batch_size: int) -> list[torch.Tensor]:
        cfg = rl_config(micro_batch_size=micro_batch_size, max_grad_norm=None, precision="fp32")
        trainer = Trainer("rl", AutoModelForCausalLM.from_pretrained(tiny_model_dir), 1, cfg)
        trainer.model.train()
        train_on(trainer, samples, cfg, 0, random.Random(0))
        opt = getattr(trainer.opt, "optimizer", trainer.opt)
        return [opt.state[p]["exp_avg"] for p in trainer.unwrapped().parameters()]

    one_by_one, all_in_one = first_moments(1), first_moments(len(samples))
    assert max(a.abs().max().item() for a in all_in_one) > 1e-4  # the step had a gradient to compare
    for a, b in zip(one_by_one, all_in_one, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_several_processes_each_get_a_share_of_the_step_whatever_the_micro_batch_size():
    """rl.micro_batch_size 16 puts a 6-sample step in one micro-batch on one process; on two, each runs half of it
    rather than one running it all while the other waits with a weight of 0."""
    import random
    from types import SimpleNamespace

    samples = [{"ids": list(range(1, n + 1)), "loss_mask": [1] * (n - 1), "advantages": [1.0] * (n - 1)}
               for n in (5, 9, 7, 12, 6, 8)]

    def micro_batch_sizes(processes: int, **settings) -> list[list[int]]:
        seen = []

        class Recording:
            acc = SimpleNamespace(num_processes=processes)

            def step(self, micros, loss_fn, weights):
                assert sum(weights) == pytest.approx(1.0)
                seen.append([len(m) for m in micros])
                return {"loss": 0.0}

        train_on(Recording(), samples, rl_config(**{"micro_batch_size": 16, **settings}), 0, random.Random(0))
        return seen

    assert micro_batch_sizes(1) == [[6]]
    assert micro_batch_sizes(2) == [[3, 3]]
    assert micro_batch_sizes(4) == [[2, 2, 2]]
    # each optimiser step's mini-batch keeps its samples, however they are cut into micro-batches
    assert micro_batch_sizes(1, micro_batch_size=1, mini_batches=2) == [[1, 1, 1], [1, 1, 1]]


def test_flow_grpo_makes_one_sample_per_turn():
    e1 = episode([1, 2], [("gen", "", [10, 11]), ("obs", "", [20]), ("gen", "", [12])])
    e2 = episode([1, 2], [("gen", "", [13, 14, 15])])
    samples, _ = build_samples([episode_view(e1), episode_view(e2)], {"groups": ["q", "q"], "total": [1.0, 0.0]},
                               rl_config(loss={"estimator": "flow_grpo"}))
    # turn rewards [1, 1, 0]: mean 2/3, unbiased std sqrt((1/9 + 1/9 + 4/9) / 2) = 0.57735 -> 0.57735, 0.57735, -1.1547
    assert [s["ids"] for s in samples] == [[1, 2, 10, 11], [1, 2, 10, 11, 20, 12], [1, 2, 13, 14, 15]]
    assert [s["loss_mask"] for s in samples] == [[0, 1, 1], [0, 0, 0, 0, 1], [0, 1, 1, 1]]
    assert samples[0]["advantages"] == pytest.approx([0, 0.57735, 0.57735], abs=1e-4)
    assert samples[1]["advantages"] == pytest.approx([0, 0, 0, 0, 0.57735], abs=1e-4)
    assert samples[2]["advantages"] == pytest.approx([0, -1.1547, -1.1547, -1.1547], abs=1e-4)


def test_dynamic_sampling_drops_groups_without_signal():
    views = [episode_view(episode([1], [("gen", "", [5, 6])])) for _ in range(4)]
    samples, kept = build_samples(views, {"groups": [0, 0, 1, 1], "total": [1.0, 1.0, 1.0, 0.0]}, rl_config(rollout={"dynamic_sampling": True}))
    assert len(samples) == 2 and kept == 0.5


def test_dynamic_sampling_trims_to_the_first_groups_with_signal():
    views = [episode_view(episode([1], [("gen", "", [5, 6 + i])])) for i in range(6)]
    rewards = {"groups": [0, 0, 1, 1, 2, 2], "total": [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]}
    samples, kept = build_samples(views, rewards, rl_config(rollout={"dynamic_sampling": True}), max_groups=1)
    assert kept == pytest.approx(2 / 3) and [s["ids"][-1] for s in samples] == [8, 9]  # group 1 only; group 2 trimmed
    assert build_samples(views, rewards, rl_config(rollout={"dynamic_sampling": True}), max_groups=0)[0] == []


def test_dynamic_sampling_refills_until_enough_groups_keep_a_reward_spread(answerer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unison.llm.hf_backend import HFBackend

    backend = HFBackend(model=AutoModelForCausalLM.from_pretrained(answerer), tokenizer=AutoTokenizer.from_pretrained(answerer))
    rows = make_rows(6)

    def collect(max_refills):
        cfg = rl_config(rollout={"dynamic_sampling": True, "group_size": 2, "max_refills": max_refills}, reward={"format_weight": 0.0})
        return collect_step(0, 0, rows, backend, rl_setup(cfg, backend.tokenizer))

    got = collect(max_refills=4)
    rounds, rewards = got.rounds, got.rewards
    spread = [len({rewards["total"][i] for i in range(len(got.episodes)) if rewards["groups"][i] == g}) > 1 for g in range(2 * rounds)]
    assert rounds > 1 and len(got.episodes) == 4 * rounds and len(got.rows) == 2 * rounds  # this seed's first batch keeps < 2 groups
    assert sum(spread[:-2]) < 2 and (sum(spread) >= 2 or rounds == 5)  # refilled only while short, stopped when enough
    assert len(got.samples) == 2 * min(2, sum(spread))  # trimmed to 2 groups
    assert got.kept_share == pytest.approx(sum(spread) / (2 * rounds))
    assert [r["level"] for r in got.rows] == [r["level"] for r in step_prompts(rows, 0, 2 * rounds, seed=0)]  # curriculum order
    assert collect(max_refills=0).rounds == 1


def test_rewards_are_combined_as_configured(tiny_model_dir):
    from unison.train.prm import build_prm

    tools = ("search", "python")
    good = episode([1], [("gen", "<search>France</search>", [5, 6]), ("obs", "\n<result>\nParis\n</result>\n", [7]),
                         ("gen", "<answer>Paris</answer>", [8, 9, 10])])
    wrong = episode([1], [("gen", "<answer>Rome</answer>", [5, 6])])
    broken = episode([1], [("gen", "Paris is nice <answer>Paris</answer> ok", [5, 6, 7, 8])])
    eps = [good, wrong, broken]
    views = [episode_view(e) for e in eps]
    rows = make_rows(1)
    cfg = rl_config(reward={"verifiable_weight": 1.0, "format_weight": 0.5, "efficiency_weight": 1.0, "sigma_tool": 0.2, "sigma_len": 0.5, "sigma_decay": False, "prm_weight": 1.0}, rollout={"group_size": 3})
    prm = build_prm(tiny_model_dir, "\n", seed=0)  # an untrained head: scores are arbitrary but fixed
    r = score_episodes(eps, rows, views, RLSetup(cfg, LABEL, LLMConfig(), tools, prm=prm), step=1)
    assert r["verifiable"] == [1.0, 0.0, 1.0] and r["format"] == [0.0, 0.0, -1.0] and r["tool_calls"] == [1, 0, 0]
    assert r["lengths"] == [5, 2, 4]
    # f_tool = 2 / (1 + exp(0.2 * (t - 1/3))); lengths [5, 2, 4]: mean 11/3, population std 1.2472 -> z
    z = [(x - 11 / 3) / math.sqrt(((5 - 11 / 3) ** 2 + (2 - 11 / 3) ** 2 + (4 - 11 / 3) ** 2) / 3) for x in (5, 2, 4)]
    f_tool = [2 / (1 + math.exp(0.2 * (t - 1 / 3))) for t in (1, 0, 0)]
    f_len = [2 / (1 + math.exp(0.5 * zi)) for zi in z]
    expect = [s + 0.5 * f + s * (ft * fl - 1) for s, f, ft, fl in zip((1, 0, 1), (0, 0, -1), f_tool, f_len)]
    assert r["total"] == pytest.approx(expect)
    steps = [["<search>France</search>\n<result>\nParis\n</result>\n", "<answer>Paris</answer>"], ["<answer>Rome</answer>"],
             ["Paris is nice <answer>Paris</answer> ok"]]  # a turn with its observation, as label/prm cut steps
    probs = prm.step_scores([rows[0]["extra_info"]["question"]] * 3, steps)
    assert r["prm_steps"] == [[pytest.approx(2 * p - 1) for p in row] for row in probs]  # p(good) - p(bad)
    samples, _ = build_samples(views, r, cfg)
    no_prm, _ = build_samples(views, {k: v for k, v in r.items() if k != "prm_steps"}, cfg)
    # the PRM adds step rewards at turn ends: the first turn of `good` (its token 6, target index 1) sees both steps
    assert samples[0]["advantages"][1] != pytest.approx(no_prm[0]["advantages"][1])
    assert samples[0]["advantages"][2] == 0.0  # the observation carries nothing


def test_curriculum_takes_stage_one_first():
    rows = make_rows(6, levels=(2, 1, 3))
    first = step_prompts(rows, 0, 2, seed=0) + step_prompts(rows, 2, 2, seed=0) + step_prompts(rows, 4, 2, seed=0)
    assert [r["level"] for r in first] == [1, 1, 2, 2, 3, 3] and first == step_prompts(rows, 0, 6, seed=0)
    assert sorted(map(id, step_prompts(rows, 6, 6, seed=0))) == sorted(map(id, first))


def test_bad_rl_data_names_file_row_and_field(tmp_path):
    rows = make_rows(3)
    path = tmp_path / "level1.parquet"
    rows[2]["reward_model"] = {"ground_truth": [], "style": "rule"}
    write_table(rows, path, RL_ROW)
    with pytest.raises(DataError, match=r"level1.parquet, row 2, field 'reward_model'"):
        load_rl_data([path])
    rows = make_rows(2)
    rows[1]["ability"] = "poetry"
    write_table(rows, path, RL_ROW)
    with pytest.raises(DataError, match=r"row 1, field 'ability'"):
        load_rl_data([path])
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "x"}]]}), path)
    with pytest.raises(DataError, match=r"level1.parquet.*missing column"):
        load_rl_data([path])
    with pytest.raises(DataError, match="no level"):
        load_rl_data([])


def test_the_loss_rl_records_is_the_token_mean_of_the_policy_loss_and_kl_on_masked_tokens_by_hand(tiny_model_dir):
    """`train_on`, the loop of rl's optimiser steps, on two hand-built samples of different lengths in micro-batches of
    one, with advantages also where the mask is 0 (they must not count) and a fixed reference log-prob for the k3 term.
    One update per step, so rho = 1: each masked token costs -A + kl_coef * k3(logp, ref); the recorded loss is their
    mean over both samples' masked tokens (a mean of the two micro-batches' means would differ), with logp from a
    forward pass done here."""
    import random

    from transformers import AutoModelForCausalLM

    from unison.train.loop import Trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = rl_config(micro_batch_size=1, precision="fp32", loss={"kl_coef": 0.5})
    ref = -11.0  # about log(1 / 49,152): the reference's log-prob of every target token
    samples = [{"ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 1, 0, 1], "advantages": [0.9, 1.0, 0.5, 0.7, -1.0]},
               {"ids": [11, 12, 13], "loss_mask": [0, 1], "advantages": [2.0, -0.5]}]
    for s in samples:
        s["ref_logp"] = [ref] * (len(s["ids"]) - 1)
    terms = []
    with torch.no_grad():
        for s in samples:
            logp = torch.log_softmax(model(torch.tensor([s["ids"]])).logits[0, :-1].float(), -1)
            for t, (on, a) in enumerate(zip(s["loss_mask"], s["advantages"])):
                if on:
                    d = ref - logp[t, s["ids"][t + 1]].item()
                    terms.append(-a + 0.5 * (math.exp(d) - d - 1))
    record = train_on(Trainer("rl", model, 1, cfg), samples, cfg, pad_id=0, rng=random.Random(0))
    assert len(terms) == 4 and record["loss"] == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert record["loss"] != pytest.approx((sum(terms[:3]) / 3 + terms[3]) / 2, rel=1e-3)  # not a mean of micro-batch means


@pytest.mark.slow
def test_the_vllm_rollout_engine_generates_with_the_weights_synced_into_it_as_an_engine_started_from_them(base_model_dir, tmp_path):
    """rl's vLLM rollouts start an engine from the step's model folder, then push the policy into it: after each update,
    and before the first rollout of a resumed run (the checkpoint's weights, not the folder's). The synced engine must
    generate what an engine started from those weights generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unison.llm.base import Sampling
    from unison.llm.vllm_backend import VLLMBackend

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    prompts = [chat_prompt(tok, question_messages(q, SYSTEM_PROMPT)) for q in ("Where was Zorvan Kelt born?", "What is 17 * 23?")]
    sampling = [Sampling(max_tokens=24, logprobs=True)] * len(prompts)
    policy = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    with torch.no_grad():  # another policy: the last layer's MLP halved
        policy.model.layers[-1].mlp.down_proj.weight.mul_(0.5)
    policy.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    engine = VLLMBackend(str(base_model_dir), dtype="float32", max_model_len=512, kv_cache_gb=1)
    before = engine.generate(prompts, sampling)
    engine.sync(policy)
    synced = engine.generate(prompts, sampling)
    started = VLLMBackend(str(tmp_path / "policy"), dtype="float32", max_model_len=512, kv_cache_gb=1).generate(prompts, sampling)
    assert [c.token_ids for c in before] != [c.token_ids for c in started]  # the two policies differ where it shows
    for a, b in zip(synced, started):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
