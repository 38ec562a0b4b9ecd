"""On-policy distillation (rl.loss.objective opd, unison/train/opd.py): the advantage by hand (spans of a teacher of another
tokenizer, unscored tokens masked), no gradient on observations, zero advantage when the student is its teacher at any
sampling temperature, a scaffolded tool episode through rl's defaults (dynamic sampling on, an outcome term) checked
value by value, and the rl loop with a teacher that scores: it moves the student toward the teacher and resumes after
a kill."""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

import unison.train.rl as rl_module
from unison.llm.hf_backend import HFBackend
from unison.protocol import final_answer, normalize_answer
from unison.train.batches import attach_logprobs, collate, logprobs_of, scored_batch, scored_columns
from unison.train.opd import attach_teacher_logps, length_collapse, own_spans, teacher_logps, teacher_term
from unison.train.probe import split_probe
from unison.train.rl import RLConfig, batch_loss, needs_old_logp, train_on

from .test_rl import LABEL, make_rows, rl_config, run, state, teach_answers


def test_the_advantage_is_teacher_minus_student_on_sampled_tokens_by_hand():
    # targets: prompt token, 2 sampled, 2 observation, 1 sampled; the outcome term (0.5) already on the sampled tokens
    sample = {"ids": [1, 2, 3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 0, 0, 1], "advantages": [0.0, 0.5, 0.5, 0.0, 0.0, 0.5]}
    teacher = [-1.0, -0.5, -3.0, -0.1, -0.1, -0.5]
    assert attach_teacher_logps([sample], [teacher], [own_spans(sample["loss_mask"])]) == {"teacher_tokens": 3, "teacher_straddling": 0}
    assert sample["teacher_logp"] == [0.0, -0.5, -3.0, 0.0, 0.0, -0.5]  # nothing kept off the sampled tokens
    assert sample["teacher_span"] == [0, 2, 3, 0, 0, 6]
    student = torch.tensor([[-9.0, -1.0, -2.0, -7.0, -7.0, -0.5]])
    advantages, kl = teacher_term(torch.tensor([sample["advantages"]]), torch.tensor([sample["teacher_logp"]]),
                                  torch.tensor([sample["teacher_span"]]), student)
    assert advantages[0].tolist() == [0.0, 0.5 + 0.5, 0.5 - 1.0, 0.0, 0.0, 0.5 + 0.0]
    assert kl.item() == pytest.approx((-0.5 + 1.0 + 0.0) / 3)  # the mean of student - teacher over the sampled tokens
    with pytest.raises(ValueError, match=r"the teacher scored 2 tokens \(6 spans\) of a sample with 6 targets"):
        attach_teacher_logps([sample], [[0.0, 0.0]], [own_spans(sample["loss_mask"])])


def test_a_span_of_student_tokens_shares_one_advantage_and_an_unscored_token_gets_no_teacher_term_by_hand():
    """A teacher of another tokenizer: one teacher token (-3.5) covers sampled targets 1 and 2 (a span), and the last
    sampled target (an end of turn; the teacher has no end token) has no score. A log-prob of 0 there would give
    0 - (-0.5) = +0.5 of advantage for nothing."""
    sample = {"ids": [1, 2, 3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 0, 0, 1], "advantages": [0.0, 0.5, 0.5, 0.0, 0.0, 0.5]}
    attach_teacher_logps([sample], [[0.0, 0.0, -3.5, 0.0, 0.0, 0.0]], [[0, 1, 1, 0, 0, 0]], straddling=1)
    student = torch.tensor([[-9.0, -1.0, -2.0, -7.0, -7.0, -0.5]])
    advantages, kl = teacher_term(torch.tensor([sample["advantages"]]), torch.tensor([sample["teacher_logp"]]),
                                  torch.tensor([sample["teacher_span"]]), student)
    span = -3.5 - (-1.0 - 2.0)  # the teacher's log-prob of the span's text minus the student's
    assert advantages[0].tolist() == [0.0, 0.5 + span, 0.5 + span, 0.0, 0.0, 0.5]  # the end of turn keeps its outcome term only
    assert kl.item() == pytest.approx(-span / 2)  # over the two scored tokens


def test_observation_tokens_get_exactly_zero_gradient():
    """Through rl's own loss, one update per step (no old_logp pass: the loss's log-probs stand in for the student's)."""
    logits = torch.randn(1, 7, 11, requires_grad=True)
    ids = torch.tensor([[2, 3, 1, 4, 1, 5, 9]])
    mask = [0, 1, 1, 0, 0, 1]
    logp = torch.log_softmax(logits[:, :-1].detach(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    sample = {"ids": ids[0].tolist(), "loss_mask": mask, "advantages": [0.0] * 6}
    attach_teacher_logps([sample], [[x + 1.0 for x in logp[0].tolist()]], [own_spans(mask)])  # the teacher likes every token more
    batch = collate([sample], 0)
    loss, metrics = batch_loss(logits[:, :-1], batch, RLConfig(loss={"objective": "opd"}))
    loss.backward()
    grad = logits.grad[0, :-1].abs().sum(-1)
    assert grad[[0, 3, 4]].tolist() == [0.0, 0.0, 0.0] and bool((grad[[1, 2, 5]] > 0).all())
    assert metrics["kl_teacher"] == pytest.approx(-1.0) and loss.item() == pytest.approx(-1.0)  # A = +1 on each sampled token


def test_the_kd_term_is_the_teachers_top_k_against_the_students_on_scored_tokens_only_by_hand():
    """rl.opd.kd_weight: the forward KL from the teacher's top-k (renormalised) to the student's distribution over the same
    tokens, at the scored sampled positions only (not the prompt's or the observation's), weighted into the loss; a
    slot the teacher left empty weighs nothing."""
    logits = torch.randn(1, 7, 11)
    ids = torch.tensor([[2, 3, 1, 4, 1, 5, 9]])
    mask = [0, 1, 1, 0, 0, 1]
    student_logp = torch.log_softmax(logits[0, :-1], -1)
    tops = [([7, 8], [-0.1, -2.5]), ([1, 3], [-0.5, -1.0]), ([4, 6], [-0.2, -1.9]), ([2, 2], [-0.3, -0.3]),
            ([5, 9], [-1.0, -1.1]), ([10, 0], [-0.05, float("-inf")])]
    sample = {"ids": ids[0].tolist(), "loss_mask": mask, "advantages": [0.0] * 6}
    attach_teacher_logps([sample], [student_logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()], [own_spans(mask)],
                         tops=[tops])
    assert sample["teacher_top"][0] == ([], []) and sample["teacher_top"][1] == tops[1]  # kept on sampled tokens only
    expected = []
    for t in (1, 2, 5):
        top_ids, top_logps = tops[t]
        keep = [k for k, v in enumerate(top_logps) if v != float("-inf")]
        teacher = torch.log_softmax(torch.tensor([top_logps[k] for k in keep]), -1)
        student = torch.log_softmax(student_logp[t, [top_ids[k] for k in keep]], -1)
        expected.append((teacher.exp() * (teacher - student)).sum().item())
    kd = sum(expected) / 3
    plain, _ = batch_loss(logits[:, :-1], collate([{k: v for k, v in sample.items() if k != "teacher_top"}], 0),
                          RLConfig(loss={"objective": "opd"}))
    loss, metrics = batch_loss(logits[:, :-1], collate([sample], 0), RLConfig(loss={"objective": "opd"}, opd={"kd_weight": 0.5}))
    assert metrics["kd_teacher"] == pytest.approx(kd, abs=1e-5) and metrics["kl_teacher"] == pytest.approx(0.0, abs=1e-6)
    assert loss.item() == pytest.approx(plain.item() + 0.5 * kd, abs=1e-5)


def test_the_kd_term_raises_a_token_the_teacher_likes_that_the_student_never_sampled(tiny_model_dir):
    """The teacher term scores only what the student sampled; with rl.opd.kd_weight one update also raises the teacher's
    top token at a position where the student sampled another, and the teacher term alone (kd_weight 0) does not move
    it as far."""
    from unison.train.loop import Trainer

    teacher = HFBackend(str(tiny_model_dir), dtype="float32")
    ids = [5, 17, 99, 4, 250, 31, 7]
    with torch.no_grad():
        start = torch.log_softmax(teacher.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    liked = int(start[3].argsort()[len(start[3]) // 2])  # a middling token at target 3, not the one sampled there
    assert liked != ids[4]

    def raised(kd_weight: float) -> float:
        cfg = RLConfig(lr=1e-3, precision="fp32", checkpoint_every=0, loss={"objective": "opd"}, opd={"kd_weight": kd_weight})
        trainer = Trainer("rl", HFBackend(str(tiny_model_dir), dtype="float32").model, 1, cfg)
        sample = {"ids": ids, "loss_mask": [0, 0, 1, 1, 0, 1], "advantages": [0.0] * 6}
        tops = [([liked, ids[t + 1]], [-0.01, -5.0]) for t in range(6)]  # sure of `liked`, not of what was sampled
        attach_teacher_logps([sample], [start.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()],
                             [own_spans(sample["loss_mask"])], tops=[tops])
        record = train_on(trainer, [sample], cfg, 0, random.Random(0))
        # the record's loss is the one backpropagated: the policy term plus the kd term
        assert record["loss"] == pytest.approx(record["pg_loss"] + kd_weight * record.get("kd_teacher", 0.0), rel=1e-5)
        with torch.no_grad():
            after = torch.log_softmax(trainer.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        return (after[3, liked] - start[3, liked]).item()

    with_kd, without = raised(1.0), raised(0.0)
    print(f"log-prob of the teacher's token at a position it was not sampled: {with_kd:+.3f} with kd, {without:+.3f} without")
    assert with_kd > 0.05 and with_kd > without + 0.05


def test_kd_weight_needs_opd_and_a_teacher_of_the_students_vocabulary(tiny_model_dir):
    with pytest.raises(ValueError, match="rl.opd.kd_weight > 0 distils the teacher's top-k .* set rl.loss.objective: opd"):
        RLConfig(opd={"kd_weight": 1.0})

    class OtherVocabulary:
        tokenizer = type("Tok", (), {"get_vocab": lambda self: {"a": 0}})()

    teacher = HFBackend(str(tiny_model_dir), dtype="float32")
    sample = {"ids": [5, 17, 99], "loss_mask": [0, 1], "advantages": [0.0, 0.0], "messages": []}
    with pytest.raises(ValueError, match="the teacher's vocabulary is not the student's: set rl.opd.kd_weight: 0"):
        teacher_logps(OtherVocabulary(), [sample], teacher.tokenizer, top_k=8)
    logps, spans, _, tops = teacher_logps(teacher, [sample], teacher.tokenizer, top_k=3)
    assert len(tops[0]) == 2 and all(len(ids) == len(lps) == 3 for ids, lps in tops[0])
    assert tops[0][1][1][0] >= logps[0][1] - 1e-5  # the best of the top-k is at least the sampled token's log-prob


@pytest.mark.parametrize("ppo_epochs", [1, 2], ids=["one-update", "old-logp-pass"])
def test_a_student_that_is_its_teacher_gets_zero_advantage_at_any_sampling_temperature(tiny_model_dir, ppo_epochs):
    """The teacher scores at temperature 1; the student's log-probs in the teacher term are its temperature-1 ones too,
    whatever rl.rollout.temperature samples at (the loss's own with one update, else the old-policy pass's), so the loss of a
    student equal to its teacher is 0 at 0.7 as at 1 (log-probs at 0.7 would leave a KL of their own)."""
    teacher = HFBackend(str(tiny_model_dir), dtype="float32")
    samples = [{"ids": [5, 17, 99, 4, 250, 31, 7], "loss_mask": [0, 0, 1, 1, 0, 1], "advantages": [0.0] * 6},
               {"ids": [8, 9, 10, 11], "loss_mask": [0, 1, 1], "advantages": [0.0] * 3}]
    attach_teacher_logps(samples, *teacher_logps(teacher, samples, teacher.tokenizer))
    for temperature in (1.0, 0.7):
        cfg = RLConfig(ppo_epochs=ppo_epochs, precision="fp32", loss={"objective": "opd"}, rollout={"temperature": temperature})
        assert needs_old_logp(cfg) == (ppo_epochs > 1)
        if needs_old_logp(cfg):
            attach_logprobs(teacher.model, samples, "old_logp", cfg, 0, torch.device("cpu"), "fp32", unscaled_key="old_logp_t1")
        batch = collate(samples, 0)
        logp, logits = logprobs_of(teacher.model, batch, temperature)
        loss, metrics = batch_loss(logits, batch, cfg)
        assert abs(metrics["kl_teacher"]) < 1e-5 and abs(loss.item()) < 1e-5, temperature
        if temperature != 1.0:  # the log-probs it samples with are another distribution than the teacher's
            scored = scored_batch(batch, scored_columns(batch))  # where logprobs_of computes them
            assert (logp - scored["teacher_logp"])[scored["teacher_span"] > 0].abs().max().item() > 0.01


class CapitalPassage:
    def search(self, queries):
        return [[{"title": "Paris", "text": "Paris is the capital of France."}] for _ in queries]


def test_opd_with_rls_default_sampling_on_a_tool_episode_checked_value_by_value(tiny_model_dir):
    """rl's defaults (params.yaml) keep DAPO's dynamic sampling on; OPD with an outcome term (0.5) and sampling at 0.7.
    The tiny random student, its turns scaffolded (<search> then <answer>), calls search and answers: two groups of two
    episodes, one with a reward spread, one without (DAPO would drop it for RL; OPD keeps it: the teacher's signal is
    in every episode). build_samples, the teacher's log-probs (a random teacher of the same vocabulary) and rl's update
    (train_on) are each checked against values computed here from the two models' raw log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from unison.agents.runtime import Episode, EpisodeSettings, run_episodes
    from unison.agents.toolbox import Toolbox
    from unison.config import LLMConfig
    from unison.protocol import chat_prompt
    from unison.tool_format import TagFormat
    from unison.train.loop import Trainer
    from unison.train.rl import RLSetup, build_samples, score_episodes, train_on
    from unison.train.rollout import episode_view

    cfg = RLConfig(micro_batch_size=3, lr=1e-4, precision="fp32", seed=0, loss={"objective": "opd"}, opd={"outcome_weight": 0.5}, rollout={"temperature": 0.7, "group_size": 2, "prompts_per_step": 2})
    assert cfg.rollout.dynamic_sampling and cfg.loss.estimator == "grpo"  # the defaults
    tools = ("search", "python")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = make_rows(2)
    episodes = [Episode(key=f"{k}/{g}", prompt_ids=chat_prompt(tok, row["prompt"]), seed=10 * k + g, scaffold=["search", "answer"],
                        tools=tools, format=TagFormat(tok)) for k, row in enumerate(rows) for g in range(2)]
    run_episodes(episodes, HFBackend(model=model, tokenizer=tok), Toolbox(CapitalPassage()),
                 EpisodeSettings(temperature=cfg.rollout.temperature, top_p=1.0, max_turns=2, max_tokens_per_turn=6, max_model_len=512))
    for e in episodes:
        assert [s.kind for s in e.segments] == ["gen", "obs", "gen"] and e.n_tool_calls == 1 and e.finish_reason == "answer"
        assert "Paris is the capital of France." in e.segments[1].text
    rows[0]["reward_model"]["ground_truth"] = [episodes[0].answer]  # group 0: right, wrong; group 1: wrong, wrong
    views = [episode_view(e, rows[i // 2]["prompt"]) for i, e in enumerate(episodes)]
    rewards = score_episodes(episodes, rows, views, RLSetup(cfg, LABEL, LLMConfig(), tools), step=1)
    assert rewards["verifiable"] == [1.0, 0.0, 0.0, 0.0] and rewards["total"][2] == rewards["total"][3]
    assert len(build_samples(views, rewards, cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"objective": "reward"})}))[0]) == 2  # RL drops group 1
    samples, kept = build_samples(views, rewards, cfg)
    assert len(samples) == 4 and kept == 1.0
    outcome = []  # grpo by hand: (r - mean) / (unbiased std + 1e-6) within each group
    for g in (0, 1):
        r = rewards["total"][2 * g : 2 * g + 2]
        outcome += [(x - statistics.mean(r)) / (statistics.stdev(r) + 1e-6) for x in r]
    assert outcome[0] == pytest.approx(-outcome[1]) and abs(outcome[0]) > 0.7 and outcome[2:] == [0.0, 0.0]
    for s, v, a in zip(samples, views, outcome):
        assert s["ids"] == v.ids and s["loss_mask"] == v.loss_mask[1:]
        assert 0 < sum(s["loss_mask"]) < len(s["loss_mask"]) - len(episodes[0].segments[1].ids)  # prompt, prefills, observation off
        assert s["advantages"] == pytest.approx([0.5 * a * m for m in s["loss_mask"]], abs=1e-6)

    torch.manual_seed(1)
    teacher = HFBackend(model=LlamaForCausalLM(model.config).eval(), tokenizer=tok)
    stats = attach_teacher_logps(samples, *teacher_logps(teacher, samples, tok))
    assert stats == {"teacher_tokens": sum(v.sampled for v in views), "teacher_straddling": 0}
    with torch.no_grad():  # both models' raw log-probs (temperature 1) of every target, before the update
        raw = [[torch.log_softmax(m(torch.tensor([s["ids"]])).logits[0, :-1].float(), -1).gather(-1, torch.tensor(s["ids"][1:])[:, None])
                .squeeze(-1).tolist() for m in (teacher.model, model)] for s in samples]
        at_temperature = [torch.log_softmax(model(torch.tensor([s["ids"]])).logits[0, :-1].float() / 0.7, -1)
                          .gather(-1, torch.tensor(s["ids"][1:])[:, None]).squeeze(-1).tolist() for s in samples]
    terms, kls, kls_at_temperature = [], [], []
    for s, (t_lp, s_lp), s_lp_07, a in zip(samples, raw, at_temperature, outcome):
        for t, m in enumerate(s["loss_mask"]):
            if m:
                assert s["teacher_logp"][t] == pytest.approx(t_lp[t], abs=1e-5)
                terms.append(-(0.5 * a + t_lp[t] - s_lp[t]))  # ratio 1 at the step's only update: the token's loss is -A
                kls.append(s_lp[t] - t_lp[t])
                kls_at_temperature.append(s_lp_07[t] - t_lp[t])
    first = collate(samples[:1], tok.pad_token_id)  # the right answer alone: its outcome term does not cancel out
    loss, _ = batch_loss(logprobs_of(model, first, cfg.rollout.temperature)[1], first, cfg)
    n_first = sum(samples[0]["loss_mask"])
    assert loss.item() == pytest.approx(sum(terms[:n_first]) / n_first, rel=1e-5)
    assert loss.item() == pytest.approx(sum(kls[:n_first]) / n_first - 0.5 * outcome[0], rel=1e-5)  # -mean(A): KL - 0.5 x 0.707
    record = train_on(Trainer("rl", model, 1, cfg), samples, cfg, pad_id=tok.pad_token_id, rng=random.Random(0))
    assert record["kl_teacher"] == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert record["loss"] == pytest.approx(sum(terms) / len(terms), rel=1e-5)  # the token mean over all four samples
    assert record["kl_teacher"] != pytest.approx(sum(kls_at_temperature) / len(kls), rel=1e-3)  # the student's log-probs at 0.7


def test_length_collapse_warns_when_episodes_shorten_as_the_kl_rises():
    assert length_collapse([{"response_tokens": 30, "kl_teacher": 0.2}]) is None
    assert length_collapse([{"response_tokens": 30, "kl_teacher": 0.2}, {"response_tokens": 20, "kl_teacher": 0.1}]) is None
    assert "episodes shortened (30.0 -> 20.0 tokens)" in length_collapse([{"response_tokens": 30, "kl_teacher": 0.1},
                                                                         {"response_tokens": 20, "kl_teacher": 0.2}])


def resumed_after_a_kill(student, cfg, tmp_path, teacher, step: int) -> tuple[list[int], list[dict]]:
    """A run in tmp_path/resumed killed as it logs `step`, then run again: the steps the second run trained, its
    records."""
    def kill(rec):
        if rec["step"] == step:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(student, cfg, tmp_path, "resumed", on_step=kill, teacher=teacher)
    trained = []
    records = run(student, cfg, tmp_path, "resumed", on_step=lambda rec: trained.append(rec["step"]), teacher=teacher)
    return trained, records


@pytest.mark.slow
def test_opd_moves_the_student_toward_its_teacher_and_resumes_after_a_kill(tiny_model_dir, tmp_path):
    """The student was taught Paris and Rome, the teacher Paris only; the teacher scores the student's tokens. After one
    OPD update (no outcome term) the next step's rollouts are closer to the teacher: their reverse KL falls (0.84 -> 0.61
    on AVX2); a run killed in step 2 resumes from step 1's checkpoint. DAPO's dynamic sampling is on (rl's default):
    under opd it drops no group, so no batch is rolled out again and every sampled token of every episode is scored."""
    student = teach_answers(tiny_model_dir, tmp_path / "student")
    teacher_dir = teach_answers(tiny_model_dir, tmp_path / "teacher", ("Paris",))
    teacher = HFBackend(str(teacher_dir), dtype="float32")
    cfg = rl_config(steps=2, lr=1e-4, loss={"objective": "opd"}, opd={"outcome_weight": 0.0}, rollout={"group_size": 4, "dynamic_sampling": True})
    records = run(student, cfg, tmp_path, "straight", teacher=teacher)
    assert all(r["teacher_tokens"] > 0 and math.isfinite(r["kl_teacher"]) for r in records)
    for r in records:
        assert r["rollout_rounds"] == 1 and r["kept_groups"] == 1.0 and r["samples"] == r["episodes"] == 8
        assert r["teacher_tokens"] == round(r["response_tokens"] * r["episodes"])
    assert records[1]["kl_teacher"] < 0.9 * records[0]["kl_teacher"], [r["kl_teacher"] for r in records]
    assert records[0]["loss"] == pytest.approx(records[0]["kl_teacher"], rel=1e-6)  # ratio 1 at the first update: -mean(A) = KL
    trained, _ = resumed_after_a_kill(student, cfg, tmp_path, teacher, step=2)
    assert trained == [2]
    a, b = state(tmp_path / "straight" / "out"), state(tmp_path / "resumed" / "out")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_opd_steps_distil_first_then_train_on_rewards_in_one_run_that_resumes_across_the_switch(tiny_model_dir, tmp_path,
                                                                                             monkeypatch):
    """rl.opd.steps 2 of 3 steps: the first two steps are the steps of an OPD run of the same seeds (the same batches,
    losses and KL), the third trains on the rewards (no teacher term) with the lr schedule started again (rl.opd.switch
    restart; continue decays one schedule over the three steps); a run killed in the RL step resumes there from the
    checkpoint of the last OPD step, drops the OPD steps' AdamW moments as the run never killed did, and ends with the
    same weights."""
    student = teach_answers(tiny_model_dir, tmp_path / "student")
    teacher = HFBackend(str(teach_answers(tiny_model_dir, tmp_path / "teacher", ("Paris",))), dtype="float32")
    common = dict(lr=1e-4, warmup_ratio=0.0, schedule="linear", rollout={"dynamic_sampling": True})
    opd = run(student, rl_config(steps=2, loss={"objective": "opd"}, **common), tmp_path, "opd", teacher=teacher)
    cfg = rl_config(steps=3, opd={"steps": 2}, **common)
    collected, collect_step = [], rl_module.collect_step

    def recorded(*args, **kwargs):
        collected.append(collect_step(*args, **kwargs))
        return collected[-1]

    with monkeypatch.context() as m:  # each step's rollouts, to score them here
        m.setattr(rl_module, "collect_step", recorded)
        hybrid = run(student, cfg, tmp_path, "hybrid", teacher=teacher)
    assert ["kl_teacher" in r for r in hybrid] == [True, True, False]
    for a, b in zip(opd, hybrid):
        assert (a["kl_teacher"], a["loss"], a["response_tokens"]) == (b["kl_teacher"], b["loss"], b["response_tokens"])
    assert "teacher_tokens" not in hybrid[2] and len(collected) == 3
    # the RL step's accuracy: the share of its episodes (every refill's) whose last <answer> says Paris (subem)
    answers = [normalize_answer(final_answer(e.text) or "").split() for e in collected[2].episodes]
    right = [words.count("paris") > 0 and len(words) <= 5 for words in answers]
    assert hybrid[2]["accuracy"] == pytest.approx(sum(right) / len(right)), answers
    assert [r["lr"] for r in hybrid] == pytest.approx([5e-5, 1e-4, 0.0])  # the lr of the step after each: 1e-4 at the switch
    continued = run(student, rl_config(steps=3, opd={"steps": 2, "switch": "continue"}, **common), tmp_path, "continued",
                    teacher=teacher)
    assert [r["lr"] for r in continued] == pytest.approx([1e-4 * 2 / 3, 1e-4 / 3, 0.0])
    trained, resumed = resumed_after_a_kill(student, cfg, tmp_path, teacher, step=3)
    assert trained == [3] and resumed[-1]["loss"] == hybrid[2]["loss"]
    a, b = state(tmp_path / "hybrid" / "out"), state(tmp_path / "resumed" / "out")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_opd_steps_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="rl.opd.steps 2 leaves none of rl.steps 2 to RL"):
        RLConfig(steps=2, opd={"steps": 2})
    with pytest.raises(ValueError, match="rl.loss.objective is opd already"):
        RLConfig(steps=4, opd={"steps": 2}, loss={"objective": "opd"})
    with pytest.raises(ValueError, match="rl.loss.objective opd and rl.opd.steps run on rl.trainer unison"):
        RLConfig(steps=4, opd={"steps": 2}, loss={"estimator": "flow_grpo"})
    cfg = RLConfig(steps=4, opd={"steps": 2, "kd_weight": 1.0})
    assert cfg.scores_with_teacher and [cfg.at_step(s).loss.objective for s in range(4)] == ["opd", "opd", "reward", "reward"]


def test_opd_with_a_chat_api_teacher_is_refused_when_params_load():
    import yaml

    from unison.config import ROOT, ParamsError, validate_params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["rl"]["loss"]["objective"] = "opd"
    raw["teacher"].update(backend="openai", api="chat", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(ParamsError, match="rl.loss.objective opd, rl.opd.steps or rl.probe.prompts: the teacher .* must score given tokens, and teacher.api chat cannot"):
        validate_params(raw)
    raw["teacher"]["api"] = "completions"  # a vLLM server scores (prompt_logprobs)
    assert validate_params(raw).rl.loss.objective == "opd"
    raw["rl"]["opd"]["teacher_context"], raw["generate"]["demonstrations"] = "worked_examples", ""
    with pytest.raises(ParamsError, match="rl.opd.teacher_context worked_examples puts generate.demonstrations in the teacher's prompt"):
        validate_params(raw)
    raw["rl"]["opd"]["teacher_context"] = "student"
    with pytest.raises(ValueError, match="rl.loss.objective opd and rl.opd.steps run on rl.trainer unison with a sequence estimator"):
        RLConfig(loss={"objective": "opd", "estimator": "flow_grpo"})


def test_with_worked_examples_the_teacher_scores_the_students_tokens_after_its_own_context(tiny_model_dir):
    """rl.opd.teacher_context worked_examples: the same tokens, scored after the prompt with the worked examples in the
    system message (context distillation), equal to a direct score with that prompt, and not the student-context scores."""
    from unison.protocol import chat_prompt

    teacher = HFBackend(str(tiny_model_dir), dtype="float32")
    tok = teacher.tokenizer
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "Where is Zorvan Kelt?"}]
    prompt = chat_prompt(tok, messages)
    completion = tok("<search>Zorvan Kelt</search>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = prompt + completion
    sample = {"ids": ids, "loss_mask": [0] * (len(prompt) - 1) + [1] * len(completion), "messages": messages}
    examples = "Question: Where is Praxil? <search>Praxil</search> <answer>Tarsk</answer>"
    plain, _, _, _ = teacher_logps(teacher, [sample], tok)
    context, spans, straddling, _ = teacher_logps(teacher, [sample], tok, worked_examples=examples)
    (direct,) = teacher.score([chat_prompt(tok, [{"role": "system", "content": f"You answer.\n\n{examples}"}, messages[1]])], [completion])
    assert straddling == 0 and len(context[0]) == len(plain[0]) == len(ids) - 1 and spans[0] == own_spans(sample["loss_mask"])
    assert context[0][len(prompt) - 1 :] == pytest.approx(direct.logprobs, abs=1e-5)
    assert all(v == 0.0 for v in context[0][: len(prompt) - 1])  # the prompt's own positions are not targets
    assert max(abs(a - b) for a, b in zip(context[0][len(prompt) - 1 :], plain[0][len(prompt) - 1 :])) > 1e-3


def test_the_curve_csv_keeps_the_probe_of_steps_after_the_first_when_it_probes_every_few_steps(tmp_path):
    """rl.probe.every 2: step 1's record has the probe's start only, steps 2 and 3 their probe; the CSV's header is every
    key of the records, so the later probes stay (a header from step 1's keys alone dropped them)."""
    import csv

    from unison.train.loop import write_records_csv

    records = [{"step": 1, "kl_teacher": 0.3, "probe_kl_start": 0.9},
               {"step": 2, "kl_teacher": 0.2, "probe_kl": 0.5, "probe_kl_p90": 1.5},
               {"step": 3, "kl_teacher": 0.1, "probe_kl": 0.4, "probe_kl_p90": 1.2}]
    write_records_csv(records, tmp_path / "rl_curve.csv")
    with open(tmp_path / "rl_curve.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "kl_teacher", "probe_kl_start", "probe_kl", "probe_kl_p90"]
    assert [r["probe_kl"] for r in rows] == ["", "0.5", "0.4"] and rows[2]["probe_kl_p90"] == "1.2"
    assert rows[0]["probe_kl_start"] == "0.9" and rows[1]["probe_kl_start"] == ""


def test_split_probe_holds_out_seeded_prompts_and_refuses_to_hold_out_the_whole_curriculum():
    rows = make_rows(6)
    train, probe = split_probe(rows, 2, seed=0)
    qid = lambda r: r["extra_info"]["question_id"]
    assert len(train) == 4 and len(probe) == 2 and not {qid(r) for r in train} & {qid(r) for r in probe}
    assert split_probe(rows, 2, seed=0) == (train, probe) and split_probe(rows, 0, seed=0) == (rows, [])
    with pytest.raises(ValueError, match=r"rl.probe.prompts 6: the curriculum \(data/rl\) has 6 prompts"):
        split_probe(rows, 6, seed=0)


# Measured on 2 CPU cores (AVX2, fp32, seed 0), the probe's reverse KL before the first step and after each of the 20:
# 1.113 1.111 0.970 0.891 1.023 0.869 0.765 0.725 0.681 0.611 0.382 0.465 0.402 0.434 0.395 0.295 0.445 0.283 0.172 0.120
# 0.100, a fall of 91%; probed after steps 10 and 20 only (rl.probe.every 10), the same 1.113, 0.382 and 0.100: the
# probe's episodes have seeds of their own and move no training. The floor asks for a fall of half: an OPD that moves
# the student half as far fails.
KL_FALL = 0.5


@pytest.mark.slow
def test_twenty_opd_steps_reduce_the_reverse_kl_on_held_out_prompts_and_the_probe_repeats_itself(tiny_model_dir, tmp_path):
    """The student was taught Paris and Rome, the teacher Paris only. The probe rolls out eight held-out prompts four
    times each with the same seeds every time: with lr 0 it measures the same KL at every step (only the policy moves
    it); with training, 20 OPD steps (rl's default dynamic sampling, no outcome term), probed after steps 10 and 20, must
    cut it by KL_FALL."""
    student = teach_answers(tiny_model_dir, tmp_path / "student")
    teacher = HFBackend(str(teach_answers(tiny_model_dir, tmp_path / "teacher", ("Paris",))), dtype="float32")
    still = run(student, rl_config(steps=2, lr=0.0, checkpoint_every=0, loss={"objective": "opd"}, probe={"prompts": 8}, rollout={"dynamic_sampling": True}),
                tmp_path, "still", rows=make_rows(12), teacher=teacher)
    assert still[0]["probe_kl_start"] == still[0]["probe_kl"] == still[1]["probe_kl"] and still[0]["probe_tokens"] > 0
    records = run(student, rl_config(steps=20, checkpoint_every=0, loss={"objective": "opd"}, probe={"prompts": 8, "every": 10}, rollout={"dynamic_sampling": True}), tmp_path, "trained", rows=make_rows(12), teacher=teacher)
    assert [r["step"] for r in records if "probe_kl" in r] == [10, 20]  # rl.probe.every: after steps 10 and 20 only
    curve = [records[0]["probe_kl_start"]] + [r["probe_kl"] for r in records if "probe_kl" in r]
    print("probe KL:", " ".join(f"{v:.3f}" for v in curve))
    assert curve[0] == still[0]["probe_kl_start"]  # the same policy, the same prompts, the same seeds
    assert curve[-1] <= (1 - KL_FALL) * curve[0], curve


def test_the_probes_sampled_reverse_kl_estimates_trls_full_vocabulary_reverse_kl_on_the_same_tokens(tiny_model_dir, tmp_path):
    """The reference: TRL's GKD loss at beta 1 (GKDTrainer.generalized_jsd_loss), the reverse KL summed over the whole
    vocabulary at every scored position of the student's own episodes. The probe's value on the very same tokens is its
    one-sample estimate (log p_student - log p_teacher of the sampled token), so over 64 episodes of a student taught
    Paris and Rome against a teacher taught Paris the two agree within the estimate's standard error (x 3), and the
    teacher's log-probs that the probe used are the ones TRL's teacher logits give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDTrainer

    from unison.train.probe import probe_samples, span_kls
    from unison.train.rollout import make_rollout_backend

    from .test_rl import rl_setup

    student_dir = teach_answers(tiny_model_dir, tmp_path / "student")
    teacher_dir = teach_answers(tiny_model_dir, tmp_path / "teacher", ("Paris",))
    tok = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    setup = rl_setup(rl_config(rollout={"group_size": 16}, loss={"objective": "opd"}), tok, teacher=HFBackend(model=teacher, tokenizer=tok))
    backend = make_rollout_backend("transformers", student, tok, str(student_dir), setup.llm, 0)
    samples = probe_samples(make_rows(4), backend, student, tok, setup, tok.eos_token_id, torch.device("cpu"), "fp32")
    assert len(samples) == 64
    values, tokens = span_kls(samples)
    ours = sum(values) / tokens
    spread = statistics.pstdev(values) / math.sqrt(len(values))
    trl_sum, trl_tokens = 0.0, 0
    for sample in samples:  # one episode at a time: the whole batch's logits over the vocabulary take ~15 GB
        with torch.no_grad():
            batch = collate([sample], tok.eos_token_id)
            s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["input_ids"][:, 1:].masked_fill(batch["teacher_span"] == 0, -100)
        trl_sum += GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels=labels, beta=1.0, reduction="sum").item()
        trl_tokens += int((labels != -100).sum())
        t_logp = torch.log_softmax(t_logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        scored = batch["teacher_span"] > 0
        assert torch.allclose(t_logp[scored], batch["teacher_logp"][scored], atol=1e-5)  # the probe's teacher scores
    assert trl_tokens == tokens
    trl = trl_sum / trl_tokens  # TRL's batchmean over the scored tokens of all the episodes, counted from its labels
    print(f"reverse KL per scored token: TRL (whole vocabulary) {trl:.4f}, the probe's estimate {ours:.4f} +- {spread:.4f} "
          f"over {tokens} tokens")
    assert trl > 0.05 and abs(ours - trl) < 3 * spread + 0.01


def test_a_steps_record_keeps_the_teacher_terms_figures_the_kd_term_included():
    from types import SimpleNamespace

    from unison.train.rl import Collected, step_record

    rewards = {k: [0.0] for k in ("total", "verifiable", "format", "efficiency", "correct", "tool_calls", "lengths")}
    collected = Collected([], [{"level": 1}], [SimpleNamespace(turn=1)], rewards, 1.0, 1, {"rollout_s": 1.0})
    record = step_record(1, collected, {"loss": 0.3, "kl_teacher": 0.2, "kd_teacher": 0.25, "teacher_tokens": 9}, 1e-5)
    assert (record["kl_teacher"], record["kd_teacher"], record["teacher_tokens"]) == (0.2, 0.25, 9)


def test_opd_from_two_teachers_scores_each_prompt_with_its_own_and_the_probe_reports_the_kl_to_each(tiny_model_dir, tmp_path):
    """A TeacherTeam as the stage builds it where several teachers teach: the France prompts go to a teacher taught
    Paris, the arithmetic ones to another (the random tiny model). One OPD step with a probe of four held-out prompts:
    every scored token is scored, and the probe reports the KL to each teacher beside the whole."""
    from unison.train.opd import TeacherTeam, prompt_key
    from unison.train.pareto import rl_rows

    student = teach_answers(tiny_model_dir, tmp_path / "student")
    paris = HFBackend(str(teach_answers(tiny_model_dir, tmp_path / "teacher", ("Paris",))), dtype="float32")
    other = HFBackend(str(tiny_model_dir), dtype="float32")
    texts = {f"q{i}": "What is the capital of France?" if i % 2 == 0 else "What is 6 times 7?" for i in range(8)}
    groups = [{"question_id": q, "task": "qa", "tool_calls": [0, 1], "correctness": [0.0, 1.0], "score_tool": 0.25,
               "score_corr": 0.25, "front": 0, "crowding": 1.0} for q in texts]
    rows = rl_rows(groups, [1] * len(groups), {q: {"id": q, "source": "test", "task": "qa", "question": t,
                                                   "answers": ["Paris" if "France" in t else "42"]} for q, t in texts.items()})
    team = TeacherTeam({"teacher": paris, "calc": other},
                       {prompt_key(r["prompt"]): "calc" for r in rows if "times" in r["extra_info"]["question"]})
    records = run(student, rl_config(checkpoint_every=0, loss={"objective": "opd"}, probe={"prompts": 4}), tmp_path, "team",
                  rows=rows, teacher=team)
    first = records[0]
    assert first["teacher_tokens"] > 0 and "kl_teacher" in first
    assert first["teachers.teacher.probe_tokens"] > 0 and first["teachers.calc.probe_tokens"] > 0
    assert first["teachers.teacher.probe_tokens"] + first["teachers.calc.probe_tokens"] == first["probe_tokens"]
    whole = (first["teachers.teacher.probe_kl"] * first["teachers.teacher.probe_tokens"]
             + first["teachers.calc.probe_kl"] * first["teachers.calc.probe_tokens"]) / first["probe_tokens"]
    assert whole == pytest.approx(first["probe_kl"])  # the two teachers' shares make the whole
    assert first["teachers.teacher.probe_kl_start"] != first["teachers.calc.probe_kl_start"]
