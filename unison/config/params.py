"""`Params`: the sections composed, the rules across them, and params.yaml loaded and validated."""
from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..layout import teacher_dir
from .base import ParamsError, Section
from .cluster import ClusterConfig
from .download import DownloadConfig
from .evaluate import EvaluateConfig
from .export import ExportConfig
from .flywheel import FlywheelConfig
from .generate import FIXED_MODULES, GenerateConfig
from .index import IndexConfig
from .label import LabelConfig
from .llm import CHAT_TOP_LOGPROBS, EngineConfig, LLMConfig, check_llm_overrides
from .models import StudentConfig, TeacherConfig
from .pareto import ParetoConfig
from .rl import VERL_AGENT_LOOP, RLConfig
from .storage import StorageConfig
from .tools import ToolsConfig
from .train import DPOConfig, PRMConfig, SFTConfig, TrainConfig

TEACHER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
ROUTE_FIELDS = ("task", "source")  # a question's own fields a route may read, besides meta.<key>


class Params(Section):
    seed: int = Field(0)
    download: DownloadConfig = Field(default_factory=DownloadConfig)
    student: StudentConfig = Field(default_factory=StudentConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    teachers: dict[str, TeacherConfig] = Field(default_factory=dict, description="more teachers, by name, each a block "
                                               "like `teacher` (known by the name teacher); generate.route or "
                                               "generate.cascade says which teaches what")
    index: IndexConfig = Field(default_factory=IndexConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig, description='the local engine (students; a local teacher unless '
                           'teacher.llm overrides it)')
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    label: LabelConfig = Field(default_factory=LabelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig, description='how sft, dpo, prm and rl train: processes '
                               '(accelerate launch / DeepSpeed), machines, gradient checkpointing')
    prm: PRMConfig = Field(default_factory=PRMConfig, description='AgentArk prm/finetune2.py: backbone + 2-class head '
                           'on a separator token after each step')
    sft: SFTConfig = Field(default_factory=SFTConfig)
    pareto: ParetoConfig = Field(default_factory=ParetoConfig, description='ET-Agent direct rollout + group-wise '
                                 'Pareto sampling (docs/seeds.md#et-agent)')
    dpo: DPOConfig = Field(default_factory=DPOConfig, description='AFM DPO (docs/seeds.md#afm): chosen = correct, '
                           'rejected = wrong rendering of one question')
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    rl: RLConfig = Field(default_factory=RLConfig, description='GRPO family on live multi-turn tool rollouts of the '
                         'SFT student (docs/seeds.md)')
    flywheel: FlywheelConfig = Field(default_factory=FlywheelConfig, description="ET-Agent's data flywheel / STaR "
                                     "rounds after the pipeline (round 0 = teacher -> SFT -> RL)")
    export: ExportConfig = Field(default_factory=ExportConfig, description='the SFT conversations, DPO pairs and RL '
                                 'prompts in LLaMA-Factory, verl and TRL formats (data/export)')
    storage: StorageConfig = Field(default_factory=StorageConfig, description='where DVC data is shared between '
                                   'machines (unison/storage.py); no stage depends on it')
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description='Ray for rollouts and evaluation '
                                   '(docs/scale.md); same seeds and order as in process')

    @model_validator(mode="after")
    def _seeds(self):
        for name in ("prm", "sft", "dpo", "rl"):
            section = getattr(self, name)
            if "seed" in section.model_fields_set:
                raise ValueError(f"{name}.seed: set the top-level seed (one seed for every stage)")
            object.__setattr__(section, "seed", self.seed)
        check_llm_overrides(self.label.llm, "label.llm", allow_backend=True)
        for role, spec in self.generate.roles.items():
            check_llm_overrides(spec, f"generate.roles.{role}", allow_backend=True)
        return self

    @model_validator(mode="after")
    def _across_sections(self):
        if not self.prm.enabled and self.rl.reward.prm_weight > 0:
            raise ValueError("rl.reward.prm_weight > 0 scores steps with models/prm, but prm.enabled is false")
        if not self.prm.enabled and self.evaluate.rerank_samples > 1:
            raise ValueError("evaluate.rerank_samples > 1 reranks with models/prm, but prm.enabled is false")
        for name in self.generating_teachers() if self.rl.scores_with_teacher else []:
            if self.teacher_engine(name).chat:
                key = self.teacher_key(name)
                raise ValueError(f"rl.loss.objective opd, rl.opd.steps or rl.probe.prompts: the teacher "
                                 f"({self.teacher_block(name).model}) must score given tokens, and {key}.api chat "
                                 "cannot (a chat API returns no log-probs of given tokens): set "
                                 f"{key}.api: completions with a vLLM server, or a local teacher "
                                 f"({key}.backend vllm | transformers)")
        if self.generate.topk and self.teacher_engine().chat and self.generate.source:
            raise ValueError("generate.topk with imported trajectories (generate.source) needs a teacher that "
                             "scores them, and teacher.api chat cannot: a chat API's top log-probs come only with what "
                             "it generates itself")
        for name in self.generating_teachers() if self.generate.topk > CHAT_TOP_LOGPROBS else []:
            if self.teacher_engine(name).chat:
                key = self.teacher_key(name)
                raise ValueError(f"generate.topk {self.generate.topk}: a chat API teacher returns at most "
                                 f"{CHAT_TOP_LOGPROBS} top log-probs a token (OpenAI's top_logprobs limit), and {key} "
                                 "is one")
        if (self.rl.scores_with_teacher and self.rl.opd.teacher_context == "worked_examples"
                and not self.generate.demonstrations):
            raise ValueError("rl.opd.teacher_context worked_examples puts generate.demonstrations in the "
                             "teacher's prompt, but generate.demonstrations is \"\": name the worked examples' file, "
                             "or set rl.opd.teacher_context: student")
        if (self.rl.student_role == "agentflow_planner"
                and (missing := [r for r in FIXED_MODULES if r not in self.generate.roles])):
            raise ValueError(f"rl.student_role agentflow_planner: generate.roles has no {', '.join(missing)}: name "
                             "the fixed modules that play them (e.g. {model: gpt-4o-mini, backend: openai, api: chat, "
                             "base_url: ...}); without them the student would play them too")
        if self.sft.kd_weight > 0 and not self.generate.topk:
            raise ValueError("sft.kd_weight > 0 distils the teacher's top-k log-probs, but generate.topk is 0: "
                             "set generate.topk (e.g. 8) so generate keeps them")
        if self.generate.stop_at_verified and self.label.judge != "rule":
            raise ValueError("generate.stop_at_verified verifies each trajectory as it is generated, with label's "
                             f"rule judge, but label.judge is {self.label.judge}: set label.judge: rule or "
                             "generate.stop_at_verified: 0")
        if self.generate.stop_at_verified > self.generate.samples:
            raise ValueError(f"generate.stop_at_verified {self.generate.stop_at_verified} is more than "
                             f"generate.samples {self.generate.samples}: no question could stop early")
        if self.rl.trainer == "verl" and self.export.verl_agent != VERL_AGENT_LOOP:
            raise ValueError(f"export.verl_agent must be {VERL_AGENT_LOOP} with rl.trainer verl: unison's student "
                             f"writes tag tool calls (<search>q</search>), which verl's {self.export.verl_agent!r} "
                             "loop does not parse")
        return self

    @model_validator(mode="after")
    def _teachers(self):
        names = set(self.teacher_names)
        for name in self.teachers:
            if name == "teacher" or not TEACHER_NAME.fullmatch(name):
                raise ValueError(f"teachers.{name}: a teacher's name is lower-case letters, digits, _ and - (and not "
                                 "teacher, the `teacher` block's own)")
        route, cascade = self.generate.route, self.generate.cascade
        named = [("generate.route.default", route.default),
                 *((f"generate.route.to.{value}", name) for value, name in route.to.items()),
                 *((f"generate.cascade[{i}]", name) for i, name in enumerate(cascade))]
        for key, name in named:
            if name not in names:
                raise ValueError(f"{key}: no teacher named {name!r} (teachers: {', '.join(sorted(names))})")
        if route.by and not (route.by in ROUTE_FIELDS or route.by.startswith("meta.") and route.by != "meta."):
            raise ValueError(f"generate.route.by: {route.by!r} is not a question field ({' | '.join(ROUTE_FIELDS)} | "
                             "meta.<key>)")
        if route.to and not route.by:
            raise ValueError("generate.route.to names teachers by a field's value, but generate.route.by is \"\": "
                             "name the field (task, source or meta.<key>)")
        if cascade and route.by:
            raise ValueError("generate.route and generate.cascade: choose one (a route sends each question to one "
                             "teacher; a cascade tries them in turn)")
        if len(cascade) == 1 or len(set(cascade)) != len(cascade):
            raise ValueError(f"generate.cascade {cascade}: two teachers or more, each once")
        if cascade and self.label.judge != "rule":
            raise ValueError("generate.cascade passes a question on where its trajectories do not verify, with label's "
                             f"rule judge, but label.judge is {self.label.judge}: set label.judge: rule")
        if self.generate.source and (route.by or cascade):
            raise ValueError("generate.source imports trajectories instead of running teachers: generate.route and "
                             "generate.cascade have nothing to route")
        return self

    @model_validator(mode="after")
    def _local_files_in_inputs(self):
        """DVC sees the local files the pipeline takes in only through download.inputs (a dependency of download and
        generate in dvc.yaml): a file elsewhere could change unseen."""
        d, source = self.download, self.generate.source
        kind, _, dataset = d.dataset.partition(":")
        local = (([("download.dataset", dataset)] if kind == "local" else [])
                 + ([("download.corpus", d.corpus)] if d.corpus else []))
        if source:
            kind, _, path = source.partition(":")
            if kind != "local":
                raise ValueError(f"generate.source: {source!r} is not local:<file> (a file under "
                                 f"download.inputs, {d.inputs}/)")
            local.append(("generate.source", path))
        root = os.path.abspath(d.inputs)
        for key, path in local:
            if os.path.commonpath([root, os.path.abspath(path)]) != root:
                raise ValueError(f"{key}: {path} is outside download.inputs ({d.inputs}), the folder DVC watches "
                                 "for the files the pipeline takes in; move it there or set download.inputs to a "
                                 "folder holding it")
        return self

    def stage(self, name: str) -> BaseModel:
        """One stage's section (e.g. params.stage("sft") is params.sft)."""
        return getattr(self, name)

    @property
    def teacher_names(self) -> list[str]:
        """Every teacher's name: teacher (the `teacher` block), then the `teachers` in their order."""
        return ["teacher", *self.teachers]

    def teacher_block(self, name: str = "teacher") -> TeacherConfig:
        return self.teacher if name == "teacher" else self.teachers[name]

    @staticmethod
    def teacher_key(name: str) -> str:
        """Where a teacher's settings sit in params.yaml: teacher, or teachers.<name>."""
        return "teacher" if name == "teacher" else f"teachers.{name}"

    def generating_teachers(self) -> list[str]:
        """The teachers generate runs: the cascade's in its order, the route's, or generate.route.default alone (the
        `teacher` block unless it names another)."""
        route = self.generate.route
        if self.generate.cascade:
            return list(self.generate.cascade)
        if route.by:
            return [n for n in self.teacher_names if n == route.default or n in route.to.values()]
        return [route.default]

    def teacher_engine(self, name: str = "teacher") -> EngineConfig:
        """A teacher's engine: the shared llm.* settings, the teacher's overrides, its backend and server."""
        t = self.teacher_block(name)
        return EngineConfig(**{**self.llm.model_dump(), **t.llm, "backend": t.backend, "base_url": t.base_url,
                               "api": t.api, "api_model": t.served_name or t.model.partition(":")[2],
                               "api_key_env": t.api_key_env})

    def system_settings(self, teacher: str = "teacher") -> SystemSettings:
        """What running a system needs, taken out of these params, with `teacher` as the teacher (stages call this;
        the library never sees Params)."""
        return SystemSettings(generate=self.generate, tools=self.tools,
                              student_engine=EngineConfig(**self.llm.model_dump()),
                              teacher_engine=self.teacher_engine(teacher),
                              teacher_model=self.teacher_block(teacher).model, teacher_name=teacher,
                              teacher_dir=teacher_dir(teacher), seed=self.seed)


class SystemSettings(BaseModel):
    """What running a system needs, the teacher's method with its roles or a student alone: the generate and tools
    sections, both engines, the teacher's model spec and the seed. Built by `Params.system_settings()` in a stage;
    picklable, so Ray replicas build their Workbench from it."""
    model_config = ConfigDict(frozen=True)
    generate: GenerateConfig
    tools: ToolsConfig
    student_engine: EngineConfig
    teacher_engine: EngineConfig
    teacher_model: str
    seed: int
    teacher_name: str = "teacher"  # which of params' teachers this is: recorded with each trajectory it makes
    teacher_dir: str = "models/teacher"  # its folder: weights, or a served teacher's tokenizer (stage teacher)

    @property
    def chat_top_logprobs(self) -> int:
        """generate.topk for a chat API teacher, which returns its top log-probs as it generates (0 for a teacher that
        scores the trajectories afterwards, teacher_topk.capture_topk)."""
        return self.generate.topk if self.teacher_engine.chat else 0


def load_params(path: str | os.PathLike | None = None) -> Params:
    """All settings from params.yaml (in the working directory unless `path`), validated."""
    path = Path(path or "params.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such file (run from the project root)") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({e})") from None
    return validate_params(raw, path)


def validate_params(raw: dict, where: str | os.PathLike = "params.yaml") -> Params:
    """`raw` (a parsed params file or overlay) as Params; ParamsError naming `where` and the key otherwise."""
    for block in ("teacher", "student"):
        if not isinstance((raw or {}).get(block), dict):
            raise ParamsError(f"{where}: missing the `{block}` block (teacher and student are separate, "
                              "explicit settings)")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError("\n".join(map(lambda err: describe_error(err, where), e.errors()))) from None


def describe_error(err: dict, where) -> str:
    """One validation error as `<file> <key>: <what is wrong>`; a refused value gets the field's own description."""
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "value_error":  # our validators name the key themselves
        message = err["msg"].removeprefix("Value error, ")
        if err["loc"][:1] == ("teachers",) and len(err["loc"]) > 1:  # TeacherConfig's own rules name `teacher.`
            message = message.replace("teacher.", f"teachers.{err['loc'][1]}.")
        return f"{where} {message}"
    if err["type"] == "extra_forbidden":
        return f"{where} {key}: unknown key"
    model, field = Params, None
    for part in err["loc"]:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            break
        model = field.annotation
    hint = f"; {field.description}" if field is not None and field.description else ""
    return f"{where} {key}: {err['msg']} (got {err['input']!r}){hint}"
