"""Teacher methods (DESIGN §5), one module each; `run(questions, samples, ctx) -> trajectory rows` for the sample
indices in `samples` (a range) of every question."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from ...config import METHODS  # the methods' names, one per module here; generate.method's Literal reads the same tuple
from ...teacher_topk import generated_row
from ...token_view import tokenizer_fingerprint
from ...tool_format import NativeFormat, TagFormat
from ...tools.registry import DEFAULT_TOOLS, SCAFFOLD, system_prompt
from ..episodes import start_episode
from ..runtime import Episode, EpisodeSettings
from ..scheduler import run_flows
from ..toolbox import Toolbox


@dataclass
class MethodContext:
    backend: object
    toolbox: Toolbox
    settings: EpisodeSettings  # sampling and per-episode budgets (turns, tokens, tool calls)
    teacher: str  # model id recorded in each trajectory
    teacher_name: str = ""  # which of params' teachers runs (teacher, or a key of `teachers`); "" = a student
    scaffold: dict[str, list[str]] = field(default_factory=dict)  # task -> forced tag per turn; {} = unscaffolded
    params: BaseModel | None = None  # the method's own settings (e.g. generate.debate); None = its defaults
    # role -> backend, for roles with their own model (generate.roles)
    role_backends: dict = field(default_factory=dict)
    # tools acting agents may call (the stages pass context.enabled_tools(params))
    tools: tuple[str, ...] = DEFAULT_TOOLS
    taught_by: str = ""  # the teacher method whose students this context prompts (generate.method): their role tags
    # worked examples the acting agents see after the system prompt; never in the student rendering
    demonstrations: str = ""
    # how acting agents write tool calls (tool_format.py): the student's format, by default the tag protocol under
    # `system`
    format: NativeFormat | TagFormat | None = None

    def __post_init__(self):
        for task, tags in self.scaffold.items():
            unknown = [t for t in tags if t not in SCAFFOLD]
            if unknown:
                raise ValueError(f"params.yaml generate.scaffold.{task}: unknown tag(s) {unknown} (one of "
                                 f"{sorted(SCAFFOLD)})")
        if self.format is None:
            self.format = TagFormat(self.backend.tokenizer, self.system)

    def scaffold_for(self, task: str) -> list[str]:
        return self.scaffold.get(task, [])

    @property
    def system(self) -> str:
        """The student protocol's system prompt for this context's tools and teacher method."""
        return system_prompt(self.tools, self.taught_by)

    def with_demonstrations(self, system: str) -> str:
        """An acting agent's system prompt followed by the teacher's demonstrations (the student learns to act without
        them: context distillation)."""
        return f"{system}\n\n{self.demonstrations}" if self.demonstrations else system

    def solver_episode(self, key: str, question: str, seed: int, task: str) -> Episode:
        """An agent acting on the student protocol in this context's format: its tools, the scaffold for the question's
        task, and the teacher's demonstrations after the system prompt."""
        return start_episode(self.format.with_system(self.with_demonstrations(self.format.system)), key, question,
                             seed, self.scaffold_for(task), self.tools)

    def backend_for(self, role: str):
        return self.role_backends.get(role, self.backend)


def get_method(name: str):
    """The `run` function of unison/agents/methods/<name>.py."""
    from importlib import import_module

    if name not in METHODS:
        raise ValueError(f"params.yaml generate.method: unknown method {name!r} (one of {sorted(METHODS)})")
    return import_module(f".{name}", __package__).run


@dataclass(frozen=True)
class StopWhenVerified:
    """Rejection sampling that stops early: a question draws no more samples once `enough` of its trajectories pass
    `check` (the label judge on the trajectory row)."""
    check: Callable[[dict], bool]
    enough: int


def sample_waves(samples: int, enough: int = 0) -> list[range]:
    """The sample indices a question draws, wave by wave: all at once when nothing stops it early; else `enough`
    first, then each wave as large as all drawn before it, so a question that keeps failing reaches `samples` in a few
    waves and an easy one stops after its first."""
    if not enough:
        return [range(samples)]
    waves, start = [], 0
    while start < samples:
        size = max(enough, start)
        waves.append(range(start, min(samples, start + size)))
        start += size
    return waves


def run_method(name: str, questions: list[dict], samples: int, ctx: MethodContext, episodes_in_flight: int,
               on_question: Callable[[int, list[dict]], None] | None = None,
               stop: StopWhenVerified | None = None) -> list[dict]:
    """Trajectory rows of a teacher method on the questions (`samples` each, fewer where `stop` ends a question
    early), each question a flow of its own on ctx's engine (`run_flows`): a question's next round starts as soon as
    its own agents finish, and the next question starts as soon as fewer than `episodes_in_flight` episodes are live.
    `on_question(i, rows)` is called as question i finishes. A chat teacher asked for its top log-probs
    (settings.top_logprobs) gives each row its TEACHER_TOPK row, in memory under "teacher_topk" (the shard writer
    stores it beside the trajectories). Sample s of a question draws with the same seed whether or not `stop` is set."""
    run = get_method(name)

    tok, k = ctx.backend.tokenizer, ctx.settings.top_logprobs
    fingerprint = tokenizer_fingerprint(tok)

    def named(row: dict) -> dict:
        """The teacher's name; a named teacher's own ids, so that a question two teachers answer (a cascade) keeps
        both."""
        name = ctx.teacher_name
        if name in ("", "teacher"):
            return {"teacher_name": name}
        return {"teacher_name": name, "id": f"{row['question_id']}/{row['method']}/{name}/{row['sample']}"}

    def flow(i: int, q: dict) -> list[dict]:
        rows, verified = [], 0
        for wave in sample_waves(samples, stop.enough if stop else 0):
            drawn = run([q], wave, ctx)
            rows += [{**r, "tokenizer": fingerprint, **named(r)} for r in drawn]
            if stop:
                verified += sum(map(stop.check, drawn))
                if verified >= stop.enough:
                    break
        for r in rows:
            tops = r.pop("teacher_tops", {})
            if k:
                r["teacher_topk"] = generated_row(tok, r, tops, k)
        if on_question:
            on_question(i, rows)
        return rows

    flows = [lambda i=i, q=q: flow(i, q) for i, q in enumerate(questions)]
    return [row for rows in run_flows(flows, ctx.backend, episodes_in_flight, desc=name, unit="q") for row in rows]
