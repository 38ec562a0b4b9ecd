"""PRM: a process reward model (AgentArk prm/finetune2.py, docs/seeds.md#agentarks-prm; DESIGN §6).

The input is the question, then each step followed by a separator; a 2-class linear head reads the backbone's last
hidden state at each step's (last) separator token. Loss: cross-entropy against soft targets [1 - y, y] from the step
labels. `freeze_backbone` trains only the head (AgentArk fix_llm). The loop is loop.py's.
"""
from __future__ import annotations

import json
import math
import random
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch import nn

from ..config import PRMConfig
from ..data.schemas import DataError, atomic_dir
from ..judge.stats import auc
from ..protocol import normalize_answer
from .loop import Trainer, autocast, epoch_batches, fit, resolve_precision, split_batch

HEAD_FILE, CONFIG_FILE = "prm_head.safetensors", "prm_config.json"


class PRM(nn.Module):
    def __init__(self, backbone, tokenizer, separator: str):
        super().__init__()
        self.backbone, self.tok, self.separator = backbone, tokenizer, separator
        self.head = nn.Linear(backbone.config.hidden_size, 2)
        self.precision = "fp32"  # of step_scores: load_prm and train_prm set it from prm.precision
        self.sep_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
        if not self.sep_ids:
            raise ValueError(f"prm.separator {separator!r} tokenises to nothing")

    def encode(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """(input ids, position of each step's last separator token): question + sep, then each step + sep."""
        ids = self.tok(question, add_special_tokens=False)["input_ids"] + self.sep_ids
        positions = []
        for step in steps:
            ids += self.tok(step, add_special_tokens=False)["input_ids"] + self.sep_ids
            positions.append(len(ids) - 1)
        return ids, positions

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def forward(self, batch: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """Head logits [n_steps, 2] at the given positions of each (ids, positions) example (training calls it through
        its DDP / DeepSpeed wrapper)."""
        device = self.head.weight.device
        width = max(len(ids) for ids, _ in batch)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, (i, _) in enumerate(batch):
            ids[r, : len(i)] = torch.tensor(i)
            attn[r, : len(i)] = 1
        frozen = not any(p.requires_grad for p in self.backbone.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            hidden = self.backbone(input_ids=ids.to(device), attention_mask=attn.to(device)).last_hidden_state
        return [self.head(hidden[r, pos].float()) for r, (_, pos) in enumerate(batch)]

    @torch.no_grad()
    def step_scores(self, questions: list[str], steps: list[list[str]], batch_size: int = 8) -> list[list[float]]:
        """Probability that each step is good, per trajectory: each distinct (question, steps) scored once, in batches
        of similar length (little padding), under `self.precision`'s autocast, no grad."""
        was_training = self.training
        self.eval()
        keys = [(q, tuple(s)) for q, s in zip(questions, steps)]
        distinct = list(dict.fromkeys(keys))
        examples = [self.encode(q, list(s)) for q, s in distinct]
        order = sorted(range(len(examples)), key=lambda k: len(examples[k][0]))
        scores: list[list[float]] = [[] for _ in examples]
        with autocast(self.precision, self.head.weight.device.type):
            for i in range(0, len(order), batch_size):
                batch = order[i : i + batch_size]
                for k, lg in zip(batch, self([examples[k] for k in batch])):
                    scores[k] = torch.softmax(lg.float(), -1)[:, 1].tolist()
        self.train(was_training)
        by_key = dict(zip(distinct, scores))
        return [by_key[k] for k in keys]

    def save(self, out_dir: str | Path, extra: dict | None = None) -> None:
        """Backbone, tokenizer, head and a json config (separator), atomically."""
        from safetensors.torch import save_file

        with atomic_dir(out_dir) as tmp:
            self.backbone.save_pretrained(tmp)
            self.tok.save_pretrained(tmp)
            save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                      str(tmp / HEAD_FILE))
            (tmp / CONFIG_FILE).write_text(json.dumps({"separator": self.separator, "num_labels": 2, **(extra or {})},
                                                      indent=2))


def build_prm(model_dir: str | Path, separator: str, seed: int = 0) -> PRM:
    """A fresh PRM on a base model's backbone (AutoModel), head initialised under `seed`."""
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    return PRM(AutoModel.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(model_dir),
               separator)


def load_prm(path: str | Path, precision: str = "fp32") -> PRM:
    """A PRM saved by `PRM.save` (models/prm), scoring in `precision` (prm.precision: auto | bf16 | fp32)."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    path = Path(path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    prm = PRM(AutoModel.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path),
              cfg["separator"])
    prm.head.load_state_dict(load_file(str(path / HEAD_FILE)))
    prm.precision = resolve_precision(precision, "prm.precision")
    return prm.eval()


def soft_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of [n, 2] logits against soft targets [1 - y, y]."""
    logp = torch.log_softmax(logits, -1)
    return -((1 - labels) * logp[:, 0] + labels * logp[:, 1]).mean()


def prm_loss(prm, batch: list[tuple[list[int], list[int], list[float]]]) -> torch.Tensor:
    """Soft cross-entropy over every labeled step of the batch (each step weighs the same); `prm` a PRM or its
    wrapper."""
    logits = torch.cat(prm([(ids, pos) for ids, pos, _ in batch]))
    labels = torch.tensor([y for _, _, ys in batch for y in ys], dtype=torch.float32, device=logits.device)
    return soft_ce(logits, labels)


def split_by_question(rows: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a seeded share of question ids is held out, with all their trajectories."""
    qids = sorted({r["question_id"] for r in rows})
    random.Random(seed).shuffle(qids)
    n_eval = min(len(qids) - 1, math.ceil(eval_fraction * len(qids))) if eval_fraction > 0 else 0
    held = set(qids[:n_eval])
    return [r for r in rows if r["question_id"] not in held], [r for r in rows if r["question_id"] in held]


def check_train(rows: list[dict], path: str) -> None:
    """Training needs labeled steps of both classes (label >= 0.5 and < 0.5); DataError naming `path` otherwise."""
    labels = [y for r in rows for y in r["step_labels"]]
    if not labels:
        raise DataError(path, "no step labels in the training questions (every trajectory has no steps)",
                        field="step_labels")
    good = sum(y >= 0.5 for y in labels)
    if good in (0, len(labels)):
        raise DataError(path, f"all {len(labels)} training step labels are "
                              f"{'good (>= 0.5)' if good else 'bad (< 0.5)'}: a PRM needs both classes (more samples, "
                              "label.step_labels: montecarlo, or a stronger teacher)", field="step_labels")


def build_examples(prm: PRM, rows: list[dict],
                   max_length: int) -> tuple[list[tuple[list[int], list[int], list[float]]], int]:
    """(ids, positions, labels) per row with steps, cut at max_length (steps past it dropped); and how many were cut."""
    examples, cut = [], 0
    for r in rows:
        if not r["steps"]:
            continue
        ids, pos = prm.encode(r["question"], r["steps"])
        keep = [k for k, p in enumerate(pos) if p < max_length]
        cut += len(keep) < len(pos)
        if keep:
            examples.append((ids[:max_length], [pos[k] for k in keep], [float(r["step_labels"][k]) for k in keep]))
    return examples, cut


def train_prm(model_dir: str, rows: list[dict], cfg: PRMConfig, out_dir: str | None = None, on_step=None,
              gradient_checkpointing: bool = False, checkpoint_dir: str | None = None) -> tuple[PRM, list[dict]]:
    """Train on `rows`' step labels; save to `out_dir` (if given) atomically (rank 0); returns the PRM and the step
    records. Several processes: each step's examples are split between them, weighted by their labeled steps. A killed
    run resumes from `checkpoint_dir` (written every cfg.checkpoint_every steps) when one is given."""
    prm = build_prm(model_dir, cfg.separator, cfg.seed)
    if cfg.freeze_backbone:
        prm.backbone.requires_grad_(False)
    examples, _ = build_examples(prm, rows, cfg.max_length)
    batches = [[examples[k] for k in b] for epoch in epoch_batches(len(examples), cfg.batch_size, cfg.epochs, cfg.seed)
               for b in epoch]
    total = max(1, len(batches))
    trainer = Trainer("prm", prm, total, cfg, gradient_checkpointing=gradient_checkpointing, on_step=on_step)
    prm.precision = trainer.precision
    split = [split_batch(b, trainer.acc.num_processes, lambda ex: len(ex[2])) for b in batches]
    records = fit(trainer, [m for m, _ in split], lambda batch: (prm_loss(trainer.model, batch), {}),
                  max(1, total // cfg.epochs), weights=[w for _, w in split], checkpoint_dir=checkpoint_dir)
    with trainer.whole_model():
        if out_dir and trainer.is_main:
            prm.save(out_dir, {**cfg.model_dump(), "base": str(model_dir)})
    return prm, records


# --- metrics on held-out questions ------------------------------------------------------------------


def step_metrics(scores: list[list[float]], labels: list[list[float]]) -> dict:
    """Step accuracy (score >= 0.5 vs label >= 0.5) and AUC over all steps (None with a reason when one class)."""
    s = [x for row in scores for x in row]
    y = [v >= 0.5 for row in labels for v in row]
    out = {"eval_steps": len(s), "step_accuracy": sum((a >= 0.5) == b for a, b in zip(s, y)) / max(1, len(s)),
           "auc": auc(s, y)}
    if out["auc"] is None:
        out["auc_reason"] = f"held-out step labels are all {'good' if all(y) else 'bad'}" if y else "no held-out steps"
    return out


def rerank_metrics(rows: list[dict], scores: list[list[float]]) -> dict:
    """Best-of-N per held-out question with >= 2 trajectories: PRM pick (min / last step score) vs majority vote vs
    random."""
    groups = defaultdict(list)
    for r, s in zip(rows, scores):
        groups[r["question_id"]].append((r, s))
    groups = {q: g for q, g in groups.items() if len(g) >= 2}
    if not groups:
        return {"bon_questions": 0, "bon_reason": "no held-out question has >= 2 trajectories"}
    picks = {"bon_prm_min": [], "bon_prm_last": [], "bon_majority": [], "bon_random": [], "bon_oracle": []}
    for g in groups.values():
        g = sorted(g, key=lambda rs: (rs[0]["sample"], rs[0]["id"]))
        correct = [float(r["correct"]) for r, _ in g]
        for key, agg in (("bon_prm_min", min), ("bon_prm_last", lambda s: s[-1])):
            value = [agg(s) if s else -1.0 for _, s in g]
            picks[key].append(correct[value.index(max(value))])
        votes = Counter(normalize_answer(r["final_answer"]) for r, _ in g if r["final_answer"].strip())
        top = max(votes.values()) if votes else 0
        pick = next((k for k, (r, _) in enumerate(g)
                     if votes and votes.get(normalize_answer(r["final_answer"])) == top), 0)
        picks["bon_majority"].append(correct[pick])
        picks["bon_random"].append(sum(correct) / len(correct))
        picks["bon_oracle"].append(max(correct))
    return {"bon_questions": len(groups), **{k: sum(v) / len(v) for k, v in picks.items()}}


def evaluate_prm(prm: PRM, rows: list[dict], batch_size: int = 8) -> dict:
    """Step accuracy, AUC and best-of-N reranking on held-out rows (those with steps)."""
    rows = [r for r in rows if r["steps"]]
    if not rows:
        return {"eval_steps": 0, "auc": None, "auc_reason": "no held-out steps", "bon_questions": 0}
    scores = prm.step_scores([r["question"] for r in rows], [r["steps"] for r in rows], batch_size)
    return {**step_metrics(scores, [r["step_labels"] for r in rows]), **rerank_metrics(rows, scores)}
