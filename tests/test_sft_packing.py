"""SFT packing and the shared prefix: rows of several examples, or a micro-batch's common first tokens run once, give the
padded token-mean loss and gradients; attention never crosses examples."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from unison.train import sft
from unison.train.sft import (
    SFTConfig,
    collate,
    collate_packed,
    distill_loss,
    logits_at,
    pack,
    shared_prefix_length,
    target_logits,
    target_nll,
    target_positions,
    train_sft,
    use_packed_attention,
)


def examples(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Token views of varied lengths: a masked prompt, then generated and masked (observation) spans."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(3, 12)
        spans = [(rng.randint(2, 10), rng.random() < 0.6) for _ in range(rng.randint(1, 4))]
        ids = [rng.randrange(vocab) for _ in range(prompt + sum(k for k, _ in spans))]
        mask = [0] * prompt + [int(gen) for k, gen in spans for _ in range(k)]
        out.append((ids, mask))
    return out


def test_pack_fills_as_few_rows_as_fit_and_balances_them():
    batch = [([1] * 5, [0] * 5), ([2] * 4, [0] * 4), ([3] * 3, [0] * 3), ([4] * 10, [0] * 10)]
    assert [[len(i) for i, _ in row] for row in pack(batch, 10)] == [[10], [5], [4, 3]]  # 22 tokens: 3 rows of 10
    assert [[len(i) for i, _ in row] for row in pack(batch[:3], 12)] == [[5, 4, 3]]
    # in order they would be [6, 5] and [4, 3], both padded to 11: even rows keep the padding down
    assert [[len(i) for i, _ in row] for row in pack([(x, x) for x in ([0] * 6, [0] * 5, [0] * 4, [0] * 3)], 12)] == [[6, 3], [5, 4]]
    packed = collate_packed(batch[:3], pad_id=0, max_length=10)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 1, 2]]  # pads restart too
    assert packed["input_ids"].tolist() == [[1] * 5 + [0, 0], [2] * 4 + [3] * 3]
    assert "attention_mask" not in packed


def test_packed_loss_and_gradients_equal_unpacked(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = examples(7, model.config.vocab_size)

    def loss_and_grads(inputs):
        model.zero_grad()
        loss = target_nll(*target_logits(model, inputs))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain = collate(batch, pad_id=0)
    packed = collate_packed(batch, pad_id=0, max_length=64)
    assert packed["input_ids"].shape[0] < plain["input_ids"].shape[0]  # several examples share a row
    assert packed["loss_mask"].sum() == plain["loss_mask"][:, 1:].sum()  # the same targets, nothing extra
    loss_a, grads_a = loss_and_grads(plain)
    loss_b, grads_b = loss_and_grads(packed)  # transformers' own packing: a block-diagonal mask over the row
    use_packed_attention(model)  # attention example by example, as train_sft runs a packed model
    loss_c, grads_c = loss_and_grads(packed)
    for loss, grads in ((loss_b, grads_b), (loss_c, grads_c)):
        assert torch.allclose(loss_a, loss, atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads_a, grads))
    # the restarts are what makes them equal: the same row with one position sequence leaks across examples
    leak = {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"])}
    with torch.no_grad():
        logits = model(**{k: v for k, v in leak.items() if k != "loss_mask"}, use_cache=False).logits
    assert not torch.allclose(target_nll(logits[:, :-1], leak["input_ids"][:, 1:], leak["loss_mask"][:, 1:]), loss_a, atol=1e-4)
    # the LM head only where targets are gives the loss of the full logits
    with torch.no_grad():
        full = model(**{k: v for k, v in plain.items() if k != "loss_mask"}, use_cache=False).logits
    assert torch.allclose(target_nll(full[:, :-1], plain["input_ids"][:, 1:], plain["loss_mask"][:, 1:]), loss_a, atol=1e-6)


def test_train_sft_packed_takes_the_same_steps(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    batch = examples(6, AutoConfig.from_pretrained(tiny_model_dir).vocab_size, seed=1)
    losses, rows = {}, {}
    for packing in (False, True):
        cfg = SFTConfig(epochs=2, lr=1e-3, batch_size=3, max_length=64, warmup_ratio=0.0, packing=packing)
        recs = train_sft(str(tiny_model_dir), batch, cfg, str(tmp_path / f"sft-{packing}"))
        losses[packing], rows[packing] = [r["loss"] for r in recs], sum(r["row_tokens"] for r in recs)
        saved = json.loads((tmp_path / f"sft-{packing}" / "config.json").read_text())
        assert saved.get("_attn_implementation", "sdpa") != "unison_packed"  # vLLM and transformers load it as ever
    # the same steps up to float32 reduction order (packed rows attend in other shapes): 2e-5 of the loss was seen on one
    # CI machine; a wrong mask or position would move it by far more than 1e-4 of it
    assert losses[True] == pytest.approx(losses[False], rel=1e-4) and losses[True][-1] < losses[True][0]
    assert rows[True] < rows[False]  # fewer pad tokens run through the model


def with_prefix(batch: list[tuple], prefix: list[int]) -> list[tuple]:
    return [(prefix + ids, [0] * len(prefix) + mask) for ids, mask in batch]


def test_the_shared_prefix_is_the_rows_common_real_tokens_up_to_the_first_logit_needed():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 0, 0]])
    mask = torch.tensor([[1] * 6, [1] * 6, [1, 1, 1, 1, 0, 0]])
    assert shared_prefix_length(ids, mask, limit=10) == 4  # the third row's pads are not shared tokens
    assert shared_prefix_length(ids[:2], mask[:2], limit=10) == 5
    assert shared_prefix_length(ids[:2], mask[:2], limit=2) == 2  # a logit needed at position 2: the rows run from it
    assert shared_prefix_length(ids[:1], mask[:1], limit=10) == 6


def test_shared_prefix_loss_and_gradients_equal_every_row_in_full(tiny_model_dir, monkeypatch):
    """The common first tokens run once and each row attends to them: the same loss, gradients and teacher terms as
    every row in full."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    batch = with_prefix(examples(5, vocab, seed=2), [random.Random(3).randrange(vocab) for _ in range(24)])
    rng = np.random.default_rng(0)
    batch = [(ids, mask, (rng.integers(0, vocab, (sum(mask), 4)),
                          np.log(rng.dirichlet([1.0] * 4, sum(mask))).astype(np.float32))) for ids, mask in batch]
    inputs = collate(batch, pad_id=0)
    calls = []
    model.register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs["input_ids"].shape), with_kwargs=True)

    def loss_and_grads(share: bool):
        monkeypatch.setattr(sft, "MIN_SHARED_PREFIX", 16 if share else 10**9)  # 10**9: every row in full
        model.zero_grad()
        kept = target_positions(inputs)
        logits = logits_at(model, {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
                           kept - 1)
        targets, mask = inputs["input_ids"][:, kept], inputs["loss_mask"][:, kept]
        kd = distill_loss(logits, inputs["kd_ids"][:, kept], inputs["kd_logps"][:, kept], mask, "forward_kl")
        loss = target_nll(logits, targets, mask) + kd
        loss.backward()
        return loss.detach(), kd.detach(), [p.grad.clone() for p in model.parameters()]

    loss_a, kd_a, grads_a = loss_and_grads(share=False)
    calls.clear()
    loss_b, _, grads_b = loss_and_grads(share=True)
    width = inputs["input_ids"].shape[1]
    assert calls == [torch.Size([1, 24]), torch.Size([5, width - 24])]  # the prefix once, then each row's rest
    assert torch.allclose(loss_a, loss_b, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads_a, grads_b))
    # the loop's own path (target_logits: sft and dpo) shares it too
    calls.clear()
    with torch.no_grad():
        nll = target_nll(*target_logits(model, {k: inputs[k] for k in ("input_ids", "attention_mask", "loss_mask")}))
    assert calls[0] == torch.Size([1, 24]) and torch.allclose(nll, loss_a - kd_a, atol=1e-5)


def test_train_sft_takes_the_same_steps_with_the_prefix_shared_or_every_row_in_full(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoConfig

    batch = with_prefix(examples(6, AutoConfig.from_pretrained(tiny_model_dir).vocab_size, seed=4), list(range(7, 47)))
    losses = {}
    for share in (False, True):
        monkeypatch.setattr(sft, "MIN_SHARED_PREFIX", 16 if share else 10**9)
        cfg = SFTConfig(epochs=2, lr=1e-3, batch_size=3, max_length=128, warmup_ratio=0.0)
        recs = train_sft(str(tiny_model_dir), batch, cfg, str(tmp_path / f"sft-{share}"))
        losses[share] = [r["loss"] for r in recs]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4) and losses[True][-1] < losses[True][0]
