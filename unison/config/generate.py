"""`generate.*`: the teacher's method, its roles and sampling."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section

# AgentFlow's roles besides the planner (rl.student_role agentflow_planner)
FIXED_MODULES = ("executor", "verifier", "generator")


# generate.method: unison/agents/methods/<name>.py
METHODS = ("single", "self_consistency", "debate", "dylan", "agentverse", "mav", "chain_of_agents", "agentflow", "gap")
# methods that give an agent a new user turn: a chat template
CONVERSING_METHODS = ("debate", "dylan", "agentverse", "mav", "gap")


class SelfConsistencyConfig(Section):
    samples: int = Field(3, description='paths (AgentArk parallel_num: 5, the agentark recipe sets it; the demo takes '
                         '3 for its time budget)')
    aggregator: Literal['vote', 'llm'] = Field('vote', description="vote (free-form majority) | llm (AgentArk's "
                                               "aggregator prompt)")


class DebateConfig(Section):
    agents: int = Field(3)
    rounds: int = Field(2)
    aggregator: Literal['vote', 'llm'] = Field('vote', description='vote | llm')


class DylanConfig(Section):
    agents: int = Field(4)
    rounds: int = Field(3)
    top_k: int = Field(2)
    consensus: float = Field(0.667)


class AgentVerseConfig(Section):
    agents: int = Field(2)
    turns: int = Field(3)
    critic_rounds: int = Field(3)


class MAVConfig(Section):
    solutions: int = Field(2)
    verifiers: int = Field(2)
    verifier_temperature: float = Field(0.0)


class ChainOfAgentsConfig(Section):
    max_cycles: int = Field(2, description='re-plans after a double_check score <= 2')
    accept_score: int = Field(3, description='double_check score (1-4) that lets the answer through')


class AgentFlowConfig(Section):
    max_steps: int = Field(3, description='AgentFlow train TOOL_STEPS (eval uses 10)')


class GAPConfig(Section):
    max_levels: int = Field(3)
    max_parallel: int = Field(4)


class RouteConfig(Section):
    by: str = Field('', description='"" = no routing | task | source | meta.<key>: the question field whose value '
                    'picks the teacher (docs/guide.md, "Several teachers")')
    to: dict[str, str] = Field(default_factory=dict, description="the field's value -> the name of its teacher (a key "
                               "of `teachers`, or teacher for the `teacher` block)")
    default: str = Field('teacher', description="the teacher of a question whose value `to` does not name (with by "
                         "\"\": of every question)")


class GenerateConfig(Section):
    method: Literal[METHODS] = Field('single', description=f"{' | '.join(METHODS)}  (defaults below from the "
                                     "seed systems, docs/seeds.md)")
    samples: int = Field(8, ge=1, description="samples the teacher draws per train question (label keeps those that "
                         "verify: rejection sampling); reports/label.json and the report show the coverage per k")
    stop_at_verified: int = Field(1, ge=0, description="> 0: a question stops drawing samples once this many of its "
                                  "trajectories verify (label's rule judge); 0 = every question draws generate.samples")
    temperature: float = Field(0.7, description="the teacher's sampling temperature (docs/guide.md compares the demo's "
                               "methods at several)")
    top_p: float = Field(1.0, description='< 1 slows decoding on CPU: vLLM sorts the vocabulary per request '
                         '(docs/benchmarks.md)')
    max_turns: int = Field(4)
    max_tokens_per_turn: int = Field(96)
    max_tool_calls: int = Field(3)
    scaffold: dict[str, list[str]] = Field(default_factory=lambda: {'qa': ['search', 'answer'],
                                                                    'math': ['python', 'answer']})
    demonstrations: str = Field('configs/demonstrations/builtin.txt', description='worked examples the teacher\'s '
                                'acting agents see after the system prompt; students never see them, they learn to act '
                                'alone (context distillation); "" = none')
    source: str = Field('', description='"" = the teacher runs generate.method | local:<file>: import SFT trajectories '
                        'from a jsonl/json/parquet file under download.inputs instead (Alpaca, ShareGPT, OpenAI '
                        'messages: docs/guide.md)')
    shard_size: int = Field(64, description='questions per resumable shard (a killed run keeps its finished shards)')
    topk: int = Field(0, ge=0, le=64, description="> 0: keep the teacher's top-k log-probs at the trajectories' "
                      "assistant tokens (data/trajectories/teacher_topk.parquet) for sft.kd_weight; a chat API gives "
                      "at most 20; 0 = none")
    episodes_in_flight: int = Field(256, description='episodes (agents x samples of all running questions) the engine '
                                    'works on at once in generate, evaluate and pareto; the next question starts '
                                    'whenever fewer are live')
    roles: dict[str, dict] = Field(default_factory=dict, description="role -> its own model, e.g. {aggregator: {model: "
                                   "Qwen/Qwen2.5-7B-Instruct, backend: openai}}; other keys override the teacher's "
                                   "llm.*; {} = every role on the teacher")
    route: RouteConfig = Field(default_factory=RouteConfig, description="each train question to the teacher its "
                               "field names (teachers: the named ones besides `teacher`)")
    cascade: list[str] = Field(default_factory=list, description="[cheap, strong, ...]: each teacher in turn on the "
                               "questions none before it verified (label's rule judge); [] = no cascade")
    self_consistency: SelfConsistencyConfig = Field(default_factory=SelfConsistencyConfig,
                                                    description='AgentArk self_consistency: parallel paths, '
                                                    'then an aggregator')
    debate: DebateConfig = Field(default_factory=DebateConfig, description='AgentArk llm_debate')
    dylan: DylanConfig = Field(default_factory=DylanConfig, description='AgentArk DyLAN: 4 agents, 3 rounds, listwise '
                               'top-2 from round 3, 2/3 consensus exit')
    agentverse: AgentVerseConfig = Field(default_factory=AgentVerseConfig, description='AgentArk AgentVerse: 2 agents '
                                         '(solver + critic), 3 turns, up to 3 critique rounds')
    mav: MAVConfig = Field(default_factory=MAVConfig, description='AgentArk multi-agent verification: 2 solutions x 2 '
                           'verifier aspects, verifiers greedy')
    chain_of_agents: ChainOfAgentsConfig = Field(default_factory=ChainOfAgentsConfig, description='AFM: '
                                                 'think/plan/tool/reflection/suggested_answer/double_check role agents')
    agentflow: AgentFlowConfig = Field(default_factory=AgentFlowConfig, description='AgentFlow: planner, executor, '
                                       'verifier, generator with a memory of action steps')
    gap: GAPConfig = Field(default_factory=GAPConfig, description="GAP: a plan of sub-tasks with dependencies; each "
                           "level's queries in one parallel turn")
