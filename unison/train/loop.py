"""The one training loop of sft, dpo, prm and rl: each trainer supplies its batches and its loss, this does the rest.

`Trainer` holds what every trainer repeated: the accelerator (a DeepSpeed json works on GPUs), AdamW over the trainable
parameters, an lr schedule, micro-batch accumulation, bf16 autocast where the hardware has it, gradient clipping,
checkpoint and resume, a progress line with rate and ETA, and the step records that become the loss CSV. `fit` runs
epochs of pre-built batches through it (sft, dpo, prm); rl calls `Trainer.step` itself between rollouts.

Several processes (launch.py: train.num_processes, accelerate launch): every process builds the same steps, and each
runs every num_processes-th micro-batch of a step; losses are weighted so that the averaged gradient, the step's
metrics and so the loss curve are the one-process run's (`Trainer.step`). Only rank 0 prints, logs and writes.

    trainer = Trainer("sft", model, len(steps), SFTConfig(lr=5e-5))  # any section of TrainingSettings
    records = fit(trainer, steps, loss_fn)        # steps: per optimiser step, its micro-batches
    trainer.unwrapped()                           # the trained model
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .. import layout
from ..config import TrainingSettings
from ..data.schemas import atomic_dir, atomic_path

SHOWN = ("loss", "reward_total", "accuracy", "kl_teacher", "probe_kl", "tool_calls_per_episode", "kept_groups",
         "lr")  # on the progress line

LossFn = Callable[[object], "tuple[torch.Tensor, dict]"]  # micro-batch -> (loss, metrics of that micro-batch)


def bf16_supported() -> bool:
    """bf16 matmuls in hardware: a CUDA GPU that has them, or a CPU with AVX512-BF16/AMX (oneDNN). Without them a CPU
    emulates bf16 hundreds of times slower than fp32 (docs/benchmarks.md, "Facts about the CPU stack"), so auto means
    fp32 there."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(precision: str, param: str) -> str:
    """"bf16" or "fp32" for a setting of auto | bf16 | fp32 (the config's Literal); `param` names the setting in
    errors."""
    if precision == "fp32":
        return "fp32"
    if bf16_supported():
        return "bf16"
    if precision == "bf16":
        raise ValueError(f"params.yaml {param}: bf16 asked for, but this device has no bf16 matmuls "
                         "(CPU without AVX512-BF16/AMX, or an old GPU); use auto or fp32")
    return "fp32"


def make_accelerator(deepspeed_config: str = "", grad_accum: int = 1, param: str = "sft.deepspeed_config"):
    """An Accelerator on the GPU if there is one (else the CPU; several processes: gloo); with a DeepSpeed json, a
    DeepSpeed engine whose gradient accumulation is this process's share of `grad_accum` micro-batches. Losses reach
    backward already weighted (Trainer.step), so neither divides them by the accumulation. `param` names the setting
    in errors."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs

    # the schedule steps once an optimiser step (accelerate would step it once per process: a batch N times as large)
    if not deepspeed_config:
        # buffers (rotary frequencies) are constants, and processes run different numbers of forwards in a step: no
        # broadcast of them at every forward, which would pair one process's forward with another's
        ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
        return Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[ddp],
                           step_scheduler_with_optimizer=False)
    ds, launched = read_deepspeed_config(deepspeed_config, param), int(os.environ.get("WORLD_SIZE", "1"))
    ds["gradient_accumulation_steps"] = math.ceil(grad_accum / launched)
    acc = Accelerator(gradient_accumulation_steps=ds["gradient_accumulation_steps"],
                      deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds), step_scheduler_with_optimizer=False)
    if acc.num_processes != launched:  # seen on CPU: each launched process a DeepSpeed world of its own
        raise RuntimeError(f"params.yaml {param}: DeepSpeed formed a group of {acc.num_processes} of the "
                           f"{launched} launched processes (without GPUs accelerate does not join them); leave it "
                           "empty to train on several CPU processes")
    return acc


def read_deepspeed_config(deepspeed_config: str, param: str) -> dict:
    """A DeepSpeed json as a dict; FileNotFoundError / ValueError naming `param`."""
    path = Path(deepspeed_config)
    if not path.is_file():
        raise FileNotFoundError(f"params.yaml {param}: no DeepSpeed config at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"params.yaml {param}: {path} is not valid JSON ({e})") from None


def split_batch(items: list, parts: int, units: Callable[[object], float]) -> tuple[list[list], list[float]]:
    """One optimiser step's batch as up to `parts` contiguous micro-batches (one per process) and their weights, each
    micro-batch's share of the batch's loss units (`units(item)`: pairs, labeled steps): a mean over the whole batch is
    then the weighted sum of the micro-batches' means. One part: the batch itself, weight 1."""
    size = math.ceil(len(items) / parts)
    micros = [items[i : i + size] for i in range(0, len(items), size)]
    total = sum(units(x) for x in items)
    return micros, [sum(units(x) for x in m) / total if total else 1 / len(micros) for m in micros]


def lr_schedule(schedule: str, total: int, warmup: int) -> Callable[[int], float]:
    """lr factor at step s: linear warm-up over `warmup` steps (none at 0), then linear decay to 0 at `total` or
    constant."""
    if schedule == "constant":
        return lambda s: min(1.0, (s + 1) / max(1, warmup))
    return lambda s: min((s + 1) / warmup if warmup else math.inf, max(0.0, (total - s) / max(1, total - warmup)))


def autocast(precision: str, device_type: str):
    """bf16 autocast for precision "bf16" (weights and optimiser stay fp32), else nothing."""
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Trainer:
    """Optimiser steps of one model: `step(micro_batches, loss_fn)` accumulates, clips, steps and returns the
    metrics."""

    def __init__(self, name: str, model, total_steps: int, settings: TrainingSettings, *, grad_accum: int = 1,
                 gradient_checkpointing: bool = False, on_step: Callable[[dict], None] | None = None,
                 restart_at: int = 0):
        """`settings`: the stage's section of params.yaml (its TrainingSettings fields); `name` the stage, for
        errors. `restart_at` > 0: the lr schedule runs over the first restart_at optimiser steps, then again over the
        rest (with `forget_moments` there, the rest trains as a second run would)."""
        self.name, self.total, self.max_grad_norm, self.on_step = name, total_steps, settings.max_grad_norm, on_step
        self.checkpoint_every = settings.checkpoint_every
        self.precision = resolve_precision(settings.precision, f"{name}.precision")
        self.acc = make_accelerator(settings.deepspeed_config, grad_accum, param=f"{name}.deepspeed_config")
        self.deepspeed = self.acc.state.deepspeed_plugin is not None
        self.zero_stage = self.acc.state.deepspeed_plugin.zero_stage if self.deepspeed else 0
        self.is_main = self.acc.is_main_process
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainable = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel over all the parameters (torch's default on CPU loops over them one tensor at a time)
        opt = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay, fused=True)
        first = restart_at or total_steps
        before = lr_schedule(settings.schedule, first, settings.warmup_steps(first))
        after = lr_schedule(settings.schedule, total_steps - first, settings.warmup_steps(total_steps - first))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: before(s) if s < first else after(s - first))
        self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
        self.device = self.acc.device
        self.steps_done, self.records, self.t0 = 0, [], time.perf_counter()
        self.resumed_at, self.resumed_s = 0, 0.0  # the step and elapsed time a resumed run started from

    def checkpoint_due(self, done: int) -> bool:
        """Whether a checkpoint is written after `done` steps: every `checkpoint_every`, never after the last one."""
        return bool(self.checkpoint_every) and done % self.checkpoint_every == 0 and done < self.total

    def step(self, micro_batches: list, loss_fn: LossFn, weights: list[float] | None = None) -> dict:
        """One optimiser step over `micro_batches`, the whole step's (every process passes the same list): this process
        runs micro-batches rank, rank + P, ... (P processes). Each loss counts with its weight (given, else 1/len: the
        mean of the micro-batches' losses) times P, since the gradient is averaged over the processes: the update is
        the one-process update for any P. A process left without a micro-batch runs the first with weight 0 (every
        process joins the gradient reduction). Then clip and step. Returns the weighted mean metrics of all the
        micro-batches (summed over processes), plus the loss backpropagated, grad_norm and lr."""
        n, procs = len(micro_batches), self.acc.num_processes
        weights = weights or [1.0 / n] * n
        mine = [(k, weights[k] * procs) for k in range(self.acc.process_index, n, procs)] or [(0, 0.0)]
        sums, total_w = {}, 0.0
        for j, (k, scale) in enumerate(mine):
            last = j == len(mine) - 1  # gradients are reduced (and DeepSpeed steps) once, after this process's last
            self.acc.sync_gradients = last
            with contextlib.nullcontext() if last else self.acc.no_sync(self.model):
                with autocast(self.precision, self.device.type):
                    loss, metrics = loss_fn(micro_batches[k])
                self.acc.backward(loss * scale, **({"scale_wrt_gas": False} if self.deepspeed else {}))
            w = scale / procs
            for key, v in {**metrics, "loss": loss.item()}.items():  # the loss backpropagated, whatever a metric says
                sums[key] = sums.get(key, 0.0) + float(v) * w
            total_w += w
        keys = sorted(sums)
        *values, total_w = self.summed([sums[key] for key in keys] + [total_w])
        out = {key: v / max(1e-9, total_w) for key, v in zip(keys, values)}
        if self.max_grad_norm is not None:
            out["grad_norm"] = float(self.acc.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.steps_done += 1
        out["lr"] = self.sched.get_last_lr()[0]
        return out

    def forget_moments(self) -> None:
        """AdamW starts again: its moment estimates and step counts are dropped, the weights kept."""
        opt = self.opt
        while hasattr(opt, "optimizer"):  # accelerate's and DeepSpeed's wrappers
            opt = opt.optimizer
        opt.state.clear()

    def summed(self, values: list[float]) -> list[float]:
        """`values` summed over the processes (as they are with one)."""
        if self.acc.num_processes == 1:
            return values
        return self.acc.reduce(torch.tensor(values, dtype=torch.float64, device=self.device), reduction="sum").tolist()

    def from_main(self, value):
        """Rank 0's `value` (any picklable object) on every process; with one process, `value`."""
        if self.acc.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value])[0]

    def log(self, record: dict) -> dict:
        """Stamp a step record (step, elapsed_s), keep it; rank 0 prints the progress line and passes it to on_step."""
        # rl counts its own steps
        record = {"step": self.steps_done, **record, "elapsed_s": time.perf_counter() - self.t0}
        self.records.append(record)
        if not self.is_main:
            return record
        step = record["step"]
        per_step = (record["elapsed_s"] - self.resumed_s) / max(1, step - self.resumed_at)
        rate = f" {record['tokens_seen'] / record['elapsed_s']:.0f} tok/s" if record.get("tokens_seen") else ""
        shown = " ".join(f"{k} {record[k]:.4g}" for k in SHOWN if k in record)
        print(f"{self.name} step {step}/{self.total} {shown} {per_step:.2f}s/step{rate} "
              f"eta {per_step * (self.total - step) / 60:.1f} min", flush=True)
        if self.on_step:
            self.on_step(record)
        return record

    def save_checkpoint(self, directory: str | Path, extra: dict | None = None) -> None:
        """Model, optimiser, schedule and RNG states, the records and `extra`, atomically (a kill leaves the old one).
        Every process writes its part into rank 0's temp dir (several machines: `directory` on a shared filesystem)."""
        with atomic_dir(directory) if self.is_main else contextlib.nullcontext() as tmp:
            tmp = Path(self.from_main(str(tmp)))
            self.acc.save_state(str(tmp))
            if self.is_main:
                (tmp / "state.json").write_text(json.dumps({"step": self.steps_done, "records": self.records,
                                                            "extra": extra or {}}))
            self.acc.wait_for_everyone()

    def load_checkpoint(self, directory: str | Path) -> dict | None:
        """Resume from a checkpoint `save_checkpoint` wrote, returning its `extra`; None when there is none."""
        directory = Path(directory)
        if not (directory / "state.json").exists():
            return None
        self.acc.load_state(str(directory))
        saved = json.loads((directory / "state.json").read_text())
        self.steps_done, self.records = saved["step"], saved["records"]
        self.resumed_at = self.records[-1]["step"] if self.records else 0
        self.resumed_s = self.records[-1]["elapsed_s"] if self.records else 0.0
        self.t0 = time.perf_counter() - self.resumed_s
        if self.is_main:
            print(f"{self.name}: resumed from {directory} at step {self.resumed_at}", flush=True)
        return saved["extra"]

    def unwrapped(self):
        return self.acc.unwrap_model(self.model)

    @contextlib.contextmanager
    def whole_model(self):
        """The unwrapped model with all its weights while the block runs (ZeRO-3 gathers its shards on every process:
        every process enters it; rank 0 saves inside), then every process waits for the others."""
        model = self.unwrapped()
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
                yield model
        else:
            yield model
        self.acc.wait_for_everyone()


def epoch_batches(n: int, batch_size: int, epochs: int, seed: int) -> list[list[list[int]]]:
    """Per epoch, indices 0..n-1 shuffled (one seeded stream over all epochs) and cut into batches of `batch_size`."""
    rng, out = random.Random(seed), []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        out.append([order[i : i + batch_size] for i in range(0, n, batch_size)])
    return out


def fit(trainer: Trainer, steps: list[list], loss_fn: LossFn, steps_per_epoch: int, *,
        weights: list[list[float]] | None = None, record: Callable[[list, dict], dict] | None = None,
        checkpoint_dir: str | Path | None = None) -> list[dict]:
    """Run `steps` (each optimiser step's micro-batches, every epoch's in order; `weights[i]`: step i's micro-batch
    weights, else their mean) from wherever a checkpoint in `checkpoint_dir` left off, checkpointing every
    `checkpoint_every` steps of the trainer's settings; `record(micro_batches, metrics)` adds a trainer's own fields to
    a step record (its "real_tokens", the non-pad tokens of the step, give the progress line a rate). The checkpoint is
    removed once the last step is done: only a killed run resumes."""
    if checkpoint_dir:
        trainer.load_checkpoint(checkpoint_dir)
    trainer.model.train()
    seen = sum(r.get("real_tokens", 0) for r in trainer.records)
    for i in range(trainer.steps_done, len(steps)):
        metrics = trainer.step(steps[i], loss_fn, weights[i] if weights else None)
        extra = record(steps[i], metrics) if record else {}
        seen += extra.get("real_tokens", 0)
        epoch = i // steps_per_epoch + (i % steps_per_epoch + 1) / steps_per_epoch
        trainer.log({"epoch": epoch, **metrics, **extra, **({"tokens_seen": seen} if seen else {})})
        if checkpoint_dir and trainer.checkpoint_due(i + 1):
            trainer.save_checkpoint(checkpoint_dir)
    trainer.acc.wait_for_everyone()
    if checkpoint_dir and trainer.is_main:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    trainer.model.eval()
    return trainer.records


def run_key(params: dict, files: Iterable[Path]) -> str:
    """Hash of the settings and the bytes of the input files: a checkpoint is only resumed by the same run."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for path in files:
        h.update(str(path).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def checkpoint_path(stage: str, settings: dict, files: Iterable[Path]) -> str:
    """Where a stage's run keeps the checkpoint a re-run after a kill resumes from:
    data/.cache/<stage>-checkpoint/<key>, the key hashing `settings` and the bytes of the input `files` (run_key)."""
    return f"{layout.CACHE}/{stage}-checkpoint/{run_key(settings, files)}"


def write_records_csv(records: list[dict], path: str | Path, fields: list[str] | None = None) -> None:
    """Step records as a CSV (atomically): `fields`, else every key of the records in the order first seen (a key only
    some steps have, such as rl.probe.every's probe, leaves the other rows' cells empty)."""
    path = Path(path)
    tmp = atomic_path(path)
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields or list(dict.fromkeys(k for r in records for k in r)) or ["step"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    tmp.replace(path)
