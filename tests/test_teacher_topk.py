"""Logit distillation (issue 27 point 4): the teacher's top-k on the assistant tokens, stored compactly by generate
(unison/teacher_topk.py), and sft.kd_weight's divergence term, checked against numbers computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from unison.data.schemas import DataError, read_table, write_table
from unison.teacher_topk import TEACHER_TOPK, capture_topk, topk_arrays, topk_for
from unison.token_view import token_view, tokenizer_fingerprint
from unison.train.sft import SFTConfig, build_examples, distill_loss, train_sft


def rows_for(tok, n: int = 3) -> list[dict]:
    """Trajectories with a tool observation between two assistant turns, the student rendering's ids as generated."""
    out = []
    for i in range(n):
        turns = [("assistant", f"<search>Zorvan Kelt {i}</search>"), ("tool", "<result>Tarsk is a city.</result>"),
                 ("assistant", f"<answer>Tarsk {i}</answer>")]
        student = [{"role": "system", "content": "You answer.", "token_ids": []}, {"role": "user", "content": f"Where is {i}?", "token_ids": []}]
        student += [{"role": role, "content": text, "token_ids": tok(text, add_special_tokens=False)["input_ids"]} for role, text in turns]
        out.append({"id": f"q{i}/single/0", "question_id": f"q{i}", "sample": 0, "correct": True, "student": student,
                    "tokenizer": tokenizer_fingerprint(tok)})
    return out


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory):
    """Another random model of the student's shape and tokenizer: a teacher whose distribution differs from the student's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unison.llm.hf_backend import HFBackend

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    path = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return HFBackend(str(path), dtype="float32")


def test_capture_keeps_the_teachers_top_k_at_every_assistant_token_and_nowhere_else(teacher, tmp_path):
    tok, rows, k = teacher.tokenizer, rows_for(teacher.tokenizer), 4
    stored, figures = capture_topk(teacher, rows, k, progress=lambda _: None)
    path = tmp_path / "topk.parquet"
    write_table(stored, path, TEACHER_TOPK)
    back = read_table(path, TEACHER_TOPK)
    assert figures["topk_tokens"] == sum(r["tokens"] for r in back) and [r["id"] for r in back] == [r["id"] for r in rows]
    for row, s in zip(rows, back):
        ids, mask = token_view(tok, row["student"])
        assert s["tokens"] == sum(mask) and len(s["top_ids"]) == 4 * k * s["tokens"] and len(s["top_logprobs"]) == 2 * k * s["tokens"]
        with torch.no_grad():  # the teacher's own forward pass: position t-1 predicts token t
            logp = torch.log_softmax(teacher.model(torch.tensor([ids])).logits[0].float(), -1)
        top_ids, top_logps = topk_arrays(s)
        targets = [t for t, m in enumerate(mask) if m]
        for j, t in enumerate(targets):
            values, indices = logp[t - 1].topk(k)
            assert top_ids[j].tolist() == indices.tolist(), (row["id"], t)
            assert top_logps[j] == pytest.approx(values.numpy(), abs=2e-3)  # float16 on disk: ~3 significant digits
    with pytest.raises(DataError, match=r"topk.parquet, field 'id': no teacher top-k for trajectory q9/single/0"):
        topk_for(tok, [{**rows[0], "id": "q9/single/0"}], back, path=str(path))
    with pytest.raises(DataError, match="scored under another tokenizer than the student's"):
        topk_for(tok, rows, [{**r, "tokenizer": "0" * 16} for r in back], path=str(path))
    arrays = topk_for(tok, rows, back)
    with pytest.raises(ValueError, match=r"trajectory q0/single/0: \d+ tokens have the teacher's top-k, \d+ are assistant tokens"):
        build_examples(tok, rows, 128, [(a[:-1], b[:-1]) for a, b in arrays])


def test_divergences_equal_the_hand_computed_ones_and_vanish_when_student_equals_teacher():
    # one position, vocabulary of 4; teacher's top-2 are tokens 2 and 0 with log-probs log 0.6, log 0.2
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]))
    top_ids, top_logps, mask = torch.tensor([[[2, 0]]]), torch.log(torch.tensor([[[0.6, 0.2]]])), torch.tensor([[1]])
    p = [0.75, 0.25]  # the teacher renormalised over its top-2
    q = [0.75, 0.25]  # the student's 0.3 and 0.1, renormalised: equal on that support
    assert distill_loss(logits, top_ids, top_logps, mask, "forward_kl").item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.2, 0.5]]]))
    q = [0.2 / 0.3, 0.1 / 0.3]
    kl = sum(a * math.log(a / b) for a, b in zip(p, q))
    m = [(a + b) / 2 for a, b in zip(p, q)]
    jsd = 0.5 * sum(a * math.log(a / c) for a, c in zip(p, m)) + 0.5 * sum(b * math.log(b / c) for b, c in zip(q, m))
    assert distill_loss(logits, top_ids, top_logps, mask, "forward_kl").item() == pytest.approx(kl, rel=1e-5)
    assert distill_loss(logits, top_ids, top_logps, mask, "jsd").item() == pytest.approx(jsd, rel=1e-5)
    assert distill_loss(logits, top_ids, top_logps, torch.tensor([[0]]), "forward_kl").item() == 0.0  # masked: nothing


@pytest.mark.parametrize("packing", [False, True])
def test_sft_records_cross_entropy_plus_the_weighted_divergence_computed_by_hand(teacher, tiny_model_dir, tmp_path, packing):
    from transformers import AutoModelForCausalLM

    tok, rows, k, weight = teacher.tokenizer, rows_for(teacher.tokenizer), 4, 0.5
    stored, _ = capture_topk(teacher, rows, k, progress=lambda _: None)
    examples, _ = build_examples(tok, rows, 128, topk_for(tok, rows, stored))
    cfg = SFTConfig(epochs=1, batch_size=len(rows), lr=1e-3, warmup_ratio=0.0, kd_weight=weight, packing=packing, max_length=512)
    first = train_sft(str(tiny_model_dir), examples, cfg, str(tmp_path / "out"))[0]  # step 1's loss: the untrained student's

    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    nll, kl, n = 0.0, 0.0, 0
    with torch.no_grad():
        for ids, mask, (top_ids, top_logps) in examples:
            logp = torch.log_softmax(student(torch.tensor([ids])).logits[0].float(), -1)
            for j, t in enumerate(t for t, m in enumerate(mask) if m):
                nll -= logp[t - 1, ids[t]].item()
                p = torch.softmax(torch.from_numpy(top_logps[j]), -1)
                q = torch.softmax(logp[t - 1, torch.from_numpy(top_ids[j])], -1)
                kl += (p * (p.log() - q.log())).sum().item()
                n += 1
    assert first["nll"] == pytest.approx(nll / n, rel=1e-4) and first["kd"] == pytest.approx(kl / n, rel=1e-4)
    assert first["loss"] == pytest.approx(nll / n + weight * kl / n, rel=1e-4) and kl / n > 0.01


def test_without_topk_generate_writes_an_empty_table_and_sft_refuses_it_by_name(tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "teacher_topk.parquet"
    with pytest.raises(DataError, match="no rows"):
        write_table([], path, TEACHER_TOPK)
    write_table([], path, TEACHER_TOPK, empty_ok=True)  # generate.topk 0: the DVC output exists, with its schema
    assert pq.read_table(path).num_rows == 0 and pq.read_schema(path).names == TEACHER_TOPK.names
    with pytest.raises(DataError, match=r"teacher_topk.parquet: no rows"):
        read_table(path, TEACHER_TOPK)
