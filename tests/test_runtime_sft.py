"""The agent runtime, the student token view and the SFT loss: real models (tiny random, and SmolLM2 on the HF backend)."""
from __future__ import annotations

import pytest
import torch

from unison.agents.episodes import continuation_ids, start_episode, student_messages
from unison.agents.methods import MethodContext, get_method
from unison.agents.methods.common import majority
from unison.agents.runtime import EpisodeSettings, run_episodes, timed_call
from unison.agents.toolbox import Toolbox
from unison.config import DebateConfig
from unison.llm.hf_backend import HFBackend
from unison.protocol import parse_tool_call, split_queries
from unison.token_view import retokenization_drift, token_view
from unison.tool_format import TagFormat
from unison.tools.registry import BUILTIN
from unison.train.sft import SFTConfig, build_examples, select_trajectories, target_nll, train_sft


class CorpusRetriever:
    """A real (lexical) retriever over a few passages: the runtime only needs `search(queries)`."""

    passages = [{"title": "Zorvan Kelt", "text": "Zorvan Kelt is a chemist born in 1961 in Tarsk."},
                {"title": "Tarsk", "text": "Tarsk is a city in Velmora."}]

    def search(self, queries):
        return [[p for p in self.passages if any(w.lower() in (p["title"] + p["text"]).lower() for w in q.split())][:1] for q in queries]


@pytest.fixture(scope="module")
def smol(base_model_dir):
    return HFBackend(str(base_model_dir), dtype="float32")


def test_parse_tool_call_and_parallel_queries():
    assert parse_tool_call("<think>x</think><search>a | b </search>", tuple(BUILTIN)) == ("search", "a | b")
    assert parse_tool_call("<python>\nprint(1+1)</python>\n", tuple(BUILTIN)) == ("python", "print(1+1)")
    assert parse_tool_call("no call</search>", tuple(BUILTIN)) is None
    assert split_queries("a | b ||  c") == ["a", "b", "c"]


def test_majority_vote_normalises_and_breaks_ties_by_first_agent():
    assert majority(["The Tarsk", "tarsk", "Velmora"]) == "The Tarsk"
    assert majority(["x", "y"]) == "x"
    assert majority([None, None]) is None


@pytest.mark.slow
def test_scaffolded_episodes_are_token_in_token_out(smol):
    tok = smol.tokenizer
    eps = [start_episode(TagFormat(tok), f"q{i}", "In which city was Zorvan Kelt born?", seed=i, scaffold=["search", "answer"]) for i in range(3)]
    run_episodes(eps, smol, Toolbox(CorpusRetriever()), EpisodeSettings(temperature=0.0, max_tokens_per_turn=24, max_turns=4))
    for e in eps:
        assert e.finish_reason in ("answer", "length", "max_turns")
        assert e.segments[0].text.startswith("<search>") and e.segments[0].n_prefill > 0
        assert e.n_tool_calls == 1 and e.segments[1].kind == "obs" and "Tarsk" in e.segments[1].text
        ids, mask = token_view(tok, student_messages("In which city was Zorvan Kelt born?", e.segments))
        assert ids == e.ids  # the token view is exactly what was generated and appended
        prompt_len = len(e.prompt_ids)
        assert mask[:prompt_len] == [0] * prompt_len
        pos = prompt_len
        for s in e.segments:
            assert mask[pos : pos + len(s.ids)] == [int(s.kind == "gen")] * len(s.ids)
            pos += len(s.ids)


def test_tool_failures_become_observations():
    box = Toolbox(retriever=None)
    box.handlers["python"] = lambda code: (_ for _ in ()).throw(RuntimeError("sandbox down"))  # a tool that crashes
    text, err, _ = timed_call(box, "python", "print(1)")
    assert text == "error: RuntimeError: sandbox down" and err == "exception"
    assert box.call("search", "x") == ("error: search is not available", "unavailable")
    assert box.call("shell", "ls")[1] == "unknown_tool"


@pytest.mark.nightly  # debate runs on the real model in make test's tiny pipeline (configs/tiny.yaml)
def test_debate_transcript_and_student_rendering(smol):
    ctx = MethodContext(smol, Toolbox(CorpusRetriever()), EpisodeSettings(temperature=0.7, top_p=0.95, max_tokens_per_turn=16), "smol",
                        scaffold={"qa": ["search", "answer"]}, params=DebateConfig(agents=3, rounds=2, aggregator="vote"))
    q = {"id": "q1", "question": "In which city was Zorvan Kelt born?", "answers": ["Tarsk"], "task": "qa"}
    (row,) = get_method("debate")([q], range(1), ctx)
    names = {m["name"] for m in row["messages"] if m["role"] == "assistant"}
    assert {"agent0", "agent1", "agent2", "aggregator(vote)"} <= names
    assert sum(m["name"] == "moderator" for m in row["messages"]) == 3  # one update prompt per agent in round 2
    assert row["n_llm_calls"] >= 3 * 2 + 3  # round 1: search + answer per agent; round 2: one answer each
    student = row["student"]
    assert [m["role"] for m in student[:2]] == ["system", "user"]
    assert student[-1]["role"] == "assistant" and student[-1]["content"] == f"<answer>{row['final_answer']}</answer>"
    ids, mask = token_view(smol.tokenizer, student)
    assert ids[-1] == smol.tokenizer.eos_token_id and mask[-1] == 1


@pytest.mark.slow
def test_continuation_opens_a_user_then_assistant_turn(smol):
    tok = smol.tokenizer
    text = tok.decode(continuation_ids(tok, "What now?"))
    assert text.startswith("\n<|im_start|>user\nWhat now?<|im_end|>") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_drift_counts_retokenisation_differences(smol):
    tok = smol.tokenizer
    ids = tok("<search>Zorvan Kelt</search>", add_special_tokens=False)["input_ids"]
    assert retokenization_drift(tok, ids) == 0
    split = tok("<sea", add_special_tokens=False)["input_ids"] + tok("rch>", add_special_tokens=False)["input_ids"]
    assert retokenization_drift(tok, split) > 0


def test_target_nll_ignores_prompt_and_tool_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11, requires_grad=True)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 0, 1, 1]])  # targets at positions 2, 4, 5 count
    loss = target_nll(logits[:, :-1], ids[:, 1:], mask[:, 1:])
    logp = torch.log_softmax(logits[0], -1)
    expected = -(logp[1, 3] + logp[3, 5] + logp[4, 6]) / 3
    assert torch.allclose(loss, expected)
    loss.backward()
    assert logits.grad[0, 0].abs().sum() == 0 and logits.grad[0, 2].abs().sum() == 0  # predict masked targets: no gradient


def _row(qid, sample, correct, content):
    return {"id": f"{qid}/{sample}", "question_id": qid, "sample": sample, "correct": correct,
            "student": [{"role": "system", "content": "s", "token_ids": []}, {"role": "user", "content": "u", "token_ids": []},
                        {"role": "assistant", "content": content, "token_ids": []}]}


def test_select_trajectories_keeps_correct_deduped_capped():
    rows = [_row("a", 0, True, "x"), _row("a", 1, True, "x"), _row("a", 2, True, "y"), _row("a", 3, True, "z"), _row("b", 0, False, "x")]
    kept = select_trajectories(rows, max_per_question=2, dedupe=True)
    assert [r["id"] for r in kept] == ["a/0", "a/2"]


def test_sft_trains_saves_and_reduces_loss(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [_row("a", i, True, f"<search>Zorvan Kelt</search><answer>Tarsk {i}</answer>") for i in range(4)]
    examples, stats = build_examples(TagFormat(tok), rows, max_length=128)
    assert stats["examples"] == 4 and stats["train_tokens"] > 0
    out = tmp_path / "sft"
    recs = train_sft(str(tiny_model_dir), examples, SFTConfig(epochs=8, lr=3e-3, batch_size=4, warmup_ratio=0.0), str(out))
    assert len(recs) == 8 and recs[-1]["loss"] < recs[0]["loss"]

    def nll(model_dir) -> float:
        """The mean loss of the examples' trained tokens under the model saved in `model_dir`."""
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        ids, mask = (torch.tensor([ex[k] for ex in examples]) for k in (0, 1))  # 4 rows of one length: no padding
        with torch.no_grad():
            return target_nll(model(ids).logits[:, :-1], ids[:, 1:], mask[:, 1:]).item()

    assert nll(tiny_model_dir) == pytest.approx(recs[0]["loss"], rel=1e-3)  # the first step's loss: the base weights'
    assert nll(out) < recs[-1]["loss"]  # the saved weights are those after the last update


def test_hf_backend_logprobs_only_when_asked_and_one_stop_criteria_per_stop_set(tiny_model_dir):
    from unison.llm import Sampling

    backend = HFBackend(str(tiny_model_dir), dtype="float32")
    prompt = backend.tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    plain, scored = backend.generate([prompt, prompt], [Sampling(max_tokens=5, stop=["</search>"]),
                                                        Sampling(max_tokens=5, stop=["</answer>"], logprobs=True)])
    assert plain.logprobs is None and len(scored.logprobs) == len(scored.token_ids) > 0
    assert all(lp <= 0 for lp in scored.logprobs)
    backend.generate([prompt], [Sampling(max_tokens=2, stop=["</answer>", "</search>"])])
    assert list(backend._stop_criteria) == [("</answer>", "</search>")]  # the union of the batch's stops, built once


def test_an_episode_without_room_for_a_turn_ends_with_context_and_is_never_sent(tiny_model_dir):
    backend = HFBackend(str(tiny_model_dir), dtype="float32")
    tok = backend.tokenizer
    cfg = EpisodeSettings(temperature=0.0, max_tokens_per_turn=4, max_turns=2, max_model_len=300)
    long_question = " ".join(["word"] * 400)  # its prompt alone exceeds max_model_len
    short, long = (start_episode(TagFormat(tok), k, q, seed=0, scaffold=["answer"]) for k, q in (("s", "Hi?"), ("l", long_question)))
    assert len(long.prompt_ids) > cfg.max_model_len
    run_episodes([short, long], backend, Toolbox(), cfg)
    assert long.finish_reason == "context" and long.n_llm_calls == 0 and long.segments == []
    # the short one was sent: one forced answer turn of at most max_tokens_per_turn tokens ended it
    assert short.n_llm_calls == 1 and short.finish_reason == "answer" and 0 < short.n_tokens <= cfg.max_tokens_per_turn
    assert [s.kind for s in short.segments] == ["gen"] and short.segments[0].text.startswith("<answer>")


def test_a_scaffolded_thought_is_followed_by_the_next_tag_react(tiny_model_dir):
    backend = HFBackend(str(tiny_model_dir), dtype="float32")
    tok = backend.tokenizer
    question = "In which city was Zorvan Kelt born?"
    react = start_episode(TagFormat(tok), "r", question, seed=0, scaffold=["think", "search", "think", "answer"])
    thought_only = start_episode(TagFormat(tok), "t", question, seed=1, scaffold=["think"])  # a one-turn role (Chain-of-Agents)
    run_episodes([react, thought_only], backend, Toolbox(CorpusRetriever()), EpisodeSettings(temperature=0.0, max_tokens_per_turn=6, max_turns=4))
    kinds = [(s.kind, s.text[: s.text.find(">") + 1] if s.kind == "gen" else "") for s in react.segments]
    assert kinds == [("gen", "<think>"), ("gen", "<search>"), ("obs", ""), ("gen", "<think>"), ("gen", "<answer>")]
    assert all(s.text.endswith(f"</{tag[1:]}") for s, (_, tag) in zip(react.segments, kinds) if s.kind == "gen")
    assert react.n_tool_calls == 1 and react.finish_reason == "answer" and react.n_llm_calls == 4
    ids, _ = token_view(tok, student_messages(question, react.segments))
    assert ids == react.ids
    assert thought_only.n_llm_calls == 1 and thought_only.finish_reason != "answer"


def test_an_unknown_scaffold_tag_names_the_param(tiny_model_dir):
    with pytest.raises(ValueError, match=r"generate\.scaffold\.qa: unknown tag\(s\) \['thought'\]"):
        MethodContext(backend=None, toolbox=Toolbox(), settings=EpisodeSettings(), teacher="t", scaffold={"qa": ["thought", "answer"]})


@pytest.mark.parametrize("packing", [False, True])
def test_the_loss_train_sft_records_is_the_masked_cross_entropy_computed_by_hand(tiny_model_dir, tmp_path, packing):
    """Two hand-built examples of other lengths in one step: the loss train_sft records is the mean cross-entropy of the
    targets whose mask is 1, each example run alone through the untrained model; a loop that trained every token
    (labels = input_ids, an all-ones mask) or the prompt would record another number."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    examples = [([5, 17, 99, 4, 250, 31, 7, 2], [0, 0, 0, 1, 1, 0, 1, 1]), ([8, 300, 12, 2], [0, 0, 1, 1])]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    nll = []
    with torch.no_grad():
        for ids, mask in examples:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            nll += [-logp[t - 1, ids[t]].item() for t in range(1, len(ids)) if mask[t]]
    by_hand = sum(nll) / len(nll)  # 6 targets
    with torch.no_grad():
        all_tokens = [-torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)[t - 1, ids[t]].item()
                      for ids, _ in examples for t in range(1, len(ids))]
    cfg = SFTConfig(epochs=1, lr=1e-3, batch_size=2, grad_accum=1, warmup_ratio=0.0, precision="fp32", packing=packing, max_length=16)
    [record] = train_sft(str(tiny_model_dir), examples, cfg, str(tmp_path / "sft"))
    assert record["tokens"] == 6 and record["loss"] == pytest.approx(by_hand, rel=1e-5)
    assert abs(sum(all_tokens) / len(all_tokens) - by_hand) > 1e-3  # the all-ones mask's loss is another number
