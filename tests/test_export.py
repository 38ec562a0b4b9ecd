"""Stage `export` (unison/exports.py): each dataset is loaded the way its consumer loads it -- `datasets.load_dataset`
as LLaMA-Factory's loader and verl's RLHFDataset call it, TRL's own SFTTrainer dataset preparation -- and what the
consumer then reads is checked: LLaMA-Factory's sharegpt rules (data/README.md: human/observation at odd, gpt/function_call
at even positions, a ranking prompt ending on the human side), the keys verl's RLHFDataset and tool agent loop read
(agent_name, extra_info.index/need_tools_kwargs/tools_kwargs[tool].create_kwargs), TRL's assistant-only loss mask
(tool output out of it). LLaMA-Factory and verl do not install here; TRL does.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from unison.config import ROOT, ParamsError, load_params
from unison.data.schemas import LABELED, RL_ROW, DataError, read_table, write_table
from unison.exports import read_rl_prompts, student_turns, write_export
from unison.protocol import observation
from unison.tool_format import NativeFormat, TagFormat
from unison.tools.registry import DEFAULT_TOOLS, system_prompt
from unison.train.pareto import rl_rows, write_rl_data

SYSTEM = system_prompt(DEFAULT_TOOLS)
QUESTIONS = {"q0": ("In which city was Zorvan Kelt born?", "Tarsk"), "q1": ("In which country is Tarsk?", "Velmora"),
             "q2": ("What is 17 * 23?", "391")}
BORN = observation("Doc 1 (Title: Zorvan Kelt)\nZorvan Kelt was born in Tarsk.")
# (question, sample, correct, student turns after the question)
TRAJECTORIES = [
    ("q0", 0, True, [("assistant", "<search>Zorvan Kelt</search>"), ("tool", BORN), ("assistant", "<answer>Tarsk</answer>")]),
    ("q0", 1, False, [("assistant", "<search>Kelt</search>"), ("tool", observation("no results")),
                      ("assistant", "<answer>Velmora</answer>")]),
    ("q0", 2, False, [("assistant", "<search>Zorvan</search>"), ("tool", BORN)]),  # out of turns: ends on an observation
    ("q1", 0, True, [("assistant", "<think>Tarsk is a city.</think>"), ("assistant", "<search>Tarsk</search>"),  # two segments, one turn
                     ("tool", observation("Tarsk is a city in Velmora.")), ("assistant", "<answer>Velmora</answer>")]),
    ("q2", 0, False, [("assistant", "<python>\nprint(17 * 23)</python>"), ("tool", observation("390")),
                      ("assistant", "<answer>390</answer>")]),
]


def labeled_row(qid: str, sample: int, correct: bool, turns: list[tuple[str, str]]) -> dict:
    question, answer = QUESTIONS[qid]
    student = [{"role": "system", "content": SYSTEM, "token_ids": []}, {"role": "user", "content": question, "token_ids": []}]
    student += [{"role": role, "content": text, "token_ids": []} for role, text in turns]
    return {"id": f"{qid}/single/{sample}", "question_id": qid, "sample": sample, "method": "single", "teacher": "builtin:t", "teacher_name": "teacher",
            "question": question, "answers": [answer], "task": "math" if qid == "q2" else "qa",
            "messages": [{"role": "user", "name": None, "content": question}], "student": student, "final_answer": "",
            "n_llm_calls": 1, "n_tool_calls": 1, "n_tokens": 9, "tool_errors": 0, "tool_stats": "{}", "finish_reason": "answer",
            "tokenizer": "", "correct": correct, "score": float(correct), "judge": "rule", "steps": [], "step_labels": []}


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_model_dir):
    """A project dir as cwd: the repo's params, the student (its tokenizer is what export reads), labeled trajectories,
    and two curriculum levels of RL prompts written by pareto's own writer; its own MLflow store."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(tiny_model_dir, tmp_path / "models/base")
    monkeypatch.chdir(tmp_path)
    write_table([labeled_row(*t) for t in TRAJECTORIES], "data/labeled/train.parquet", LABELED)
    questions = {qid: {"id": qid, "source": "builtin", "task": "math" if qid == "q2" else "qa", "question": q, "answers": [a]}
                 for qid, (q, a) in QUESTIONS.items()}
    groups = [{"question_id": qid, "score_tool": 0.5, "score_corr": 0.5, "front": 1, "crowding": 1.0, "correctness": [1.0, 0.0]}
              for qid in QUESTIONS]
    write_rl_data(rl_rows(groups, [1, 1, 2], questions, SYSTEM), "data/rl")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    return tmp_path


def export_sections(params) -> tuple:
    """write_export's settings, as the export stage takes them out of `params`."""
    return params.export, params.sft, params.dpo


def files(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.fixture
def exported(project):
    """The library's export of the project (the stage itself, MLflow and all, is the first test's)."""
    write_export("data/export", read_table("data/labeled/train.parquet", LABELED), read_rl_prompts("data/rl"), *export_sections(load_params()), DEFAULT_TOOLS,
                 TagFormat(student_tokenizer()))
    return project / "data/export"


def student_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained("models/base")


def test_the_stage_writes_every_format_the_same_bytes_twice_and_keeps_the_last_export_when_it_fails(project):
    from stages import export

    export.main()
    first = files(project / "data/export")
    assert sorted(first) == ["llamafactory/dataset_info.json", "llamafactory/dpo.jsonl", "llamafactory/sft.jsonl", "trl/sft.jsonl",
                             "trl/sft_tokenized.jsonl", "verl/level1.parquet", "verl/level2.parquet"]
    report = json.loads((project / "reports/export.json").read_text())
    train_tokens = report.pop("sft_train_tokens")
    assert report == {"sft_conversations": 2, "sft_questions": 2, "dpo_pairs": 2, "dpo_questions": 1, "rl_prompts": 3, "rl_levels": 2,
                      "tools": ["search", "python"]}
    assert train_tokens == sum(sum(json.loads(line)["assistant_masks"]) for line in
                               (project / "data/export/trl/sft_tokenized.jsonl").read_text().splitlines())
    export.main()
    assert files(project / "data/export") == first
    rows = read_table("data/labeled/train.parquet", LABELED)
    write_table([{**r, "correct": False} for r in rows], "data/labeled/train.parquet", LABELED)
    with pytest.raises(DataError, match=r"data/labeled/train.parquet, field 'correct': no correct trajectories to export"):
        export.main()
    assert files(project / "data/export") == first


def test_llamafactory_loads_both_datasets_and_they_follow_its_sharegpt_rules(exported):
    """As LLaMA-Factory's loader: dataset_info.json's file_name under dataset_dir, `load_dataset("json", data_files=...)`
    (a .jsonl file is type json). Then its sharegpt converter's rules (data/README.md)."""
    from datasets import load_dataset

    dataset_dir = exported / "llamafactory"
    info = json.loads((dataset_dir / "dataset_info.json").read_text())
    assert info == {
        "unison_sft": {"file_name": "sft.jsonl", "formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system"}},
        "unison_dpo": {"file_name": "dpo.jsonl", "formatting": "sharegpt", "ranking": True,
                       "columns": {"messages": "conversations", "system": "system", "chosen": "chosen", "rejected": "rejected"}}}
    sft = load_dataset("json", data_files=[str(dataset_dir / info["unison_sft"]["file_name"])], split="train")
    dpo = load_dataset("json", data_files=[str(dataset_dir / info["unison_dpo"]["file_name"])], split="train")
    for example in sft:
        roles = [m["from"] for m in example["conversations"]]
        assert set(roles[0::2]) <= {"human", "observation"} and set(roles[1::2]) <= {"gpt", "function_call"} and len(roles) % 2 == 0
        assert example["system"] == SYSTEM and roles[0] == "human"
        assert all("<result>" not in m["value"] for m in example["conversations"] if m["from"] == "gpt")  # tool output is observation only
    assert sft[0]["conversations"] == [{"from": "human", "value": QUESTIONS["q0"][0]},
                                       {"from": "gpt", "value": "<search>Zorvan Kelt</search>"},
                                       {"from": "observation", "value": BORN}, {"from": "gpt", "value": "<answer>Tarsk</answer>"}]
    assert sft[1]["conversations"][1] == {"from": "gpt", "value": "<think>Tarsk is a city.</think><search>Tarsk</search>"}
    for example in dpo:  # a ranking prompt has an odd count (ends on the human side); chosen and rejected are one gpt message each
        assert [m["from"] for m in example["conversations"]] == ["human"] and example["system"] == SYSTEM
        assert example["chosen"]["from"] == example["rejected"]["from"] == "gpt"
    assert [ex["chosen"]["value"] for ex in dpo] == ["<search>Zorvan Kelt</search>" + BORN + "<answer>Tarsk</answer>"] * 2
    assert [ex["rejected"]["value"] for ex in dpo] == ["<search>Kelt</search>" + observation("no results") + "<answer>Velmora</answer>",
                                                     "<search>Zorvan</search>"]  # the observation nothing answered is dropped


def test_verl_reads_the_rl_parquet_as_its_dataset_and_tool_agent_loop_do(exported):
    """As verl's RLHFDataset: `load_dataset("parquet", data_files=...)["train"]`; then what __getitem__ takes from
    extra_info (index, need_tools_kwargs, tools_kwargs) and what ToolAgentLoop._call_tool passes to a tool's create()
    (tools_kwargs[name]["create_kwargs"]); agent_name picks the registered loop ("tool_agent")."""
    from datasets import load_dataset

    for level, n in ((1, 2), (2, 1)):
        rows = load_dataset("parquet", data_files=str(exported / f"verl/level{level}.parquet"))["train"]
        source = read_table(f"data/rl/level{level}.parquet", RL_ROW)
        assert len(rows) == len(source) == n
        for row, src in zip(rows, source):
            assert {k: row[k] for k in RL_ROW.names if k != "extra_info"} == {k: src[k] for k in RL_ROW.names if k != "extra_info"}
            assert row["agent_name"] == "tool_agent" and row["prompt"][0] == {"role": "system", "content": SYSTEM}
            extra = row.get("extra_info") or {}
            assert {k: extra[k] for k in src["extra_info"]} == src["extra_info"] and extra.get("need_tools_kwargs") is True
            for tool in ("search", "python"):
                assert extra.get("tools_kwargs", {}).get(tool, {}).get("create_kwargs", {}) == {
                    "ground_truth": src["reward_model"]["ground_truth"], "question": src["extra_info"]["question"],
                    "data_source": "builtin"}


def test_trl_sft_trainer_with_its_default_settings_trains_exactly_the_tokens_sft_trains(exported, tmp_path):
    """TRL's own preparation (SFTTrainer, default SFTConfig) of sft_tokenized.jsonl, under the student's own tokenizer: its
    labels are the ids where unison's token view trains and -100 elsewhere (system prompt, question, observations)."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from unison.data.schemas import LABELED, read_table
    from unison.train.sft import build_examples, select_trajectories

    tok = student_tokenizer()
    data = load_dataset("json", data_files=str(exported / "trl/sft_tokenized.jsonl"), split="train")
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, use_cpu=True)
    prepared = SFTTrainer(model="models/base", args=args, train_dataset=data, processing_class=tok).train_dataset
    params = load_params()
    chosen = select_trajectories(read_table("data/labeled/train.parquet", LABELED), params.sft.max_per_question, params.sft.dedupe)
    views, _ = build_examples(TagFormat(tok), chosen, params.sft.max_length)
    assert len(prepared) == len(views) == 2
    for example, (ids, mask) in zip(prepared, views):
        assert example["input_ids"] == ids
        assert example["labels"] == [i if m else -100 for i, m in zip(ids, mask)]
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        assert "<answer>" in trained and "<result>" not in trained and SYSTEM[:40] not in trained
    plain = load_dataset("json", data_files=str(exported / "trl/sft.jsonl"), split="train")
    with pytest.raises(Exception, match="generation"):  # the messages file: the student's template has no generation markers
        SFTTrainer(model="models/base", args=SFTConfig(output_dir=str(tmp_path / "trl2"), report_to="none", bf16=False,
                                                        use_cpu=True, assistant_only_loss=True),
                   train_dataset=plain, processing_class=tok)


def test_a_rendering_without_an_assistant_turn_or_with_a_stray_role_is_refused():
    row = labeled_row("q0", 0, True, [("tool", BORN)])
    with pytest.raises(DataError, match=r"x.parquet, field 'student': trajectory q0/single/0: no assistant turn after the question"):
        student_turns(row, "x.parquet")
    row = labeled_row("q0", 0, True, [("assistant", "<answer>Tarsk</answer>"), ("user", "more?")])
    with pytest.raises(DataError, match=r"unexpected role 'user' after the question"):
        student_turns(row, "x.parquet")


def test_without_pairs_there_is_no_dpo_dataset_and_a_bad_name_fails_at_load(project):
    rows = [r for r in read_table("data/labeled/train.parquet", LABELED) if r["correct"] or r["question_id"] == "q2"]
    counts = write_export("data/export", rows, read_rl_prompts("data/rl"), *export_sections(load_params()), DEFAULT_TOOLS,
                          TagFormat(student_tokenizer()))
    assert (counts["sft_conversations"], counts["dpo_pairs"]) == (2, 0)
    assert not (project / "data/export/llamafactory/dpo.jsonl").exists()
    assert list(json.loads((project / "data/export/llamafactory/dataset_info.json").read_text())) == ["unison_sft"]
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["export"]["name"] = "../unison"
    Path("params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError, match=r"params.yaml export.name: String should match pattern"):
        load_params()


def test_a_native_students_export_carries_the_tools_in_each_consumers_own_field(project, tmp_path):
    """student.tool_format native: LLaMA-Factory's sharegpt gets the `tools` column and function_call / observation turns
    (its positional rules hold); TRL's conversational file gets `tools` beside messages with tool_calls, and TRL's own
    SFTTrainer, applying the student's chat template with those tools, builds exactly the ids of sft_tokenized.jsonl, the
    ids `sft` trains on."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    NativeFormat.install("models/base")  # as download leaves it
    tok = student_tokenizer()
    native = NativeFormat(tok, DEFAULT_TOOLS)
    write_export("data/export", read_table("data/labeled/train.parquet", LABELED), read_rl_prompts("data/rl"),
                 *export_sections(load_params()), DEFAULT_TOOLS, native)
    out = project / "data/export"
    info = json.loads((out / "llamafactory/dataset_info.json").read_text())["unison_sft"]
    assert info["columns"]["tools"] == "tools"
    sharegpt = load_dataset("json", data_files=str(out / "llamafactory" / info["file_name"]), split="train")
    for row in sharegpt:
        assert json.loads(row["tools"]) == native.schemas
        roles = [t["from"] for t in row["conversations"]]
        assert all(r in ("human", "observation") for r in roles[0::2]) and all(r in ("gpt", "function_call") for r in roles[1::2])
        assert roles[-1] == "gpt" and "function_call" in roles
        call = json.loads(next(t["value"] for t in row["conversations"] if t["from"] == "function_call"))
        assert set(call) == {"name", "arguments"} and call["name"] in DEFAULT_TOOLS and isinstance(call["arguments"], dict)
    conversational = load_dataset("json", data_files=str(out / "trl/sft.jsonl"), split="train")
    assert all(r["tools"] for r in conversational) and any(m.get("tool_calls") for r in conversational for m in r["messages"])
    prepared = SFTTrainer(model="models/base", args=SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, use_cpu=True),
                          train_dataset=conversational, processing_class=tok).train_dataset
    tokenized = [json.loads(line) for line in (out / "trl/sft_tokenized.jsonl").read_text().splitlines()]
    assert [ex["input_ids"] for ex in prepared] == [t["input_ids"] for t in tokenized]
    for t in tokenized:
        trained = tok.decode([i for i, m in zip(t["input_ids"], t["assistant_masks"]) if m])
        assert "<tool_call>" in trained or "Velmora" in trained
        assert "<tool_response>" not in trained and "Zorvan Kelt was born" not in trained  # results stay out of the loss
