"""`export.*`: the training data in other frameworks' formats."""
from __future__ import annotations

from pydantic import Field

from .base import Section


class ExportConfig(Section):
    name: str = Field('unison', pattern=r'^[A-Za-z0-9_.-]+$', description="LLaMA-Factory: dataset_info.json names the "
                      "datasets <name>_sft and <name>_dpo")
    verl_agent: str = Field('tool_agent', description="verl: each RL row's agent_name, the agent loop that rolls it "
                            "out (tool_agent = verl's ToolAgentLoop; unison_agent = unison's tag protocol, required by "
                            "rl.trainer verl)")
