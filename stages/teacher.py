"""Stage `teacher`: materialise every teacher, the `teacher` block in models/teacher and the others in models/teachers.

A local teacher (teacher.backend vllm | transformers) gets its weights and tokenizer there. A served teacher
(teacher.backend openai) gets only the tokenizer that renders its prompts (teacher.tokenizer, else teacher.model's; with
teacher.api chat, the student's: the runtime keeps a chat teacher's turns in the student's tokens);
its weights stay on the server. models/teacher/unison_model.json records what the teacher is (never an API key; the
URL's credentials redacted).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from unison import layout, track
from unison.cli import stage_main
from unison.config import TeacherConfig, load_params
from unison.data import models
from unison.data.schemas import write_json
from unison.llm import served_at

NAMES = Path(layout.TEACHERS) / "names.json"


def teacher_info(t: TeacherConfig, student_model: str) -> dict:
    """What models/teacher/unison_model.json says of this teacher block (a local teacher: its source). A chat teacher's
    turns are kept in the student's tokens, so its folder holds the student's tokenizer unless teacher.tokenizer
    says."""
    if t.backend != "openai":
        return {"source": t.model}
    return {"source": t.model, "base_url": served_at(t.base_url),
            "served_name": t.served_name or t.model.partition(":")[2], "api": t.api,
            "tokenizer": t.tokenizer or (student_model if t.api == "chat" else t.model)}


def materialize(name: str, t: TeacherConfig, student_model: str) -> dict:
    """One teacher block into its folder (layout.teacher_dir), unless the folder already holds it; its info."""
    out = Path(layout.teacher_dir(name))
    want = teacher_info(t, student_model)
    info = models.read_info(out) or {}
    if {k: info.get(k) for k in want} == want:
        print(f"teacher: {out} already holds {t.model}", flush=True)
    elif "served_name" in want:
        print(f"teacher: {want['served_name']} at {want['base_url']}; keeping its tokenizer in {out}", flush=True)
        info = models.materialize_tokenizer(want["tokenizer"], out, want)
    else:
        print(f"teacher: materialising {t.model} -> {out} ...", flush=True)
        info = models.materialize_model(t.model, out)
    if "served_name" not in want:
        from transformers import AutoTokenizer

        if not AutoTokenizer.from_pretrained(out).chat_template:
            print(f"teacher: {t.model} has no chat template (a base model): it reads each "
                  "conversation as paragraphs after its BOS, when it acts and when it scores "
                  "(protocol.chat_prompt)", flush=True)
    return info


def main() -> None:
    params = load_params()
    with track.stage_run("teacher", params.model_dump(include={"teacher", "teachers"})) as run:
        info = materialize("teacher", params.teacher, params.student.model)
        run.log_metrics({"teacher_parameters": float(info["n_parameters"])})
        named = Path(layout.TEACHERS)
        named.mkdir(parents=True, exist_ok=True)
        for old in named.iterdir():  # a teacher no longer in params.yaml leaves no folder behind
            if old.name not in params.teachers and old.name != NAMES.name:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        for name, t in params.teachers.items():
            info = materialize(name, t, params.student.model)
            run.log_metrics({f"teachers.{name}.parameters": float(info["n_parameters"])})
        # the folder exists, and says which teachers it holds, whether or not there are any
        write_json(sorted(params.teachers), NAMES)


if __name__ == "__main__":
    stage_main("teacher", main)
