"""rl.trainer verl (unison/train/verl_trainer.py, verl_reward.py, verl_tools.py): what of verl's path runs without a GPU.

The config stages/rl.py writes is parsed with Hydra's own override parser, and every key it sets is one of verl 0.9.1's
(tests/fixtures/verl/ppo_trainer_keys.txt, the leaves of its _generated_ppo_trainer.yaml); the tool config is loaded
with OmegaConf as verl's initialize_tools_from_config loads it; the reward function is called on verl's call signature
(its naive reward manager's keywords) with rows of the export's verl parquet loaded as verl's RLHFDataset loads them, and
must equal the in-house loop's reward for the same responses; the tools run against unison's real search server.
verl itself does not install beside the CPU lock (transformers); where it is importable (PYTHONPATH with verl 0.9.1
installed --no-deps, docs/scale.md) the test also loads the reward and the tools through verl's own loaders.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from unison.agents.toolbox import Toolbox
from unison.config import ROOT, ToolsConfig, load_params
from unison.data.corpus import corpus_tables, write_corpus
from unison.protocol import final_answer, observation
from unison.tools.registry import DEFAULT_TOOLS
from unison.tools.retrieval import Retriever, build_index, make_retriever
from unison.tools.search_server import create_app
from unison.train.rl import RLSetup, load_rl_data, score_episodes
from unison.train.rollout import View
from unison.train.verl_reward import compute_score
from unison.train.verl_tools import CLASS_NAME, run_tool, tool_config
from unison.train.verl_trainer import write_verl_config

from .test_export import BORN, exported, project  # noqa: F401  (fixtures)
from .test_retrieval import invented_passages, serving

VERL = importlib.util.find_spec("verl") is not None
VERL_KEYS = {line.strip() for line in (Path(__file__).parent / "fixtures/verl/ppo_trainer_keys.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
RESPONSES = {  # question -> responses of one group, as the student writes them (observations inline)
    "q0": ["<search>Zorvan Kelt</search>" + BORN + "<answer>Tarsk</answer>",
           "<answer>Tarsk city</answer>",                                   # f1 partial credit
           "<answer>Tarsk</answer> I think",                                 # text after the answer: f_fmt -1
           "<think>no idea</think>"],                                        # no answer
    "q2": ["<python>\nprint(17 * 23)</python>" + observation("391") + "<answer>391</answer>", "<answer>390</answer>"],
}


def verl_params(project_dir: Path, search_url: str = "http://127.0.0.1:9", **rl):
    """params.yaml for rl.trainer verl, with `rl`'s settings over rl's (a group's keys, e.g. loss={...}, over the group's)."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["rl"]["trainer"] = "verl"
    raw["rl"]["reward"] |= {"verifiable_weight": 2.0, "format_weight": 0.5}
    for key, value in rl.items():
        raw["rl"][key] = raw["rl"][key] | value if isinstance(value, dict) else value
    raw["label"]["qa_metric"] = "f1"
    raw["tools"]["search_url"] = search_url
    raw["export"]["verl_agent"] = "unison_agent"
    (project_dir / "params.yaml").write_text(yaml.safe_dump(raw))
    return load_params()


def verl_sections(params) -> tuple:
    """write_verl_config's settings, as the rl stage takes them out of `params`."""
    return params.rl, params.llm, params.label, params.tools, params.export.verl_agent


def parsed(overrides: list[str]) -> dict:
    """{key: value} as Hydra parses main_ppo's command line (a grammar error raises); `+` keys keep their +."""
    return {("+" if o.is_add() else "") + o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}


def test_verl_config_sets_only_verl_keys_from_params_and_refuses_what_verl_cannot_do(exported):
    params = verl_params(exported.parent.parent, verl={"nnodes": 2, "gpus_per_node": 4}, loss={"estimator": "dr_grpo", "kl_coef": 0.001})
    files = [str(p) for p in sorted((exported / "verl").glob("level*.parquet"))]
    overrides = parsed(write_verl_config(*verl_sections(params), files, "models/sft", "work", DEFAULT_TOOLS))
    unknown = [k for k in overrides if not k.startswith("+") and k not in VERL_KEYS]
    assert not unknown, f"keys verl 0.9.1 does not have: {unknown}"
    rl = params.rl
    assert {k: overrides[k] for k in ["data.train_files", "actor_rollout_ref.model.path", "actor_rollout_ref.rollout.name",
                                      "actor_rollout_ref.rollout.n", "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo",
                                      "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.clip_ratio_low",
                                      "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.kl_loss_coef",
                                      "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.loss_agg_mode",
                                      "trainer.total_training_steps", "trainer.nnodes", "trainer.n_gpus_per_node",
                                      "reward.custom_reward_function.name", "actor_rollout_ref.rollout.multi_turn.enable"]} == {
        "data.train_files": files, "actor_rollout_ref.model.path": "models/sft", "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": rl.rollout.group_size, "algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False,
        "actor_rollout_ref.actor.optim.lr": rl.lr, "actor_rollout_ref.actor.clip_ratio_low": rl.loss.clip_low,
        "actor_rollout_ref.actor.clip_ratio_high": rl.loss.clip_high, "actor_rollout_ref.actor.kl_loss_coef": 0.001,
        "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "trainer.total_training_steps": rl.steps, "trainer.nnodes": 2, "trainer.n_gpus_per_node": 4,
        "reward.custom_reward_function.name": "compute_score", "actor_rollout_ref.rollout.multi_turn.enable": True}
    assert Path(overrides["trainer.default_local_dir"]) == Path("work/checkpoints").resolve()
    assert importlib.util.find_spec(overrides["reward.custom_reward_function.path"].removeprefix("pkg://")) is not None
    kwargs = overrides["+reward.custom_reward_function.reward_kwargs"]
    assert kwargs["verifiable_weight"] == 2.0 and kwargs["format_weight"] == 0.5 and kwargs["label"]["qa_metric"] == "f1"

    tool_yaml = OmegaConf.load(overrides["actor_rollout_ref.rollout.multi_turn.tool_config_path"])  # as verl loads it
    entries = OmegaConf.to_container(tool_yaml.tools, resolve=True)
    assert [e["tool_schema"]["function"]["name"] for e in entries] == list(DEFAULT_TOOLS)
    assert {e["class_name"] for e in entries} == {CLASS_NAME} and {e["config"]["type"] for e in entries} == {"native"}
    assert ToolsConfig(**entries[0]["config"]["tools"]) == params.tools
    assert [e["tool_schema"]["function"]["parameters"]["required"] for e in entries] == [["query"], ["code"]]
    (loop,) = OmegaConf.load(overrides["actor_rollout_ref.rollout.agent.agent_loop_config_path"])  # as verl's worker loads it
    module, _, cls = loop["_target_"].rpartition(".")
    assert loop["name"] == "unison_agent" and loop["max_tokens_per_turn"] == rl.rollout.max_tokens_per_turn
    assert hasattr(importlib.import_module(module), cls) == VERL  # the class exists where verl does

    for bad, key in [({"loss": {"estimator": "flow_grpo"}}, "rl.loss.estimator"), ({"reward": {"efficiency_weight": 1.0}}, "rl.reward.efficiency_weight"),
                     ({"loss": {"dual_clip": None}}, "rl.loss.dual_clip"), ({"mini_batches": 3}, "rl.mini_batches")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            verl_params(exported.parent.parent, **bad)  # refused when params load
    verl_params(exported.parent.parent)  # back to settings verl can run
    raw = yaml.safe_load(Path("params.yaml").read_text())
    raw["export"]["verl_agent"] = "tool_agent"
    Path("params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"export\.verl_agent must be unison_agent"):
        load_params()
    with pytest.raises(ValueError, match=r"tools\.search_url"):
        tool_config(DEFAULT_TOOLS, ToolsConfig())
    if not VERL:  # the stage fails at once, naming the setting and the install command
        import stages.rl

        verl_params(exported.parent.parent)
        with pytest.raises(RuntimeError, match=r"rl\.trainer is verl.*pip install verl"):
            stages.rl.main()


def test_the_verl_reward_on_verls_call_signature_equals_the_in_house_reward(exported):
    params = verl_params(exported.parent.parent)
    files = [str(p) for p in sorted((exported / "verl").glob("level*.parquet"))]
    kwargs = parsed(write_verl_config(*verl_sections(params), files, "models/sft", "work", DEFAULT_TOOLS))["+reward.custom_reward_function.reward_kwargs"]
    verl_rows = {r["extra_info"]["question_id"]: r for r in datasets.load_dataset("parquet", data_files=files)["train"]}  # RLHFDataset
    in_house = {r["extra_info"]["question_id"]: r for r in load_rl_data(sorted(Path("data/rl").glob("level*.parquet")))}
    reward_fn = compute_score
    if VERL:  # through verl's own loader, reward_kwargs merged as verl merges them
        from verl.trainer.ppo.reward import get_custom_reward_fn

        reward_fn = get_custom_reward_fn(OmegaConf.create({"reward": {"custom_reward_function": {
            "path": "pkg://unison.train.verl_reward", "name": "compute_score", "reward_kwargs": kwargs}}}))
        kwargs = {}
    for qid, responses in RESPONSES.items():
        row = verl_rows[qid]
        ours = [reward_fn(data_source=row["data_source"], solution_str=text, ground_truth=row["reward_model"]["ground_truth"],
                          extra_info=dict(row["extra_info"]), **kwargs) for text in responses]
        episodes = [SimpleNamespace(text=t, answer=final_answer(t)) for t in responses]
        views = [View([0] * len(t), [1] * len(t), []) for t in responses]
        setup = RLSetup(params.rl.model_copy(update={"rollout": params.rl.rollout.model_copy(update={"group_size": len(responses)})}), params.label, params.llm, DEFAULT_TOOLS)
        theirs = score_episodes(episodes, [in_house[qid]], views, setup, step=1)
        assert [r["score"] for r in ours] == theirs["total"]
        assert [r["format"] for r in ours] == theirs["format"] and [r["verifiable"] for r in ours] == theirs["verifiable"]
    assert [r["score"] for r in ours] == [2.0, 0.0]  # math: right (2 * 1 + 0.5 * 0), wrong
    q0 = [compute_score("builtin", t, verl_rows["q0"]["reward_model"]["ground_truth"], dict(verl_rows["q0"]["extra_info"]),
                        verifiable_weight=2.0, format_weight=0.5, label={"qa_metric": "f1"}) for t in RESPONSES["q0"]]
    assert [r["score"] for r in q0] == pytest.approx([2.0, 2 * 2 / 3, 2.0 - 0.5, -0.5])
    with pytest.raises(ValueError, match="ability"):
        compute_score("builtin", "<answer>x</answer>", ["x"], {})


def test_the_tools_answer_as_the_in_house_toolbox_over_the_search_server(tmp_path):
    rows = [{"id": str(i), "contents": f'"{p["title"]}"\n{p["text"]}'} for i, p in enumerate(invented_passages(20))]
    (tmp_path / "wiki.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_corpus(corpus_tables(tmp_path / "wiki.jsonl"), tmp_path / "corpus.parquet")
    build_index(tmp_path / "corpus.parquet", tmp_path / "index", encoder="hash:128")
    local = Toolbox(Retriever(tmp_path / "index", topk=2), ToolsConfig(python_timeout_s=5))
    query = " | ".join(p["title"] for p in invented_passages(2))
    with serving(create_app(Retriever(tmp_path / "index", topk=2))) as (_, url):
        settings = ToolsConfig(search_url=url, search_topk=2, sandbox_isolation="rlimits")
        remote = Toolbox(make_retriever(tmp_path / "index-unused", settings), ToolsConfig(python_timeout_s=5))
        text, error = run_tool(remote, "search", {"query": query})
        assert error is None and text == observation(local.call("search", query)[0])
        assert text.count("Doc 1 (Title:") == 2
        assert run_tool(remote, "python", {"code": "print(6 * 7)"}) == (observation(local.call("python", "print(6 * 7)")[0]), None)
        assert "42" in run_tool(remote, "python", {"code": "print(6 * 7)"})[0]
        assert run_tool(remote, "python", {"source": "print(1)"})[1] == "unparsable"
        if VERL:  # verl builds the tools from the YAML and calls them as its ToolAgentLoop does
            from verl.tools.schemas import OpenAIFunctionToolSchema
            from verl.tools.tool_registry import initialize_tools_from_config

            (tmp_path / "tools.yaml").write_text(yaml.safe_dump(tool_config(DEFAULT_TOOLS, settings)))
            tools = {t.name: t for t in initialize_tools_from_config(str(tmp_path / "tools.yaml"))}
            assert all(isinstance(t.tool_schema, OpenAIFunctionToolSchema) for t in tools.values())
            response, reward, _ = asyncio.run(tools["search"].execute("i0", {"query": query}))
            assert response.text == text and reward == 0.0


def test_the_scale_projection_divides_by_gpus_until_one_episode_bounds_a_step():
    from bench.project_scale import DEMO_FILL, SEEDS, markdown, projection, step_seconds

    gap = SEEDS["GAP MHQA RL (Qwen2.5-3B, GRPO + DAPO)"]
    (r8, t8), (r16, t16) = step_seconds(gap, 8, 1.0), step_seconds(gap, 16, 1.0)
    assert r16 == pytest.approx(r8 / 2) and t16 == pytest.approx(t8 / 2)
    r_many, _ = step_seconds(gap, 4096, 1.0)
    assert r_many == pytest.approx(8192 * 0.5 * 2 * 3.09e9 / 3.35e12)  # one episode's decode latency is the floor
    assert step_seconds(gap, 8, 0.5)[1] == pytest.approx(t8 / 2)       # training FLOPs scale with the tokens
    assert DEMO_FILL == pytest.approx(27.25 / 384)
    rows = projection([8, 32], [1.0, DEMO_FILL])
    assert len(rows) == 2 * len(SEEDS) and all(r["8 GPUs h"] > r["32 GPUs h"] for r in rows)
    assert markdown(rows, [8, 32]).count("\n") == len(rows) + 1


def test_the_agent_loop_runs_the_tag_protocol_as_the_runtime_does_with_a_scripted_engine_fake_at_the_gpu_boundary(base_model_dir):
    """unison_agent's episode with the vLLM server replaced by scripted turns (no GPU here) and SmolLM2's real tokenizer:
    stop strings and the turn budget reach the engine, each call's observation block follows its turn with mask 0 and
    the next turn sees all of it, an answer ends with EOS, and the call and response budgets end an episode."""
    from transformers import AutoTokenizer

    from unison.protocol import stops_for
    from unison.train.verl_agent import tag_protocol_episode

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = ["<search>Zorvan Kelt</search>", "<answer>Tarsk</answer>"]
    seen, calls = [], []

    async def generate(context, sampling):  # the scripted engine
        seen.append((list(context), sampling))
        return ids(turns[len(seen) - 1]), None

    async def call_tool(tool, argument):
        calls.append((tool, argument))
        return BORN

    def episode(**limits):
        seen.clear(), calls.clear()
        settings = {"max_turns": 4, "max_tool_calls": 3, "max_tokens_per_turn": 96, "response_length": 512, **limits}
        return asyncio.run(tag_protocol_episode(generate, call_tool, tok, [1, 2, 3], DEFAULT_TOOLS, **settings))

    out = episode()
    expected = ids(turns[0]) + ids(BORN) + ids(turns[1]) + [tok.eos_token_id]
    assert out["response_ids"] == expected and out["num_turns"] == 2 and calls == [("search", "Zorvan Kelt")]
    assert out["response_mask"] == [1] * len(ids(turns[0])) + [0] * len(ids(BORN)) + [1] * (len(ids(turns[1])) + 1)
    assert seen[1][0] == [1, 2, 3] + ids(turns[0]) + ids(BORN)  # the second turn continues after the observation
    assert seen[0][1] == {"stop": stops_for(DEFAULT_TOOLS), "include_stop_str_in_output": True, "max_tokens": 96}
    assert episode(max_tool_calls=0)["response_ids"] == ids(turns[0]) and calls == []
    short = episode(response_length=10)
    assert len(short["response_ids"]) == 10 and seen[0][1]["max_tokens"] == 10 and len(seen) == 1
