"""`pareto.*`: the student's direct rollouts and group-wise Pareto sampling."""
from __future__ import annotations

from pydantic import Field

from .base import Section


class ParetoConfig(Section):
    k: int = Field(8, description='rollouts per train question by models/sft (ET-Agent: 8); more find more questions '
                   'the student sometimes gets wrong: the mixed groups RL learns from')
    temperature: float = Field(0.7, description="the student's rollouts (ET-Agent: 1.0; the demo's student gives more "
                               "mixed groups below it: docs/results.md)")
    counts: int = Field(200, description='groups taken by Pareto front + crowding before the mixed-outcome filter '
                        '(ET-Agent: 8000)')
    qa_threshold: float = Field(0.75, description="a QA rollout counts as solved at this score "
                                "(ET-Agent's post-filter)")
    levels: int = Field(2, description='curriculum levels for rl, easiest (highest mean correctness) first')
    min_groups: int = Field(8, description='fewer mixed groups -> top up with Pareto-selected unmixed ones; 0 = none '
                            '(then none mixed = error)')
    max_questions: int = Field(0, description='train questions the SFT student rolls out; 0 = the whole train '
                               'split')
