"""`label.*`: how trajectories are judged and labelled."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class LabelConfig(Section):
    qa_metric: Literal['em', 'subem', 'f1'] = Field('subem', description='em | subem | f1  (the one that '
                                                    'decides `correct`)')
    f1_threshold: float = Field(0.8)
    first_only: bool = Field(False, description='`a | b` answers: false = every item must be right (GAP train), true = '
                             'first item only (GAP eval)')
    math_timeout_s: int = Field(5)
    judge: Literal['rule', 'llm'] = Field('rule', description='rule (EM/F1, math equivalence) | llm (label.judge_model '
                                          'asked true/false, AgentArk label.py)')
    judge_model: str = Field('models/base', description='llm judge: a model dir, or a served name with label.llm '
                             '{backend: openai, base_url: ...}')
    judge_temperature: float = Field(0.0)
    step_labels: Literal['outcome', 'montecarlo', 'agent'] = Field('outcome',
                                                                   description="outcome (each step gets the episode's "
                                                                   "score) | montecarlo (Math-Shepherd) | agent "
                                                                   "(AgentArk: each agent's solution in the transcript "
                                                                   "is a step, judged on its own answer)")
    mc_model: str = Field('student', description='montecarlo completer: student (models/base) | teacher (the teacher '
                          'block) | a model dir / served name')
    mc_rollouts: int = Field(8, description='completions per step prefix (Math-Shepherd N)')
    mc_temperature: float = Field(0.7)
    mc_scaffold: bool = Field(True, description='completions continue generate.scaffold from the next turn '
                              '(false = unscaffolded)')
    llm: dict = Field(default_factory=dict, description='llm.* overrides for the judge and completer models (e.g. '
                      '{backend: openai, base_url: ...})')
