"""Logit distillation (issue 27 point 4): the teacher's top-k on the assistant tokens, stored compactly by generate
(unison/teacher_topk.py), and sft.kd_weight's divergence term, checked against numbers computed by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unison.data.schemas import DataError, read_table, write_table
from unison.teacher_topk import TEACHER_TOPK, capture_topk, topk_arrays, topk_by_teacher, topk_for
from unison.token_view import token_view, tokenizer_fingerprint
from unison.tool_format import TagFormat
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


def test_with_several_teachers_each_trajectory_gets_the_top_k_of_the_teacher_that_made_it(teacher, tiny_model_dir):
    """generate.route or generate.cascade: each row scored by its own teacher (one engine at a time), a chat
    teacher's row kept as it generated, the table in the rows' order, each teacher's tokens counted."""
    from unison.llm.hf_backend import HFBackend

    other, k = HFBackend(str(tiny_model_dir), dtype="float32"), 4
    rows = rows_for(teacher.tokenizer, 5)
    for r, name in zip(rows, ["teacher", "calc", "teacher", "calc", "chat"]):
        r["teacher_name"] = name
    chat_row = {**capture_topk(other, rows[4:], k, progress=lambda _: None)[0][0]}
    asked = []
    table, figures = topk_by_teacher(lambda name: asked.append(name) or {"teacher": teacher, "calc": other}[name],
                                     rows, k, [chat_row], progress=lambda _: None)
    assert asked == ["teacher", "calc"]  # each engine once; the chat teacher's row is never re-scored
    assert [t["id"] for t in table] == [r["id"] for r in rows] and table[4] is chat_row
    own = {name: capture_topk(b, [r for r in rows if r["teacher_name"] == name], k, progress=lambda _: None)[0]
           for name, b in [("teacher", teacher), ("calc", other)]}
    assert [t["top_ids"] for t in table[:4]] == [own["teacher"][0]["top_ids"], own["calc"][0]["top_ids"],
                                                 own["teacher"][1]["top_ids"], own["calc"][1]["top_ids"]]
    assert table[0]["top_ids"] != table[1]["top_ids"]  # two models, two distributions on the same text
    assert {n: f["topk_tokens"] for n, f in figures["teachers"].items()} == {
        n: sum(t["tokens"] for t, r in zip(table, rows) if r["teacher_name"] == n) for n in ["teacher", "calc", "chat"]}
    assert figures["topk_tokens"] == sum(t["tokens"] for t in table) and figures["topk_covered"] == 1.0


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
        build_examples(TagFormat(tok), rows, 128, [(a[:-1], b[:-1]) for a, b in arrays])


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
    examples, _ = build_examples(TagFormat(tok), rows, 128, topk_for(tok, rows, stored))
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


# A chat API teacher's top log-probs (issue 25 point 5): token strings, carried over to the student's tokens by characters.
ANSWER_TOKENS = [("The", [("The", -0.1), ("A", -2.4)]), (" ans", [(" ans", -0.3), (" reply", -1.6)]), ("wer", [("wer", -0.01)]),
                 (" is", [(" is", -0.2), (" was", -1.8)]), (" Tar", [(" Tar", -0.2), (" Tarsk", -1.9), (" Paris", -2.5)]),
                 ("sk", [("sk", -0.05), ("ask", -3.0)])]  # how a teacher of another vocabulary might cut "The answer is Tarsk"


def fake_hosted_chat_api_with_logprobs(requests_seen: list):
    """A fake hosted chat API (the boundary we cannot reach from here), in OpenAI's documented shapes: a search call
    (tool_calls, which come with no log-probs) until a tool message is in the transcript, then the answer as plain
    content with `logprobs.content` [{token, logprob, bytes, top_logprobs}]."""
    def respond(req):
        body = req["json"]
        requests_seen.append(body)
        usage = {"prompt_tokens": 40, "completion_tokens": 6}
        if "tools" in body and not any(m["role"] == "tool" for m in body["messages"]):
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "Zorvan Kelt"}'}}]}
            return 200, {"model": "gpt-fake", "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls",
                                                           "logprobs": {"content": []}}], "usage": usage}, None
        content = [{"token": t, "logprob": alts[0][1], "bytes": list(t.encode()),
                    "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())} for a, lp in alts[:body.get("top_logprobs", 0)]]}
                   for t, alts in ANSWER_TOKENS]
        message = {"role": "assistant", "content": "".join(t for t, _ in ANSWER_TOKENS)}
        return 200, {"model": "gpt-fake", "choices": [{"index": 0, "message": message, "finish_reason": "stop",
                                                       "logprobs": {"content": content}}], "usage": usage}, None
    return respond


def expected_top(tok, text: str, content_at: int, k: int) -> list:
    """What each student token of `text` should get, worked out from the tokenizer's own offsets: where a student token
    begins at a teacher token's first character, that token's alternatives by their first student token, summed."""
    starts, at = {}, content_at
    for t, alts in ANSWER_TOKENS:
        starts[at] = alts[:k]
        at += len(t)
    out = []
    for start, _ in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]:
        if start not in starts:
            out.append(None)
            continue
        merged = {}
        for a, lp in starts[start]:
            first = tok(a, add_special_tokens=False)["input_ids"][0]
            merged[first] = math.log(math.exp(merged[first]) + math.exp(lp)) if first in merged else lp
        out.append(sorted(merged.items(), key=lambda kv: -kv[1]))
    return out


def test_a_chat_teachers_top_logprobs_land_on_the_student_tokens_where_both_tokenisations_break(tiny_model_dir):
    from transformers import AutoTokenizer

    from tests.local_http import LocalServer
    from unison.llm.base import Sampling
    from unison.llm.openai_backend import OpenAIBackend

    tok, seen = AutoTokenizer.from_pretrained(tiny_model_dir), []
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "Where?"}], tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    with LocalServer(fake_hosted_chat_api_with_logprobs(seen)) as api:
        backend = OpenAIBackend(f"{api.url}/v1", "gpt-fake", tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=30)
        [c] = backend.generate([prompt], [Sampling(max_tokens=16, stop=["</answer>"], top_logprobs=2)])
        [plain] = backend.generate([prompt], [Sampling(max_tokens=16, stop=["</answer>"])])
    assert seen[0]["logprobs"] is True and seen[0]["top_logprobs"] == 2 and "logprobs" not in seen[1]
    assert c.text == "<answer>The answer is Tarsk</answer>" and plain.top is None
    want = expected_top(tok, c.text, len("<answer>"), 2)
    assert c.top == [None if w is None else [(i, pytest.approx(lp)) for i, lp in w] for w in want]
    assert c.top[0] is None and c.top[-1] is None  # the protocol's own tags: no teacher distribution
    assert 3 <= sum(t is not None for t in c.top) < len(c.token_ids) and backend.stats["top_logprob_tokens"] == sum(t is not None for t in c.top)
    covered = [tok.decode([i]) for i, t in zip(c.token_ids, c.top) if t]
    assert "The" in covered and " is" in covered  # both vocabularies break there


def test_a_chat_teachers_top_k_is_kept_beside_the_shard_and_sft_distils_only_the_covered_tokens(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.local_http import LocalServer
    from unison.agents.generation import read_shard, write_shard
    from unison.agents.methods import MethodContext, run_method
    from unison.agents.runtime import EpisodeSettings
    from unison.agents.toolbox import Toolbox
    from unison.data.schemas import TRAJECTORY
    from unison.llm.openai_backend import OpenAIBackend

    class OnePassage:
        def search(self, queries):
            return [[{"title": "Zorvan Kelt", "text": "Zorvan Kelt was born in Tarsk."}] for _ in queries]

    tok, k, seen = AutoTokenizer.from_pretrained(tiny_model_dir), 3, []
    questions = [{"id": f"q{i}", "source": "builtin", "task": "qa", "question": f"Where was Zorvan Kelt {i} born?", "answers": ["Tarsk"],
                  "meta": "{}"} for i in range(2)]
    with LocalServer(fake_hosted_chat_api_with_logprobs(seen)) as api:
        backend = OpenAIBackend(f"{api.url}/v1", "gpt-fake", tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=30)
        ctx = MethodContext(backend, Toolbox(OnePassage()), EpisodeSettings(temperature=0.0, max_turns=3, top_logprobs=k), "gpt-fake@api")
        rows = run_method("single", questions, 1, ctx, 8)
    assert all(body["top_logprobs"] == k for body in seen)
    for r in rows:
        assert [m["content"] for m in r["student"] if m["role"] == "assistant"] == ["<search>Zorvan Kelt</search>",
                                                                                  "<answer>The answer is Tarsk</answer>"]
    path = tmp_path / "shard-00000.parquet"
    write_shard([dict(r) for r in rows], path)  # the trajectories, and beside them the top-k rows
    back = read_shard(path)
    assert (tmp_path / "shard-00000.topk.parquet").is_file() and all("teacher_topk" not in r for r in read_table(path, TRAJECTORY))
    assert [b["teacher_topk"] for b in back] == [r["teacher_topk"] for r in rows]
    table = [r["teacher_topk"] for r in rows]
    for r, t in zip(rows, table):
        ids, mask = token_view(tok, r["student"])
        top_ids, top_logps = topk_arrays(t)
        assert t["tokens"] == sum(mask) and t["k"] == k
        answer = [m for m in r["student"] if m["role"] == "assistant"][1]
        want = expected_top(tok, answer["content"], len("<answer>"), k)
        covered = [j for j in range(t["tokens"]) if math.isfinite(top_logps[j, 0])]
        search_tokens = t["tokens"] - len(answer["token_ids"])  # the call's tokens (and no log-probs for a tool call)
        assert covered == [search_tokens + j for j, w in enumerate(want) if w]
        for j, w in zip(covered, [w for w in want if w]):
            assert top_ids[j, :len(w)].tolist() == [i for i, _ in w] and top_logps[j, :len(w)] == pytest.approx([lp for _, lp in w], abs=2e-3)
            assert not np.isfinite(top_logps[j, len(w):]).any()  # the slots past its alternatives hold no token

    examples, _ = build_examples(TagFormat(tok), [{**r, "correct": True} for r in rows], 1024, topk_for(tok, rows, table))
    weight = 0.5
    cfg = SFTConfig(epochs=1, batch_size=len(rows), lr=1e-3, warmup_ratio=0.0, kd_weight=weight, max_length=512, precision="fp32")
    first = train_sft(str(tiny_model_dir), examples, cfg, str(tmp_path / "out"))[0]
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    nll, n, kl, m = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for ids, mask, (top_ids, top_logps) in examples:
            logp = torch.log_softmax(student(torch.tensor([ids])).logits[0].float(), -1)
            for j, t in enumerate(t for t, on in enumerate(mask) if on):
                nll -= logp[t - 1, ids[t]].item()
                n += 1
                live = torch.from_numpy(top_logps[j]).isfinite()
                if live[0]:  # a covered token: the divergence over the slots that hold a token
                    p = torch.softmax(torch.from_numpy(top_logps[j])[live], -1)
                    q = torch.softmax(logp[t - 1, torch.from_numpy(top_ids[j])[live]], -1)
                    kl += (p * (p.log() - q.log())).sum().item()
                    m += 1
    assert 0 < m < n and first["nll"] == pytest.approx(nll / n, rel=1e-4) and first["kd"] == pytest.approx(kl / m, rel=1e-4)
    assert first["loss"] == pytest.approx(nll / n + weight * kl / m, rel=1e-4)


def test_generate_topk_with_a_chat_teacher_is_checked_when_params_load():
    import yaml

    from unison.agents.generation import shard_dir
    from unison.config import ROOT, ParamsError, validate_params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["teacher"].update(backend="openai", api="chat", base_url="http://127.0.0.1:9/v1")
    raw["generate"]["topk"], raw["sft"]["kd_weight"] = 8, 0.5
    assert validate_params(raw).teacher_engine().chat  # its top_logprobs come with what it generates
    raw["generate"]["topk"] = 21
    with pytest.raises(ParamsError, match="generate.topk 21: a chat API teacher returns at most 20 top log-probs a token"):
        validate_params(raw)
    raw["generate"] |= {"topk": 8, "source": "local:imports/sft.jsonl"}
    with pytest.raises(ParamsError, match=r"generate.topk with imported trajectories \(generate.source\) needs a teacher that scores"):
        validate_params(raw)
    raw["generate"]["source"] = ""
    chat = [shard_dir(validate_params({**raw, "generate": {**raw["generate"], "topk": k}}).system_settings(), []) for k in (4, 8)]
    raw["teacher"] = {"model": raw["teacher"]["model"], "backend": "transformers"}
    local = [shard_dir(validate_params({**raw, "generate": {**raw["generate"], "topk": k}}).system_settings(), []) for k in (4, 8)]
    assert chat[0] != chat[1] and local[0] == local[1]  # a chat teacher's k is generated with it; a local one re-scores
