"""`evaluate.*`: how systems are scored on the test split."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class EvaluateConfig(Section):
    max_questions: int = Field(0, description='0 = whole test split')
    temperature: float = Field(0.0)
    bootstrap: int = Field(1000)
    teacher: bool = Field(True)
    rerank_samples: int = Field(1, description='prm_rerank: SFT-student samples per question, the PRM keeps one; <= 1 '
                                '= skip that system (the demo skips it: docs/benchmarks.md; the '
                                'agentark recipe reranks)')
    rerank_temperature: float = Field(0.7)
    first_only: bool | None = Field(None, description='`a | b` answers when scoring: null = label.first_only; true = '
                                    'the first item only (GAP eval)')
    engine_per_process: bool | Literal['auto'] = Field('auto', description='each model\'s engine in its own process, '
                                                       'which gives all its GPU memory back when it exits; auto = on '
                                                       'CUDA only (on CPU a child costs ~10 s of imports and toolbox '
                                                       'per engine); same rows either way')
