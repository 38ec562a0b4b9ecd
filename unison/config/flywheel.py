"""`flywheel.*`: rounds of teacher -> student after the pipeline."""
from __future__ import annotations

from pydantic import Field

from .base import Section


class FlywheelConfig(Section):
    rounds: int = Field(0, description="round k's teacher: round k-1's last student under generate.method + scaffold; "
                        "its correct train trajectories fine-tune a new student from models/base (sft.*); 0 = off "
                        "(et_agent runs 2)")
    sft_epochs: int = Field(2, ge=0, description="epochs of a round's student over its round's trajectories (the other "
                            "settings are sft.*); 0 = sft.epochs")
