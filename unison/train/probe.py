"""The KL probe (rl.probe.prompts): curriculum prompts held out of training, on which the student's reverse KL to the
teacher is measured before the first step and after every rl.probe.every steps. Its episodes are sampled as in
training with the same seeds at every probe, so only the policy differs between two probes."""
from __future__ import annotations

import random

import torch

from .batches import attach_logprobs, make_sample
from .opd import attach_teacher_logps, scored_by_teachers

PROBE_ROUND = -1  # the probe's episodes' seeds (rollout's step): the same at every probe, so only the policy differs


def split_probe(rows: list[dict], n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(the curriculum without its `n` probe prompts, the probe prompts): drawn with the seed, in curriculum order."""
    if not n:
        return rows, []
    if n >= len(rows):
        raise ValueError(f"rl.probe.prompts {n}: the curriculum (data/rl) has {len(rows)} prompts; hold out fewer")
    held = set(random.Random(f"{seed}/probe").sample(range(len(rows)), n))
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


@torch.no_grad()
def probe_samples(probe_rows: list[dict], backend, model, tok, setup, pad_id: int, device,
                  precision: str) -> list[dict]:
    """The probe's samples: rl.rollout.group_size episodes of each held-out prompt (setup.acting, the student alone),
    each with the student's log-probs at temperature 1 (`logp_t1`) and the teacher's (`teacher_logp`, `teacher_span`)
    on its sampled tokens."""
    rl = setup.rl
    _, views = setup.acting(probe_rows, rl.rollout.group_size, backend, setup.episode, rl.seed, PROBE_ROUND)
    samples = [make_sample(v.ids, v.loss_mask, [0.0] * len(v.ids), v.messages) for v in views if any(v.loss_mask)]
    if samples:
        attach_logprobs(model, samples, "logp", rl, pad_id, device, precision, unscaled_key="logp_t1")
        attach_teacher_logps(samples, *scored_by_teachers(setup.teacher, samples, tok, setup.worked_examples))
    return samples


def kl_probe(probe_rows: list[dict], backend, model, tok, setup, pad_id: int, device, precision: str) -> dict:
    """The reverse KL to the teacher on the held-out probe prompts (probe_figures of probe_samples)."""
    return probe_figures(probe_samples(probe_rows, backend, model, tok, setup, pad_id, device, precision))


def span_kls(samples: list[dict]) -> tuple[list[float], int]:
    """Per teacher span of each sample (a token of its own for a teacher of the student's vocabulary): the student's
    log-prob (`logp_t1`, temperature 1) minus the teacher's, summed over the span; and how many student tokens the spans
    cover. Their sum over the tokens is the one-sample estimate of the reverse KL that opd.teacher_term reports."""
    values, tokens = [], 0
    for s in samples:
        per_span: dict[int, float] = {}
        for student, teacher, span in zip(s["logp_t1"], s["teacher_logp"], s["teacher_span"]):
            if span:
                per_span[span] = per_span.get(span, 0.0) + student - teacher
                tokens += 1
        values += per_span.values()
    return values, tokens


def probe_figures(samples: list[dict]) -> dict:
    """The probe's figures: the reverse KL to the teacher in nats per scored student token, the 10th, 50th and 90th
    percentiles of the per-span values (the histogram's shape), the share of spans over 1 nat, and the tokens scored;
    with several teachers, the KL and tokens of each one's samples too (teachers.<name>.probe_kl, .probe_tokens)."""
    names = sorted({s["teacher_name"] for s in samples if "teacher_name" in s})
    per_teacher = {}
    for name in names if len(names) > 1 else []:
        values, tokens = span_kls([s for s in samples if s["teacher_name"] == name])
        per_teacher |= {f"teachers.{name}.probe_kl": sum(values) / tokens if tokens else 0.0,
                        f"teachers.{name}.probe_tokens": tokens}
    return {**whole_figures(samples), **per_teacher}


def whole_figures(samples: list[dict]) -> dict:
    """probe_figures over all the samples."""
    values, tokens = span_kls(samples)
    if not values:
        return {"probe_kl": 0.0, "probe_kl_p10": 0.0, "probe_kl_p50": 0.0, "probe_kl_p90": 0.0, "probe_over_1nat": 0.0,
                "probe_tokens": 0}
    ranked = sorted(values)
    at = lambda q: ranked[min(len(ranked) - 1, int(q * len(ranked)))]
    return {"probe_kl": sum(values) / tokens, "probe_kl_p10": at(0.1), "probe_kl_p50": at(0.5), "probe_kl_p90": at(0.9),
            "probe_over_1nat": sum(v > 1.0 for v in values) / len(values), "probe_tokens": tokens}
