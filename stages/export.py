"""Stage `export`: the SFT conversations, DPO pairs and RL prompts as LLaMA-Factory, verl and TRL datasets \
(data/export).

No model is loaded, only the student's tokenizer (models/base); the same inputs and settings write the same bytes. What
each file holds: unison/exports.py.
"""
from __future__ import annotations

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import LABELED, atomic_dir, read_table, write_json
from unison.exports import read_rl_prompts, write_export
from unison.tool_format import student_format
from unison.tools.registry import check_toolset, enabled_tools

LABELED_PATH, RL_DIR, OUT, STUDENT = layout.LABELED, layout.RL_DATA, layout.EXPORT, layout.BASE


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "export")
    tools = enabled_tools(params.tools)
    settings = {**params.export.model_dump(), "sft.max_per_question": params.sft.max_per_question,
                "sft.dedupe": params.sft.dedupe, "sft.max_length": params.sft.max_length,
                "dpo.max_pairs_per_question": params.dpo.max_pairs_per_question, "tools": ",".join(tools),
                "tool_format": params.student.tool_format}
    with track.stage_run("export", settings) as run:
        from transformers import AutoTokenizer

        labeled, rl = read_table(LABELED_PATH, LABELED), read_rl_prompts(RL_DIR)
        tok = AutoTokenizer.from_pretrained(STUDENT)
        with atomic_dir(OUT) as tmp:
            counts = write_export(tmp, labeled, rl, params.export, params.sft, params.dpo, tools,
                                  student_format(params.student.tool_format, tok, tools, params.generate.method),
                                  LABELED_PATH)
        write_json(counts, layout.report("export"))
        run.log_metrics(counts)
        print(f"export: {counts['sft_conversations']} SFT conversations ({counts['sft_questions']} questions), "
              f"{counts['dpo_pairs']} DPO pairs, {counts['rl_prompts']} RL prompts in {counts['rl_levels']} curriculum "
              f"levels -> {OUT}/", flush=True)


if __name__ == "__main__":
    stage_main("export", main)
