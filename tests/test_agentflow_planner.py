"""AgentFlow's recipe as the seed runs it (issue 25 point 7): the student is the planner of the flow and only its turns
train (Flow-GRPO); the executor, verifier and generator are fixed modules behind a chat API. Here a fake hosted chat API
(the boundary we cannot reach from here) plays them, and the tiny random model is the planner."""
from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from unison.agents.toolbox import Toolbox
from unison.config import AgentFlowConfig, LLMConfig, ParamsError, validate_params
from unison.llm.hf_backend import HFBackend
from unison.llm.openai_backend import OpenAIBackend
from unison.train.rl import RLSetup, collect_step, train_rl
from unison.train.rollout import PlannerRollout

from .local_http import LocalServer
from .test_rl import LABEL, make_rows, rl_config, state

TOOLS = ("search", "python")


class OnePassage:
    def search(self, queries):
        return [[{"title": "France", "text": "Paris is the capital of France."}] for _ in queries]


def fake_hosted_fixed_modules(log: list):
    """AgentFlow's fixed modules in OpenAI's documented chat shapes: the executor (its system prompt names the query it
    serves) calls search with the sub-goal it is given; the verifier concludes STOP; the generator answers Paris when the
    request's seed is even, else Rome, so a question's rollouts have mixed outcomes."""
    def respond(req):
        body = req["json"]
        log.append(body)
        messages = body["messages"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        usage = {"prompt_tokens": 30, "completion_tokens": 4}
        if "This step serves the query" in (messages[0]["content"] if messages[0]["role"] == "system" else ""):
            role, message = "executor", {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": json.dumps({"query": user[:40]})}}]}
        elif user.startswith("Task: Evaluate"):
            role, message = "verifier", {"role": "assistant", "content": "The memory answers it. Conclusion: STOP"}
        elif user.startswith("Actions Taken"):
            role, message = "generator", {"role": "assistant", "content": "Paris" if body["seed"] % 2 == 0 else "Rome"}
        else:
            role, message = "unknown", {"role": "assistant", "content": "?"}
        body["unison_test_role"] = role
        return 200, {"model": "gpt-4o-mini-fake", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage}, None
    return respond


def planner_setup(cfg, flow: dict) -> RLSetup:
    """The RL bundle of a planner run: 1024-token episodes with search, the student planning `flow` (`roles` and
    `flow`)."""
    return RLSetup(cfg, LABEL, LLMConfig(max_model_len=1024), TOOLS, acting=PlannerRollout(Toolbox(OnePassage()), TOOLS, **flow))


def fixed_modules(modules, max_steps: int) -> dict:
    """PlannerRollout's `roles` (one backend for the executor, the verifier and the generator) and `flow`."""
    return {"roles": {role: modules for role in ("executor", "verifier", "generator")}, "flow": AgentFlowConfig(max_steps=max_steps)}


@contextmanager
def fake_hosted_flow(tok, max_steps: int):
    """The fixed modules answered by `fake_hosted_fixed_modules` (the API's request log unread), as `fixed_modules`."""
    with LocalServer(fake_hosted_fixed_modules([])) as api:
        modules = OpenAIBackend(f"{api.url}/v1", "gpt-4o-mini", tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=30)
        yield fixed_modules(modules, max_steps)


def small_planner_config(**kw):
    """One question, two rollouts of one step each, 8 tokens a planner turn; seed 3 names the rollouts' questions so that
    the fake generator answers Paris in one rollout of two in each of the first two steps (its seed's parity)."""
    return rl_config(student_role="agentflow_planner", seed=3, loss={"estimator": "flow_grpo"}, reward={"format_weight": 0.0},
                     rollout={"group_size": 2, "prompts_per_step": 1, "max_tokens_per_turn": 8}, **kw)


def train_planner(model_dir, cfg, flow, out, on_step=None) -> list[dict]:
    return train_rl(str(model_dir), make_rows(), planner_setup(cfg, flow), str(out / "out"), str(out / "ckpt"), on_step=on_step)


def turn_logprobs(model_dir, samples: list[dict]) -> list[float]:
    """Each sample's log-prob of its own (loss-masked) tokens after its context, by a plain forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in samples:
            logp = torch.log_softmax(model(torch.tensor([s["ids"]])).logits[0, :-1], -1)  # row t predicts token t + 1
            out.append(sum(logp[t, s["ids"][t + 1]].item() for t, m in enumerate(s["loss_mask"]) if m))
    return out


@pytest.mark.slow
def test_only_the_planners_turns_train_and_the_fixed_modules_answer_from_the_api(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = rl_config(student_role="agentflow_planner", lr=1e-3, loss={"estimator": "flow_grpo"}, rollout={"group_size": 4, "prompts_per_step": 2, "max_tokens_per_turn": 12}, reward={"format_weight": 0.0})
    rows, log = make_rows(), []
    with LocalServer(fake_hosted_fixed_modules(log)) as api:
        modules = OpenAIBackend(f"{api.url}/v1", "gpt-4o-mini", tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=30)
        setup = planner_setup(cfg, fixed_modules(modules, max_steps=2))
        policy = HFBackend(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer=tok)
        got = collect_step(0, 0, rows, policy, setup)
        samples, episodes, rewards = got.samples, got.episodes, got.rewards
        records = train_rl(str(tiny_model_dir), rows, setup, str(tmp_path / "out"), str(tmp_path / "ckpt"))

    # 2 questions x 4 rollouts: per flow the executor, the verifier (STOP after step 1) and the generator asked the API
    first_step = log[: len(log) // 2]
    assert [b["unison_test_role"] for b in first_step].count("executor") == 8 and "unknown" not in {b["unison_test_role"] for b in log}
    assert sorted(b["unison_test_role"] for b in first_step) == ["executor"] * 8 + ["generator"] * 8 + ["verifier"] * 8
    assert len(episodes) == 8 and got.rounds == 1 and 0 < sum(rewards["correct"]) < 8  # mixed outcomes: something to learn
    renderings = [e.text for e in episodes]
    assert all("<search>" in t and "<result>" in t and t.rstrip().endswith("</answer>") for t in renderings)  # the flow as the student protocol

    # 16 samples: each rollout's analysis and its one step's plan, the planner's prompt then its own tokens only
    assert len(samples) == 16
    for s in samples:
        trained = tok.decode([t for t, m in zip(s["ids"][1:], s["loss_mask"]) if m])
        context = tok.decode(s["ids"])
        assert "Task: Analyze the given query" in context or "Task: Determine the optimal next step" in context
        assert not any(w in trained for w in ("Conclusion: STOP", "<answer>", "<result>")), trained
        assert sum(s["loss_mask"]) > 0 and len(s["ids"]) < 1024
    # Flow-GRPO: both turns of a rollout carry its one advantage, of the sign of its reward against its question's mean
    per_rollout = [{round(a, 5) for a, m in zip(s["advantages"], s["loss_mask"]) if m} for s in samples]
    assert all(len(a) == 1 for a in per_rollout)
    values = [a.pop() for a in per_rollout]
    assert all(values[2 * i] == values[2 * i + 1] for i in range(8))
    total, groups = rewards["total"], rewards["groups"]
    mean = {g: sum(t for t, h in zip(total, groups) if h == g) / groups.count(g) for g in set(groups)}
    signs = [(t > mean[g]) - (t < mean[g]) for t, g in zip(total, groups)]
    assert [(v > 0) - (v < 0) for v in values[::2]] == signs and any(signs)

    rec = records[0]
    assert rec["samples"] == 16 and rec["episodes"] == 8
    before, after = state(tiny_model_dir), state(tmp_path / "out")
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_one_planner_update_raises_the_rewarded_plans_and_lowers_the_punished_ones(tiny_model_dir, tmp_path):
    """One Flow-GRPO step of `train_rl` (lr 1e-3, fixed seeds): every planner turn of the rollout rewarded 1 becomes
    likelier under the saved model, every one of the rollout rewarded 0 less likely. The rollouts are collected once
    more beforehand, with the same seeds on the same weights, to know the turns and their rewards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = small_planner_config(lr=1e-3)
    with fake_hosted_flow(tok, max_steps=1) as flow:
        policy = HFBackend(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer=tok)
        got = collect_step(0, 0, make_rows(), policy, planner_setup(cfg, flow))
        samples, rewards = got.samples, got.rewards
        [record] = train_planner(tiny_model_dir, cfg, flow, tmp_path)
    assert rewards["total"] in ([1.0, 0.0], [0.0, 1.0])  # one rollout rewarded, one punished
    assert record["reward_total"] == 0.5 and record["response_tokens"] == sum(rewards["lengths"]) / 2  # train_rl's rollouts
    assert len(samples) == 4  # per rollout: its analysis turn and its one plan, in rollout order
    reward_of = [rewards["total"][i // 2] for i in range(4)]
    assert [{a > 0 for a, m in zip(s["advantages"], s["loss_mask"]) if m} for s in samples] == [{r == 1.0} for r in reward_of]
    before, after = turn_logprobs(tiny_model_dir, samples), turn_logprobs(tmp_path / "out", samples)
    for reward, b, a in zip(reward_of, before, after):
        assert (a > b) if reward == 1.0 else (a < b), (reward, b, a)


@pytest.mark.slow
def test_a_planner_run_killed_after_a_step_resumes_to_the_same_weights(tiny_model_dir, tmp_path):
    """As tests/test_rl.py's resume test, for rl.student_role agentflow_planner: killed in step 2, after step 1's
    checkpoint, the re-run trains step 2 only and ends on the weights of a run never killed."""
    from transformers import AutoTokenizer

    cfg = small_planner_config(steps=2)
    with fake_hosted_flow(AutoTokenizer.from_pretrained(tiny_model_dir), max_steps=1) as flow:
        straight = train_planner(tiny_model_dir, cfg, flow, tmp_path / "straight")

        def kill(rec):
            if rec["step"] == 2:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            train_planner(tiny_model_dir, cfg, flow, tmp_path / "resumed", on_step=kill)
        assert not (tmp_path / "resumed" / "out").exists()
        trained = []
        resumed = train_planner(tiny_model_dir, cfg, flow, tmp_path / "resumed", on_step=lambda rec: trained.append(rec["step"]))
    assert trained == [2]  # it read the checkpoint of step 1
    assert [r["reward_total"] for r in straight] == [0.5, 0.5]  # both steps have a reward spread: both move the weights
    a, b = state(tmp_path / "straight" / "out"), state(tmp_path / "resumed" / "out")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["reward_total"] for r in resumed] == [r["reward_total"] for r in straight] and len(resumed) == 2


def test_the_planner_role_needs_flow_grpo_and_the_three_fixed_modules_when_params_load():
    import yaml

    from unison.config import ROOT

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["rl"] |= {"student_role": "agentflow_planner"}
    with pytest.raises(ParamsError, match="rl.student_role agentflow_planner .* needs rl.loss.estimator flow_grpo"):
        validate_params(raw)
    raw["rl"]["loss"]["estimator"] = "flow_grpo"
    raw["generate"]["roles"] = {"executor": {"model": "gpt-4o-mini", "backend": "openai", "api": "chat", "base_url": "http://127.0.0.1:9/v1"}}
    with pytest.raises(ParamsError, match="generate.roles has no verifier, generator: name the fixed modules"):
        validate_params(raw)
    raw["generate"]["roles"] |= {r: raw["generate"]["roles"]["executor"] for r in ("verifier", "generator")}
    assert validate_params(raw).rl.student_role == "agentflow_planner"
