"""DPO (AFM, docs/seeds.md#afms-dpo): chosen = a correct, rejected = a wrong student rendering of the same question.

Both sides use the SFT token view (token_view.py), so only generated tokens count: the prompt and every tool observation
are masked out of the sequence log-probabilities, as AFM's IgnoreObsPairwiseDatasetProcessor masks `<observation>`
spans. TRL's DPOTrainer is not used: it tokenises prompt/chosen/rejected text itself and masks only the prompt, so an
observation in the middle of a multi-turn completion would be trained on and the ids would not be the generated ones.
The loop is loop.py's (as sft.py): the reference is the frozen starting model, its log-probabilities
computed once before training.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..config import DPOConfig
from ..data.schemas import LABELED, DataError, read_table
from .loop import Trainer, autocast, epoch_batches, fit, split_batch
from .sft import collate, load_student, save_model, target_logits


def build_pairs(rows: list[dict], max_per_question: int) -> list[tuple[dict, dict]]:
    """(correct, wrong) renderings of one question, correct x wrong in sample order, at most `max_per_question` each;
    renderings identical to an earlier one of the same question are dropped."""
    by_q: dict[str, tuple[list, list]] = {}
    seen = set()
    for r in sorted(rows, key=lambda r: (r["question_id"], r["sample"], r["id"])):
        key = (r["question_id"], tuple(m["content"] for m in r["student"]))
        if key in seen:
            continue
        seen.add(key)
        by_q.setdefault(r["question_id"], ([], []))[0 if r["correct"] else 1].append(r)
    pairs = []
    for q in sorted(by_q):
        correct, wrong = by_q[q]
        pairs += list(itertools.islice(itertools.product(correct, wrong), max_per_question))
    return pairs


def load_pairs(path: str, max_per_question: int) -> list[tuple[dict, dict]]:
    """(correct, wrong) pairs from a labeled file; DataError when no question has both."""
    rows = read_table(path, LABELED)
    pairs = build_pairs(rows, max_per_question)
    if not pairs:
        n_q = len({r["question_id"] for r in rows})
        raise DataError(path, f"no question of {n_q} has both a correct and a wrong trajectory to pair "
                        "(raise generate.samples, or set dpo.enabled: false)", field="correct")
    return pairs


def pair_views(format, pairs: list[tuple[dict, dict]], max_length: int) -> tuple[list[tuple], dict]:
    """Token views ((ids, mask) chosen, (ids, mask) rejected) of every pair in the student's `format` (tool_format.py:
    its `view`), cut to `max_length`, and counts."""
    views, truncated = [], 0
    for chosen, rejected in pairs:
        pair = []
        for r in (chosen, rejected):
            ids, mask = format.view(r)
            truncated += len(ids) > max_length
            pair.append((ids[:max_length], mask[:max_length]))
        views.append(tuple(pair))
    return views, {"pairs": len(views), "questions": len({c["question_id"] for c, _ in pairs}),
                   "truncated_sequences": truncated}


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row: the sum of log p(targets[b, p]) under logits[b, p] (aligned) over the positions where mask = 1."""
    logits = logits.float()
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # no (B, L, V) log-softmax copy
    return (logp * mask.float()).sum(-1)


def dpo_loss(pol_c: torch.Tensor, pol_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor, beta: float,
             kind: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward); h = (pol_c - ref_c) - (pol_r - ref_r) on summed log-probs.

    sigmoid: -log sigmoid(beta h) (Rafailov et al.); ipo: (h - 1/(2 beta))^2 (Azar et al.); rewards = beta * log-ratio.
    """
    h = (pol_c - ref_c) - (pol_r - ref_r)
    loss = -F.logsigmoid(beta * h) if kind == "sigmoid" else (h - 1 / (2 * beta)) ** 2  # dpo.loss: sigmoid | ipo
    return loss, beta * (pol_c - ref_c).detach(), beta * (pol_r - ref_r).detach()


def pair_logps(model, views: list[tuple], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence log-probs of a batch of pairs, both sides in one forward pass."""
    batch = {k: t.to(device) for k, t in collate([v[0] for v in views] + [v[1] for v in views], pad_id).items()}
    logps = sequence_logps(*target_logits(model, batch))
    return logps[: len(views)], logps[len(views):]


def train_dpo(model_dir: str, views: list[tuple], cfg: DPOConfig, out_dir: str, on_step=None,
              gradient_checkpointing: bool = False, checkpoint_dir: str | None = None) -> list[dict]:
    """Train from `model_dir` (also the frozen reference), save to `out_dir` atomically with a dpo.json (rank 0); the
    step records. Several processes: each step's pairs are split between them. A killed run resumes from
    `checkpoint_dir` (written every cfg.checkpoint_every steps) when one is given."""
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id or 0
    model = load_student(model_dir, cfg.lora, cfg.lora_r, cfg.lora_alpha, cfg.precision, "dpo")
    batches = [b for epoch in epoch_batches(len(views), cfg.batch_size, cfg.epochs, cfg.seed) for b in epoch]
    trainer = Trainer("dpo", model, len(batches), cfg, gradient_checkpointing=gradient_checkpointing, on_step=on_step)
    trainer.model.eval()
    # the reference: the starting weights (LoRA's start as zero), scored once
    with torch.no_grad(), autocast(trainer.precision, trainer.device.type):
        ref = [pair_logps(trainer.model, views[i : i + cfg.batch_size], pad, trainer.device)
               for i in range(0, len(views), cfg.batch_size)]
    ref_c, ref_r = torch.cat([c for c, _ in ref]), torch.cat([r for _, r in ref])
    split = [split_batch(b, trainer.acc.num_processes, lambda _: 1) for b in batches]  # pairs weigh the same

    def loss_fn(idx):
        pol_c, pol_r = pair_logps(trainer.model, [views[i] for i in idx], pad, trainer.device)
        loss, rew_c, rew_r = dpo_loss(pol_c, pol_r, ref_c[idx].to(trainer.device), ref_r[idx].to(trainer.device),
                                      cfg.beta, cfg.loss)
        return loss.mean(), {"reward_chosen": rew_c.mean().item(), "reward_rejected": rew_r.mean().item(),
                             "reward_margin": (rew_c - rew_r).mean().item(),
                             "accuracy": (rew_c > rew_r).float().mean().item()}

    records = fit(trainer, [m for m, _ in split], loss_fn, math.ceil(len(views) / cfg.batch_size),
                  weights=[w for _, w in split], checkpoint_dir=checkpoint_dir)
    with trainer.whole_model() as trained:
        if trainer.is_main:
            save_model(trained, tok, out_dir, cfg.lora,
                       {"dpo.json": {**cfg.model_dump(), "enabled": True, "start": str(model_dir), "pairs": len(views),
                                     "steps": len(records)}})
    return records
