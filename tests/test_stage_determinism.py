"""A forced re-run of a stage on unchanged inputs writes byte-identical outputs (no wall-clock field in any data file),
so DVC sees the same hash and reruns nothing below it: `generate` and `label` on the tiny model (transformers backend)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.test_runtime_sft import CorpusRetriever
from unison.agents.toolbox import Toolbox
from unison.config import ROOT
from unison.data.schemas import QUESTION, write_table

QUESTIONS = [{"id": f"q{i}", "source": "builtin", "task": "qa", "question": q, "answers": [a], "meta": "{}"}
             for i, (q, a) in enumerate([("In which city was Zorvan Kelt born?", "Tarsk"), ("In which country is Tarsk?", "Velmora")])]


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_model_dir):
    """A project dir as cwd: the repo's params and configs, two qa questions, the tiny model as every model, a lexical
    search tool, its own MLflow store."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["llm"] |= {"backend": "transformers", "dtype": "float32"}
    params["teacher"]["backend"] = "transformers"
    params["generate"] |= {"samples": 2, "max_turns": 2, "max_tokens_per_turn": 12, "debate": {"agents": 2, "rounds": 2, "aggregator": "llm"}}
    params["label"] |= {"step_labels": "montecarlo", "mc_rollouts": 2}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copytree(ROOT / "configs", tmp_path / "configs")  # files params.yaml names (the teacher's demonstrations)
    for name in ("base", "teacher"):
        shutil.copytree(tiny_model_dir, tmp_path / "models" / name)
    monkeypatch.chdir(tmp_path)
    write_table(QUESTIONS, "data/raw/train.parquet", QUESTION)
    monkeypatch.setattr("unison.agents.cluster.make_toolbox", lambda params: Toolbox(CorpusRetriever()))
    monkeypatch.setattr("unison.agents.wiring.make_toolbox", lambda params: Toolbox(CorpusRetriever()))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    return tmp_path


@pytest.mark.slow
def test_rerunning_generate_and_label_writes_identical_bytes(project):
    from stages import generate, label

    hashes = []
    for _ in range(2):
        generate.main()
        label.main()
        hashes.append((sha256("data/trajectories/train.parquet"), sha256("data/labeled/train.parquet")))
    assert hashes[0] == hashes[1]
    meta = pq.ParquetFile("data/labeled/train.parquet").metadata
    assert meta.num_rows == 4 and not {"latency_s", "wall_s"} & set(meta.schema.names)
    assert set(meta.metadata) == {b"ARROW:schema"} and meta.created_by.startswith("parquet-cpp-arrow version")  # no timestamps
    assert json.loads(Path("reports/generate.json").read_text())["wall_s"] > 0  # the timing went to the report


def test_generate_shards_are_not_reused_after_the_teachers_examples_change(tmp_path, monkeypatch):
    from unison.agents.generation import shard_dir
    from unison.config import GenerateConfig, Params

    monkeypatch.chdir(tmp_path)
    examples = tmp_path / "examples.txt"
    params = Params(generate=GenerateConfig(demonstrations=str(examples)))
    examples.write_text("Question: a?\n<answer>b</answer>")
    before = shard_dir(params.system_settings(), QUESTIONS)
    assert shard_dir(params.system_settings(), QUESTIONS) == before
    examples.write_text("Question: a?\n<answer>c</answer>")  # same file name, other text
    assert shard_dir(params.system_settings(), QUESTIONS) != before
