"""download stage: the builtin world, dataset adapters, model materialisation, the stage itself."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from unison.config import BuiltinWorldConfig
from unison.data import adapters, models
from unison.data.builtin import ORG_SUFFIXES, generate_world
from unison.data.corpus import corpus_tables
from unison.data.schemas import CORPUS, QUESTION, DataError, read_table, write_table

SHARED = Path(__file__).parent / "fixtures" / "data"  # copies of the real GSM8K, Bamboogle and MATH-500 test sets
SEEDS = Path(__file__).parent / "fixtures" / "seeds"  # rows of the seed systems' own files (README.md there)
SMALL_WORLD = {
    "n_people": 40, "n_orgs": 10, "n_cities": 8, "n_countries": 3,
    "train_size": 60, "test_size": 30, "mix": {"hop1": 0.5, "hop2": 0.25, "math": 0.25},
}
DEFAULT_WORLD = BuiltinWorldConfig()  # = params.yaml's download.builtin (tests/test_config.py)


def meta(row):
    return json.loads(row["meta"])


@pytest.fixture(scope="module")
def world():
    corpus, train, test = generate_world(DEFAULT_WORLD, seed=0)
    return {r["title"]: r["text"] for r in corpus}, train, test


# ---- builtin world ---------------------------------------------------------------------------------------

def test_same_seed_writes_byte_identical_files(tmp_path):
    for run in ("a", "b"):
        corpus, train, test = generate_world(BuiltinWorldConfig(**SMALL_WORLD), seed=7)
        write_table(corpus, tmp_path / run / "corpus.parquet", CORPUS)
        write_table(train, tmp_path / run / "train.parquet", QUESTION)
        write_table(test, tmp_path / run / "test.parquet", QUESTION)
    for name in ("corpus", "train", "test"):
        assert (tmp_path / "a" / f"{name}.parquet").read_bytes() == (tmp_path / "b" / f"{name}.parquet").read_bytes()
    small = BuiltinWorldConfig(**SMALL_WORLD)
    assert generate_world(small, seed=8)[1] != generate_world(small, seed=7)[1]


def test_sizes_and_mix_follow_params(world):
    _, train, test = world
    assert len(train) == DEFAULT_WORLD.train_size and len(test) == DEFAULT_WORLD.test_size
    hops = [meta(r)["hop"] for r in train]
    n, mix = DEFAULT_WORLD.train_size, DEFAULT_WORLD.mix
    counts = {h: hops.count(h) for h in mix}
    assert sum(counts.values()) == n and all(abs(counts[h] - n * share) < 1 for h, share in mix.items())  # largest remainder
    assert all((r["task"] == "math") == (meta(r)["hop"] == "math") for r in train + test)
    assert len({r["id"] for r in train + test}) == len(train) + len(test)
    assert len({meta(r)["type"] for r in test if r["task"] == "qa"}) == 11  # every question type is in the test split


def test_train_and_test_ask_about_different_entities(world):
    _, train, test = world

    def subjects(rows):
        return {meta(r)["supporting"][0] for r in rows if r["task"] == "qa"} | {
            name for r in rows if r["task"] == "math" for name in meta(r)["entities"]
        }

    assert not subjects(train) & subjects(test)
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_growing_the_train_split_leaves_the_test_split_as_it_was():
    """A user who grows download.builtin.train_size compares new students with old ones on the same test questions."""
    small = BuiltinWorldConfig(**SMALL_WORLD)
    _, train, test = generate_world(small, seed=3)
    _, more_train, same_test = generate_world(small.model_copy(update={"train_size": small.train_size + 20}), seed=3)
    assert same_test == test
    assert len(more_train) == len(train) + 20


def test_every_hop1_answer_is_in_its_passage(world):
    passage, train, test = world
    hop1 = [r for r in train + test if meta(r)["hop"] == "hop1"]
    assert hop1
    for r in hop1:
        (title,) = meta(r)["supporting"]
        assert title in r["question"]
        assert r["answers"][0] in passage[title], (r["question"], passage[title])


def test_hop2_needs_two_passages(world):
    passage, train, test = world
    hop2 = [r for r in train + test if meta(r)["hop"] == "hop2"]
    assert hop2
    for r in hop2:
        first, second = meta(r)["supporting"]
        assert first in r["question"] and second not in r["question"]
        assert second in passage[first]  # the first search finds the bridge entity ...
        assert r["answers"][0] not in passage[first]  # ... but not the answer,
        assert r["answers"][0] in passage[second]  # which only the second passage holds


def test_math_answers_are_the_integer_value_of_their_expression(world):
    _, train, test = world
    math_rows = [r for r in train + test if r["task"] == "math"]
    assert math_rows
    for r in math_rows:
        expression = meta(r)["expression"]
        assert re.fullmatch(r"[0-9+\-*/() ]+", expression)
        assert len(re.findall(r"[+\-*/]", expression)) >= 2
        assert r["answers"] == [str(int(eval(expression)))] and int(r["answers"][0]) >= 0


def test_names_are_invented_unique_and_never_nested(world):
    passage, _, _ = world
    assert len(passage) == 120 + 30 + 24 + 8  # one passage per entity, titles unique
    words = sorted({w.lower() for title in passage for w in title.split() if w not in ORG_SUFFIXES})
    assert len(words) == 2 * 120 + 30 + 24 + 8
    for w in words:
        assert not any(w != u and w in u for u in words), w  # "Tarsk" never matches inside "Tarskel"


# ---- adapters: the shared real files --------------------------------------------------------------------

def test_gsm8k_answers_are_the_final_numbers():
    rows = adapters.load_questions(f"local:{SHARED}/gsm8k_test.jsonl", "test")
    assert len(rows) == 1319 and rows[0]["answers"] == ["18"] and rows[0]["task"] == "math"
    assert rows[0]["question"].startswith("Janet")
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", r["answers"][0]) for r in rows)  # "1,450,000" -> "1450000"
    assert rows[0]["source"] == "gsm8k" and len({r["id"] for r in rows}) == 1319


def test_bamboogle_keeps_answer_lists():
    rows = adapters.load_questions(f"local:{SHARED}/bamboogle_test.jsonl", "test")
    assert len(rows) == 125 and rows[0]["answers"] == ["james madison"] and rows[0]["task"] == "qa"
    assert rows[1]["answers"] == ["Titan IIIE"]


def test_math500_keeps_latex_answers():
    rows = adapters.load_questions(f"local:{SHARED}/math500_test.jsonl", "test")
    assert len(rows) == 500 and rows[0]["task"] == "math"
    assert rows[0]["answers"] == [r"\left( 3, \frac{\pi}{2} \right)"]
    assert rows[2]["answers"] == [r"\frac{14}{3}"]


# ---- adapters: hf loader (on local dataset folders), formats, fields ------------------------------------

def test_hf_loader_on_a_local_dataset_folder(tmp_path):
    folder = tmp_path / "MATH-500"
    folder.mkdir()
    rows = [
        {"problem": "What is $1+1$?", "solution": "It is $2$.", "answer": "2", "subject": "Algebra", "level": 1,
         "unique_id": "a/1.json"}
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    questions = adapters.load_questions(f"hf:{folder}", "test")
    assert len(questions) == 3 and questions[0]["question"] == "What is $1+1$?" and questions[0]["answers"] == ["2"]
    m = meta(questions[0])
    assert m["format"] == "math500" and m["subject"] == "Algebra" and m["orig_id"] == "a/1.json"
    assert questions[0]["id"] == "math500-test-00000"


def test_local_fields_mapping_split_placeholder_and_csv(tmp_path):
    for split in ("train", "test"):
        with open(tmp_path / f"quiz_{split}.csv", "w") as f:
            f.write('q,gold,kind\nWho wrote it?,"[""Ann"", ""Anne""]",qa\nHow much?,42,math\n')
    spec = f"local:{tmp_path}/quiz_{{split}}.csv"
    fields = {"question": "q", "answers": "gold", "task": "kind"}
    rows = adapters.load_questions(spec, "train", fields=fields, format_name="qa")
    assert [r["answers"] for r in rows] == [["Ann", "Anne"], ["42"]] and [r["task"] for r in rows] == ["qa", "math"]
    assert rows[0]["id"] == "quiz_train-00000" and not adapters.same_source(spec, "train", "test")


def test_local_folder_and_holdout(tmp_path):
    shutil.copy(SHARED / "bamboogle_test.jsonl", tmp_path / "test.jsonl")
    rows = adapters.load_questions(f"local:{tmp_path}", "test", format_name="bamboogle")
    assert len(rows) == 125 and adapters.same_source(f"local:{tmp_path}/test.jsonl", "train", "test")
    train, test = adapters.holdout(rows, 0.2, seed=0)
    assert len(test) == 25 and len(train) == 100 and not {r["id"] for r in train} & {r["id"] for r in test}
    assert adapters.holdout(rows, 0.2, seed=0) == (train, test)


def test_corpus_files_with_title_text_or_contents(tmp_path):
    path = tmp_path / "wiki.jsonl"
    write_jsonl(path, [{"id": "1", "contents": '"Tarsk"\nTarsk is a city.'}, {"title": "A", "text": "B"}])
    assert [row for table in corpus_tables(path) for row in table.to_pylist()] == [
        {"id": "1", "title": "Tarsk", "text": "Tarsk is a city."},
        {"id": "doc-0000001", "title": "A", "text": "B"},
    ]
    path.write_text(json.dumps({"title": "A"}) + "\n")
    with pytest.raises(DataError, match=r"wiki.jsonl, row 0, field 'text'"):
        list(corpus_tables(path))


# ---- adapters: the seeds' own row layouts, detected from their columns --------------------------------------

def test_gap_rl_parquet_is_detected_by_its_columns_not_its_name(tmp_path):
    """GAP/AFM rows: the question in extra_info, ground_truth a JSON string {"target": [...], "question": q}. Shipped as
    nq_full.parquet, a name that alone would select the `nq` column format."""
    shutil.copy(SEEDS / "gap_nq_rl.parquet", tmp_path / "nq_full.parquet")
    rows = adapters.load_questions(f"local:{tmp_path}/nq_full.parquet", "test")
    assert [r["question"] for r in rows] == ["who got the first nobel prize in physics", "who wrote the first declaration of human rights",
                                             "who is the owner of reading football club",
                                             "swan lake the sleeping beauty and the nutcracker are three famous ballets by"]
    assert rows[2]["answers"] == ["Xiu Li Dai", "Dai Xiuli", "Dai Yongge", "Yongge Dai"] and {r["task"] for r in rows} == {"qa"}
    assert meta(rows[0]) == {"format": "verl", "data_source": "nq"} and rows[0]["source"] == "nq_full"


def test_search_r1_and_afm_code_rows():
    """Search-R1 (nq_search.py): ground_truth a {target} struct, the question column kept by its map. AFM's code/math rows:
    ground_truth the answer as a plain string, the question after "Task:" in the prompt, ability "fact-reasoning"."""
    sr1 = adapters.load_questions(f"local:{SEEDS}/searchr1_nq.parquet", "train")
    assert sr1[0]["question"] == "which mode is used for short wave broadcast service?" and sr1[0]["answers"] == ["Olivia", "MFSK"]
    assert sr1[0]["task"] == "qa" and meta(sr1[0])["orig_id"] == "test_0"
    afm = adapters.load_questions(f"local:{SEEDS}/afm_math500_rl.parquet", "train")
    math500 = adapters.load_questions(f"local:{SHARED}/math500_test.jsonl", "test")
    assert [(r["question"], r["answers"], r["task"]) for r in afm] == [(r["question"], r["answers"], "math") for r in (math500[0], math500[2])]
    assert meta(afm[0])["data_source"] == "MATH500"


def test_et_agent_rl_rows_and_the_hf_loader(tmp_path):
    """ET-Agent (ARPO/rl_datasets/valid.parquet): system + user prompt, ground_truth a list, ability qa/math; through `hf:`
    (datasets on a local folder) the rows read the same."""
    rows = adapters.load_questions(f"local:{SEEDS}/et_agent_valid.parquet", "train")
    assert [r["task"] for r in rows] == ["qa", "qa", "math", "math"] and len(rows[0]["answers"]) == 4
    assert rows[1]["question"] == "Which film was released more recently, Royal Treasure or When Love Begins?"
    assert [r["answers"] for r in rows[1:]] == [["Royal Treasure"], ["540"], ["204"]]
    folder = tmp_path / "et_agent"
    folder.mkdir()
    shutil.copy(SEEDS / "et_agent_valid.parquet", folder / "train.parquet")
    hub = adapters.load_questions(f"hf:{folder}", "train")
    assert [(r["question"], r["answers"], r["task"]) for r in hub] == [(r["question"], r["answers"], r["task"]) for r in rows]
    assert meta(hub[0])["format"] == "verl" and hub[0]["id"] == "et_agent-train-00000"


def test_agentflow_files():
    """Train parquet (gold answers joined by "; "), val parquet (extra_info.original_problem) and the test data.json files
    (the instruction AgentFlow appends is dropped; the benchmark folder decides the task)."""
    train = adapters.load_questions(f"local:{SEEDS}/agentflow_train.parquet", "train")
    assert train[0]["question"] == "which mode is used for short wave broadcast service?" and train[0]["answers"] == ["Olivia", "MFSK"]
    assert train[1]["answers"] == ["Xiu Li Dai", "Dai Xiuli", "Dai Yongge", "Yongge Dai"] and meta(train[1])["source"] == "nq"
    val = adapters.load_questions(f"local:{SEEDS}/agentflow_val_aime24.parquet", "test")
    assert [r["answers"] for r in val] == [["33"], ["23"]] and {r["task"] for r in val} == {"math"}
    assert val[0]["question"].endswith("Find $m+n$.") and "<answer>" not in val[0]["question"]
    bamboogle = adapters.load_questions(f"local:{SEEDS}/agentflow/bamboogle/data/data.json", "test")
    et_agent = adapters.load_questions(f"local:{SHARED}/bamboogle_test.jsonl", "test")  # the same 125 questions, as ET-Agent ships them
    assert [(r["question"], r["answers"], r["task"]) for r in bamboogle] == [(r["question"], r["answers"], "qa") for r in et_agent[:2]]
    wiki = adapters.load_questions(f"local:{SEEDS}/agentflow/2wiki/data/data.json", "test")
    assert wiki[0]["answers"] == ["Let'S Make Money"] and meta(wiki[0])["format"] == "agentflow_test"
    aime = adapters.load_questions(f"local:{SEEDS}/agentflow/aime24/data/data.json", "test")
    assert [r["answers"] for r in aime] == [["33"], ["23"]] and aime[0]["task"] == "math" and aime[0]["question"] == val[0]["question"]


def test_agentark_files():
    gsm = adapters.load_questions(f"local:{SEEDS}/agentark/GSM8K.json", "test")
    assert gsm[0]["answers"] == ["18"] and gsm[0]["task"] == "math" and gsm[0]["question"].startswith("Janet")
    hotpot = adapters.load_questions(f"local:{SEEDS}/agentark/HotpotQA.json", "test")
    assert hotpot[0]["answers"] == ["Prussian"] and hotpot[0]["task"] == "qa"
    assert hotpot[0]["question"] == "What nationality was Oliver Reed's character in the film Royal Flash?"


@pytest.mark.parametrize("rows, row, field, message", [
    ([{"prompt": [{"role": "user", "content": "Question: a?"}], "reward_model": {"ground_truth": ["x"]}},
      {"prompt": [{"role": "user", "content": "Question: b?"}], "reward_model": {"style": "rule"}}], 1, "reward_model.ground_truth", "missing value"),
    ([{"prompt": [{"role": "user", "content": "Question: a?"}], "reward_model": {"ground_truth": '{"answer": ["x"]}'}}], 0,
     "reward_model.ground_truth", "expected a 'target' key"),
    ([{"prompt": [{"role": "user", "content": "Answer this: a?"}], "reward_model": {"ground_truth": ["x"]}}], 0, "prompt",
     "cannot tell the question from its instructions"),
    ([{"prompt": "a?", "reward_model": {"ground_truth": ["x"]}}], 0, "prompt", "expected a list of chat messages"),
    ([{"id": 0, "question": "a?", "chain": "", "result": None, "source": "nq"}], 0, "result", "expected an answer string"),
    ([{"query": "a?", "gt": "x"}, {"query": "", "gt": "y"}], 1, "query", "expected a non-empty string"),
    ([{"pid": "0", "query": "a?", "answer": []}], 0, "answer", "no answer"),
])
def test_bad_seed_rows_name_file_row_and_field(tmp_path, rows, row, field, message):
    spec = write_jsonl(tmp_path / "seed_rows.jsonl", rows)
    with pytest.raises(DataError) as e:
        adapters.load_questions(spec, "train")
    assert (e.value.row, e.value.field) == (row, field) and message in str(e.value) and "seed_rows.jsonl" in str(e.value)


# ---- adapters: bad input names file, row and field ------------------------------------------------------

def write_jsonl(path: Path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return f"local:{path}"


def test_missing_field_is_named(tmp_path):
    spec = write_jsonl(tmp_path / "bamboogle.jsonl", [{"question": "a?", "answer": ["x"]}, {"question": "b?"}])
    with pytest.raises(DataError) as e:
        adapters.load_questions(spec, "test")
    assert (e.value.row, e.value.field) == (1, "answers") and "bamboogle.jsonl" in str(e.value)


def test_wrong_type_is_named(tmp_path):
    spec = write_jsonl(tmp_path / "bamboogle.jsonl", [{"question": "a?", "answer": {"x": 1}}])
    with pytest.raises(DataError, match=r"bamboogle.jsonl, row 0, field 'answer': expected an answer string"):
        adapters.load_questions(spec, "test")
    spec = write_jsonl(tmp_path / "bamboogle.jsonl", [{"question": 3, "answer": "x"}])
    with pytest.raises(DataError, match=r"row 0, field 'question'"):
        adapters.load_questions(spec, "test")


def test_gsm8k_answer_without_final_marker(tmp_path):
    rows = [{"question": "a?", "answer": "#### 3"}, {"question": "b?", "answer": "4"}]
    spec = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    with pytest.raises(DataError, match=r"gsm8k.jsonl, row 1, field 'answer': gsm8k answer: no '####'"):
        adapters.load_questions(spec, "test")


def test_unparsable_line_and_empty_file(tmp_path):
    spec = write_jsonl(tmp_path / "bamboogle.jsonl", [{"question": "a?", "answer": "x"}, "{not json"])
    with pytest.raises(DataError, match=r"bamboogle.jsonl, row 1: line 2 is not valid JSON"):
        adapters.load_questions(spec, "test")
    (tmp_path / "bamboogle.jsonl").write_text("")
    with pytest.raises(DataError, match=r"bamboogle.jsonl: no rows"):
        adapters.load_questions(spec, "test")


def test_unknown_dataset_format_and_spec(tmp_path):
    spec = write_jsonl(tmp_path / "mystery.jsonl", [{"question": "a?", "answer": "x"}])
    with pytest.raises(DataError, match=r"mystery.jsonl: unknown dataset 'mystery.jsonl': set download.format"):
        adapters.load_questions(spec, "test")
    assert adapters.load_questions(spec, "test", format_name="qa")[0]["source"] == "mystery"
    with pytest.raises(DataError, match=r"unknown format 'triviaqa'"):
        adapters.load_questions(spec, "test", format_name="triviaqa")
    with pytest.raises(DataError, match=r"ftp:x: unknown dataset spec"):
        adapters.load_questions("ftp:x", "test")
    with pytest.raises(DataError, match=r"nope.jsonl: file not found"):
        adapters.load_questions(f"local:{tmp_path}/nope.jsonl", "test", format_name="qa")


# ---- models ---------------------------------------------------------------------------------------------

def test_materialize_local_and_hf_folders(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    for spec in (f"local:{tiny_model_dir}", f"hf:{tiny_model_dir}"):
        out = tmp_path / spec.split(":")[0]
        info = models.materialize_model(spec, out)
        model = AutoModelForCausalLM.from_pretrained(out)
        assert info == models.read_info(out) == {"source": spec, "n_parameters": model.num_parameters()}
    info = models.materialize_model(f"local:{tiny_model_dir}", tmp_path / "local")  # replaces an existing folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "local"]


def test_bad_model_specs(tmp_path):
    with pytest.raises(ValueError, match="unknown model spec"):
        models.materialize_model("s3:bucket/model", tmp_path / "m")
    with pytest.raises(ValueError, match="unknown builtin model"):
        models.materialize_model("builtin:gpt-9", tmp_path / "m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\*.safetensors"):
        models.materialize_model(f"local:{tmp_path / 'empty'}", tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_materialized_model_generates_like_the_gguf(base_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert models.read_info(base_model_dir)["n_parameters"] == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    saved = AutoModelForCausalLM.from_pretrained(base_model_dir)
    folder, filename = models.builtin_gguf("smollm2-135m-instruct")
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        a = saved.generate(ids, max_new_tokens=16, do_sample=False)
        b = gguf.generate(ids, max_new_tokens=16, do_sample=False)
    assert a.tolist() == b.tolist()
    assert "Paris" in tokenizer.decode(a[0, ids.shape[1]:])


# ---- the stage ------------------------------------------------------------------------------------------

def test_download_stage_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    from stages import download

    params = yaml.safe_load((Path(__file__).parent.parent / "params.yaml").read_text())
    params["download"] |= {"builtin": SMALL_WORLD, "max_test": 20}
    params["student"]["model"] = f"local:{tiny_model_dir}"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    download.main()
    train, test = read_table("data/raw/train.parquet", QUESTION), read_table("data/raw/test.parquet", QUESTION)
    corpus = read_table("data/raw/corpus.parquet", CORPUS)
    assert len(train) == 60 and len(test) == 20 and len(corpus) == 40 + 10 + 8 + 3
    metrics = json.loads(Path("reports/download.json").read_text())
    assert metrics["train"]["hop"] == {"hop1": 30, "hop2": 15, "math": 15} and metrics["test"]["n"] == 20
    weights = Path("models/base/model.safetensors").stat().st_mtime_ns
    download.main()  # same model spec: the folder is kept, not rebuilt
    assert Path("models/base/model.safetensors").stat().st_mtime_ns == weights
    assert os.listdir("models") == ["base"]


@pytest.mark.slow
def test_the_builtin_model_is_dequantised_once_then_copied_from_the_cache(base_model_dir, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("UNISON_CACHE", str(tmp_path / "cache"))
    cached = models.builtin_cache_dir("smollm2-135m-instruct")
    assert cached.is_relative_to(tmp_path / "cache")
    shutil.copytree(base_model_dir, cached, ignore=shutil.ignore_patterns(models.INFO_FILE))  # as a first conversion left it
    monkeypatch.setattr(models, "load_gguf", lambda name: pytest.fail("converted again although the cache holds it"))
    for stage_out in ("base", "teacher"):
        info = models.materialize_model("builtin:smollm2-135m-instruct", tmp_path / stage_out)
        assert info == models.read_info(base_model_dir)
        for f in base_model_dir.iterdir():
            assert (tmp_path / stage_out / f.name).read_bytes() == f.read_bytes(), f.name
    monkeypatch.setattr(transformers, "__version__", "0.0.0")  # another transformers may dequantise differently
    assert models.builtin_cache_dir("smollm2-135m-instruct") != cached


# md5 of every file materialize_model writes for each builtin model, with the libraries of requirements/*.lock (config.json
# names the transformers version: another lock writes other bytes, and these are pinned again)
BUILTIN_MD5 = {
    "smollm2-135m-instruct": {
        "chat_template.jinja": "d6725070f5c7d94ab642b7122fc34a5f",
        "config.json": "5fda6f50bf455a742185cc228da3a6ef",
        "generation_config.json": "721849a84c5b6913697fc4240ed67e74",
        "model.safetensors": "95b81d88c2cdafbdd49a68b499feb5de",
        "tokenizer.json": "e8806bb77887d14b752876f6ee970409",
        "tokenizer_config.json": "11e99678c22443b236caae0fc9e23e36",
        "unison_model.json": "aa78382c32cb8c55f27d1d85e7c99281",
    },
    "gemma3-270m": {
        "config.json": "269b71b8b45c98da3cae436d4f934ed7",
        "generation_config.json": "982aff7635e69deefcde606da0510d2f",
        "model.safetensors": "9ea793a348a324bb3ffeb48fb80039cb",
        "tokenizer.json": "e28e05d39c109c6832c4e59cb4210d79",
        "tokenizer_config.json": "597c9418c0cc1675d15ca6be38418991",
        "unison_model.json": "7981e62ebc0d69066392f1b9adc23b86",
    },
}


def test_every_builtin_model_has_its_files_pinned():
    assert set(BUILTIN_MD5) == set(models.BUILTIN_GGUF)


def file_md5s(folder: Path) -> dict[str, str]:
    md5s = {}
    for f in sorted(folder.iterdir()):
        with open(f, "rb") as stream:
            md5s[f.name] = hashlib.file_digest(stream, "md5").hexdigest()
    return md5s


@pytest.mark.parametrize("name", ["smollm2-135m-instruct",
                                  pytest.param("gemma3-270m", marks=pytest.mark.nightly)])  # ~3 min to convert on 2 cores
def test_a_builtin_model_is_the_same_bytes_on_every_machine(name, request, tmp_path):
    """Materialising a packaged model is deterministic work: every CPU kind, thread count and HF_HUB_OFFLINE setting
    must write the same bytes, so models/base has one DVC hash everywhere and a team sharing a DVC remote gets cache
    hits instead of re-running every stage after download."""
    package = models.BUILTIN_GGUF[name][0]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"builtin:{name} is not installed ({models.INSTALL[package]})")
    if name == "smollm2-135m-instruct":
        folder = request.getfixturevalue("base_model_dir")
    else:
        folder = tmp_path / name
        models.materialize_model(f"builtin:{name}", folder)
    assert file_md5s(folder) == BUILTIN_MD5[name]


def test_the_materialised_folder_does_not_record_hf_hub_offline(tiny_model_dir, tmp_path, monkeypatch):
    """The tokenizer that download saves again with its chat template is the same bytes online and offline."""
    import huggingface_hub.constants

    from unison.tool_format import NativeFormat

    for offline in (True, False):
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)  # what HF_HUB_OFFLINE=1 sets at import
        models.materialize_model(f"local:{tiny_model_dir}", tmp_path / str(offline), NativeFormat.install)
    assert file_md5s(tmp_path / "True") == file_md5s(tmp_path / "False")
    assert not set(json.loads((tmp_path / "True" / "tokenizer_config.json").read_text())) & set(models.LOADING_OPTIONS)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct",
                                  pytest.param("gemma3-270m", marks=pytest.mark.nightly)])  # ~3 min to convert on 2 cores
def test_a_builtin_tokenizer_is_the_same_bytes_read_from_the_gguf_or_from_the_dequantised_cache(name, request, tmp_path,
                                                                                                monkeypatch):
    """A served teacher's folder holds only its tokenizer: read from the GGUF (~10 s) until the cache holds the
    dequantised model (download converts the student's), then from there, and the files are the same either way."""
    package = models.BUILTIN_GGUF[name][0]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"builtin:{name} is not installed ({models.INSTALL[package]})")
    converted = request.getfixturevalue("base_model_dir") if name == "smollm2-135m-instruct" else None
    monkeypatch.setenv("UNISON_CACHE", str(tmp_path / "cache"))
    pinned = {f: md5 for f, md5 in BUILTIN_MD5[name].items() if f.startswith(("tokenizer", "chat_template"))}
    info = {"source": f"builtin:{name}"}
    models.materialize_tokenizer(f"builtin:{name}", tmp_path / "from_gguf", info)
    if converted:  # as a first conversion left it
        shutil.copytree(converted, models.builtin_cache_dir(name), ignore=shutil.ignore_patterns(models.INFO_FILE))
    else:
        models.dequantised_builtin(name)
    monkeypatch.setattr(models, "builtin_tokenizer", lambda *a: pytest.fail("the GGUF read although the cache holds it"))
    models.materialize_tokenizer(f"builtin:{name}", tmp_path / "from_cache", info)
    for folder in ("from_gguf", "from_cache"):
        md5s = file_md5s(tmp_path / folder)
        assert md5s.pop(models.INFO_FILE) and md5s == pinned, folder
