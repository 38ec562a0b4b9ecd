"""Stage `teacher`: materialise the teacher named by the `teacher` block into models/teacher.

A local teacher (teacher.backend vllm | transformers) gets its weights and tokenizer there. A served teacher
(teacher.backend openai) gets only the tokenizer that renders its prompts (teacher.tokenizer, else teacher.model's; with
teacher.api chat, the student's: the runtime keeps a chat teacher's turns in the student's tokens);
its weights stay on the server. models/teacher/unison_model.json records what the teacher is (never an API key; the
URL's credentials redacted).
"""
from __future__ import annotations

from pathlib import Path

from unison import layout, track
from unison.cli import stage_main
from unison.config import TeacherConfig, load_params
from unison.data import models
from unison.llm import served_at

OUT = Path(layout.TEACHER)


def teacher_info(t: TeacherConfig, student_model: str) -> dict:
    """What models/teacher/unison_model.json says of this teacher block (a local teacher: its source). A chat teacher's
    turns are kept in the student's tokens, so its folder holds the student's tokenizer unless teacher.tokenizer
    says."""
    if t.backend != "openai":
        return {"source": t.model}
    return {"source": t.model, "base_url": served_at(t.base_url),
            "served_name": t.served_name or t.model.partition(":")[2], "api": t.api,
            "tokenizer": t.tokenizer or (student_model if t.api == "chat" else t.model)}


def main() -> None:
    params = load_params()
    t = params.teacher
    with track.stage_run("teacher", t.model_dump()) as run:
        want = teacher_info(t, params.student.model)
        info = models.read_info(OUT) or {}
        if {k: info.get(k) for k in want} == want:
            print(f"teacher: {OUT} already holds {t.model}", flush=True)
        elif "served_name" in want:
            print(f"teacher: {want['served_name']} at {want['base_url']}; keeping its tokenizer in {OUT}", flush=True)
            info = models.materialize_tokenizer(want["tokenizer"], OUT, want)
        else:
            print(f"teacher: materialising {t.model} -> {OUT} ...", flush=True)
            info = models.materialize_model(t.model, OUT)
        if "served_name" not in want:
            from transformers import AutoTokenizer

            if not AutoTokenizer.from_pretrained(OUT).chat_template:
                print(f"teacher: {t.model} has no chat template (a base model): it reads each "
                      "conversation as paragraphs after its BOS, when it acts and when it scores "
                      "(protocol.chat_prompt)", flush=True)
        run.log_metrics({"teacher_parameters": float(info["n_parameters"])})


if __name__ == "__main__":
    stage_main("teacher", main)
