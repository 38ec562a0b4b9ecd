"""RL samples as tensors: one sample a rollout (or a turn of it), collated into right-padded batches, cut to the
columns some row trains on, and their log-probs under a model."""
from __future__ import annotations

import torch

from ..config import RLConfig
from ..teacher_topk import MISSING
from .loop import autocast
from .policy_loss import token_logprobs
from .sft import logits_at


def make_sample(ids: list[int], loss_mask: list[int], adv: list[float], messages: list[dict]) -> dict:
    """A sample: its ids, and its loss mask and advantages aligned to targets (position t scores token t+1);
    `messages`, the prompt's, for a teacher of another tokenizer to render in its own template (on-policy
    distillation)."""
    return {"ids": ids, "loss_mask": loss_mask[1:], "advantages": adv[1:], "messages": messages}


def padded(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def collate(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; target-aligned fields (width - 1) are 0 on padding, so padding never counts."""
    width = max(len(s["ids"]) for s in samples)
    batch = {"input_ids": torch.full((len(samples), width), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(samples), width), dtype=torch.long)}
    for r, s in enumerate(samples):
        batch["input_ids"][r, : len(s["ids"])] = torch.tensor(s["ids"])
        batch["attention_mask"][r, : len(s["ids"])] = 1
    for key in ("loss_mask", "advantages", "old_logp", "old_logp_t1", "ref_logp", "teacher_logp", "teacher_span"):
        if key in samples[0]:
            batch[key] = padded([list(s[key]) for s in samples], width - 1)
    if "teacher_top" in samples[0]:
        tops = [s["teacher_top"] for s in samples]
        batch["teacher_top_ids"], batch["teacher_top_logp"] = padded_tops(tops, width - 1)
    return batch


def padded_tops(rows: list[list[tuple[list[int], list[float]]]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k per target, [batch, width, k]: ids (0 where none) and log-probs (MISSING where none, which
    distill_loss leaves out)."""
    k = max((len(ids) for row in rows for ids, _ in row), default=1)
    ids_out = torch.zeros(len(rows), width, k, dtype=torch.long)
    logp_out = torch.full((len(rows), width, k), MISSING)
    for i, row in enumerate(rows):
        for t, (ids, logps) in enumerate(row):
            ids_out[i, t, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp_out[i, t, : len(logps)] = torch.tensor(logps, dtype=torch.float32)
    return ids_out, logp_out


TOKEN_FIELDS = ("loss_mask", "advantages", "old_logp", "old_logp_t1", "ref_logp", "teacher_logp", "teacher_span",
                "teacher_top_ids", "teacher_top_logp")  # collate's target-aligned fields, [batch, width - 1, ...]


def scored_columns(batch: dict) -> torch.Tensor:
    """The target positions that are a loss-mask token in some row (the teacher scores only those too): the LM head and
    the log-softmax over the vocabulary run nowhere else. In a rollout the prompt, the tools' schemas and their results
    are most of the tokens, and the head is a fifth of a 135M model's compute plus a [batch, width, vocab] fp32
    tensor."""
    return (batch["loss_mask"] > 0).any(0).nonzero().squeeze(-1)


def scored_batch(batch: dict, columns: torch.Tensor) -> dict:
    """The batch's target-aligned fields cut to `columns`, with the next tokens there as `targets`."""
    return {**{k: v[:, columns] if k in TOKEN_FIELDS else v for k, v in batch.items()},
            "targets": batch["input_ids"][:, 1:][:, columns]}


def logprobs_of(model, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of each next token, temperature-scaled logits) under `model` (the sampling distribution), at the
    batch's scored_columns only."""
    columns = scored_columns(batch)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logits = logits_at(model, inputs, columns).float() / temperature  # a group's shared prompt runs once
    return token_logprobs(logits, batch["input_ids"][:, 1:][:, columns]), logits


@torch.no_grad()
def attach_logprobs(model, samples: list[dict], key: str, rl: RLConfig, pad_id: int, device, precision: str,
                    unscaled_key: str | None = None) -> None:
    """Each sample's per-token log-probs under `model` (in the training precision, at rl.rollout.temperature) as
    samples[i][key], and at temperature 1 as samples[i][unscaled_key] when given; 0 at the positions that count in no
    sample of its micro-batch (scored_columns), which no loss reads."""
    for i in range(0, len(samples), rl.micro_batch_size):
        chunk = samples[i : i + rl.micro_batch_size]
        batch = {n: t.to(device) for n, t in collate(chunk, pad_id).items()}
        columns = scored_columns(batch)
        with autocast(precision, device.type):
            logp, logits = logprobs_of(model, batch, rl.rollout.temperature)
            unscaled = (token_logprobs(logits * rl.rollout.temperature, batch["input_ids"][:, 1:][:, columns])
                        if unscaled_key else None)
        for name, values in ((key, logp), (unscaled_key, unscaled)):
            if name:
                full = torch.zeros(len(chunk), batch["input_ids"].shape[1] - 1)
                full[:, columns] = values.float().cpu()
                for r, s in enumerate(chunk):
                    s[name] = full[r, : len(s["ids"]) - 1].tolist()
