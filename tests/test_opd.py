"""On-policy distillation (rl.objective opd, unison/train/opd.py): the advantage by hand, no gradient on observations,
zero advantage when the student is its teacher, and the rl loop with a teacher that scores: it moves the student
toward the teacher and resumes after a kill."""
from __future__ import annotations

import math

import pytest
import torch

from unison.llm.hf_backend import HFBackend
from unison.train.opd import add_teacher_advantages, length_collapse, teacher_logps
from unison.train.policy_loss import policy_loss
from unison.train.rl import RLConfig, attach_logprobs

from .test_rl import rl_config, run, state, teach_answers


def test_the_advantage_is_teacher_minus_student_on_sampled_tokens_by_hand():
    # targets: prompt token, 2 sampled, 2 observation, 1 sampled; the outcome term (0.5) already on the sampled tokens
    sample = {"ids": [1, 2, 3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 0, 0, 1], "advantages": [0.0, 0.5, 0.5, 0.0, 0.0, 0.5],
              "old_logp": [-9.0, -1.0, -2.0, -7.0, -7.0, -0.5]}
    teacher = [-1.0, -0.5, -3.0, -0.1, -0.1, -0.5]
    stats = add_teacher_advantages([sample], [teacher])
    assert sample["advantages"] == [0.0, 0.5 + 0.5, 0.5 - 1.0, 0.0, 0.0, 0.5 + 0.0]
    assert stats == {"kl_teacher": pytest.approx((-0.5 + 1.0 + 0.0) / 3), "teacher_tokens": 3, "teacher_straddling": 0}  # mean of student - teacher
    with pytest.raises(ValueError, match="the teacher scored 2 tokens of a sample with 6 targets"):
        add_teacher_advantages([sample], [[0.0, 0.0]])


def test_observation_tokens_get_exactly_zero_gradient():
    logits = torch.randn(1, 6, 11, requires_grad=True)
    targets = torch.tensor([[3, 1, 4, 1, 5, 9]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]])
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    sample = {"ids": [0] * 7, "loss_mask": mask[0].tolist(), "advantages": [0.0] * 6, "old_logp": logp[0].tolist()}
    add_teacher_advantages([sample], [[x + 1.0 for x in logp[0].tolist()]])  # the teacher likes every token more
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([sample["advantages"]]), mask, 0.2, 0.28)
    loss.backward()
    grad = logits.grad[0].abs().sum(-1)
    assert grad[[0, 3, 4]].tolist() == [0.0, 0.0, 0.0] and bool((grad[[1, 2, 5]] > 0).all())


def test_a_student_that_is_its_teacher_gets_zero_advantage(tiny_model_dir):
    teacher = HFBackend(str(tiny_model_dir), dtype="float32")
    samples = [{"ids": [5, 17, 99, 4, 250, 31, 7], "loss_mask": [0, 0, 1, 1, 0, 1], "advantages": [0.0] * 6},
               {"ids": [8, 9, 10, 11], "loss_mask": [0, 1, 1], "advantages": [0.0] * 3}]
    attach_logprobs(teacher.model, samples, "old_logp", RLConfig(micro_batch_size=2), 0, torch.device("cpu"), "fp32")
    stats = add_teacher_advantages(samples, *teacher_logps(teacher, samples, teacher.tokenizer))
    assert all(abs(a) < 1e-5 for s in samples for a in s["advantages"]) and abs(stats["kl_teacher"]) < 1e-5


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
