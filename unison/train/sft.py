"""SFT: distil correct teacher trajectories into the student, loss only where loss_mask = 1 (DESIGN §7).

A plain training loop (through accelerate, so a DeepSpeed config works on GPUs) a reader can hold in their head.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.schemas import atomic_dir
from .token_view import retokenization_drift, row_view


@dataclass
class SFTConfig:
    epochs: int = 2
    lr: float = 5e-5
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 768
    warmup_ratio: float = 0.05
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    packing: bool = False  # several examples per row of up to max_length; same steps and loss, fewer pad tokens
    deepspeed_config: str = ""  # a DeepSpeed json (e.g. configs/deepspeed/zero2.json): ZeRO through accelerate
    seed: int = 0


def make_accelerator(deepspeed_config: str = "", grad_accum: int = 1, param: str = "sft.deepspeed_config"):
    """An Accelerator on the GPU if there is one (else the CPU); with a DeepSpeed json, a DeepSpeed engine whose gradient
    accumulation is `grad_accum`. `param` names the setting in errors."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if not deepspeed_config:
        return Accelerator(gradient_accumulation_steps=grad_accum, cpu=not torch.cuda.is_available())
    path = Path(deepspeed_config)
    if not path.is_file():
        raise FileNotFoundError(f"params.yaml {param}: no DeepSpeed config at {path}")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"params.yaml {param}: {path} is not valid JSON ({e})") from None
    ds["gradient_accumulation_steps"] = grad_accum
    return Accelerator(gradient_accumulation_steps=grad_accum, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))


def select_trajectories(rows: list[dict], max_per_question: int, dedupe: bool) -> list[dict]:
    """Correct trajectories, at most `max_per_question` per question, identical student renderings dropped."""
    kept, per_q, seen = [], {}, set()
    for r in sorted(rows, key=lambda r: (r["question_id"], r["sample"], r["id"])):
        if not r["correct"]:
            continue
        key = (r["question_id"], tuple(m["content"] for m in r["student"]))
        if dedupe and key in seen:
            continue
        if per_q.get(r["question_id"], 0) >= max_per_question:
            continue
        seen.add(key)
        per_q[r["question_id"]] = per_q.get(r["question_id"], 0) + 1
        kept.append(r)
    return kept


def build_examples(tok, rows: list[dict], max_length: int) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Token views of the selected rows (too long ones truncated) and drift statistics."""
    examples, drifted, drift_tokens, truncated, n_tokens = [], 0, 0, 0, 0
    for r in rows:
        ids, mask = row_view(tok, r)
        d = retokenization_drift(tok, ids)
        drifted += d > 0
        drift_tokens += d
        n_tokens += len(ids)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        examples.append((ids, mask))
    stats = {"examples": len(examples), "drifted_examples": drifted, "drift_tokens": drift_tokens,
             "drift_token_rate": drift_tokens / max(1, n_tokens), "truncated_examples": truncated,
             "train_tokens": sum(sum(m) for _, m in examples)}
    return examples, stats


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for r, (i, m) in enumerate(batch):
        ids[r, : len(i)] = torch.tensor(i)
        mask[r, : len(m)] = torch.tensor(m)
        attn[r, : len(i)] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def pack(batch: list[tuple[list[int], list[int]]], max_length: int) -> list[list[tuple[list[int], list[int]]]]:
    """Greedy, in order: each example joins the current row while the row stays within max_length tokens."""
    rows, used = [], max_length
    for ex in batch:
        if used + len(ex[0]) > max_length:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += len(ex[0])
    return rows


def collate_packed(batch: list[tuple[list[int], list[int]]], pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """Packed rows with position_ids restarting at 0 per example (trailing pads too) and no attention_mask.

    Without a 2D mask, transformers reads the restarts as sequence boundaries and builds a block-diagonal causal mask
    (masking_utils.find_packed_sequence_indices, for sdpa/eager/flex; flash-attention uses them as varlen), so no
    token attends across examples. The loss mask is the examples' own, except each example's first token, which is
    never a target unpacked and must not become one for the previous example's last token.
    """
    rows = pack(batch, max_length)
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i, m in row:
            ids[r, at : at + len(i)] = torch.tensor(i)
            mask[r, at + 1 : at + len(m)] = torch.tensor(m[1:])
            pos[r, at : at + len(i)] = torch.arange(len(i))
            at += len(i)
        pos[r, at:] = torch.arange(width - at)
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos}


def masked_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose target token has loss_mask = 1."""
    target_mask = loss_mask[:, 1:].float()
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * target_mask).sum() / target_mask.sum().clamp(min=1)


def train_sft(model_dir: str, examples: list, cfg: SFTConfig, out_dir: str, on_step=None) -> list[dict]:
    """Train and save to `out_dir` atomically; `on_step(record)` sees every optimiser step; returns the step records."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if cfg.lora:
        model = with_lora(model, cfg.lora_r, cfg.lora_alpha)
    acc = make_accelerator(cfg.deepspeed_config, cfg.grad_accum)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(examples) / (cfg.batch_size * cfg.grad_accum))
    total = max(1, steps_per_epoch * cfg.epochs)
    warmup = max(1, int(cfg.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup))))
    model, opt, sched = acc.prepare(model, opt, sched)
    model.train()
    rng = random.Random(cfg.seed)
    pad = tok.pad_token_id or 0
    records, step, t0 = [], 0, time.perf_counter()
    for epoch in range(cfg.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        batches = [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
        for k, idx in enumerate(batches):
            chosen = [examples[i] for i in idx]
            batch = collate_packed(chosen, pad, cfg.max_length) if cfg.packing else collate(chosen, pad)
            batch = {n: t.to(acc.device) for n, t in batch.items()}
            with acc.accumulate(model):
                logits = model(**{n: t for n, t in batch.items() if n != "loss_mask"}, use_cache=False).logits
                loss = masked_loss(logits, batch["input_ids"], batch["loss_mask"])
                acc.backward(loss)
                if acc.sync_gradients:  # clip the accumulated gradient, not each micro-batch's part of it
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                step += 1
                rec = {"step": step, "epoch": epoch + (k + 1) / len(batches), "loss": loss.item(), "lr": sched.get_last_lr()[0],
                       "tokens": int(batch["loss_mask"].sum()),
                       "row_tokens": batch["input_ids"].numel(), "elapsed_s": time.perf_counter() - t0}
                records.append(rec)
                eta = rec["elapsed_s"] / step * (total - step)
                print(f"sft step {step}/{total} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                      f"{rec['elapsed_s'] / step:.1f}s/step eta {eta / 60:.1f} min", flush=True)
                if on_step:
                    on_step(rec)
    save_model(acc.unwrap_model(model), tok, out_dir, cfg.lora)
    return records


def with_lora(model, r: int, alpha: int):
    """`model` with LoRA adapters on the attention projections; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, task_type="CAUSAL_LM", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def save_model(model, tok, out_dir: str, lora: bool, extra: dict | None = None) -> None:
    """Save a trained student atomically as a plain model vLLM and transformers both load (LoRA merged), plus `extra`
    json files (name -> content) inside it."""
    from ..data.schemas import write_json

    if lora:
        model = model.merge_and_unload()
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for name, content in (extra or {}).items():
            write_json(content, tmp / name)
