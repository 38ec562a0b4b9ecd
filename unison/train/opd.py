"""On-policy distillation (rl.loss.objective: opd, or the first rl.opd.steps steps of an RL run): the student rolls out
as in RL, the teacher scores every token the student sampled, and the per-token reverse KL is the advantage
(discount 0):

    A_t = log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t)      on the student's sampled tokens (loss_mask 1)

plus `rl.opd.outcome_weight` times the configured estimator's sequence advantage of the verifiable reward
(rl.build_samples). Both log-probs are at temperature 1, whatever rl.rollout.temperature samples at: the teacher scores
at 1 (a server's prompt log-probs are the raw model's), so a student equal to its teacher gets A_t = 0 at any sampling
temperature.
Prompt and tool-observation tokens have loss_mask 0: no advantage, no gradient. A teacher of the student's vocabulary
scores the student's own tokens, each a span of its own; a teacher of another tokenizer scores the student's text after
its own rendering of the prompt, sampled segment by sampled segment (token_alignment.py), and a span of several student
tokens shares one A: the teacher's log-prob of the span's text minus the student's. A sampled token the teacher gives
no score (span 0: an end of turn when the teacher has no end token) gets no teacher term at all, rather than one
computed from a log-prob of 0.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..protocol import chat_prompt
from ..token_alignment import score_across
from .policy_loss import token_logprobs
from .sft import distill_loss


def attach_teacher_logps(samples: list[dict], teacher_logps: list[list[float]], span_ids: list[list[int]],
                         straddling: int = 0, tops: list[list[tuple[list[int], list[float]]]] | None = None) -> dict:
    """Each sample's teacher log-probs as `teacher_logp` and spans as `teacher_span` (0 outside its loss_mask and where
    the teacher gave no score); the loss adds the teacher term there (teacher_term). With `tops` (rl.opd.kd_weight),
    each target's top-k ids and log-probs as `teacher_top`, empty where the span is 0. Returns the number of sampled
    tokens with a teacher score and of teacher tokens straddling a student token boundary (a teacher of another
    tokenizer)."""
    n = 0
    for i, (s, teacher, spans) in enumerate(zip(samples, teacher_logps, span_ids)):
        if len(teacher) != len(s["loss_mask"]) or len(spans) != len(s["loss_mask"]):
            raise ValueError(f"opd: the teacher scored {len(teacher)} tokens ({len(spans)} spans) of a sample with "
                             f"{len(s['loss_mask'])} targets")
        s["teacher_span"] = [k * m for k, m in zip(spans, s["loss_mask"])]
        s["teacher_logp"] = [t if k else 0.0 for t, k in zip(teacher, s["teacher_span"])]
        if tops is not None:
            s["teacher_top"] = [top if k else ([], []) for top, k in zip(tops[i], s["teacher_span"])]
        n += sum(k > 0 for k in s["teacher_span"])
    return {"teacher_tokens": n, "teacher_straddling": straddling}


def teacher_term(advantages: torch.Tensor, teacher_logp: torch.Tensor, teacher_span: torch.Tensor,
                 student_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages + the teacher term, the batch's reverse KL to the teacher: the mean over scored tokens of student -
    teacher log-prob). Each token of span k gets the teacher's minus the student's log-prob summed over span k; span 0
    gets nothing. `student_logp`: the sampling policy's at temperature 1 (detached here)."""
    span = teacher_span.long()
    scored = (span > 0).to(teacher_logp.dtype)
    teacher, student = teacher_logp * scored, student_logp.detach() * scored
    per_span = torch.zeros(span.shape[0], int(span.max()) + 1 if span.numel() else 1, dtype=teacher.dtype,
                           device=teacher.device)  # span ids, not positions: a batch cut to its scored columns
    per_span.scatter_add_(1, span, teacher - student)
    return advantages + per_span.gather(1, span) * scored, (student - teacher).sum() / scored.sum().clamp(min=1)


def own_spans(loss_mask: list[int]) -> list[int]:
    """Spans of a teacher of the student's vocabulary: each sampled token its own."""
    return [t + 1 if m else 0 for t, m in enumerate(loss_mask)]


def teacher_logps(teacher, samples: list[dict], student_tok, worked_examples: str = "",
                  top_k: int = 0) -> tuple[list[list[float]], list[list[int]], int, list | None]:
    """The teacher's log-prob of each sample's every target token (position t scores token t+1, as loss_mask is
    aligned), each target's span (0: no teacher score), how many teacher tokens straddled a student token boundary,
    and with `top_k` (rl.opd.kd_weight) each target's k likeliest teacher tokens as (ids, log-probs), else None.
    A teacher of the student's vocabulary scores the very tokens: after the sequence's first token when it reads the
    student's own prompt, else after its own rendering of the prompt with `worked_examples` after the system prompt
    (rl.opd.teacher_context); a teacher of another tokenizer scores the student's text after that rendering
    (token_alignment.py), and has no top-k over the student's vocabulary."""
    same_vocab = teacher.tokenizer.get_vocab() == student_tok.get_vocab()
    if top_k and not same_vocab:
        raise ValueError("rl.opd.kd_weight > 0 distils the teacher's top-k tokens into the student's distribution, but "
                         "the teacher's vocabulary is not the student's: set rl.opd.kd_weight: 0 (the teacher term "
                         "scores across tokenizers)")
    tops = lambda scores, first: ([[([], [])] * first + list(zip(sc.top_ids, sc.top_logprobs))
                                   for first, sc in zip(first, scores)] if top_k else None)
    if same_vocab and not worked_examples:
        scores = teacher.score([s["ids"][:1] for s in samples], [s["ids"][1:] for s in samples], top_k)
        return ([sc.logprobs for sc in scores], [own_spans(s["loss_mask"]) for s in samples], 0,
                tops(scores, [0] * len(samples)))
    # target t is ids[t + 1]
    firsts = [s["loss_mask"].index(1) if 1 in s["loss_mask"] else len(s["loss_mask"]) for s in samples]
    heads = [teacher_messages(s["messages"], worked_examples) for s in samples]
    completions = [s["ids"][first + 1 :] for s, first in zip(samples, firsts)]
    if same_vocab:
        scores = teacher.score([chat_prompt(teacher.tokenizer, h) for h in heads], completions, top_k)
        return ([[0.0] * first + sc.logprobs for first, sc in zip(firsts, scores)],
                [own_spans(s["loss_mask"]) for s in samples], 0, tops(scores, firsts))
    # which completion tokens the student sampled
    sampled = [s["loss_mask"][first:] for s, first in zip(samples, firsts)]
    aligned = score_across(teacher, student_tok, list(zip(heads, completions, sampled)))
    return ([[0.0] * first + a.logprobs for first, a in zip(firsts, aligned)],
            [[0] * first + a.span_ids for first, a in zip(firsts, aligned)], sum(a.straddling for a in aligned), None)


@dataclass(frozen=True)
class TeacherTeam:
    """Several teachers scoring the student (on-policy distillation, the probe), each sample by the teacher of its
    prompt's question: `backends` by name; `routes` from a prompt (prompt_key of its messages) to a name, a prompt not
    listed going to `default`."""
    backends: dict[str, Any]
    routes: dict[str, str] = field(default_factory=dict)
    default: str = "teacher"

    def name_of(self, sample: dict) -> str:
        return self.routes.get(prompt_key(sample["messages"]), self.default)


def prompt_key(messages: list[dict]) -> str:
    """A prompt as the team looks its teacher up: its messages' roles and texts."""
    return json.dumps([[m["role"], m["content"]] for m in messages])


def scored_by_teachers(teacher, samples: list[dict], student_tok, worked_examples: str = "",
                       top_k: int = 0) -> tuple[list[list[float]], list[list[int]], int, list | None]:
    """teacher_logps by each sample's own teacher: one backend scores them all; a TeacherTeam gives each sample to the
    teacher its prompt routes to (each with its own tokenizer: the very tokens or the character alignment), and marks
    the sample with its name (`teacher_name`, which the probe's figures split by)."""
    if not isinstance(teacher, TeacherTeam):
        return teacher_logps(teacher, samples, student_tok, worked_examples, top_k)
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        s["teacher_name"] = teacher.name_of(s)
        groups.setdefault(s["teacher_name"], []).append(i)
    logps, spans, tops, straddling = [None] * len(samples), [None] * len(samples), [None] * len(samples), 0
    for name, at in groups.items():
        lp, sp, n, tp = teacher_logps(teacher.backends[name], [samples[i] for i in at], student_tok, worked_examples,
                                      top_k)
        straddling += n
        for j, i in enumerate(at):
            logps[i], spans[i], tops[i] = lp[j], sp[j], tp[j] if tp is not None else None
    return logps, spans, straddling, tops if top_k else None


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
        return (f"opd: WARNING: episodes shortened ({before['response_tokens']:.1f} -> "
                f"{now['response_tokens']:.1f} tokens) while the KL to the teacher rose ({before['kl_teacher']:.4f} -> "
                f"{now['kl_teacher']:.4f}): teacher and student may stop differently (check their end-of-turn tokens)")
    return None


def unscaled_logp(logits: torch.Tensor, logp: torch.Tensor, batch: dict, temperature: float) -> torch.Tensor:
    """The sampling policy's log-probs at temperature 1 (the teacher term's): stored with the policy before the update
    (`old_logp_t1`), else the loss's own (`logp` from `logits` scaled by 1/temperature), detached."""
    if "old_logp_t1" in batch:
        return batch["old_logp_t1"]
    return (logp if temperature == 1 else token_logprobs(logits * temperature, batch["targets"])).detach()


def with_teacher_term(advantages: torch.Tensor, logits: torch.Tensor, logp: torch.Tensor, batch: dict,
                      temperature: float) -> tuple[torch.Tensor, dict]:
    """A scored batch's advantages plus the teacher term, and its reverse KL to the teacher (`kl_teacher`)."""
    student = unscaled_logp(logits, logp, batch, temperature)
    advantages, kl = teacher_term(advantages, batch["teacher_logp"], batch["teacher_span"], student)
    return advantages, {"kl_teacher": kl.item()}


def top_k_term(logits: torch.Tensor, batch: dict, opd, temperature: float) -> tuple[torch.Tensor, dict]:
    """rl.opd.kd_weight x the divergence of the student's distribution at temperature 1 from the teacher's top-k, on
    the tokens the teacher scored; and its value (`kd_teacher`)."""
    kd = distill_loss(logits * temperature, batch["teacher_top_ids"], batch["teacher_top_logp"],
                      batch["teacher_span"] > 0, opd.kd_loss)
    return opd.kd_weight * kd, {"kd_teacher": kd.item()}


def score_with_teacher(samples: list[dict], setup, tok, trainer) -> dict:
    """The teacher's log-probs (and, with rl.opd.kd_weight, its top-k) on every sample's sampled tokens, scored on rank
    0 and handed to every process; the figures of the scoring and its time (`teacher_s`)."""
    t0 = time.perf_counter()
    opd = setup.rl.opd
    top_k = opd.kd_topk if opd.kd_weight > 0 else 0
    scored = (scored_by_teachers(setup.teacher, samples, tok, setup.worked_examples, top_k) if trainer.is_main
              else None)
    return {**attach_teacher_logps(samples, *trainer.from_main(scored)), "teacher_s": time.perf_counter() - t0}


def restart_step(rl) -> int:
    """The step at which an RL run that began with rl.opd.steps of distillation starts its RL part as a second run
    would (fresh AdamW moments, the lr schedule again: rl.opd.switch restart); 0 = never."""
    return rl.opd.steps if rl.opd.switch == "restart" else 0
