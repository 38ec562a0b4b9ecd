"""SFT: distil correct teacher trajectories into the student, loss only where loss_mask = 1 (DESIGN §7).

The batches and the loss; the loop (accelerate, so a DeepSpeed config works on GPUs; bf16 where supported) is loop.py.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..config import SFTConfig
from ..data.schemas import atomic_dir
from ..token_view import retokenization_drift
from .loop import Trainer, epoch_batches, fit, resolve_precision


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


def build_examples(format, rows: list[dict], max_length: int, topk: list | None = None) -> tuple[list[tuple], dict]:
    """Token views (ids, mask) of the selected rows in the student's `format` (tool_format.py: its `view`; too long
    ones truncated) and drift statistics; with `topk` (the teacher's top-k ids and log-probs of each row's assistant
    tokens, `teacher_topk.topk_for`) each example carries them as a third item, one row per mask-1 token."""
    if topk is not None and not format.tag_tokens:
        raise ValueError("sft.kd_weight > 0 with student.tool_format native: the teacher's top-k are kept on the tag "
                         "protocol's tokens, not the native template's; set sft.kd_weight: 0 or "
                         "student.tool_format: tags")
    examples, drifted, drift_tokens, truncated, n_tokens = [], 0, 0, 0, 0
    for k, r in enumerate(rows):
        ids, mask = format.view(r)
        if topk is not None and len(topk[k][0]) != sum(mask):
            raise ValueError(f"trajectory {r['id']}: {len(topk[k][0])} tokens have the teacher's top-k, {sum(mask)} "
                             "are assistant tokens")
        d = retokenization_drift(format.tok, ids)
        drifted += d > 0
        drift_tokens += d
        n_tokens += len(ids)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if topk is None:
            examples.append((ids, mask))
        else:
            top_ids, top_logps = topk[k]
            examples.append((ids, mask, (top_ids[: sum(mask)], top_logps[: sum(mask)])))
    if examples and not any(sum(ex[1]) for ex in examples):
        raise ValueError(f"sft.max_length {max_length} cuts every example before its first trained token (the prompts, "
                         "tool schemas included, are longer): raise sft.max_length")
    stats = {"examples": len(examples), "drifted_examples": drifted, "drift_tokens": drift_tokens,
             "drift_token_rate": drift_tokens / max(1, n_tokens), "truncated_examples": truncated,
             "train_tokens": sum(sum(ex[1]) for ex in examples)}
    return examples, stats


def collate(batch: list[tuple], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ex[0]) for ex in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for r, (i, m, *_) in enumerate(batch):
        ids[r, : len(i)] = torch.tensor(i)
        mask[r, : len(m)] = torch.tensor(m)
        attn[r, : len(i)] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn,
            **teacher_targets(batch, [[0]] * len(batch), width)}


def teacher_targets(batch: list[tuple], starts: list[list[int]], width: int) -> dict[str, torch.Tensor]:
    """Examples' teacher top-k (their third item) placed at their assistant tokens: kd_ids and kd_logps [rows, width, k]
    (zeros elsewhere; the loss mask says where they count); {} when the examples carry none. `starts[r]`: where each
    example of row r begins (packed rows hold several)."""
    if len(batch[0]) < 3:
        return {}
    k = batch[0][2][0].shape[1]
    kd_ids = torch.zeros((len(starts), width, k), dtype=torch.long)
    kd_logps = torch.zeros((len(starts), width, k), dtype=torch.float32)
    examples = iter(batch)
    for r, row_starts in enumerate(starts):
        for at in row_starts:
            _, m, (top_ids, top_logps) = next(examples)
            where = at + torch.tensor(m).nonzero().squeeze(-1)
            kd_ids[r, where], kd_logps[r, where] = torch.from_numpy(top_ids), torch.from_numpy(top_logps)
    return {"kd_ids": kd_ids, "kd_logps": kd_logps}


def pack(batch: list[tuple], max_length: int) -> list[list[tuple]]:
    """The examples in as few rows of at most max_length tokens as they fit in, balanced: longest first, each into the
    row with the fewest tokens (another row when it would not fit there; an example longer than max_length has a row
    of its own). Rows are padded to the longest, so uneven rows would bring back the padding packing removes: four
    examples of ~260 tokens packed in order into rows of 768 gave rows of three and one, more tokens than unpacked."""
    n_rows = max(1, math.ceil(sum(len(ex[0]) for ex in batch) / max_length))
    while True:
        rows, used = [[] for _ in range(n_rows)], [0] * n_rows
        for ex in sorted(batch, key=lambda ex: -len(ex[0])):
            r = min(range(n_rows), key=used.__getitem__)
            if used[r] and used[r] + len(ex[0]) > max_length:
                break
            rows[r].append(ex)
            used[r] += len(ex[0])
        else:
            return [row for row in rows if row]
        n_rows += 1


def collate_packed(batch: list[tuple], pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """Packed rows with position_ids restarting at 0 per example (trailing pads too) and no attention_mask.

    The model attends within each example alone (packed_attention; flash-attention reads the restarts as varlen), so
    no token attends across examples. The loss mask is the examples' own, except each example's first token, which is
    never a target unpacked and must not become one for the previous example's last token.
    """
    rows = pack(batch, max_length)
    width = max(sum(len(ex[0]) for ex in row) for row in rows)
    batch = [ex for row in rows for ex in row]  # in row order, as teacher_targets places them
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    starts = []
    for r, row in enumerate(rows):
        at, starts_r = 0, []
        for i, m, *_ in row:
            ids[r, at : at + len(i)] = torch.tensor(i)
            mask[r, at + 1 : at + len(m)] = torch.tensor(m[1:])
            pos[r, at : at + len(i)] = torch.arange(len(i))
            starts_r.append(at)
            at += len(i)
        pos[r, at:] = torch.arange(width - at)
        starts.append(starts_r)
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos, **teacher_targets(batch, starts, width)}


PACKED_ATTENTION = "unison_packed"


def packed_attention(module, query, key, value, attention_mask, *, position_ids=None, **kwargs):
    """Causal attention within each example of a packed row (a stretch whose position_ids start at 0): sdpa per
    example, as unpacked. Transformers' own packing builds a block-diagonal mask over the whole row instead, which makes
    CPU attention compute every block between examples and take its slow masked path: packing was slower per real
    token than padding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if position_ids is None:
        raise ValueError(f"sft.packing: {type(module).__name__} does not pass position_ids to its attention, so the "
                         "examples of a packed row cannot be told apart; set sft.packing: false")
    rows = []
    for r in range(query.shape[0]):
        positions = position_ids[r if len(position_ids) > 1 else 0]  # one row of positions: every row's
        starts = [*(positions == 0).nonzero().squeeze(-1).tolist(), query.shape[2]]
        rows.append(torch.cat([sdpa_attention_forward(module, query[r : r + 1, :, a:b], key[r : r + 1, :, a:b],
                                                      value[r : r + 1, :, a:b], None, is_causal=True, **kwargs)[0]
                               for a, b in itertools.pairwise(starts)], dim=1))
    return torch.cat(rows), None


def use_packed_attention(model) -> None:
    """Run `model`'s attention as packed_attention (registered with transformers once; a model whose attention is not
    transformers' own keeps it). Transformers builds no mask for an attention it has no mask function for."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    model.set_attn_implementation(PACKED_ATTENTION)


def target_logits(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, target ids, target mask), aligned, at only the positions whose next token is a target in some row.

    The LM head runs nowhere else (logits_to_keep): on the demo 2% of tokens are targets, and the head is a fifth of a
    135M model's compute plus a [batch, length, vocab] fp32 tensor and its log-softmax.
    """
    targets = target_positions(batch)
    logits = logits_at(model, {n: t for n, t in batch.items() if n in MODEL_INPUTS}, targets - 1)
    return logits, batch["input_ids"][:, targets], batch["loss_mask"][:, targets]


MIN_SHARED_PREFIX = 16  # tokens; rows sharing fewer first tokens run in full


def logits_at(model, inputs: dict[str, torch.Tensor], positions: torch.Tensor):
    """The model's logits at `positions` of right-padded rows (`inputs`: input_ids, attention_mask). The first tokens
    every row has in common before the first of `positions` (the system prompt with the tools' schemas, a GRPO group's
    whole prompt) run once, with their gradient, and each row attends to them as to its own: the same logits and
    gradients up to float rounding, for a fraction of the compute. Packed rows (position_ids), a single row, fewer than
    MIN_SHARED_PREFIX shared tokens and gradient checkpointing (which keeps no cache) run every row in full."""
    ids = inputs["input_ids"]
    shared = shared_prefix_length(ids, inputs.get("attention_mask"), int(positions.min()) if len(positions) else 0)
    if ("position_ids" in inputs or len(ids) < 2 or shared < MIN_SHARED_PREFIX
            or getattr(getattr(model, "module", model), "is_gradient_checkpointing", False)):
        return model(**inputs, use_cache=False, logits_to_keep=positions).logits
    from transformers import DynamicCache

    cache = DynamicCache(config=getattr(model, "config", None))
    model(input_ids=ids[:1, :shared], past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(len(ids))  # backward sums the rows' gradients into the one prefix pass
    return model(input_ids=ids[:, shared:], attention_mask=inputs["attention_mask"], past_key_values=cache,
                 use_cache=True, logits_to_keep=positions - shared).logits


def shared_prefix_length(ids: torch.Tensor, attention_mask: torch.Tensor | None, limit: int) -> int:
    """How many first tokens all rows of `ids` have in common (real tokens in every row), at most `limit`."""
    same = (ids == ids[:1]).all(0)
    if attention_mask is not None:
        same &= attention_mask.bool().all(0)
    differ = (~same).nonzero()
    return min(int(differ[0]) if len(differ) else ids.shape[1], limit)


def target_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The positions that are a target in some row (their logits come from the position before)."""
    return batch["loss_mask"][:, 1:].any(0).nonzero().squeeze(-1) + 1


MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def target_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits[b, p] against targets[b, p] over the positions where mask = 1."""
    mask = mask.float()
    logp = torch.log_softmax(logits.float(), -1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (nll * mask).sum() / mask.sum().clamp(min=1)


def distill_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_logps: torch.Tensor, mask: torch.Tensor,
                 kind: str) -> torch.Tensor:
    """Mean over mask-1 positions of the divergence between the teacher's top-k distribution and the student's on the
    same k tokens, both renormalised over them: forward KL(teacher || student), or the Jensen-Shannon divergence. Slots
    of log-prob -inf hold no token (a chat teacher's, teacher_topk.MISSING): they weigh nothing on either side, and a
    position without any is left out (kept finite, so that no NaN reaches the gradient)."""
    slots = torch.isfinite(top_logps)
    mask = mask.float() * slots[..., 0]
    empty = torch.finfo(torch.float32).min / 4  # exp() = 0, and differences of two stay finite
    student = torch.log_softmax(torch.log_softmax(logits.float(), -1).gather(-1, top_ids).masked_fill(~slots, empty),
                                -1)
    teacher = torch.log_softmax(top_logps.float().masked_fill(~slots, empty), -1)
    p = teacher.exp()
    if kind == "forward_kl":
        per_token = (p * (teacher - student)).sum(-1)
    else:
        q = student.exp()
        m = torch.logaddexp(teacher, student) - math.log(2)
        per_token = 0.5 * (p * (teacher - m)).sum(-1) + 0.5 * (q * (student - m)).sum(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def sft_steps(examples: list, cfg: SFTConfig, pad_id: int) -> list[list[tuple[dict, int]]]:
    """Every epoch's optimiser steps in order: shuffled (one seeded stream over all epochs), batch_size examples a
    micro-batch (collated, with its count of real tokens), grad_accum micro-batches a step."""
    steps = []
    for batches in epoch_batches(len(examples), cfg.batch_size, cfg.epochs, cfg.seed):
        micros = []
        for indices in batches:
            chosen = [examples[k] for k in indices]
            batch = collate_packed(chosen, pad_id, cfg.max_length) if cfg.packing else collate(chosen, pad_id)
            micros.append((batch, sum(len(ex[0]) for ex in chosen)))
        steps += [micros[i : i + cfg.grad_accum] for i in range(0, len(micros), cfg.grad_accum)]
    return steps


def train_sft(model_dir: str, examples: list, cfg: SFTConfig, out_dir: str, on_step=None,
              checkpoint_dir: str | None = None, gradient_checkpointing: bool = False) -> list[dict]:
    """Train and save to `out_dir` atomically (rank 0); `on_step(record)` sees every optimiser step; returns the step
    records. A killed run resumes from `checkpoint_dir` (written every cfg.checkpoint_every steps) when one is given."""
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_student(model_dir, cfg.lora, cfg.lora_r, cfg.lora_alpha, cfg.precision, "sft")
    if cfg.packing:
        use_packed_attention(model)
    steps = sft_steps(examples, cfg, tok.pad_token_id or 0)
    total = max(1, len(steps))
    trainer = Trainer("sft", model, total, cfg, grad_accum=cfg.grad_accum,
                      gradient_checkpointing=gradient_checkpointing, on_step=on_step)

    def loss_fn(micro):
        batch = {n: t.to(trainer.device) for n, t in micro[0].items()}
        logits, targets, mask = target_logits(trainer.model, batch)
        nll = target_nll(logits, targets, mask)
        if "kd_ids" not in batch or not cfg.kd_weight:
            return nll, {}
        targets = target_positions(batch)  # those target_logits kept
        kd = distill_loss(logits, batch["kd_ids"][:, targets], batch["kd_logps"][:, targets], mask, cfg.kd_loss)
        return nll + cfg.kd_weight * kd, {"nll": nll.item(), "kd": kd.item()}

    def record(micros, _):
        return {"tokens": sum(int(b["loss_mask"].sum()) for b, _ in micros),
                "row_tokens": sum(b["input_ids"].numel() for b, _ in micros), "real_tokens": sum(n for _, n in micros)}

    records = fit(trainer, steps, loss_fn, max(1, total // cfg.epochs), record=record, checkpoint_dir=checkpoint_dir)
    with trainer.whole_model() as trained:
        if trainer.is_main:
            save_model(trained, tok, out_dir, cfg.lora)
    return records


def load_student(model_dir: str, lora: bool, lora_r: int, lora_alpha: int, precision: str, stage: str):
    """The causal LM to train, fp32; with LoRA, adapters (fp32) on a frozen base held in the training precision: in bf16
    where training runs in bf16, since frozen weights need no fp32 master copy (a 7B base: 14 GB instead of 28)."""
    from transformers import AutoModelForCausalLM

    frozen_bf16 = lora and resolve_precision(precision, f"{stage}.precision") == "bf16"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if frozen_bf16 else torch.float32)
    return with_lora(model, lora_r, lora_alpha) if lora else model


def with_lora(model, r: int, alpha: int):
    """`model` with LoRA adapters on the attention projections; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


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
