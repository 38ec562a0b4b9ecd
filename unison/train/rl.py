"""RL: the GRPO family on multi-turn tool rollouts with the live policy (DESIGN §7; docs/seeds.md: GAP, ET-Agent,
AgentArk, Flow-GRPO).

One step: take the next prompts of the curriculum (level 1 rows first), roll out `group_size` episodes per prompt with
the current policy and real tools, score every reward component, drop groups whose rewards are all equal and roll out
the next prompts while too few are kept (DAPO dynamic sampling), turn rewards into group-relative advantages, then
PPO-style epochs of the clipped token-level loss (old log-probs from the policy before the update, optional k3 KL to
a frozen reference) with AdamW through accelerate (a DeepSpeed ZeRO config works). A checkpoint outside the DVC out
lets a killed run resume exactly where it stopped.
"""
from __future__ import annotations

import copy
import math
import random
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .. import layout
from ..agents.runtime import Episode, EpisodeSettings
from ..config import LabelConfig, LLMConfig, RLConfig
from ..data.schemas import RL_ROW, DataError, read_table
from ..judge import SCORERS
from .advantages import ESTIMATORS, dynamic_sampling_keep, flow_grpo
from .batches import attach_logprobs, collate, logprobs_of, make_sample, padded, scored_batch, scored_columns
from .loop import Trainer, split_batch
from .opd import length_collapse, restart_step, score_with_teacher, top_k_term, with_teacher_term
from .policy_loss import policy_loss, token_logprobs
from .prm import PRM
from .probe import kl_probe, split_probe
from .rewards import (
    efficiency_rewards,
    judge_response,
    prm_step_rewards,
    prmvr_token_rewards,
    returns_to_go,
    sigma_factor,
)
from .rollout import (
    PlannerRollout,
    SoloRollout,
    View,
    check_colocated_memory,
    engine_sleeps,
    make_rollout_backend,
    turn_views,
)
from .sft import save_model

# ------------------------------------------------------------------------------------------------------- the setup

@dataclass(frozen=True)
class RLSetup:
    """What an RL run needs beside the model and the prompts, built once by the stage. Every process: the rl, label and
    llm sections and the enabled tools. Rank 0 alone, which rolls out and scores (None elsewhere): how the student's
    episodes are rolled out (`acting`: alone with its toolbox, or as AgentFlow's planner); the PRM
    (rl.reward.prm_weight > 0); the teacher (on-policy distillation and the probe: a backend whose `score` gives its
    log-probs of the student's tokens, read after `worked_examples` when given, rl.opd.teacher_context
    worked_examples)."""
    rl: RLConfig
    label: LabelConfig
    llm: LLMConfig
    tools: tuple[str, ...]
    acting: SoloRollout | PlannerRollout | None = None
    prm: PRM | None = None
    teacher: Any = None
    worked_examples: str = ""
    gradient_checkpointing: bool = False

    @property
    def episode(self) -> EpisodeSettings:
        """How a rollout samples and how long it may run: rl's temperature, top_p and budgets within
        llm.max_model_len."""
        ro = self.rl.rollout
        return EpisodeSettings(temperature=ro.temperature, top_p=ro.top_p, max_turns=ro.max_turns,
                               max_tokens_per_turn=ro.max_tokens_per_turn, max_tool_calls=ro.max_tool_calls,
                               max_model_len=self.llm.max_model_len)


@dataclass
class Collected:
    """A step's rollouts (collect_step): the samples to train on; the rows, episodes and rewards of every batch rolled
    out (groups numbered across batches); the share of groups with a reward spread; the batches (`rounds`) and
    timings."""
    samples: list[dict]
    rows: list[dict]
    episodes: list[Episode]
    rewards: dict
    kept_share: float
    rounds: int
    times: dict[str, float]


# ------------------------------------------------------------------------------------------------------------ data

def load_rl_data(paths: list[str | Path]) -> list[dict]:
    """RL rows of every level file (schema RL_ROW), checked beyond types, in curriculum order (level, then file
    order)."""
    if not paths:
        raise DataError(layout.RL_DATA, "no level*.parquet files")
    rows = []
    for path in paths:
        for i, r in enumerate(read_table(path, RL_ROW)):
            if not r["prompt"] or r["prompt"][-1]["role"] != "user":
                raise DataError(path, "prompt must be chat messages ending with a user turn", i, "prompt")
            if not r["reward_model"]["ground_truth"]:
                raise DataError(path, "no ground-truth answers", i, "reward_model")
            if r["ability"] not in SCORERS:
                raise DataError(path, f"ability must be one of {sorted(SCORERS)} (a judged task), got {r['ability']!r}",
                                i, "ability")
            if r["level"] < 1:
                raise DataError(path, f"level must be >= 1, got {r['level']}", i, "level")
            rows.append(r)
    return sorted(rows, key=lambda r: r["level"])


def step_prompts(rows: list[dict], start: int, n: int, seed: int) -> list[dict]:
    """Prompts `start`..`start+n-1` of the curriculum: a pass is level 1 rows (shuffled), then level 2, ...; passes
    repeat."""
    out = []
    for pos in range(start, start + n):
        epoch, i = divmod(pos, len(rows))
        rng = random.Random(f"{seed}/{epoch}")
        order = sorted(range(len(rows)), key=lambda k: (rows[k]["level"], rng.random()))
        out.append(rows[order[i]])
    return out


# --------------------------------------------------------------------------------------------------------- rewards

def episode_steps(e) -> list[str]:
    """PRM steps as `label` and `prm` cut them (unison.judge.steps.student_steps): each turn with its tool
    observations."""
    steps: list[str] = []
    for seg in e.segments:
        if seg.kind == "gen":
            steps.append(seg.text)
        elif steps:
            steps[-1] += seg.text
    return steps


def score_episodes(episodes, rows: list[dict], views: list[View], setup: RLSetup, step: int) -> dict:
    """Every reward component per episode (rl.rollout.group_size of them per row) and the scalar reward
    r = w_v*s + w_f*f_fmt + w_e*s*(f_tool*f_len - 1); with a PRM, its step rewards (`prm_steps`).

    The efficiency term makes w = 1 everywhere ET-Agent's r = s*f_tool*f_len + f_fmt; the PRM adds token rewards.
    """
    rl = setup.rl
    groups = [i // rl.rollout.group_size for i in range(len(episodes))]
    judged = [judge_response(rows[g]["ability"], e.text, rows[g]["reward_model"]["ground_truth"], setup.label,
                             setup.tools)
              for e, g in zip(episodes, groups)]
    s, fmt, calls = ([j[k] for j in judged] for k in ("verifiable", "format", "tool_calls"))
    lengths = [v.sampled for v in views]
    weights = rl.reward
    factor = sigma_factor(step, rl.steps) if weights.sigma_decay else 1.0
    eff = efficiency_rewards(s, calls, lengths, fmt, groups, weights.sigma_tool * factor, weights.sigma_len * factor)
    efficiency = [si * (ft * fl - 1) for si, ft, fl in zip(s, eff["f_tool"], eff["f_len"])]
    total = [weights.verifiable_weight * si + weights.format_weight * fi + weights.efficiency_weight * ei
             for si, fi, ei in zip(s, fmt, efficiency)]
    out = {"groups": groups, "correct": [j["correct"] for j in judged], "verifiable": s, "format": fmt,
           "efficiency": efficiency, "total": total, "tool_calls": calls, "lengths": lengths, "f_tool": eff["f_tool"],
           "f_len": eff["f_len"]}
    if setup.prm is not None:
        out["prm_steps"] = prm_step_rewards(setup.prm.step_scores([rows[g]["extra_info"]["question"] for g in groups],
                                                                  [episode_steps(e) for e in episodes]))
    return out


def build_samples(views: list[View], rewards: dict, rl: RLConfig,
                  max_groups: int | None = None) -> tuple[list[dict], float]:
    """Training samples with token advantages (target-aligned: position t scores token t+1) and the share of groups with
    a reward spread; samples come from the first `max_groups` such groups only (DAPO fills the batch, then trims it).

    Sequence estimators: A_i from the group, placed on the last sampled token with the PRM token rewards (if any), then
    summed backwards (returns_to_go) so every sampled token, before or after a tool observation, carries it.
    Flow-GRPO: every turn is a sample with its rollout's reward, normalised over all turns of the question's rollouts.
    """
    groups, total = rewards["groups"], rewards["total"]
    # opd: every group carries the teacher's signal
    spread_only = rl.rollout.dynamic_sampling and rl.loss.objective == "reward"
    keep = dynamic_sampling_keep(total, groups) if spread_only else torch.ones(len(views), dtype=torch.bool)
    kept = [i for i in range(len(views)) if keep[i]]
    kept_frac = len({groups[i] for i in kept}) / max(1, len(set(groups)))
    if max_groups is not None:
        first = list(dict.fromkeys(groups[i] for i in kept))[:max_groups]
        kept = [i for i in kept if groups[i] in first]
    if not kept:
        return [], kept_frac
    samples = []
    if rl.loss.estimator == "flow_grpo":
        per_turn = [turn_views(views[i]) for i in kept]
        adv, owner = flow_grpo([groups[i] for i in kept], [total[i] for i in kept], [len(t) for t in per_turn])
        flat = [t for ts in per_turn for t in ts]
        for v, a in zip(flat, adv.tolist()):
            samples.append(make_sample(v.ids, v.loss_mask, [a * m for m in v.loss_mask], v.messages))
        return samples, kept_frac
    seq_adv = ESTIMATORS[rl.loss.estimator]([total[i] for i in kept], [groups[i] for i in kept])
    width = max(len(views[i].ids) for i in kept)
    mask = padded([views[i].loss_mask for i in kept], width)
    token_r = torch.zeros_like(mask)
    last = [max(k for k, m in enumerate(views[i].loss_mask) if m) if any(views[i].loss_mask) else -1 for i in kept]
    if "prm_steps" in rewards:
        ends = torch.zeros_like(mask, dtype=torch.bool)
        for row, i in enumerate(kept):
            for _, end in views[i].turn_spans:
                ends[row, end - 1] = True
        steps = [rewards["prm_steps"][i] for i in kept]
        step_r = padded(steps, max(1, max(map(len, steps))))
        token_r += rl.reward.prm_weight * prmvr_token_rewards(step_r, ends, mask, [0.0] * len(kept),
                                                              [groups[i] for i in kept], mode="PRM",
                                                              baseline=rl.reward.prm_baseline,
                                                              temperature=rl.reward.prm_temperature)
    # opd: the loss adds the teacher's token term
    outcome = rl.opd.outcome_weight if rl.loss.objective == "opd" else 1.0
    for row, k in enumerate(last):
        if k >= 0:
            token_r[row, k] += outcome * float(seq_adv[row])
    _, adv = returns_to_go(token_r, mask)
    for row, i in enumerate(kept):
        n = len(views[i].ids)
        samples.append(make_sample(views[i].ids, views[i].loss_mask, adv[row, :n].tolist(), views[i].messages))
    return samples, kept_frac


# ------------------------------------------------------------------------------------------------------------ loss

def batch_loss(logits: torch.Tensor, batch: dict, rl: RLConfig,
               max_len: int | None = None) -> tuple[torch.Tensor, dict]:
    """policy_loss of a collated batch from its (scaled) logits: clipped PG on loss_mask tokens, + k3 KL if configured;
    with the teacher's log-probs in the batch (on-policy distillation) the advantages gain the teacher term (on the
    sampling policy's log-probs at temperature 1), and the metrics the batch's reverse KL to the teacher
    (`kl_teacher`). `logits`: at the batch's scored_columns (logprobs_of), or at every target position (cut to them
    here: the other positions count in no row)."""
    columns = scored_columns(batch)
    if logits.shape[1] != len(columns):
        logits = logits[:, columns]
    batch = scored_batch(batch, columns)
    logp = token_logprobs(logits, batch["targets"])
    # one update: the sampling policy is this one
    old_logp = batch["old_logp"] if "old_logp" in batch else logp.detach()
    advantages, extra = batch["advantages"], {}
    if "teacher_logp" in batch:  # on-policy distillation (opd.py)
        advantages, extra = with_teacher_term(advantages, logits, logp, batch, rl.rollout.temperature)
    loss_cfg = rl.loss
    loss, metrics = policy_loss(logp, old_logp, advantages, batch["loss_mask"], loss_cfg.clip_low, loss_cfg.clip_high,
                                loss_cfg.dual_clip, batch.get("ref_logp"), loss_cfg.kl_coef, loss_cfg.agg, max_len,
                                logits=logits)
    if "teacher_top_ids" in batch:  # rl.opd.kd_weight
        kd, kd_metrics = top_k_term(logits, batch, rl.opd, rl.rollout.temperature)
        loss, extra = loss + kd, {**extra, **kd_metrics}
    return loss, {**metrics, **extra}


def needs_old_logp(rl: RLConfig) -> bool:
    """Whether the loss needs the sampling policy's log-probs from a forward pass of their own. With one update per step
    (one PPO epoch, one mini-batch) the policy being trained is the one that sampled, so rho = 1 and its log-probs are
    the loss's own, detached (TRL's num_iterations == 1), OPD's teacher term included: a quarter of the step's compute
    saved."""
    return rl.ppo_epochs > 1 or rl.mini_batches > 1


def train_on(trainer: Trainer, samples: list[dict], rl: RLConfig, pad_id: int, rng: random.Random) -> dict:
    """PPO epochs over the step's samples: each mini-batch one optimiser step, its micro-batches (of at most
    rl.micro_batch_size, and at least one a process) weighted by their share of the mini-batch's loss units (tokens
    for token_mean, sequences otherwise)."""
    sums, n_steps = {}, 0
    for _ in range(rl.ppo_epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        size = math.ceil(len(order) / rl.mini_batches)
        for mb in (order[i : i + size] for i in range(0, len(order), size)):
            units = {i: sum(samples[i]["loss_mask"]) if rl.loss.agg == "token_mean" else
                     float(any(samples[i]["loss_mask"])) for i in mb}
            max_len = max(len(samples[i]["ids"]) for i in mb) - 1
            parts = max(math.ceil(len(mb) / rl.micro_batch_size), trainer.acc.num_processes)  # a share each process
            micros, weights = split_batch(mb, parts, units.__getitem__)

            def loss_fn(micro):
                batch = {n: t.to(trainer.device) for n, t in collate([samples[i] for i in micro], pad_id).items()}
                _, logits = logprobs_of(trainer.model, batch, rl.rollout.temperature)
                return batch_loss(logits, batch, rl, max_len)

            for name, v in trainer.step(micros, loss_fn, weights).items():
                sums[name] = sums.get(name, 0.0) + v
            n_steps += 1
    return {name: v / max(1, n_steps) for name, v in sums.items()}


# ------------------------------------------------------------------------------------------------------------ loop

def train_rl(model_dir: str, rows: list[dict], setup: RLSetup, out_dir: str, checkpoint_dir: str,
             on_step=None) -> list[dict]:
    """Train from `model_dir` on the curriculum `rows` as `setup` says, resuming from `checkpoint_dir` if a killed run
    left one there; save to `out_dir` atomically. `on_step`: called with each step's record.

    Several processes: rank 0 rolls out and scores each step exactly as one process would (the same seeds, so the same
    episodes) and hands the samples to every process; the PPO updates are split between them (Trainer.step). Rollouts
    are not spread: at scale they belong to the Ray cluster or verl (docs/scale.md)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rl = setup.rl
    torch.manual_seed(rl.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if rl.loss.kl_coef > 0 else None
    updates = rl.ppo_epochs * rl.mini_batches  # optimiser steps a step
    restart = restart_step(rl)  # after rl.opd.steps of distillation, the RL part as a second run would start
    trainer = Trainer("rl", model, rl.steps * updates, rl, gradient_checkpointing=setup.gradient_checkpointing,
                      on_step=on_step, restart_at=restart * updates)
    if trainer.zero_stage == 3 and trainer.acc.num_processes > 1:
        raise ValueError("params.yaml rl.deepspeed_config: ZeRO-3 shards the policy, but rank 0 rolls "
                         "out with the whole policy; use configs/deepspeed/zero2.json")
    if ref is not None:
        ref.to(trainer.device)
    saved = trainer.load_checkpoint(checkpoint_dir)
    start, pos = (saved["rl_step"], saved["pos"]) if saved else (0, 0)  # pos: prompts of the curriculum drawn so far
    policy = trainer.unwrapped()
    sleeps = trainer.is_main and engine_sleeps(rl.rollout.colocate, rl.rollout.backend, torch.cuda.is_available())
    if sleeps and not rl.deepspeed_config:
        check_colocated_memory(sum(p.numel() for p in policy.parameters()), setup.llm.gpu_memory_utilization,
                               torch.cuda.get_device_properties(trainer.device).total_memory, reference=ref is not None)
    backend = make_rollout_backend(rl.rollout.backend, policy, tok, model_dir, setup.llm, rl.seed,
                                   rl.rollout.batch_size, sleep_mode=sleeps) if trainer.is_main else None
    if start and rl.rollout.backend == "vllm" and trainer.is_main:
        backend.sync(policy)
    rows, probe_rows = split_probe(rows, rl.probe.prompts, rl.seed)
    probe = (lambda: kl_probe(probe_rows, backend, policy, tok, setup, pad_id, trainer.device, trainer.precision)
             ) if probe_rows and trainer.is_main else None
    probed_start = {f"{k}_start": v for k, v in probe().items()} if probe and start == 0 else {}
    for step in range(start, rl.steps):
        now = rl.at_step(step)  # rl.opd.steps: the first steps distil
        if restart and step == restart:
            trainer.forget_moments()
        trainer.model.eval()
        collected = trainer.from_main(collect_step(step, pos, rows, backend, replace(setup, rl=now)) if trainer.is_main
                                      else None)
        samples, times = collected.samples, collected.times
        pos += collected.rounds * rl.rollout.prompts_per_step
        t2 = time.perf_counter()
        metrics = {}
        if sleeps:
            backend.sleep()
        if samples:
            if needs_old_logp(rl):
                attach_logprobs(trainer.model, samples, "old_logp", rl, pad_id, trainer.device, trainer.precision,
                                unscaled_key="old_logp_t1" if now.loss.objective == "opd" else None)
            if now.loss.objective == "opd":
                metrics |= score_with_teacher(samples, setup, tok, trainer)
            if ref is not None:
                attach_logprobs(ref, samples, "ref_logp", rl, pad_id, trainer.device, trainer.precision)
            trainer.model.train()
            metrics |= train_on(trainer, samples, now, pad_id, random.Random(f"{rl.seed}/{step}"))
        if sleeps:
            backend.wake_up(policy if samples else None)
        elif samples and rl.rollout.backend == "vllm" and trainer.is_main:
            backend.sync(policy)
        times["train_s"] = time.perf_counter() - t2
        if probe and ((step + 1) % rl.probe.every == 0 or step + 1 == rl.steps):
            t_probe = time.perf_counter()
            metrics |= probe()
            times["probe_s"] = time.perf_counter() - t_probe
        metrics, probed_start = metrics | probed_start, {}
        trainer.log(step_record(step + 1, collected, metrics, trainer.sched.get_last_lr()[0]))
        if (now.loss.objective == "opd" and trainer.is_main
                and (warning := length_collapse([r for r in trainer.records if "kl_teacher" in r]))):
            print(warning, flush=True)
        if trainer.checkpoint_due((step + 1) * updates):
            trainer.save_checkpoint(checkpoint_dir, {"rl_step": step + 1, "pos": pos, "config": rl.model_dump()})
    with trainer.whole_model() as trained:
        if trainer.is_main:
            save_model(trained, tok, out_dir, lora=False)
            shutil.rmtree(checkpoint_dir, ignore_errors=True)  # finished: only a killed run resumes
    return trainer.records


def collect_step(step: int, pos: int, rows: list[dict], backend, setup: RLSetup) -> Collected:
    """Rollout batches of the step from curriculum position `pos`: one, then (DAPO dynamic sampling) up to `max_refills`
    more while fewer than prompts_per_step groups keep a reward spread. The samples are those of the first
    prompts_per_step kept groups."""
    rl, episode = setup.rl, setup.episode
    per_step, samples, rows_seen, episodes, merged, kept_groups = rl.rollout.prompts_per_step, [], [], [], {}, 0
    times = {"rollout_s": 0.0, "reward_s": 0.0}
    rounds = 0
    while rounds == 0 or (rl.rollout.dynamic_sampling and kept_groups < per_step and rounds <= rl.rollout.max_refills):
        t0 = time.perf_counter()
        batch_rows = step_prompts(rows, pos + rounds * per_step, per_step, rl.seed)
        eps, views = setup.acting(batch_rows, rl.rollout.group_size, backend, episode, rl.seed,
                                  pos // per_step + rounds)
        t1 = time.perf_counter()
        rewards = score_episodes(eps, batch_rows, views, setup, step + 1)
        new, kept_frac = build_samples(views, rewards, rl, max_groups=max(0, per_step - kept_groups))
        times["rollout_s"] += t1 - t0
        times["reward_s"] += time.perf_counter() - t1
        rewards["groups"] = [g + rounds * per_step for g in rewards["groups"]]
        for key, values in rewards.items():
            merged.setdefault(key, []).extend(values)
        samples += new
        rows_seen += batch_rows
        episodes += eps
        kept_groups += round(kept_frac * per_step)
        rounds += 1
    return Collected(samples, rows_seen, episodes, merged, kept_groups / (rounds * per_step), rounds, times)


def step_record(step: int, collected: Collected, metrics: dict, lr: float) -> dict:
    """One row of reports/rl_curve.csv: reward components, behaviour, loss terms, timings, rollout batches."""
    rows, episodes, rewards, times = collected.rows, collected.episodes, collected.rewards, collected.times
    n = len(episodes)
    mean = lambda xs: sum(xs) / max(1, len(xs))
    rec = {"step": step, "level": mean([r["level"] for r in rows]), "episodes": n, "samples": len(collected.samples),
           "reward_total": mean(rewards["total"]), "reward_verifiable": mean(rewards["verifiable"]),
           "reward_format": mean(rewards["format"]), "reward_efficiency": mean(rewards["efficiency"]),
           "reward_prm": mean([mean(s) for s in rewards["prm_steps"]]) if "prm_steps" in rewards else 0.0,
           "accuracy": mean(rewards["correct"]), "tool_call_rate": mean([float(c > 0) for c in rewards["tool_calls"]]),
           "tool_calls_per_episode": mean(rewards["tool_calls"]), "turns_per_episode": mean([e.turn for e in episodes]),
           "response_tokens": mean(rewards["lengths"]), "kept_groups": collected.kept_share, "lr": lr}
    for key in ("pg_loss", "loss", "clip_frac", "approx_kl", "kl_ref", "entropy", "grad_norm"):
        rec[key] = metrics.get(key, 0.0)
    # rl.loss.objective opd
    rec |= {key: metrics[key] for key in ("kl_teacher", "kd_teacher", "teacher_tokens", "teacher_straddling",
                                          "teacher_s") if key in metrics}
    rec |= {key: v for key, v in metrics.items() if key.startswith(("probe_", "teachers."))}  # rl.probe.prompts
    return {**rec, **times, "step_s": sum(times.values()), "rollout_rounds": collected.rounds}
