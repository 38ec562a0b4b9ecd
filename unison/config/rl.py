"""`rl.*`: reinforcement learning on the student's own tool rollouts, its settings grouped as what they are: the
rollouts, the rewards, the loss (objective and estimator), on-policy distillation, the KL probe and verl's cluster."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section
from .train import TrainingSettings

VERL_AGENT_LOOP = "unison_agent"  # the name unison's agent loop registers with verl (unison/train/verl_agent.py)
# one advantage per rollout: unison/train/advantages.py ESTIMATORS, verl_trainer.py's map
SEQUENCE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
RL_ESTIMATORS = (*SEQUENCE_ESTIMATORS, "flow_grpo")  # rl.loss.estimator


class RolloutSettings(Section):
    group_size: int = Field(4, description='rollouts per prompt (seeds: 8)')
    prompts_per_step: int = Field(4, description='curriculum: data/rl level 1 prompts first, then level 2, ...')
    temperature: float = Field(1.0, description="the loss's ratio scores tokens under the same temperature, opd's "
                               "teacher term compares student and teacher at temperature 1 (a teacher scores at 1)")
    top_p: float = Field(1.0)
    max_turns: int = Field(4)
    max_tokens_per_turn: int = Field(96)
    max_tool_calls: int = Field(3)
    dynamic_sampling: bool = Field(True, description='DAPO: drop groups whose rewards are all equal')
    max_refills: int = Field(2, description='DAPO: up to this many more rollout batches (next curriculum prompts) '
                             'while fewer than prompts_per_step groups are kept (verl max_num_gen_batches - 1); 0 = '
                             'train on what is kept')
    backend: Literal['vllm', 'transformers'] = Field('vllm', description='vllm (weights pushed into the engine after '
                                                     'each update) | transformers (the live model)')
    batch_size: int = Field(32, description='transformers: sequences per generate call')
    colocate: Literal['auto', 'sleep', 'off'] = Field('auto', description="vllm rollouts on the policy's GPU: sleep = "
                                                      "the engine frees its GPU memory while the policy trains, then "
                                                      "wakes with the new weights; auto = sleep on CUDA, else off; off "
                                                      "= it keeps its memory")

    @model_validator(mode="after")
    def _sleep_needs_vllm(self):
        if self.colocate == "sleep" and self.backend != "vllm":
            raise ValueError("rl.rollout.colocate: sleep puts the vLLM engine to sleep, but rl.rollout.backend is "
                             f"{self.backend!r}; set rl.rollout.backend: vllm or rl.rollout.colocate: auto")
        return self


class RewardSettings(Section):
    """r = verifiable_weight*s + format_weight*f_fmt + efficiency_weight*s*(f_tool*f_len - 1) (+ PRM token rewards);
    all weights 1 = ET-Agent's s*f_tool*f_len + f_fmt."""
    verifiable_weight: float = Field(1.0, description="s = the label judge's score (label.qa_metric, math-verify)")
    format_weight: float = Field(1.0, description='f_fmt = -1 when the response breaks the protocol')
    efficiency_weight: float = Field(0.0, description='ET-Agent tool/length efficiency')
    sigma_tool: float = Field(0.2)
    sigma_len: float = Field(0.5)
    sigma_decay: bool = Field(True, description='sigmas x (T - step)/(T - 1)')
    prm_weight: float = Field(0.0, description='> 0: AgentArk PRMVR step rewards from models/prm (soft-min, '
                              'leave-one-out baseline)')
    prm_temperature: float = Field(0.1)
    prm_baseline: Literal['token', 'step'] = Field('token', description='token | step')


class LossSettings(Section):
    objective: Literal['reward', 'opd'] = Field('reward', description="reward = the estimator's advantages of "
                                                "rl.reward | opd = on-policy distillation: teacher minus student "
                                                "log-prob on every sampled token (docs/design.md §7), plus "
                                                "rl.opd.outcome_weight x advantage")
    estimator: Literal[RL_ESTIMATORS] = Field('grpo', description=f"{' | '.join(RL_ESTIMATORS)} (flow_grpo, "
                                              "AgentFlow's: every assistant turn a sample with the final reward)")
    agg: Literal['token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum_norm'] = Field(
        'token_mean', description='token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (Dr.GRPO)')
    clip_low: float = Field(0.2, description='DAPO clip-higher: 0.2 / 0.28')
    clip_high: float = Field(0.28)
    dual_clip: float | None = Field(10.0, description='null = off')
    kl_coef: float = Field(0.0, description='> 0: k3 KL to a frozen copy of the SFT model (AgentFlow 0.001; GAP none)')


class OPDSettings(Section):
    outcome_weight: float = Field(0.0, ge=0.0, description='weight of the verifiable-reward advantage beside the '
                                  'teacher term; 0 = pure distillation')
    steps: int = Field(0, ge=0, description="rl.loss.objective reward: the first rl.opd.steps steps distil on-policy "
                       "as objective opd does (with these settings), the rest train on the rewards, in one run; 0 = "
                       "none")
    switch: Literal['restart', 'continue'] = Field('restart', description="steps > 0: restart = the RL steps start as "
                                                   "a second run would (fresh AdamW moments, the lr schedule again) | "
                                                   "continue = one optimiser and schedule")
    kd_weight: float = Field(0.0, ge=0.0, description="> 0 adds kd_weight x the divergence from the teacher's top-k at "
                             "each sampled token (on-policy logit distillation): it raises teacher tokens the student "
                             "never samples; same vocabulary only")
    kd_topk: int = Field(8, ge=1, description="kd_weight > 0: the teacher's likeliest tokens kept at each position")
    kd_loss: Literal['forward_kl', 'jsd'] = Field('forward_kl', description="kd_weight > 0: forward_kl (teacher || "
                                                  "student) | jsd, both over the teacher's top-k renormalised (as "
                                                  "sft.kd_loss)")
    teacher_context: Literal['student', 'worked_examples'] = Field('student', description="what the teacher reads "
                                                                   "before the student's completion: student = the "
                                                                   "student's own prompt | worked_examples = that "
                                                                   "prompt with generate.demonstrations (context "
                                                                   "distillation)")


class ProbeSettings(Section):
    prompts: int = Field(0, ge=0, description="> 0: curriculum prompts (seeded) held out of training; the reverse KL "
                         "to the teacher on rl.rollout.group_size fixed-seed episodes each, before step 1 and after "
                         "each step; 0 = off")
    every: int = Field(1, ge=1, description="the probe runs after every Nth step and after the last one (it costs "
                       "group_size episodes a held-out prompt)")


class VerlSettings(Section):
    nnodes: int = Field(1, ge=1, description='trainer.nnodes')
    gpus_per_node: int = Field(8, ge=1, description='trainer.n_gpus_per_node')
    max_prompt_length: int = Field(1024, ge=1, description='data.max_prompt_length (tokens)')
    max_response_length: int = Field(2048, ge=1, description='data.max_response_length, tool observations included '
                                     '(tokens)')


class RLConfig(TrainingSettings):
    trainer: Literal['unison', 'verl'] = Field('unison', description='unison = the in-house loop (one machine, '
                                               'tests) | verl = verl\'s PPO trainer on its Ray cluster over '
                                               'data/export/verl (pip install verl; docs/scale.md "RL through verl")')
    student_role: Literal['agent', 'agentflow_planner'] = Field('agent', description="agent = the student acts alone | "
                                                                "agentflow_planner = the student plans AgentFlow's "
                                                                "flow (generate.agentflow), only its turns trained; "
                                                                "generate.roles' executor, verifier and "
                                                                "generator do the rest")
    steps: int = Field(24, description='optimiser steps (docs/results.md has what fewer and more did)')
    lr: float = Field(1e-05, description="the demo's 135M student; GAP/AgentFlow 1e-6, AgentArk 5e-7 at 3-7B")
    schedule: Literal['linear', 'constant'] = Field('constant')
    weight_decay: float = Field(0.1, ge=0.0)
    ppo_epochs: int = Field(1)
    mini_batches: int = Field(1, description='optimiser steps per epoch')
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward; their shared first tokens "
                                  "(the tools' schemas) run once, so a whole step in one is fastest (memory)")
    checkpoint_every: int = Field(1, ge=0, description='steps; to data/.cache/rl-checkpoint/<params+inputs hash>, '
                                  'resumed by a re-run')
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="the student's live multi-turn "
                                     "tool episodes")
    reward: RewardSettings = Field(default_factory=RewardSettings, description='r = verifiable_weight*s + '
                                   'format_weight*f_fmt + efficiency_weight*s*(f_tool*f_len - 1) (+ PRM token '
                                   "rewards); all weights 1 = ET-Agent's s*f_tool*f_len + f_fmt")
    loss: LossSettings = Field(default_factory=LossSettings, description='the objective, the advantage estimator and '
                               'the clipped policy loss')
    opd: OPDSettings = Field(default_factory=OPDSettings, description='on-policy distillation (loss.objective opd, or '
                             'its first opd.steps steps)')
    probe: ProbeSettings = Field(default_factory=ProbeSettings, description='the reverse KL to the teacher on '
                                 'held-out prompts')
    verl: VerlSettings = Field(default_factory=VerlSettings, description="trainer verl: verl's cluster and lengths")

    @property
    def distils(self) -> bool:
        """Whether some step distils on-policy: objective opd, or its first opd.steps steps."""
        return self.loss.objective == "opd" or self.opd.steps > 0

    @property
    def scores_with_teacher(self) -> bool:
        """Whether the teacher block scores the student's tokens: opd's advantage, or the KL probe."""
        return self.distils or self.probe.prompts > 0

    def at_step(self, step: int) -> RLConfig:
        """The settings of step `step` (0-based): objective opd during the first opd.steps steps, these after."""
        if step >= self.opd.steps:
            return self
        return self.model_copy(update={"loss": self.loss.model_copy(update={"objective": "opd"}),
                                       "opd": self.opd.model_copy(update={"steps": 0})})

    @model_validator(mode="after")
    def _rules(self):
        loss, opd = self.loss, self.opd
        if self.distils and (loss.estimator == "flow_grpo" or self.trainer == "verl"):
            raise ValueError("rl.loss.objective opd and rl.opd.steps run on rl.trainer unison with a sequence "
                             f"estimator ({' | '.join(SEQUENCE_ESTIMATORS)}) for the outcome term")
        if opd.steps and loss.objective == "opd":
            raise ValueError(f"rl.opd.steps {opd.steps} starts an RL run with on-policy distillation, but "
                             "rl.loss.objective is opd already: every step distils; set rl.loss.objective: reward or "
                             "rl.opd.steps: 0")
        if opd.steps and opd.steps >= self.steps:
            raise ValueError(f"rl.opd.steps {opd.steps} leaves none of rl.steps {self.steps} to RL: set "
                             "rl.loss.objective: opd for a run of distillation only, or fewer rl.opd.steps")
        if opd.kd_weight > 0 and not self.distils:
            raise ValueError("rl.opd.kd_weight > 0 distils the teacher's top-k on the student's own episodes, a part "
                             "of on-policy distillation: set rl.loss.objective: opd (or rl.opd.steps), or "
                             "rl.opd.kd_weight: 0")
        if self.reward.prm_weight > 0 and loss.estimator == "flow_grpo":
            raise ValueError("rl.reward.prm_weight > 0 needs a sequence estimator "
                             f"({' | '.join(SEQUENCE_ESTIMATORS)}), not flow_grpo")
        if self.student_role == "agentflow_planner" and (loss.estimator != "flow_grpo" or self.trainer != "unison"):
            raise ValueError("rl.student_role agentflow_planner trains the planner's turns of a flow, each its own "
                             "prompt: it needs rl.loss.estimator flow_grpo on rl.trainer unison")
        if self.probe.prompts and (self.trainer == "verl" or self.student_role != "agent"):
            raise ValueError("rl.probe.prompts measures the KL of a student acting alone on rl.trainer unison "
                             "(rl.student_role agent)")
        if self.trainer == "verl":
            self._verl_rules()
        return self

    def _verl_rules(self) -> None:
        """What verl's trainer cannot honour (unison/train/verl_trainer.py maps the rest)."""
        if self.loss.estimator == "flow_grpo":
            raise ValueError("rl.loss.estimator: 'flow_grpo' has no verl estimator with rl.trainer verl (one of "
                             f"{', '.join(SEQUENCE_ESTIMATORS)}; flow_grpo runs with rl.trainer: unison)")
        if self.reward.efficiency_weight or self.reward.prm_weight:
            raise ValueError("rl.reward.efficiency_weight and rl.reward.prm_weight must be 0 with rl.trainer verl: "
                             "the ET-Agent efficiency term and the PRM are relative to a response's group, and verl's "
                             "reward function scores one response at a time")
        if self.loss.dual_clip is None:
            raise ValueError("rl.loss.dual_clip: verl always applies dual clip (actor.clip_ratio_c); give a value")
        if self.rollout.prompts_per_step % self.mini_batches:
            raise ValueError(f"rl.mini_batches ({self.mini_batches}) must divide rl.rollout.prompts_per_step "
                             f"({self.rollout.prompts_per_step}) with rl.trainer verl "
                             "(actor.ppo_mini_batch_size is in prompts)")
        if self.schedule != "constant" or self.max_grad_norm is None:
            raise ValueError("rl.schedule: trainer verl's optimiser warms up then holds the lr constant "
                             "and always clips; set rl.schedule: constant and a rl.max_grad_norm")
