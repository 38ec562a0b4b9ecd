"""What every settings section shares: unknown keys refused, the error that names file and key, model specs."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parents[2]
Precision = Literal["auto", "bf16", "fp32"]


MODEL_KINDS = ("builtin", "hf", "local")


class ParamsError(ValueError):
    """A setting that cannot work; the message names the file and the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_model_spec(spec: str, key: str) -> str:
    kind, _, name = spec.partition(":")
    if kind not in MODEL_KINDS or not name:
        raise ValueError(f"{key}: {spec!r} is not a model spec (builtin:<name> | hf:<name> | local:<dir>)")
    return spec
