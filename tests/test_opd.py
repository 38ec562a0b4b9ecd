"""On-policy distillation (rl.objective opd, unison/train/opd.py): the advantage by hand, no gradient on observations,
zero advantage when the student is its teacher, and the rl loop with a teacher that scores: it moves the student
toward the teacher and resumes after a kill."""
from __future__ import annotations

import math

import pytest
import torch

from unison.llm.hf_backend import HFBackend
from unison.train.opd import attach_teacher_logps, length_collapse, teacher_logps, teacher_term
from unison.train.policy_loss import token_logprobs
from unison.train.rl import RLConfig, batch_loss, collate, logprobs_of

from .test_rl import rl_config, run, state, teach_answers


def test_the_advantage_is_teacher_minus_student_on_sampled_tokens_by_hand():
    # targets: prompt token, 2 sampled, 2 observation, 1 sampled; the outcome term (0.5) already on the sampled tokens
    sample = {"ids": [1, 2, 3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 0, 0, 1], "advantages": [0.0, 0.5, 0.5, 0.0, 0.0, 0.5]}
    teacher = [-1.0, -0.5, -3.0, -0.1, -0.1, -0.5]
    assert attach_teacher_logps([sample], [teacher]) == {"teacher_tokens": 3, "teacher_straddling": 0}
    assert sample["teacher_logp"] == [0.0, -0.5, -3.0, 0.0, 0.0, -0.5]  # nothing kept off the sampled tokens
    student = torch.tensor([[-9.0, -1.0, -2.0, -7.0, -7.0, -0.5]])
    advantages, kl = teacher_term(torch.tensor([sample["advantages"]]), torch.tensor([sample["teacher_logp"]]), student,
                                  torch.tensor([sample["loss_mask"]], dtype=torch.float32))
    assert advantages[0].tolist() == [0.0, 0.5 + 0.5, 0.5 - 1.0, 0.0, 0.0, 0.5 + 0.0]
    assert kl.item() == pytest.approx((-0.5 + 1.0 + 0.0) / 3)  # the mean of student - teacher over the sampled tokens
    with pytest.raises(ValueError, match="the teacher scored 2 tokens of a sample with 6 targets"):
        attach_teacher_logps([sample], [[0.0, 0.0]])


def test_observation_tokens_get_exactly_zero_gradient():
    """Through rl's own loss, one update per step (no old_logp pass: the loss's log-probs stand in for the student's)."""
    logits = torch.randn(1, 7, 11, requires_grad=True)
    ids = torch.tensor([[2, 3, 1, 4, 1, 5, 9]])
    mask = [0, 1, 1, 0, 0, 1]
    logp = torch.log_softmax(logits[:, :-1].detach(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    sample = {"ids": ids[0].tolist(), "loss_mask": mask, "advantages": [0.0] * 6}
    attach_teacher_logps([sample], [[x + 1.0 for x in logp[0].tolist()]])  # the teacher likes every token more
    batch = collate([sample], 0)
    loss, metrics = batch_loss(logits[:, :-1], batch, RLConfig(objective="opd"))
    loss.backward()
    grad = logits.grad[0, :-1].abs().sum(-1)
    assert grad[[0, 3, 4]].tolist() == [0.0, 0.0, 0.0] and bool((grad[[1, 2, 5]] > 0).all())
    assert metrics["kl_teacher"] == pytest.approx(-1.0) and loss.item() == pytest.approx(-1.0)  # A = +1 on each sampled token


def test_a_student_that_is_its_teacher_gets_zero_advantage(tiny_model_dir):
    teacher = HFBackend(str(tiny_model_dir), dtype="float32")
    samples = [{"ids": [5, 17, 99, 4, 250, 31, 7], "loss_mask": [0, 0, 1, 1, 0, 1], "advantages": [0.0] * 6},
               {"ids": [8, 9, 10, 11], "loss_mask": [0, 1, 1], "advantages": [0.0] * 3}]
    attach_teacher_logps(samples, *teacher_logps(teacher, samples, teacher.tokenizer))
    batch = collate(samples, 0)
    _, logits = logprobs_of(teacher.model, batch, 1.0)
    student = token_logprobs(logits, batch["input_ids"][:, 1:])
    advantages, kl = teacher_term(batch["advantages"], batch["teacher_logp"], student, batch["loss_mask"])
    assert advantages.abs().max().item() < 1e-5 and abs(kl.item()) < 1e-5


def test_length_collapse_warns_when_episodes_shorten_as_the_kl_rises():
    assert length_collapse([{"response_tokens": 30, "kl_teacher": 0.2}]) is None
    assert length_collapse([{"response_tokens": 30, "kl_teacher": 0.2}, {"response_tokens": 20, "kl_teacher": 0.1}]) is None
    assert "episodes shortened (30.0 -> 20.0 tokens)" in length_collapse([{"response_tokens": 30, "kl_teacher": 0.1},
                                                                         {"response_tokens": 20, "kl_teacher": 0.2}])


@pytest.mark.slow
def test_opd_moves_the_student_toward_its_teacher_and_resumes_after_a_kill(tiny_model_dir, tmp_path):
    """The student was taught Paris and Rome, the teacher Paris only; the teacher scores the student's tokens. After one
    OPD update (no outcome term) the next step's rollouts are closer to the teacher: their reverse KL falls (0.84 -> 0.61
    on AVX2); a run killed in step 2 resumes from step 1's checkpoint."""
    student = teach_answers(tiny_model_dir, tmp_path / "student")
    teacher_dir = teach_answers(tiny_model_dir, tmp_path / "teacher", ("Paris",))
    teacher = HFBackend(str(teacher_dir), dtype="float32")
    cfg = rl_config(steps=2, objective="opd", outcome_weight=0.0, group_size=4, lr=1e-4)
    records = run(student, cfg, tmp_path, "straight", teacher=teacher)
    assert all(r["teacher_tokens"] > 0 and math.isfinite(r["kl_teacher"]) for r in records)
    assert records[1]["kl_teacher"] < 0.9 * records[0]["kl_teacher"], [r["kl_teacher"] for r in records]
    assert records[0]["loss"] == pytest.approx(records[0]["kl_teacher"], rel=1e-6)  # ratio 1 at the first update: -mean(A) = KL

    def kill(rec):
        if rec["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(student, cfg, tmp_path, "resumed", on_step=kill, teacher=teacher)
    trained = []
    run(student, cfg, tmp_path, "resumed", on_step=lambda rec: trained.append(rec["step"]), teacher=teacher)
    assert trained == [2]
    a, b = state(tmp_path / "straight" / "out"), state(tmp_path / "resumed" / "out")
    assert all(torch.equal(a[k], b[k]) for k in a)




def test_opd_with_a_chat_api_teacher_is_refused_when_params_load():
    import yaml

    from unison.config import ROOT, ParamsError, validate_params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["rl"]["objective"] = "opd"
    raw["teacher"].update(backend="openai", api="chat", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(ParamsError, match="rl.objective opd: the teacher .* must score given tokens, and teacher.api chat cannot"):
        validate_params(raw)
    raw["teacher"]["api"] = "completions"  # a vLLM server scores (prompt_logprobs)
    assert validate_params(raw).rl.objective == "opd"
    raw["rl"]["teacher_context"], raw["generate"]["demonstrations"] = "worked_examples", ""
    with pytest.raises(ParamsError, match="rl.teacher_context worked_examples puts generate.demonstrations in the teacher's prompt"):
        validate_params(raw)
    raw["rl"]["teacher_context"] = "student"
    with pytest.raises(ValueError, match="rl.objective opd runs on rl.trainer unison with a sequence estimator"):
        RLConfig(objective="opd", estimator="flow_grpo")


def test_with_worked_examples_the_teacher_scores_the_students_tokens_after_its_own_context(tiny_model_dir):
    """rl.teacher_context worked_examples: the same tokens, scored after the prompt with the worked examples in the
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
    plain, _ = teacher_logps(teacher, [sample], tok)
    context, straddling = teacher_logps(teacher, [sample], tok, worked_examples=examples)
    (direct,) = teacher.score([chat_prompt(tok, [{"role": "system", "content": f"You answer.\n\n{examples}"}, messages[1]])], [completion])
    assert straddling == 0 and len(context[0]) == len(plain[0]) == len(ids) - 1
    assert context[0][len(prompt) - 1 :] == pytest.approx(direct.logprobs, abs=1e-5)
    assert all(v == 0.0 for v in context[0][: len(prompt) - 1])  # the prompt's own positions are not targets
    assert max(abs(a - b) for a, b in zip(context[0][len(prompt) - 1 :], plain[0][len(prompt) - 1 :])) > 1e-3
