"""Typed settings: one pydantic model per params.yaml section, unknown keys refused, and the only place defaults live.

params.yaml holds every setting that changes results (DVC tracks it) and equals these defaults (tests/test_config.py);
recipes (configs/recipes) and test overlays are validated by the same models. `load_params` names the file and the key
of anything that cannot work:

    params = load_params()              # params.yaml in the working directory (DVC runs stages at the project root)
    params.sft.lr, params.teacher.backend

Each section lives in the module of what it configures (llm.py, generate.py, rl.py, ...); params.py composes them into
`Params`, with the rules that span sections. Import the names from this package.
"""
from .base import MODEL_KINDS, ROOT, ParamsError, Precision, Section, check_model_spec
from .cluster import ClusterConfig
from .download import BuiltinWorldConfig, DownloadConfig
from .evaluate import EvaluateConfig
from .export import ExportConfig
from .flywheel import FlywheelConfig
from .generate import (
    CONVERSING_METHODS,
    FIXED_MODULES,
    METHODS,
    AgentFlowConfig,
    AgentVerseConfig,
    ChainOfAgentsConfig,
    DebateConfig,
    DylanConfig,
    GAPConfig,
    GenerateConfig,
    MAVConfig,
    RouteConfig,
    SelfConsistencyConfig,
)
from .index import IndexConfig
from .label import LabelConfig
from .llm import (
    CHAT_TOP_LOGPROBS,
    LOCAL_BACKENDS,
    SPENDING_LIMITS,
    EngineConfig,
    LLMConfig,
    check_base_url,
    check_llm_overrides,
    engine_with,
)
from .models import StudentConfig, TeacherConfig
from .params import Params, SystemSettings, describe_error, load_params, validate_params
from .pareto import ParetoConfig
from .rl import (
    RL_ESTIMATORS,
    SEQUENCE_ESTIMATORS,
    VERL_AGENT_LOOP,
    LossSettings,
    OPDSettings,
    ProbeSettings,
    RewardSettings,
    RLConfig,
    RolloutSettings,
    VerlSettings,
)
from .storage import StorageConfig, check_remote
from .tools import McpServerConfig, ToolsConfig
from .train import DPOConfig, PRMConfig, SFTConfig, TrainConfig, TrainingSettings

__all__ = [
    "MODEL_KINDS", "ROOT", "ParamsError", "Precision", "Section", "check_model_spec", "ClusterConfig",
    "BuiltinWorldConfig", "DownloadConfig", "EvaluateConfig", "ExportConfig", "FlywheelConfig", "CONVERSING_METHODS",
    "FIXED_MODULES", "METHODS", "AgentFlowConfig", "AgentVerseConfig", "ChainOfAgentsConfig", "DebateConfig",
    "DylanConfig", "GAPConfig", "GenerateConfig", "MAVConfig", "RouteConfig", "SelfConsistencyConfig", "IndexConfig",
    "LabelConfig",
    "CHAT_TOP_LOGPROBS", "LOCAL_BACKENDS", "SPENDING_LIMITS", "EngineConfig", "LLMConfig", "check_base_url",
    "check_llm_overrides", "engine_with", "StudentConfig", "TeacherConfig", "ParetoConfig", "Params",
    "SystemSettings", "describe_error", "load_params", "validate_params", "RL_ESTIMATORS", "SEQUENCE_ESTIMATORS",
    "VERL_AGENT_LOOP", "RLConfig", "LossSettings", "OPDSettings", "ProbeSettings", "RewardSettings",
    "RolloutSettings", "VerlSettings", "StorageConfig", "check_remote", "McpServerConfig", "ToolsConfig", "DPOConfig",
    "PRMConfig", "SFTConfig", "TrainConfig", "TrainingSettings",
]
