"""On-policy distillation (rl.objective: opd): the student rolls out as in RL, the teacher scores every token the
student sampled, and the per-token reverse KL is the advantage (discount 0):

    A_t = log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t)      on the student's sampled tokens (loss_mask 1)

plus `rl.outcome_weight` times the configured estimator's sequence advantage of the verifiable reward (build_samples).
Prompt and tool-observation tokens have loss_mask 0: no advantage, no gradient. A student that already equals its
teacher gets A_t = 0 everywhere. A teacher of the student's vocabulary scores the student's own tokens; a teacher of
another tokenizer scores the student's text after its own rendering of the prompt (token_alignment.py: character
alignment, tokens straddling a boundary counted).
"""
from __future__ import annotations

import torch

from ..protocol import chat_prompt
from ..token_alignment import score_across


def attach_teacher_logps(samples: list[dict], teacher_logps: list[list[float]], straddling: int = 0) -> dict:
    """Each sample's teacher log-probs as `teacher_logp`, 0 outside its loss_mask; the loss adds A_t = teacher - student
    there (teacher_term). Returns the number of tokens scored and of teacher tokens straddling a student token boundary
    (a teacher of another tokenizer)."""
    n = 0
    for s, teacher in zip(samples, teacher_logps):
        if len(teacher) != len(s["loss_mask"]):
            raise ValueError(f"opd: the teacher scored {len(teacher)} tokens of a sample with {len(s['loss_mask'])} targets")
        s["teacher_logp"] = [t * m for t, m in zip(teacher, s["loss_mask"])]
        n += sum(s["loss_mask"])
    return {"teacher_tokens": n, "teacher_straddling": straddling}


def teacher_term(advantages: torch.Tensor, teacher_logp: torch.Tensor, student_logp: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages + (teacher - student log-prob) on loss_mask tokens, the batch's reverse KL to the teacher: the mean over
    those tokens of student - teacher log-prob). `student_logp` is the sampling policy's (old_logp, or with one update
    per step the loss's own, detached: the same policy, so no forward pass of its own is needed)."""
    gap = (teacher_logp - student_logp.detach()) * loss_mask
    return advantages + gap, -gap.sum() / loss_mask.sum().clamp(min=1)


def teacher_logps(teacher, samples: list[dict], student_tok, worked_examples: str = "") -> tuple[list[list[float]], int]:
    """The teacher's log-prob of each sample's every target token (position t scores token t+1, as loss_mask is
    aligned), and how many teacher tokens straddled a student token boundary. A teacher of the student's
    vocabulary scores the very tokens: after the sequence's first token when it reads the student's own prompt, else
    after its own rendering of the prompt with `worked_examples` after the system prompt (rl.teacher_context); a teacher
    of another tokenizer scores the student's text after that rendering (token_alignment.py)."""
    same_vocab = teacher.tokenizer.get_vocab() == student_tok.get_vocab()
    if same_vocab and not worked_examples:
        scores = teacher.score([s["ids"][:1] for s in samples], [s["ids"][1:] for s in samples])
        return [sc.logprobs for sc in scores], 0
    firsts = [s["loss_mask"].index(1) if 1 in s["loss_mask"] else len(s["loss_mask"]) for s in samples]  # target t is ids[t + 1]
    heads = [teacher_messages(s["messages"], worked_examples) for s in samples]
    completions = [s["ids"][first + 1 :] for s, first in zip(samples, firsts)]
    if same_vocab:
        scores = teacher.score([chat_prompt(teacher.tokenizer, h) for h in heads], completions)
        return [[0.0] * first + sc.logprobs for first, sc in zip(firsts, scores)], 0
    aligned = score_across(teacher, student_tok, list(zip(heads, completions)))
    return [[0.0] * first + a.logprobs for first, a in zip(firsts, aligned)], sum(a.straddling for a in aligned)


def teacher_messages(messages: list[dict], worked_examples: str) -> list[dict]:
    """The prompt's messages with `worked_examples` after the system prompt (as generate's acting agents read them)."""
    if not worked_examples:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{worked_examples}"}, *messages[1:]]
    return [{"role": "system", "content": worked_examples}, *messages]


def length_collapse(history: list[dict]) -> str | None:
    """A warning when the student's episodes got shorter while its KL to the teacher rose, over the last two steps (the
    sign that teacher and student stop differently: the student learns to end early), else None."""
    if len(history) < 2:
        return None
    before, now = history[-2], history[-1]
    if now["response_tokens"] < before["response_tokens"] and now["kl_teacher"] > before["kl_teacher"]:
        return (f"opd: WARNING: episodes shortened ({before['response_tokens']:.1f} -> {now['response_tokens']:.1f} tokens) while "
                f"the KL to the teacher rose ({before['kl_teacher']:.4f} -> {now['kl_teacher']:.4f}): teacher and student may "
                "stop differently (check their end-of-turn tokens)")
    return None
