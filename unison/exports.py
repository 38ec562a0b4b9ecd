"""Data out (design §3): what `sft`, `dpo` and `rl` train on, in the formats LLaMA-Factory, verl and TRL read.

    data/export/llamafactory/dataset_info.json   <name>_sft (sharegpt) and <name>_dpo (sharegpt, ranking)
    data/export/llamafactory/sft.jsonl           {system, conversations: [{from, value}]}: human, gpt (or
                                                 function_call), observation, gpt, ...; a native student's also `tools`
    data/export/llamafactory/dpo.jsonl           {system, conversations: [human], chosen: {from: gpt, value},
                                                 rejected: ...}
    data/export/trl/sft.jsonl                    {messages: [{role, content}]}: system, user, assistant, tool,
                                                 assistant, ...; a native student's with tool_calls, and `tools`
    data/export/trl/sft_tokenized.jsonl          {input_ids, assistant_masks}: sft's token views under the student's
                                                 tokenizer, the mask 1 where sft trains (what TRL's SFTTrainer trains)
    data/export/verl/level<k>.parquet            data/rl's rows + agent_name and extra_info.{ability, need_tools_kwargs,
                                                 tools_kwargs}

The conversations are the student renderings `sft` trains on (sft.select_trajectories, same settings), in the
student's tool format (student.tool_format). Native: LLaMA-Factory's sharegpt gets the tools' schemas in its `tools`
column, each call a `function_call` turn and its results an `observation` turn (llamafactory_sft); TRL's
conversational file gets `tools` beside messages whose assistant turns carry `tool_calls` and whose results are `tool`
messages, and TRL's SFTTrainer applying the student's chat template to it builds exactly sft_tokenized.jsonl's ids.
Tags: tool calls stay the tags the student writes (<search>q</search>), each observation a turn of the consumer's tool
role (LLaMA-Factory `observation`, TRL `tool`), and no `tools` column (it would make LLaMA-Factory's template announce a
JSON call format the student does not write). LLaMA-Factory leaves observations out of the loss; TRL does only with
`assistant_only_loss` and a chat template with `{% generation %}` markers, which the student's (SmolLM2's) lacks, and
with its default settings it trains every token of sft.jsonl, system prompt and observations included. So TRL gets
sft_tokenized.jsonl too: the exact ids and mask `sft` trains on (truncated at sft.max_length), which TRL's SFTTrainer
turns into labels as they are, with its default SFTConfig. Consecutive segments of one role are one turn (the runtime
generated them as one token stream), and an observation nothing answers is dropped. The DPO pairs are dpo.build_pairs';
LLaMA-Factory's ranking format holds one message per side, so chosen and rejected are whole completions with their
`<result>` blocks inline, which stock LLaMA-Factory scores (unison's own `dpo` masks them). The verl rows carry, per
enabled tool, `tools_kwargs[tool].create_kwargs = {ground_truth, question, data_source}` (verl's Search-R1
preprocessing), which verl's RLHFDataset hands to its tool agent loop; `need_tools_kwargs` is true. extra_info.ability
repeats the row's task because verl hands a custom reward function extra_info, not ability (unison.train.verl_reward
judges by it).
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from . import layout
from .config import DPOConfig, ExportConfig, SFTConfig
from .data.schemas import RL_ROW, DataError, read_table, write_json, write_jsonl, write_table
from .tool_format import NativeFormat, TagFormat
from .tools.search import SEPARATOR
from .train.dpo import build_pairs
from .train.sft import build_examples, select_trajectories

SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "tool": "observation"}


def student_turns(row: dict, path: str | Path) -> list[dict]:
    """A labeled row's student rendering after its system and user messages, as alternating assistant / tool turns
    ({role, content}) that start and end with the assistant."""
    student = row["student"]
    if [m["role"] for m in student[:2]] != ["system", "user"]:
        raise DataError(path, f"trajectory {row['id']}: the student rendering must open with system and user",
                        field="student")
    stray = next((m["role"] for m in student[2:] if m["role"] not in ("assistant", "tool")), None)
    if stray:
        raise DataError(path, f"trajectory {row['id']}: unexpected role {stray!r} after the question", field="student")
    turns = TagFormat.messages(student)[2:]
    if not turns or turns[0]["role"] != "assistant":
        raise DataError(path, f"trajectory {row['id']}: no assistant turn after the question", field="student")
    return turns


def chat(row: dict, format: NativeFormat | TagFormat, path: str | Path) -> list[dict]:
    """A chosen row's conversation as the student's `format` writes it (its rendering checked: student_turns)."""
    student_turns(row, path)
    return format.messages(row["student"])


def llamafactory_sft(rows: list[dict], format: NativeFormat | TagFormat, path: str | Path) -> list[dict]:
    """The student's conversations in LLaMA-Factory's sharegpt: its system prompt, each turn one of its `from` roles
    (a native call a `function_call` turn ({name, arguments}, a list for parallel calls), its results one
    `observation` turn, parallel results joined as search joins them), and a native format's tools' schemas (the
    `tools` column, a JSON string). Text an assistant writes before a native call has no place in a function_call turn
    and is left out."""
    out = []
    for r in rows:
        messages, conversations = chat(r, format, path), []
        for m in messages[1:]:
            if m["role"] == "tool" and conversations[-1]["from"] == "observation":
                conversations[-1]["value"] += SEPARATOR + m["content"]
            elif m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in m["tool_calls"]]
                conversations.append({"from": "function_call",
                                      "value": json.dumps(calls[0] if len(calls) == 1 else calls)})
            else:
                conversations.append({"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]})
        out.append({"system": messages[0]["content"], **tools_column(format), "conversations": conversations})
    return out


def llamafactory_dpo(pairs: list[tuple[dict, dict]], path: str | Path) -> list[dict]:
    def completion(row: dict) -> dict:
        return {"from": "gpt", "value": "".join(m["content"] for m in student_turns(row, path))}

    return [{"system": chosen["student"][0]["content"],
             "conversations": [{"from": "human", "value": chosen["student"][1]["content"]}],
             "chosen": completion(chosen), "rejected": completion(rejected)} for chosen, rejected in pairs]


def trl_sft(row: dict, format: NativeFormat | TagFormat, path: str | Path) -> dict:
    """The student's conversation for TRL: its messages, a native format's with tool_calls whose arguments are JSON
    strings and `tools` a JSON string, as OpenAI's API writes them (TRL parses a string `tools`; a JSON loader would
    otherwise merge every row's schemas and arguments into one struct, each with the others' keys as nulls)."""
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                    c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
                if m.get("tool_calls") else m for m in chat(row, format, path)]
    return {"messages": messages, **tools_column(format)}


def tools_column(format: NativeFormat | TagFormat) -> dict:
    """A format's tools' schemas as a `tools` column (a JSON string); none for the tag protocol, whose system prompt
    teaches them (a `tools` column would make LLaMA-Factory's template announce a JSON call format it never
    writes)."""
    return {"tools": json.dumps(format.schemas)} if format.schemas else {}


def dataset_info(name: str, with_pairs: bool, tools: bool = False) -> dict:
    """LLaMA-Factory's dataset descriptions of sft.jsonl (with its `tools` column for a native student) and (when there
    are pairs) dpo.jsonl."""
    columns = {"messages": "conversations", "system": "system"}
    info = {f"{name}_sft": {"file_name": "sft.jsonl", "formatting": "sharegpt",
                            "columns": {**columns, **({"tools": "tools"} if tools else {})}}}
    if with_pairs:
        info[f"{name}_dpo"] = {"file_name": "dpo.jsonl", "formatting": "sharegpt", "ranking": True,
                               "columns": {**columns, "chosen": "chosen", "rejected": "rejected"}}
    return info


def verl_schema(tools: tuple[str, ...]) -> pa.Schema:
    """RL_ROW with agent_name, and extra_info with need_tools_kwargs and tools_kwargs (a struct per tool)."""
    create = pa.struct([("ground_truth", pa.list_(pa.string())), ("question", pa.string()),
                        ("data_source", pa.string())])
    tools_kwargs = pa.struct([(t, pa.struct([("create_kwargs", create)])) for t in tools])
    extra = pa.struct(list(RL_ROW.field("extra_info").type) + [("ability", pa.string()),
                                                                ("need_tools_kwargs", pa.bool_()),
                                                                ("tools_kwargs", tools_kwargs)])
    fields = [pa.field("extra_info", extra) if f.name == "extra_info" else f for f in RL_ROW]
    return pa.schema(fields + [pa.field("agent_name", pa.string())])


def verl_rows(rows: list[dict], tools: tuple[str, ...], agent: str) -> list[dict]:
    out = []
    for r in rows:
        create = {"ground_truth": list(r["reward_model"]["ground_truth"]), "question": r["extra_info"]["question"],
                  "data_source": r["data_source"]}
        extra = {**r["extra_info"], "ability": r["ability"], "need_tools_kwargs": True,
                 "tools_kwargs": {t: {"create_kwargs": create} for t in tools}}
        out.append({**r, "extra_info": extra, "agent_name": agent})
    return out


def read_rl_prompts(rl_dir: str | Path) -> list[dict]:
    """Every row of `rl_dir`/level*.parquet (schema RL_ROW)."""
    paths = sorted(Path(rl_dir).glob("level*.parquet"))
    if not paths:
        raise DataError(rl_dir, "no level*.parquet files (run the pareto stage)")
    return [r for p in paths for r in read_table(p, RL_ROW)]


def write_export(out_dir: str | Path, labeled: list[dict], rl: list[dict], export: ExportConfig, sft: SFTConfig,
                 dpo: DPOConfig, tools: tuple[str, ...], format: NativeFormat | TagFormat,
                 path: str | Path = layout.LABELED) -> dict:
    """Write every format under `out_dir` (module docstring), the conversations and token views in the student's
    `format` (student.tool_format, in its tokenizer's chat template); counts of what was written. `path` names
    `labeled` in errors."""
    out = Path(out_dir)
    chosen = select_trajectories(labeled, sft.max_per_question, sft.dedupe)
    if not chosen:
        raise DataError(path, "no correct trajectories to export", field="correct")
    pairs = build_pairs(labeled, dpo.max_pairs_per_question)
    write_jsonl(llamafactory_sft(chosen, format, path), out / "llamafactory/sft.jsonl")
    if pairs:
        write_jsonl(llamafactory_dpo(pairs, path), out / "llamafactory/dpo.jsonl")
    write_json(dataset_info(export.name, bool(pairs), bool(format.schemas)), out / "llamafactory/dataset_info.json")
    write_jsonl([trl_sft(r, format, path) for r in chosen], out / "trl/sft.jsonl")
    examples, _ = build_examples(format, chosen, sft.max_length)
    write_jsonl([{"input_ids": ids, "assistant_masks": mask} for ids, mask in examples],
                out / "trl/sft_tokenized.jsonl")
    levels = sorted({r["level"] for r in rl})
    for level in levels:
        write_table(verl_rows([r for r in rl if r["level"] == level], tools, export.verl_agent),
                    out / f"verl/level{level}.parquet", verl_schema(tools))
    return {"sft_conversations": len(chosen), "sft_questions": len({r["question_id"] for r in chosen}),
            "sft_train_tokens": sum(sum(mask) for _, mask in examples), "dpo_pairs": len(pairs),
            "dpo_questions": len({c["question_id"] for c, _ in pairs}), "rl_prompts": len(rl), "rl_levels": len(levels),
            "tools": list(tools)}
