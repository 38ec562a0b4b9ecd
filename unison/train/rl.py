"""RL: the GRPO family on multi-turn tool rollouts with the live policy (DESIGN §7; docs/seeds.md: GAP, ET-Agent, AgentArk, Flow-GRPO).

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
from pathlib import Path

import torch

from .. import layout
from ..config import AgentFlowConfig, LabelConfig, LLMConfig, RLConfig
from ..data.schemas import RL_ROW, DataError, read_table
from ..judge import SCORERS
from .advantages import ESTIMATORS, dynamic_sampling_keep, flow_grpo
from .loop import Trainer, autocast
from .opd import attach_teacher_logps, length_collapse, probe_figures, teacher_logps, teacher_term
from .policy_loss import policy_loss, token_logprobs
from .rewards import efficiency_rewards, judge_response, prmvr_token_rewards, returns_to_go, sigma_factor
from .rollout import View, check_colocated_memory, engine_sleeps, episode_view, make_rollout_backend, planner_rollout, rollout, turn_views
from .sft import save_model

# ------------------------------------------------------------------------------------------------------------ data

def load_rl_data(paths: list[str | Path]) -> list[dict]:
    """RL rows of every level file (schema RL_ROW), checked beyond types, in curriculum order (level, then file order)."""
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
                raise DataError(path, f"ability must be one of {sorted(SCORERS)} (a judged task), got {r['ability']!r}", i, "ability")
            if r["level"] < 1:
                raise DataError(path, f"level must be >= 1, got {r['level']}", i, "level")
            rows.append(r)
    return sorted(rows, key=lambda r: r["level"])


def step_prompts(rows: list[dict], start: int, n: int, seed: int) -> list[dict]:
    """Prompts `start`..`start+n-1` of the curriculum: a pass is level 1 rows (shuffled), then level 2, ...; passes repeat."""
    out = []
    for pos in range(start, start + n):
        epoch, i = divmod(pos, len(rows))
        rng = random.Random(f"{seed}/{epoch}")
        order = sorted(range(len(rows)), key=lambda k: (rows[k]["level"], rng.random()))
        out.append(rows[order[i]])
    return out


def split_probe(rows: list[dict], n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(the curriculum without its `n` probe prompts, the probe prompts): drawn with the seed, in curriculum order."""
    if not n:
        return rows, []
    if n >= len(rows):
        raise ValueError(f"rl.probe_prompts {n}: the curriculum (data/rl) has {len(rows)} prompts; hold out fewer")
    held = set(random.Random(f"{seed}/probe").sample(range(len(rows)), n))
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


PROBE_ROUND = -1  # the probe's episodes' seeds (rollout's step): the same at every probe, so only the policy differs


# --------------------------------------------------------------------------------------------------------- rewards

def episode_steps(e) -> list[str]:
    """PRM steps as `label` and `prm` cut them (unison.judge.steps.student_steps): each turn with its tool observations."""
    steps: list[str] = []
    for seg in e.segments:
        if seg.kind == "gen":
            steps.append(seg.text)
        elif steps:
            steps[-1] += seg.text
    return steps


def score_episodes(episodes, rows: list[dict], group_size: int, views: list[View], cfg: RLConfig, label: LabelConfig,
                   tools: tuple[str, ...], step: int, prm=None) -> dict:
    """Every reward component per episode and the scalar reward r = w_v*s + w_f*f_fmt + w_e*s*(f_tool*f_len - 1).

    The efficiency term makes w = 1 everywhere ET-Agent's r = s*f_tool*f_len + f_fmt; the PRM adds token rewards.
    """
    groups = [i // group_size for i in range(len(episodes))]
    judged = [judge_response(rows[g]["ability"], e.text, rows[g]["reward_model"]["ground_truth"], label, tools)
              for e, g in zip(episodes, groups)]
    s, fmt, calls = ([j[k] for j in judged] for k in ("verifiable", "format", "tool_calls"))
    lengths = [v.sampled for v in views]
    factor = sigma_factor(step, cfg.steps) if cfg.sigma_decay else 1.0
    eff = efficiency_rewards(s, calls, lengths, fmt, groups, cfg.sigma_tool * factor, cfg.sigma_len * factor)
    efficiency = [si * (ft * fl - 1) for si, ft, fl in zip(s, eff["f_tool"], eff["f_len"])]
    total = [cfg.verifiable_weight * si + cfg.format_weight * fi + cfg.efficiency_weight * ei for si, fi, ei in zip(s, fmt, efficiency)]
    out = {"groups": groups, "correct": [j["correct"] for j in judged], "verifiable": s, "format": fmt, "efficiency": efficiency,
           "total": total, "tool_calls": calls, "lengths": lengths, "f_tool": eff["f_tool"], "f_len": eff["f_len"]}
    if prm is not None:
        probs = prm.step_scores([rows[g]["extra_info"]["question"] for g in groups], [episode_steps(e) for e in episodes])
        out["prm_steps"] = [[2 * p - 1 for p in row] for row in probs]  # p(good) - p(bad), in [-1, 1]
    return out


def padded(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def build_samples(views: list[View], rewards: dict, cfg: RLConfig, max_groups: int | None = None) -> tuple[list[dict], float]:
    """Training samples with token advantages (target-aligned: position t scores token t+1) and the share of groups with a
    reward spread; samples come from the first `max_groups` such groups only (DAPO fills the batch, then trims it).

    Sequence estimators: A_i from the group, placed on the last sampled token with the PRM token rewards (if any), then
    summed backwards (returns_to_go) so every sampled token, before or after a tool observation, carries it.
    Flow-GRPO: every turn is a sample with its rollout's reward, normalised over all turns of the question's rollouts.
    """
    groups, total = rewards["groups"], rewards["total"]
    spread_only = cfg.dynamic_sampling and cfg.objective == "reward"  # opd: every group carries the teacher's signal
    keep = dynamic_sampling_keep(total, groups) if spread_only else torch.ones(len(views), dtype=torch.bool)
    kept = [i for i in range(len(views)) if keep[i]]
    kept_frac = len({groups[i] for i in kept}) / max(1, len(set(groups)))
    if max_groups is not None:
        first = list(dict.fromkeys(groups[i] for i in kept))[:max_groups]
        kept = [i for i in kept if groups[i] in first]
    if not kept:
        return [], kept_frac
    samples = []
    if cfg.estimator == "flow_grpo":
        per_turn = [turn_views(views[i]) for i in kept]
        adv, owner = flow_grpo([groups[i] for i in kept], [total[i] for i in kept], [len(t) for t in per_turn])
        flat = [t for ts in per_turn for t in ts]
        for v, a in zip(flat, adv.tolist()):
            samples.append(_sample(v.ids, v.loss_mask, [a * m for m in v.loss_mask], v.messages))
        return samples, kept_frac
    seq_adv = ESTIMATORS[cfg.estimator]([total[i] for i in kept], [groups[i] for i in kept])
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
        token_r += cfg.prm_weight * prmvr_token_rewards(step_r, ends, mask, [0.0] * len(kept), [groups[i] for i in kept], mode="PRM",
                                                        baseline=cfg.prm_baseline, temperature=cfg.prm_temperature)
    outcome = cfg.outcome_weight if cfg.objective == "opd" else 1.0  # opd: the loss adds the teacher's token term
    for row, k in enumerate(last):
        if k >= 0:
            token_r[row, k] += outcome * float(seq_adv[row])
    _, adv = returns_to_go(token_r, mask)
    for row, i in enumerate(kept):
        n = len(views[i].ids)
        samples.append(_sample(views[i].ids, views[i].loss_mask, adv[row, :n].tolist(), views[i].messages))
    return samples, kept_frac


def _sample(ids: list[int], loss_mask: list[int], adv: list[float], messages: list[dict]) -> dict:
    """`messages`: the prompt's, for a teacher of another tokenizer to render in its own template (rl.objective opd)."""
    return {"ids": ids, "loss_mask": loss_mask[1:], "advantages": adv[1:], "messages": messages}


# ------------------------------------------------------------------------------------------------------------ loss

def collate(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; target-aligned fields (width - 1) are 0 on padding, so padding never counts."""
    width = max(len(s["ids"]) for s in samples)
    batch = {"input_ids": torch.full((len(samples), width), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(samples), width), dtype=torch.long)}
    for r, s in enumerate(samples):
        batch["input_ids"][r, : len(s["ids"])] = torch.tensor(s["ids"])
        batch["attention_mask"][r, : len(s["ids"])] = 1
    for key in ("loss_mask", "advantages", "old_logp", "old_logp_t1", "ref_logp", "teacher_logp", "teacher_span"):
        if key in samples[0]:
            batch[key] = padded([list(s[key]) for s in samples], width - 1)
    return batch


def logprobs_of(model, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of each next token, temperature-scaled logits) under `model` (the sampling distribution)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float() / temperature
    return token_logprobs(logits, batch["input_ids"][:, 1:]), logits


def batch_loss(logits: torch.Tensor, batch: dict, cfg: RLConfig, max_len: int | None = None) -> tuple[torch.Tensor, dict]:
    """policy_loss of a collated batch from its (scaled) logits: clipped PG on loss_mask tokens, + k3 KL if configured;
    with the teacher's log-probs in the batch (rl.objective opd) the advantages gain the teacher term (teacher_term, on
    the sampling policy's log-probs at temperature 1), and the metrics the batch's reverse KL to the teacher
    (`kl_teacher`)."""
    logp = token_logprobs(logits, batch["input_ids"][:, 1:])
    old_logp = batch["old_logp"] if "old_logp" in batch else logp.detach()  # one update: the sampling policy is this one
    advantages, extra = batch["advantages"], {}
    if "teacher_logp" in batch:
        student = unscaled_logp(logits, logp, batch, cfg.temperature)
        advantages, kl = teacher_term(advantages, batch["teacher_logp"], batch["teacher_span"], student)
        extra = {"kl_teacher": kl.item()}
    loss, metrics = policy_loss(logp, old_logp, advantages, batch["loss_mask"], cfg.clip_low, cfg.clip_high,
                                cfg.dual_clip, batch.get("ref_logp"), cfg.kl_coef, cfg.loss_agg, max_len, logits=logits)
    return loss, {**metrics, **extra}


def unscaled_logp(logits: torch.Tensor, logp: torch.Tensor, batch: dict, temperature: float) -> torch.Tensor:
    """The sampling policy's log-probs at temperature 1 (OPD's teacher term): stored with the policy before the update
    (`old_logp_t1`), else the loss's own (`logp` from `logits` scaled by 1/temperature), detached."""
    if "old_logp_t1" in batch:
        return batch["old_logp_t1"]
    return (logp if temperature == 1 else token_logprobs(logits * temperature, batch["input_ids"][:, 1:])).detach()


def needs_old_logp(cfg: RLConfig) -> bool:
    """Whether the loss needs the sampling policy's log-probs from a forward pass of their own. With one update per step
    (one PPO epoch, one mini-batch) the policy being trained is the one that sampled, so rho = 1 and its log-probs are
    the loss's own, detached (TRL's num_iterations == 1), OPD's teacher term included: a quarter of the step's compute
    saved."""
    return cfg.ppo_epochs > 1 or cfg.mini_batches > 1


@torch.no_grad()
def attach_logprobs(model, samples: list[dict], key: str, cfg: RLConfig, pad_id: int, device, precision: str,
                    unscaled_key: str | None = None) -> None:
    """Each sample's per-token log-probs under `model` (in the training precision, at rl.temperature) as samples[i][key],
    and at temperature 1 as samples[i][unscaled_key] when given."""
    for i in range(0, len(samples), cfg.micro_batch_size):
        chunk = samples[i : i + cfg.micro_batch_size]
        batch = {n: t.to(device) for n, t in collate(chunk, pad_id).items()}
        with autocast(precision, device.type):
            logp, logits = logprobs_of(model, batch, cfg.temperature)
            unscaled = token_logprobs(logits * cfg.temperature, batch["input_ids"][:, 1:]) if unscaled_key else None
        for r, s in enumerate(chunk):
            s[key] = logp[r, : len(s["ids"]) - 1].tolist()
            if unscaled_key:
                s[unscaled_key] = unscaled[r, : len(s["ids"]) - 1].tolist()


def train_on(trainer: Trainer, samples: list[dict], cfg: RLConfig, pad_id: int, rng: random.Random) -> dict:
    """PPO epochs over the step's samples: each mini-batch one optimiser step, its micro-batches weighted by their share
    of the mini-batch's loss units (tokens for token_mean, sequences otherwise)."""
    sums, n_steps = {}, 0
    for _ in range(cfg.ppo_epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        size = math.ceil(len(order) / cfg.mini_batches)
        for mb in (order[i : i + size] for i in range(0, len(order), size)):
            units = {i: sum(samples[i]["loss_mask"]) if cfg.loss_agg == "token_mean" else float(any(samples[i]["loss_mask"])) for i in mb}
            max_len = max(len(samples[i]["ids"]) for i in mb) - 1
            micros = [mb[i : i + cfg.micro_batch_size] for i in range(0, len(mb), cfg.micro_batch_size)]
            weights = [sum(units[i] for i in micro) / max(1e-9, sum(units.values())) for micro in micros]

            def loss_fn(micro):
                batch = {n: t.to(trainer.device) for n, t in collate([samples[i] for i in micro], pad_id).items()}
                _, logits = logprobs_of(trainer.model, batch, cfg.temperature)
                return batch_loss(logits, batch, cfg, max_len)

            for name, v in trainer.step(micros, loss_fn, weights).items():
                sums[name] = sums.get(name, 0.0) + v
            n_steps += 1
    return {name: v / max(1, n_steps) for name, v in sums.items()}


@torch.no_grad()
def kl_probe(probe_rows: list[dict], backend, model, teacher, tok, cfg: RLConfig, toolbox, episode_settings, tools, native,
             pad_id: int, device, precision: str, worked_examples: str) -> dict:
    """The reverse KL to the teacher on the held-out probe prompts (rl.probe_prompts): group_size episodes each, sampled
    as in training with the same seeds at every probe; the student's log-probs at temperature 1 against the teacher's on
    the sampled tokens (probe_figures)."""
    episodes = rollout(probe_rows, cfg.group_size, backend, toolbox, episode_settings, tools, cfg.seed, PROBE_ROUND, native)
    views = [episode_view(e, probe_rows[i // cfg.group_size]["prompt"]) for i, e in enumerate(episodes)]
    samples = [_sample(v.ids, v.loss_mask, [0.0] * len(v.ids), v.messages) for v in views if any(v.loss_mask)]
    if not samples:
        return probe_figures([])
    attach_logprobs(model, samples, "logp", cfg, pad_id, device, precision, unscaled_key="logp_t1")
    attach_teacher_logps(samples, *teacher_logps(teacher, samples, tok, worked_examples))
    return probe_figures(samples)


# ------------------------------------------------------------------------------------------------------------ loop

def train_rl(model_dir: str, rows: list[dict], cfg: RLConfig, toolbox, episode_settings, tools: tuple[str, ...], label: LabelConfig,
             llm: LLMConfig, out_dir: str, checkpoint_dir: str, prm=None, on_step=None, gradient_checkpointing: bool = False,
             teacher=None, worked_examples: str = "", flow: tuple[dict, AgentFlowConfig] | None = None, native=None) -> list[dict]:
    """Train from `model_dir`, resuming from `checkpoint_dir` if a killed run left one there; save to `out_dir` atomically.
    `teacher` (rl.objective opd, rank 0): a backend whose `score` gives the teacher's log-probs of the student's tokens,
    read after `worked_examples` when given (rl.teacher_context: worked_examples). `flow` (rl.student_role
    agentflow_planner, rank 0): the fixed modules' backends by role and the flow's settings (planner_rollout). `native`:
    the student acts in its chat template's tool calls (tool_format.NativeFormat).

    Several processes: rank 0 rolls out and scores each step exactly as one process would (the same seeds, so the same
    episodes) and hands the samples to every process; the PPO updates are split between them (Trainer.step). Rollouts
    are not spread: at scale they belong to the Ray cluster or verl (docs/scale.md)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    trainer = Trainer("rl", model, cfg.steps, cfg, gradient_checkpointing=gradient_checkpointing, on_step=on_step)
    if trainer.zero_stage == 3 and trainer.acc.num_processes > 1:
        raise ValueError("params.yaml rl.deepspeed_config: ZeRO-3 shards the policy, but rank 0 rolls out with the whole "
                         "policy; use configs/deepspeed/zero2.json")
    if ref is not None:
        ref.to(trainer.device)
    saved = trainer.load_checkpoint(checkpoint_dir)
    start, pos = (saved["rl_step"], saved["pos"]) if saved else (0, 0)  # pos: prompts of the curriculum drawn so far
    policy = trainer.unwrapped()
    sleeps = trainer.is_main and engine_sleeps(cfg.colocate, cfg.rollout_backend, torch.cuda.is_available())
    if sleeps and not cfg.deepspeed_config:
        check_colocated_memory(sum(p.numel() for p in policy.parameters()), llm.gpu_memory_utilization,
                               torch.cuda.get_device_properties(trainer.device).total_memory, reference=ref is not None)
    backend = make_rollout_backend(cfg.rollout_backend, policy, tok, model_dir, llm, cfg.seed, cfg.rollout_batch_size,
                                   sleep_mode=sleeps) if trainer.is_main else None
    if start and cfg.rollout_backend == "vllm" and trainer.is_main:
        backend.sync(policy)
    rows, probe_rows = split_probe(rows, cfg.probe_prompts, cfg.seed)
    probe = (lambda: kl_probe(probe_rows, backend, policy, teacher, tok, cfg, toolbox, episode_settings, tools, native, pad_id,
                              trainer.device, trainer.precision, worked_examples)) if probe_rows and trainer.is_main else None
    probed_start = {f"{k}_start": v for k, v in probe().items()} if probe and start == 0 else {}
    for step in range(start, cfg.steps):
        trainer.model.eval()
        collected = (collect_step(step, pos, rows, backend, toolbox, episode_settings, tools, cfg, label, prm, flow, native)
                     if trainer.is_main else None)
        samples, rows_seen, episodes, rewards, kept, rounds, times = trainer.from_main(collected)
        pos += rounds * cfg.prompts_per_step
        t2 = time.perf_counter()
        metrics = {}
        if sleeps:
            backend.sleep()
        if samples:
            if needs_old_logp(cfg):
                attach_logprobs(trainer.model, samples, "old_logp", cfg, pad_id, trainer.device, trainer.precision,
                                unscaled_key="old_logp_t1" if cfg.objective == "opd" else None)
            if cfg.objective == "opd":
                t_teacher = time.perf_counter()
                metrics |= attach_teacher_logps(samples, *trainer.from_main(teacher_logps(teacher, samples, tok, worked_examples) if trainer.is_main else None))
                metrics["teacher_s"] = time.perf_counter() - t_teacher
            if ref is not None:
                attach_logprobs(ref, samples, "ref_logp", cfg, pad_id, trainer.device, trainer.precision)
            trainer.model.train()
            metrics |= train_on(trainer, samples, cfg, pad_id, random.Random(f"{cfg.seed}/{step}"))
        if sleeps:
            backend.wake_up(policy if samples else None)
        elif samples and cfg.rollout_backend == "vllm" and trainer.is_main:
            backend.sync(policy)
        times["train_s"] = time.perf_counter() - t2
        if probe:
            t_probe = time.perf_counter()
            metrics |= probe() | probed_start
            probed_start, times["probe_s"] = {}, time.perf_counter() - t_probe
        rec = step_record(step + 1, rows_seen, episodes, rewards, metrics, kept, len(samples), times, trainer.sched.get_last_lr()[0])
        rec["rollout_rounds"] = rounds
        trainer.log(rec)
        if cfg.objective == "opd" and trainer.is_main and (warning := length_collapse([r for r in trainer.records if "kl_teacher" in r])):
            print(warning, flush=True)
        if trainer.checkpoint_due(step + 1):
            trainer.save_checkpoint(checkpoint_dir, {"rl_step": step + 1, "pos": pos, "config": cfg.model_dump()})
    with trainer.whole_model() as trained:
        if trainer.is_main:
            save_model(trained, tok, out_dir, lora=False)
            shutil.rmtree(checkpoint_dir, ignore_errors=True)  # finished: only a killed run resumes
    return trainer.records


def collect_step(step: int, pos: int, rows: list[dict], backend, toolbox, episode_settings, tools, cfg: RLConfig, label: LabelConfig, prm,
                 flow: tuple[dict, AgentFlowConfig] | None = None, native=None):
    """Rollout batches of the step from curriculum position `pos`: one, then (DAPO dynamic sampling) up to `max_refills` more
    while fewer than prompts_per_step groups keep a reward spread. Returns the samples of the first prompts_per_step kept
    groups, the rows, episodes and rewards of every batch (groups numbered across batches), the share of groups with a
    reward spread, batches and timings."""
    n, samples, rows_seen, episodes, merged, kept_groups, times = cfg.prompts_per_step, [], [], [], {}, 0, {"rollout_s": 0.0, "reward_s": 0.0}
    rounds = 0
    while rounds == 0 or (cfg.dynamic_sampling and kept_groups < n and rounds <= cfg.max_refills):
        t0 = time.perf_counter()
        batch_rows = step_prompts(rows, pos + rounds * n, n, cfg.seed)
        if flow:
            eps, views = planner_rollout(batch_rows, cfg.group_size, backend, flow[0], toolbox, episode_settings, tools, cfg.seed,
                                         pos // n + rounds, flow[1])
        else:
            eps = rollout(batch_rows, cfg.group_size, backend, toolbox, episode_settings, tools, cfg.seed, pos // n + rounds, native)
            views = [episode_view(e, batch_rows[i // cfg.group_size]["prompt"]) for i, e in enumerate(eps)]
        t1 = time.perf_counter()
        rewards = score_episodes(eps, batch_rows, cfg.group_size, views, cfg, label, tools, step + 1, prm)
        new, kept_frac = build_samples(views, rewards, cfg, max_groups=max(0, n - kept_groups))
        times["rollout_s"] += t1 - t0
        times["reward_s"] += time.perf_counter() - t1
        rewards["groups"] = [g + rounds * n for g in rewards["groups"]]
        for key, values in rewards.items():
            merged.setdefault(key, []).extend(values)
        samples += new
        rows_seen += batch_rows
        episodes += eps
        kept_groups += round(kept_frac * n)
        rounds += 1
    return samples, rows_seen, episodes, merged, kept_groups / (rounds * n), rounds, times


def step_record(step: int, rows, episodes, rewards: dict, metrics: dict, kept_frac: float, n_samples: int, times: dict,
                lr: float) -> dict:
    """One row of reports/rl_curve.csv: reward components, behaviour, loss terms, timings."""
    n = len(episodes)
    mean = lambda xs: sum(xs) / max(1, len(xs))
    rec = {"step": step, "level": mean([r["level"] for r in rows]), "episodes": n, "samples": n_samples,
           "reward_total": mean(rewards["total"]), "reward_verifiable": mean(rewards["verifiable"]),
           "reward_format": mean(rewards["format"]), "reward_efficiency": mean(rewards["efficiency"]),
           "reward_prm": mean([mean(s) for s in rewards["prm_steps"]]) if "prm_steps" in rewards else 0.0,
           "accuracy": mean(rewards["correct"]), "tool_call_rate": mean([float(c > 0) for c in rewards["tool_calls"]]),
           "tool_calls_per_episode": mean(rewards["tool_calls"]), "turns_per_episode": mean([e.turn for e in episodes]),
           "response_tokens": mean(rewards["lengths"]), "kept_groups": kept_frac, "lr": lr}
    for key in ("pg_loss", "loss", "clip_frac", "approx_kl", "kl_ref", "entropy", "grad_norm"):
        rec[key] = metrics.get(key, 0.0)
    rec |= {key: metrics[key] for key in ("kl_teacher", "teacher_tokens", "teacher_straddling", "teacher_s") if key in metrics}  # rl.objective opd
    rec |= {key: v for key, v in metrics.items() if key.startswith("probe_")}  # rl.probe_prompts
    return {**rec, **times, "step_s": sum(times.values())}
