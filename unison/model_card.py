"""A trained student's model card: README.md in its folder, as the Hugging Face Hub reads one (YAML front matter, then
prose), with tools.json (the tools' schemas, the `tools` a client sends) and system_prompt.txt (the system message it
was trained under) beside it.

The training stage writes the card with what it knows; evaluate writes the scored card, its EM with the interval,
the CPU kind and the date, into the registered version's copy of the folder and its description (a stage never
writes into another stage's output, so models/<student>/README.md says where the score is).
"""
from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

import yaml

from .data.schemas import write_text
from .tool_format import format_class, serving_info
from .tools.registry import enabled_tools, schemas

CARD, TOOLS, SYSTEM = "README.md", "tools.json", "system_prompt.txt"
TRAINED_BY = {"sft": "supervised fine-tuning on the teacher's verified trajectories (tool output masked)",
              "dpo": "DPO on preference pairs of the student's own rollouts",
              "rl": "RL with live tool rollouts, from the SFT student",
              "flywheel": "a flywheel round: SFT on the teacher's and the student's verified trajectories"}


def data_hash(paths: list[str | Path]) -> str:
    """sha256 over the files' bytes, in the order given (12 hex digits)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:12]


def teachers_of(params) -> str:
    """The teacher as a card names it: its model; several, each by name and how the questions were shared out."""
    names = params.generating_teachers()
    if names == ["teacher"]:
        return params.teacher.model
    shared = "in a cascade" if params.generate.cascade else f"routed by {params.generate.route.by}"
    return ", ".join(f"{name} = {params.teacher_block(name).model}" for name in names) + f" ({shared})"


def facts(params, student: str, data: list[str | Path], training: dict) -> dict:
    """What a card says of a student trained now under `params` from `data`; `training`, the stage's own figures."""
    from . import track
    from .stage_clock import machine

    tools = enabled_tools(params.tools)
    pipeline, git = track.pipeline_params(), track.git_tags()
    return {"name": f"unison-{pipeline.get('recipe', 'default')}-{student}",
            "student": student, "base_model": params.student.model, "teacher": teachers_of(params),
            "teacher_method": params.generate.method, "trained_by": TRAINED_BY.get(student, student),
            "data": [str(p) for p in data], "data_sha256": data_hash(data), "tools": list(tools),
            "tool_format": params.student.tool_format,
            "tool_parser": format_class(params.student.tool_format).parser,
            "params_hash": pipeline.get("params_hash", ""),
            **{k: git.get(k, "") for k in ("git_commit", "git_dirty")}, "training": training,
            "trained_on": machine()["cpu_kind"], "date": datetime.now(timezone.utc).date().isoformat()}


def evaluation(metrics: dict, dataset: str) -> dict:
    """A card's scored section from evaluate's metrics of the student: measured here, today."""
    from .stage_clock import machine

    return {**{k: metrics[k] for k in ("em", "em_lo", "em_hi", "questions")}, "dataset": dataset,
            "cpu_kind": machine()["cpu_kind"], "date": datetime.now(timezone.utc).date().isoformat()}


def write_card(model_dir: str | Path, card: dict, evaluation: dict | None = None) -> None:
    """README.md, tools.json and system_prompt.txt into `model_dir`, each replaced whole (a new file, never written
    through: a registered copy's files are hard links to DVC's cache)."""
    folder = Path(model_dir)
    system = format_class(card["tool_format"]).student_system(tuple(card["tools"]), card["teacher_method"])
    texts = {CARD: render(card, evaluation, serving_info(folder)), TOOLS: json.dumps(schemas(tuple(card["tools"])),
                                                                                     indent=2) + "\n",
             SYSTEM: system}
    for name, text in texts.items():
        write_text(text, folder / name)


def read_card(model_dir: str | Path) -> dict | None:
    """The facts in a folder's card (its front matter's `unison` key), None when it has none."""
    path = Path(model_dir) / CARD
    if not path.is_file():
        return None
    text = path.read_text()
    if not text.startswith("---\n"):
        return None
    return (yaml.safe_load(text.split("---\n", 2)[1]) or {}).get("unison")


def render(card: dict, evaluation: dict | None, serving: dict) -> str:
    """The card's text: front matter (Hub metadata; `unison`: the facts; model-index when scored), then prose."""
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation",
            "tags": ["unison", "tool-use", "distillation", card["student"]], "unison": card}
    if evaluation:
        meta["model-index"] = [{"name": card["name"], "results": [{
            "task": {"type": "question-answering"},
            "dataset": {"name": evaluation["dataset"], "type": evaluation["dataset"], "split": "test"},
            "metrics": [{"type": "exact_match", "name": "EM", "value": round(evaluation["em"], 4)}]}]}]
    fmt = (f"native: Hermes-style `<tool_call>` JSON in its chat template (chat_template.jinja), read by vLLM's "
           f"`{serving['tool_parser']}` tool parser" if serving["tool_format"] == "native" else
           "tags: unison's `<search>...</search>` protocol in the text; no OpenAI tool parser reads it")
    rows = [("base model", card["base_model"]), ("teacher", f"{card['teacher']} ({card['teacher_method']})"),
            ("trained by", f"`{card['student']}`: {card['trained_by']}"),
            ("data", f"{', '.join(card['data'])} (sha256 {card['data_sha256']})"),
            ("tool format", fmt), ("tools", f"{', '.join(card['tools'])}: schemas in tools.json"),
            ("system prompt", "system_prompt.txt"),
            ("training", ", ".join(f"{k} {v}" for k, v in card["training"].items())),
            ("code", f"commit {card['git_commit'][:10] or '?'}"
                     + (" with uncommitted changes" if card.get("git_dirty") == "true" else "")
                     + f", params hash {card['params_hash'] or '?'}"),
            ("trained on", f"{card['trained_on']} CPU, {card['date']}")]
    if evaluation:
        score = (f"**EM {100 * evaluation['em']:.1f}%** (95% Wilson interval {100 * evaluation['em_lo']:.1f}-"
                 f"{100 * evaluation['em_hi']:.1f}) on {evaluation['questions']} test questions of "
                 f"{evaluation['dataset']}, measured {evaluation['date']} on {evaluation['cpu_kind']} CPU by the "
                 "weights in this folder, in process (vLLM)")
    else:
        score = ("Not scored in this folder: `evaluate` scores these weights and writes the scored card (EM, its "
                 "interval, the CPU kind, the date) to the registry's version of it "
                 "(`python -m unison.model_registry`), and reports/metrics.json.")
    return "\n".join([
        "---", yaml.safe_dump(meta, sort_keys=False, width=1000).strip(), "---",
        f"# {card['name']}", "",
        f"A tool-using student distilled by unison from {card['teacher']}.", "",
        "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "",
        "## Evaluation", "", score, "",
        "## Serve it", "",
        "In the unison project that trained it (`make setup`'s environment, CPU or GPU):", "", "```bash",
        "unison serve <this folder>        # vLLM's OpenAI server on http://127.0.0.1:8000/v1", "```", "",
        "A client sends system_prompt.txt as the system message and tools.json as `tools`, runs each returned tool "
        "call, and sends its result back as a `tool` message (`unison serve --print-command` prints a snippet).", ""])
