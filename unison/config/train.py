"""`train.*` and the training settings sft, dpo and prm share."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Precision, Section


class TrainConfig(Section):
    """How sft, dpo, prm and rl train (on what hardware), not what they learn: one process, or several."""
    num_processes: int = Field(1, ge=1, description="training processes, one per GPU; > 1 = sft, dpo, prm and rl "
                               "re-launch themselves through `accelerate launch` (DeepSpeed with the stage's "
                               "deepspeed_config) and split each step's micro-batches")
    hostfile: str = Field("", description="a DeepSpeed hostfile (`<host> slots=<GPUs>` a line; passwordless ssh and "
                          "pdsh) to train on several machines; needs the stage's deepspeed_config; '' = this machine")
    main_process_ip: str = Field("", description="with a hostfile: the address of rank 0's machine; '' = the "
                                 "hostfile's first host")
    main_process_port: int = Field(29500, ge=0, le=65535, description="rank 0's rendezvous port (accelerate's default "
                                   "29500); 0 = any free port of this machine (one machine only)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward instead of keeping them "
                                         "(transformers' non-reentrant checkpointing): ~1/3 more compute, activation "
                                         "memory from every layer to about one; same results")


class TrainingSettings(Section):
    """How sft, dpo, prm and rl optimise, one set of settings the Trainer (unison/train/loop.py) takes whole; each stage
    keeps its own defaults (they decide its results) and adds what it learns from."""
    seed: int = Field(0, exclude=True, description='the global seed (params.yaml seed), set by Params')
    lr: float = Field(5e-05, description='AdamW peak learning rate')
    schedule: Literal['linear', 'constant'] = Field('linear', description='after warm-up: linear = decay to 0 at the '
                                                    'last step | constant')
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0, description='share of the optimiser steps with a linear warm-up '
                                '(at least one step when > 0); 0 = none')
    weight_decay: float = Field(0.0, ge=0.0, description='AdamW weight decay')
    max_grad_norm: float | None = Field(1.0, description='clip the gradient norm at this; null = no clipping')
    precision: Precision = Field('auto', description='auto = bf16 autocast where the hardware has bf16 matmuls (GPU; '
                                 'CPU with AVX512-BF16/AMX), else fp32 | bf16 | fp32')
    checkpoint_every: int = Field(0, ge=0, description='optimiser steps between checkpoints '
                                  '(data/.cache/<stage>-checkpoint/<settings and inputs hash>) a killed run '
                                  'resumes from; 0 = none')
    deepspeed_config: str = Field('', description='e.g. configs/deepspeed/zero2.json (ZeRO through accelerate)')

    def warmup_steps(self, total: int) -> int:
        """Warm-up steps of a run of `total` optimiser steps."""
        return max(1, int(self.warmup_ratio * total)) if self.warmup_ratio > 0 else 0


class PRMConfig(TrainingSettings):
    enabled: bool = Field(False, description='false = models/prm holds a marker only (then evaluate.rerank_samples 1, '
                          'rl.reward.prm_weight 0)')
    separator: str = Field('\n', description='TRL/AgentArk step separator')
    freeze_backbone: bool = Field(False, description='AgentArk fix_llm: train only the head')
    epochs: int = Field(1, description='passes over the step-labelled trajectories')
    batch_size: int = Field(8)
    max_length: int = Field(1024, description='training examples are cut here (steps past it lose their labels)')
    eval_fraction: float = Field(0.2, description='held-out share of questions (split by question id) for '
                                 'reports/prm.json')


class SFTConfig(TrainingSettings):
    max_per_question: int = Field(2)
    dedupe: bool = Field(True)
    lora: bool = Field(False)
    lora_r: int = Field(16)
    lora_alpha: int = Field(32)
    epochs: int = Field(3, description='passes over the correct teacher trajectories')
    batch_size: int = Field(4)
    grad_accum: int = Field(1, ge=1, description='micro-batches per optimiser step (with DeepSpeed: its '
                            'gradient accumulation)')
    max_length: int = Field(768)
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0, description="share of the optimiser steps with a linear warm-up "
                                "(the demo: its first step)")
    packing: bool = Field(False, description='true = several examples per row of up to max_length (positions restart, '
                          'attention never crosses examples), fewer pad tokens; false = a row each, their shared first '
                          'tokens run once')
    kd_weight: float = Field(0.0, ge=0.0, description="> 0: logit distillation, loss = cross-entropy + kd_weight x "
                             "divergence from the teacher's top-k (needs generate.topk > 0)")
    kd_loss: Literal['forward_kl', 'jsd'] = Field('forward_kl', description="forward_kl (teacher || student) | jsd, "
                                                  "both over the teacher's top-k tokens renormalised")


class DPOConfig(TrainingSettings):
    enabled: bool = Field(False, description='the demo has ~1 sample per question, so pairs are rare; false = '
                          'models/dpo holds a marker only')
    loss: Literal['sigmoid', 'ipo'] = Field('sigmoid', description='sigmoid (DPO) | ipo')
    beta: float = Field(0.1)
    lr: float = Field(5e-06, description='AFM: 1e-6 at 32B')
    schedule: Literal['linear', 'constant'] = Field('constant')
    epochs: int = Field(2, description='AFM: 4')
    batch_size: int = Field(4, description='pairs per optimiser step')
    max_length: int = Field(768)
    max_pairs_per_question: int = Field(2)
    lora: bool = Field(False)
    lora_r: int = Field(16)
    lora_alpha: int = Field(32)
