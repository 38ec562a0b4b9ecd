"""generate.source: SFT trajectories imported instead of generated (unison/agents/imports.py) -- the seeds' Alpaca records
with inline observations, LLaMA-Factory's ShareGPT, OpenAI messages -- rendered in the student protocol, matched to the
train questions, judged by `label`, and trained on by `sft` with every tool output masked token-exactly; under DVC the
imported file is a dependency of generate."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from unison.agents.imports import import_trajectories, protocol_text
from unison.config import ROOT, Params, ParamsError, validate_params
from unison.data import adapters
from unison.data.schemas import LABELED, QUESTION, TRAJECTORY, DataError, read_table, write_table
from unison.protocol import chat_prompt, observation
from unison.tools.registry import SYSTEM_PROMPT, enabled_tools

SEEDS = Path(__file__).parent / "fixtures" / "seeds"  # README.md there says where each file's layout comes from
RECORDS = ("afm_mhqa_sft.json", "et_agent_sft.json", "sharegpt_tools.json", "openai_tools.jsonl", "sharegpt_glaive_toolcall.json")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory whose imports/ holds the fixture files (generate.source must name a file under imports/)."""
    (tmp_path / "imports").mkdir()
    for name in RECORDS + ("gap_nq_rl.parquet", "wiki_passages.jsonl"):
        shutil.copy(SEEDS / name, tmp_path / "imports" / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train_questions() -> list[dict]:
    """GAP's NQ rows and ET-Agent's rows as download reads them: the questions the fixtures' trajectories answer."""
    return (adapters.load_questions(f"local:{SEEDS}/gap_nq_rl.parquet", "train")
            + adapters.load_questions(f"local:{SEEDS}/et_agent_valid.parquet", "train"))


def imported(name: str, questions=None, **settings) -> tuple[list[dict], dict]:
    params = Params(generate={"source": f"local:imports/{name}"}, **settings)
    return import_trajectories(params.generate, enabled_tools(params.tools), params.download.dataset,
                               train_questions() if questions is None else questions)


def turns(row: dict) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in row["student"][2:]]


def observations(text: str) -> list[str]:
    return [part.split("</observation>")[0].strip() for part in text.split("<observation>")[1:]]


def test_afm_alpaca_records_become_student_protocol_turns(workdir):
    rows, metrics = imported("afm_mhqa_sft.json")
    records = json.loads((SEEDS / "afm_mhqa_sft.json").read_text())
    questions = {q["question"]: q for q in train_questions()}
    assert [r["question_id"] for r in rows] == [questions[q]["id"] for q in (
        "who got the first nobel prize in physics", "who wrote the first declaration of human rights",  # 2nd: in the instruction
        "who is the owner of reading football club", "swan lake the sleeping beauty and the nutcracker are three famous ballets by")]
    assert metrics["import_records"] == 4 and metrics["import_unmatched"] == 0 and metrics["trajectories"] == 4
    first = rows[0]
    assert first["student"][0]["content"] == SYSTEM_PROMPT and first["student"][1]["content"] == "who got the first nobel prize in physics"
    assert [role for role, _ in turns(first)] == ["assistant", "tool", "assistant"]
    assert turns(first)[0][1].endswith("<think>I will search for the first Nobel Prize in Physics.</think>\n<search>first Nobel Prize in Physics</search>")
    assert turns(first)[1][1] == observation(observations(records[0]["output"])[0])
    assert turns(first)[2][1].endswith("<answer>Wilhelm Conrad Röntgen</answer>") and first["final_answer"] == "Wilhelm Conrad Röntgen"
    assert not any("wiki_search" in text or "<observation>" in text for r in rows for _, text in turns(r))
    parallel = turns(rows[2])  # one <wiki_search>a|b</wiki_search>, answered by two observation blocks: one tool turn
    assert parallel[0][1].endswith("<search>Reading F.C. owner|Reading Football Club takeover 2017</search>")
    assert parallel[1][1] == observation("\n---\n".join(observations(records[2]["output"])))
    assert [role for role, _ in turns(rows[3])] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert first["messages"][-1] == {"role": "assistant", "name": None, "content": records[0]["output"]}  # the record's own words
    assert {(r["method"], r["teacher"], r["n_llm_calls"], r["n_tokens"], r["tool_errors"], r["tool_stats"], r["finish_reason"], r["tokenizer"])
            for r in rows} == {("import", "local:imports/afm_mhqa_sft.json", 0, 0, 0, "{}", "import", "")}
    assert [r["n_tool_calls"] for r in rows] == [1, 1, 1, 2] and [r["sample"] for r in rows] == [0, 0, 0, 0]
    write_table(rows, workdir / "trajectories.parquet", TRAJECTORY)  # the same artifact generate writes


def test_et_agent_record_keeps_its_tags_and_takes_the_math_question(workdir):
    (row,), _ = imported("et_agent_sft.json")
    assert row["task"] == "math" and row["answers"] == ["204"] and row["final_answer"] == r"The final answer is \[ \boxed{204} \]"
    call, result, _ = turns(row)
    assert call[1].startswith("<think> Both walks") and call[1].endswith("</python>") and result == ("tool", observation("{s: 5/2, t: 24} 204"))


def test_afm_tool_tags_become_the_protocols():
    """AFM's web and code agents: crawl_page -> crawl, code -> python without the ```python fence the sandbox cannot run."""
    afm = "<think>t</think>\n<crawl_page>https://a.org | https://b.org</crawl_page>\n<code>\n```python\nprint(6 * 7)\n```\n</code>"
    assert protocol_text(afm) == "<think>t</think>\n<crawl>https://a.org | https://b.org</crawl>\n<python>\nprint(6 * 7)\n</python>"


def test_sharegpt_and_openai_tool_calls_become_protocol_tags(workdir):
    rows, _ = imported("sharegpt_tools.json")
    assert turns(rows[0]) == [("assistant", "<search>first Nobel Prize in Physics</search>"),
                              ("tool", observation('Doc 1(Title: "Nobel Prize in Physics") The first Nobel Prize in Physics was awarded in '
                                                   "1901 to Wilhelm Conrad Röntgen, of Germany, for his discovery of X-rays.")),
                              ("assistant", "<answer>Wilhelm Conrad Röntgen</answer>")]  # a plain last reply is the answer
    assert [m["role"] for m in rows[1]["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    rows, _ = imported("openai_tools.jsonl")
    assert turns(rows[0])[0] == ("assistant", "<search>first declaration of human rights</search>") and rows[0]["final_answer"] == "Cyrus"
    call, result, reply = turns(rows[1])  # two parallel calls of `search`: one tag, one tool turn
    assert call[1] == "I will look the club and its takeover up at once.\n<search>Reading F.C. owner | Reading Football Club takeover 2017</search>"
    assert result[1].count("\n---\n") == 1 and reply == ("assistant", "<answer>Dai Yongge</answer>")


def write_record(workdir: Path, record: dict) -> None:
    (workdir / "imports" / "bad.json").write_text(json.dumps([record]))


ALPACA = {"instruction": "Answer with wiki_search.", "input": "who wrote the first declaration of human rights"}
CALL = {"from": "function_call", "value": json.dumps({"name": "wiki_search", "arguments": {"query": "Cyrus"}})}


@pytest.mark.parametrize("record, field, message", [
    ({**ALPACA, "output": "<wiki_search>Cyrus</wiki_search>\n\n<observation> Doc 1 ...\n\n<answer>Cyrus</answer>"}, "output",
     "1 <observation> but 0 </observation>"),
    ({**ALPACA, "output": "<think>I know it.</think>\n\n<observation> Doc 1 </observation>\n\n<answer>Cyrus</answer>"}, "output",
     "a tool result follows no call of a student-protocol tool"),
    ({**ALPACA, "output": '<visual_inspector>{"file_path": "a.png"}</visual_inspector>\n\n<observation> x </observation>\n\n<answer>a</answer>'},
     "output", "a tool result follows no call"),
    ({**ALPACA, "output": "<web_search>Cyrus</web_search>\n\n<observation> x </observation>\n\n<answer>Cyrus</answer>"}, "output",
     "calls web_search, which this run does not enable"),
    ({**ALPACA, "output": "<wiki_search>Cyrus</wiki_search>\n\n<observation> x </observation>"}, "output", "does not end with a reply"),
    ({**ALPACA, "output": "<answer>Cyrus</answer>", "history": [["hi", "hello"]]}, "history", "answers one question"),
    ({"conversations": [{"from": "human", "value": "who wrote the first declaration of human rights"},
                        {"from": "function_call", "value": json.dumps({"name": "search_recipes", "arguments": {"ingredients": ["rice"]}})},
                        {"from": "observation", "value": "{}"}, {"from": "gpt", "value": "Cyrus"}]},
     "conversations[1]", "function 'search_recipes' has no tool in the student protocol"),
    ({"conversations": [{"from": "human", "value": "who wrote it?"}, {"from": "function_call", "value": "search(Cyrus)"}]},
     "conversations[1]", "a function_call must be JSON"),
    ({"conversations": [{"from": "human", "value": "who wrote it?"}, CALL, {"from": "observation", "value": "x"}, {"from": "gpt", "value": "a"},
                        {"from": "human", "value": "and then?"}]}, "conversations[4]", "a second human turn"),
    ({"messages": [{"role": "user", "content": "who wrote it?"},
                   {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "search", "arguments": '{"query": "a", "k": 3}'}}]},
                   {"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}]}, "messages[1]", "expected one argument"),
    ({"messages": [{"role": "user", "content": "who wrote it?"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "search", "arguments": '{"query": "a"}'}},
                                                        {"function": {"name": "python", "arguments": '{"code": "print(1)"}'}}]},
                   {"role": "tool", "content": "x"}, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]},
     "messages[1]", "a turn holds one call, or several calls of one search tool"),
])
def test_bad_records_name_file_row_and_field(workdir, record, field, message):
    write_record(workdir, record)
    with pytest.raises(DataError) as e:
        imported("bad.json")
    assert (e.value.row, e.value.field) == (0, field) and message in str(e.value) and "imports/bad.json" in str(e.value)


def test_unknown_format_unmatched_records_and_sources_outside_imports(workdir):
    write_record(workdir, {"prompt": "q", "completion": "a"})
    with pytest.raises(DataError, match=r"imports/bad.json, row 0: unknown trajectory format \(fields \['completion', 'prompt'\]\)"):
        imported("bad.json")
    with pytest.raises(DataError, match=r"sharegpt_glaive_toolcall.json, row 0, field 'conversations\[2\]': a second human turn"):
        imported("sharegpt_glaive_toolcall.json")  # LLaMA-Factory's own tool-call demo: a chat, not one question's trajectory
    with pytest.raises(DataError, match=r"none of its 4 alpaca records asks a train question of download.dataset \(builtin\)"):
        imported("afm_mhqa_sft.json", questions=train_questions()[4:])  # ET-Agent's questions only
    rows, metrics = imported("afm_mhqa_sft.json", questions=train_questions()[1:])  # the first question held out as test
    assert metrics["import_unmatched"] == 1 and len(rows) == 3
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for source in ("local:/tmp/sft.json", "local:data/sft.json", "local:imports/../sft.json", "hf:PersonalAILab/AFM-MHQA-Agent-SFT-Dataset"):
        with pytest.raises(ParamsError, match=r"generate.source: .*(is not local:<file>|is outside download.inputs \(imports\))"):
            validate_params({**raw, "generate": {**raw["generate"], "source": source}}, "params.yaml")


def spans(ids: list[int], mask: list[int], start: int) -> list[tuple[int, list[int]]]:
    """(mask value, token ids) of each run of equal mask values from `start` on."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ids[start:], mask[start:]):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def assert_masked_token_exactly(tok, row: dict, ids: list[int], mask: list[int]) -> None:
    """After the prompt, the loss mask is 1 on exactly the tokens of each assistant turn (the last closed by eos) and 0 on
    exactly the tokens of each tool result, tokenised on their own under the student's tokenizer."""
    prompt = chat_prompt(tok, [{"role": m["role"], "content": m["content"]} for m in row["student"][:2]])
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    expected = [(int(role == "assistant"), tok(text, add_special_tokens=False)["input_ids"]) for role, text in turns(row)]
    expected[-1][1].append(tok.eos_token_id)
    assert spans(ids, mask, len(prompt)) == expected
    assert [tok.decode(t) for m, t in expected if not m] == [text for role, text in turns(row) if role == "tool"]


def test_tool_output_is_masked_token_exactly_for_the_students_tokenizer(workdir, tiny_model_dir):
    from transformers import AutoTokenizer

    from unison.token_view import row_view

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name in ("afm_mhqa_sft.json", "et_agent_sft.json", "sharegpt_tools.json", "openai_tools.jsonl"):
        for row in imported(name)[0]:
            assert_masked_token_exactly(tok, row, *row_view(tok, row))


def test_download_generate_label_sft_on_imported_trajectories(workdir, tiny_model_dir):
    """The stages in DAG order, in process: download reads GAP's RL parquet (one question held out as test), generate
    imports AFM-style Alpaca records (the held-out question's record left out), label judges them against GAP's gold
    answers, sft builds its examples with every tool result masked token-exactly and trains the tiny model on them."""
    from transformers import AutoTokenizer

    from stages import download, generate, label, sft
    from unison.tool_format import TagFormat
    from unison.train.sft import build_examples, select_trajectories

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["student"] |= {"model": f"local:{tiny_model_dir}", "tool_format": "tags"}  # the tag rendering, checked by hand below
    params["download"] |= {"dataset": "local:imports/gap_nq_rl.parquet", "corpus": "imports/wiki_passages.jsonl", "test_fraction": 0.25}
    params["generate"]["source"] = "local:imports/afm_mhqa_sft.json"
    params["sft"] |= {"epochs": 1, "batch_size": 2}
    (workdir / "params.yaml").write_text(yaml.safe_dump(params))
    download.main()
    generate.main()
    label.main()
    (held_out,) = read_table("data/raw/test.parquet", QUESTION)
    report = json.loads(Path("reports/generate.json").read_text())
    assert (report["import_records"], report["import_unmatched"], report["trajectories"]) == (4, 1, 3)
    labeled = read_table("data/labeled/train.parquet", LABELED)
    assert held_out["id"] not in {r["question_id"] for r in labeled} and all(r["correct"] for r in labeled)
    tok = AutoTokenizer.from_pretrained("models/base")
    chosen = select_trajectories(labeled, max_per_question=2, dedupe=True)
    examples, stats = build_examples(TagFormat(tok), chosen, max_length=params["sft"]["max_length"])
    assert len(examples) == 3 and stats["truncated_examples"] == 0
    for row, (ids, mask) in zip(chosen, examples):
        assert_masked_token_exactly(tok, row, ids, mask)
    sft.main()
    metrics = json.loads(Path("reports/sft.json").read_text())
    assert metrics["selected"] == 3 and metrics["train_tokens"] == sum(sum(m) for _, m in examples)
    assert (Path("models/sft") / "model.safetensors").is_file()


@pytest.mark.slow
def test_editing_the_imported_file_reruns_generate_under_dvc(tmp_path):
    """Real DVC on a copy of the project: `dvc repro` of generate with generate.source set imports the file; editing that file
    makes generate stale (imports/ is its dependency) and the next repro imports the new content."""
    from tests.projects import copy_project, run

    project = copy_project(tmp_path / "project", None, skip=("tests/", "docs/"))
    shutil.copy(SEEDS / "afm_mhqa_sft.json", project / "imports" / "sft.json")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["generate"]["source"] = "local:imports/sft.json"
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    write_table(train_questions()[:4], project / "data/raw/train.parquet", QUESTION)  # what download would write
    for stage_output in ("data/index", "models/teacher", "models/teachers"):  # generate's other inputs, unread here
        (project / stage_output).mkdir(parents=True)
        (project / stage_output / "placeholder").write_text("not read when generate.source is set\n")
    run(project, "dvc", "repro", "--single-item", "generate")
    assert json.loads((project / "reports/generate.json").read_text())["trajectories"] == 4
    assert "generate" not in run(project, "dvc", "status", "generate").stdout
    records = json.loads((project / "imports/sft.json").read_text())
    (project / "imports/sft.json").write_text(json.dumps(records[:2]))
    status = run(project, "dvc", "status", "generate").stdout
    assert "generate:" in status and "modified:" in status and "imports" in status, status
    run(project, "dvc", "repro", "--single-item", "generate")
    assert json.loads((project / "reports/generate.json").read_text())["trajectories"] == 2
