"""rl.trainer verl: the RL stage as verl's PPO trainer (python -m verl.trainer.main_ppo) on its Ray cluster.

unison supplies the data (the export's data/export/verl parquet), the reward (unison.train.verl_reward), the tools
(unison.train.verl_tools) and the agent loop that rolls out its tag protocol (unison.train.verl_agent); verl_overrides
turns params.yaml into main_ppo's Hydra overrides, every key one of verl 0.9.1's
(verl/trainer/config/_generated_ppo_trainer.yaml) or, with a leading +, a key verl reads that its schema leaves open
(reward_kwargs). The final step's HF weights (actor/huggingface, with the tokenizer) become models/rl.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from ..config import LabelConfig, LLMConfig, RLConfig, ToolsConfig
from ..data.schemas import atomic_dir
from .verl_agent import NAME as AGENT_LOOP
from .verl_tools import tool_config

INSTALL = "pip install verl==0.9.1 (beside the GPU stack: requirements/gpu.txt; docs/scale.md, RL through verl)"
# unison's names -> verl's (actor.loss_agg_mode; algorithm.adv_estimator + norm_adv_by_std_in_grpo: Dr. GRPO drops the
# std)
LOSS_AGG = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
            "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
ESTIMATORS = {"grpo": ("grpo", True), "dr_grpo": ("grpo", False), "rloo": ("rloo", True)}


def require_verl() -> None:
    if importlib.util.find_spec("verl") is None:
        raise RuntimeError(f"params.yaml rl.trainer is verl, but verl is not installed here: {INSTALL}; "
                           "or set rl.trainer: unison (the in-house loop)")


def hydra_value(value) -> str:
    """A value in Hydra's override grammar (lists and dicts as JSON-like literals, strings quoted)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"


def verl_overrides(cfg: RLConfig, llm: LLMConfig, label: LabelConfig, verl_agent: str, train_files: list[str],
                   model_dir: str, tool_config_path: str, agent_loop_path: str, checkpoint_dir: str,
                   tools: tuple[str, ...]) -> list[str]:
    """main_ppo's overrides for params.yaml's rl section (and llm's engine memory, label's judge settings, export's
    agent loop)."""
    ro, loss, reward, verl = cfg.rollout, cfg.loss, cfg.reward, cfg.verl
    estimator, norm_by_std = ESTIMATORS[loss.estimator]
    settings = {
        "data.train_files": list(train_files), "data.val_files": list(train_files), "data.prompt_key": "prompt",
        "data.train_batch_size": ro.prompts_per_step, "data.max_prompt_length": verl.max_prompt_length,
        "data.max_response_length": verl.max_response_length, "data.seed": cfg.seed, "data.return_raw_chat": True,
        "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.actor.optim.lr": cfg.lr, "actor_rollout_ref.actor.optim.weight_decay": cfg.weight_decay,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": cfg.warmup_steps(cfg.steps),
        "actor_rollout_ref.actor.optim.clip_grad": cfg.max_grad_norm,
        "actor_rollout_ref.actor.ppo_mini_batch_size": ro.prompts_per_step // cfg.mini_batches,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "actor_rollout_ref.actor.ppo_epochs": cfg.ppo_epochs, "actor_rollout_ref.actor.clip_ratio_low": loss.clip_low,
        "actor_rollout_ref.actor.clip_ratio_high": loss.clip_high,
        "actor_rollout_ref.actor.clip_ratio_c": loss.dual_clip,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG[loss.agg],
        "actor_rollout_ref.actor.use_kl_loss": loss.kl_coef > 0, "actor_rollout_ref.actor.kl_loss_coef": loss.kl_coef,
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",  # k3, the in-house loop's KL
        "actor_rollout_ref.actor.checkpoint.save_contents": ["model", "optimizer", "extra", "hf_model"],
        "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.n": ro.group_size, "actor_rollout_ref.rollout.temperature": ro.temperature,
        "actor_rollout_ref.rollout.top_p": ro.top_p, "actor_rollout_ref.rollout.seed": cfg.seed,
        "actor_rollout_ref.rollout.gpu_memory_utilization": llm.gpu_memory_utilization,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": llm.tensor_parallel_size,
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": ro.max_turns,
        "actor_rollout_ref.rollout.multi_turn.max_user_turns": ro.max_tool_calls,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": tool_config_path,
        "actor_rollout_ref.rollout.agent.default_agent_loop": verl_agent,
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": agent_loop_path,
        "algorithm.adv_estimator": estimator, "algorithm.norm_adv_by_std_in_grpo": norm_by_std,
        "algorithm.use_kl_in_reward": False,
        "algorithm.filter_groups.enable": ro.dynamic_sampling, "algorithm.filter_groups.metric": "reward",
        "reward.custom_reward_function.path": "pkg://unison.train.verl_reward",
        "reward.custom_reward_function.name": "compute_score",
        "trainer.total_training_steps": cfg.steps, "trainer.save_freq": cfg.steps, "trainer.test_freq": -1,
        "trainer.val_before_train": False, "trainer.logger": ["console", "file"],
        "trainer.project_name": "unison", "trainer.experiment_name": "rl",
        "trainer.nnodes": verl.nnodes, "trainer.n_gpus_per_node": verl.gpus_per_node,
        "trainer.default_local_dir": checkpoint_dir, "trainer.resume_mode": "auto",
    }
    if llm.max_num_seqs:
        settings["actor_rollout_ref.rollout.max_num_seqs"] = llm.max_num_seqs
    reward_kwargs = {"verifiable_weight": reward.verifiable_weight, "format_weight": reward.format_weight,
                     "label": label.model_dump(), "tools": list(tools)}
    return ([f"{k}={hydra_value(v)}" for k, v in settings.items()]
            + [f"+reward.custom_reward_function.reward_kwargs={hydra_value(reward_kwargs)}"])


def write_verl_config(cfg: RLConfig, llm: LLMConfig, label: LabelConfig, t: ToolsConfig, verl_agent: str,
                      train_files: list[str], model_dir: str, out_dir: str | Path, tools: tuple[str, ...]) -> list[str]:
    """Write out_dir/tool_config.yaml, agent_loops.yaml (unison_agent) and overrides.txt (one override a line); the
    overrides."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tool_config.yaml").write_text(yaml.safe_dump(tool_config(tools, t), sort_keys=False))
    loop = {"name": AGENT_LOOP, "_target_": "unison.train.verl_agent.UnisonAgentLoop",
            "max_tokens_per_turn": cfg.rollout.max_tokens_per_turn}
    (out / "agent_loops.yaml").write_text(yaml.safe_dump([loop], sort_keys=False))
    overrides = verl_overrides(cfg, llm, label, verl_agent, train_files, model_dir,
                               str((out / "tool_config.yaml").resolve()), str((out / "agent_loops.yaml").resolve()),
                               str((out / "checkpoints").resolve()), tools)
    (out / "overrides.txt").write_text("\n".join(overrides) + "\n")
    return overrides


def final_hf_weights(checkpoint_dir: str | Path, steps: int) -> Path:
    path = Path(checkpoint_dir) / f"global_step_{steps}" / "actor" / "huggingface"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"verl left no HF weights at {path} (actor.checkpoint.save_contents has "
                                "hf_model; did it finish?)")
    return path


def metric_records(metrics_jsonl: str | Path) -> list[dict]:
    """verl's file logger lines -> the in-house curve's columns that verl measures (step, reward_total, ...)."""
    names = {"reward_total": "critic/score/mean", "response_length": "response_length/mean"}
    records = []
    for line in Path(metrics_jsonl).read_text().splitlines():
        entry = json.loads(line)
        records.append({"step": entry["step"], **{k: entry["data"].get(v) for k, v in names.items()}})
    return records


def run_verl(overrides: list[str], work_dir: str | Path, steps: int, out_model: str | Path) -> list[dict]:
    """Run main_ppo (its output to the console), then swap the last step's HF weights into out_model atomically."""
    work = Path(work_dir)
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str((work / "metrics.jsonl").resolve())}
    subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], check=True, env=env)
    weights = final_hf_weights(work / "checkpoints", steps)
    with atomic_dir(out_model) as tmp:
        shutil.copytree(weights, tmp, dirs_exist_ok=True)
    return metric_records(work / "metrics.jsonl")
