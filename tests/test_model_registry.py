"""The model registry (real MLflow SQLite store, real transformers folders): students as versions of one registered model
per recipe, tagged, `champion` on the best EM, loaded back by name and alias."""
from __future__ import annotations

import os
import subprocess

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from unison import model_registry, track
from unison.config import ROOT
from unison.data.schemas import atomic_dir
from unison.recipes import MARKER, recipe_of
from unison.tool_format import TEMPLATE


@pytest.fixture
def project(tracked_project, tracking_uri, request):
    """A git project with the default params.yaml as cwd, its own experiment; artifacts under it."""
    tmp_path = tracked_project
    MlflowClient(tracking_uri).create_experiment(request.node.name, artifact_location=(tmp_path / "mlruns").as_uri())
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "params.yaml"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "params"], cwd=tmp_path, check=True)
    return tmp_path


def train(path, seed: int):
    """A 2-layer, 16-wide random Llama saved as a transformers folder, swapped in whole as the stages write models."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64)
    with atomic_dir(path) as tmp:
        LlamaForCausalLM(config).save_pretrained(tmp)
    return LlamaForCausalLM.from_pretrained(path).state_dict()


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def scores(em: float) -> dict:
    return {"em": em, "em_lo": em - 0.1, "em_hi": em + 0.1, "subem": em, "f1": em, "accuracy": em, "tokens_per_question": 40.0,
            "questions": 200, "answered_rate": 1.0}


def test_students_are_tagged_versions_and_the_best_em_is_champion_loaded_back_by_alias(project, capsys):
    sft, rl = train(project / "models/sft", 1), train(project / "models/rl", 2)
    (project / "models/rl/chat_template.jinja").write_text(TEMPLATE.read_text())  # a native student's template with tools
    with track.stage_run("evaluate", {}) as run:
        first = model_registry.register_student(run, "sft", "models/sft", scores(0.30), "builtin")
        second = model_registry.register_student(run, "rl", "models/rl", scores(0.45), "builtin")
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_registered_model("unison-default").aliases == {"champion": second.version}
    tags = client.get_model_version("unison-default", second.version).tags
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert tags["git_commit"] == commit and tags["git_dirty"] == "false"
    assert tags["params_hash"] == track.pipeline_params()["params_hash"] and len(tags["params_hash"]) == 12
    assert tags["student"] == "rl" and tags["recipe"] == "default" and tags["teacher"] == "builtin:smollm2-135m-instruct"
    assert tags["pipeline_run_id"] == run.pipeline_run_id and client.get_model_version("unison-default", first.version).tags["em"] == "0.3"
    assert {k: tags[k] for k in ("em", "em_hi", "tokens_per_question", "questions")} == {
        "em": "0.45", "em_hi": "0.55", "tokens_per_question": "40.0", "questions": "200"}
    assert "answered_rate" not in tags
    assert (tags["tool_format"], tags["tool_parser"], tags["chat_template"]) == ("native", "hermes", "chat_template.jinja")
    assert client.get_model_version("unison-default", first.version).tags["tool_format"] == "tags"  # no template with tools

    # No copy: the version's files are the model's own (hard links); a stage swapping in a new folder leaves them alone.
    stored = project / "mlruns" / run.run_id / "artifacts" / "students" / "rl" / "model.safetensors"
    assert os.stat(stored).st_ino == os.stat(project / "models/rl/model.safetensors").st_ino
    train(project / "models/rl", 3)
    loaded = AutoModelForCausalLM.from_pretrained(model_registry.local_dir("unison-default", "champion")).state_dict()
    assert same_weights(loaded, rl) and not same_weights(loaded, sft)
    downloaded = mlflow.artifacts.download_artifacts("models:/unison-default@champion", dst_path=str(project / "served"),
                                                     tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    assert same_weights(AutoModelForCausalLM.from_pretrained(downloaded).state_dict(), rl)

    # A later student moves the alias only when it beats the champion's EM (a tie keeps the older one).
    train(project / "models/flywheel/round-1", 4)
    flywheel = train(project / "models/flywheel/round-2", 5)
    with track.stage_run("flywheel", {}) as run:
        tie = model_registry.register_student(run, "flywheel-round-1", "models/flywheel/round-1", scores(0.45), "builtin")
        assert client.get_registered_model("unison-default").aliases == {"champion": second.version}
        best = model_registry.register_student(run, "flywheel-round-2", "models/flywheel/round-2", scores(0.52), "builtin")
    assert int(tie.version) == int(second.version) + 1
    assert client.get_registered_model("unison-default").aliases == {"champion": best.version}

    capsys.readouterr()
    model_registry.main([])  # the folder `unison serve` serves by default
    out = capsys.readouterr()
    assert same_weights(AutoModelForCausalLM.from_pretrained(out.out.strip()).state_dict(), flywheel)
    assert f"unison-default@champion: version {best.version}, flywheel-round-2 (EM 0.52), commit {commit[:10]}" in out.err


def test_one_registered_model_per_recipe(project):
    (project / "params.yaml").write_text(f"{MARKER} gap (tiny) -- written by `python -m unison.recipes`\n"
                                         + (project / "params.yaml").read_text())
    train(project / "models/sft", 1)
    with track.stage_run("evaluate", {}) as run:
        version = model_registry.register_student(run, "sft", "models/sft", scores(0.1), "builtin")
    assert version.name == "unison-gap-tiny"
    assert MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_registered_model("unison-gap-tiny").aliases == {"champion": version.version}
    assert [recipe_of(f"{MARKER} {label} -- x\nseed: 0") for label in ("afm", "afm (tiny)", "configs/recipes/gap.yaml")] == [
        "afm", "afm-tiny", "gap"]
    assert recipe_of("seed: 0\n") == "default"


def test_no_champion_is_a_clear_error(project):
    with pytest.raises(SystemExit, match="no unison-nothing@champion in sqlite:"):
        model_registry.main(["--model", "unison-nothing"])


def test_a_trained_folder_carries_its_card_and_the_registered_version_the_scored_one(project):
    """The training stage's card (README.md with Hub front matter, tools.json, system_prompt.txt) says where the score
    is; registering writes the scored card (EM, interval, CPU kind, date) into the version's copy and description,
    replacing the hard links rather than writing through them into the trained folder."""
    import json

    import yaml

    from unison.config import load_params
    from unison.model_card import facts, read_card, write_card
    from unison.tool_format import native_system_prompt
    from unison.tools.registry import schemas

    train(project / "models/rl", 1)
    (project / "models/rl/chat_template.jinja").write_text(TEMPLATE.read_text())
    (project / "data").mkdir()
    (project / "data/rl.parquet").write_bytes(b"the prompts")
    params = load_params()
    write_card(project / "models/rl", facts(params, "rl", ["data/rl.parquet"], {"steps": 4}))
    card = (project / "models/rl/README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["unison"]["base_model"] == "builtin:smollm2-135m-instruct" and front["unison"]["tool_parser"] == "hermes"
    assert front["unison"]["data_sha256"] == __import__("hashlib").sha256(b"the prompts").hexdigest()[:12]
    assert "model-index" not in front and "Not scored in this folder" in card and "unison serve" in card
    assert json.loads((project / "models/rl/tools.json").read_text()) == schemas(("search", "python"))
    assert (project / "models/rl/system_prompt.txt").read_text() == native_system_prompt(params.generate.method)

    with track.stage_run("evaluate", {}) as run:
        version = model_registry.register_student(run, "rl", "models/rl", scores(0.45), "builtin")
    stored = project / "mlruns" / run.run_id / "artifacts" / "students" / "rl"
    scored = (stored / "README.md").read_text()
    assert "**EM 45.0%** (95% Wilson interval 35.0-55.0) on 200 test questions of builtin" in scored
    assert yaml.safe_load(scored.split("---\n")[1])["model-index"][0]["results"][0]["metrics"][0]["value"] == 0.45
    assert read_card(stored) == read_card(project / "models/rl")  # the same facts, now with the score
    assert (project / "models/rl/README.md").read_text() == card  # the trained folder (DVC's cache) is untouched
    assert os.stat(stored / "README.md").st_ino != os.stat(project / "models/rl/README.md").st_ino
    assert os.stat(stored / "model.safetensors").st_ino == os.stat(project / "models/rl/model.safetensors").st_ino
    description = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_model_version("unison-default", version.version).description
    assert "**EM 45.0%**" in description and "tools.json" in description



@pytest.mark.parametrize("tool_format", ["native", "tags"])
def test_a_cards_system_prompt_is_the_one_its_student_was_trained_under(tmp_path, base_model_dir, tool_format):
    """system_prompt.txt is the student's format's own system prompt, the teacher method's rules included: a tag
    student of gap was trained to plan in <plan>, which its card's prompt must ask for as its training prompt did."""
    from transformers import AutoTokenizer

    from unison.model_card import write_card
    from unison.tool_format import student_format
    from unison.tools.registry import STUDENT_RULES

    tools = ("search", "python")
    card = {"name": "unison-default-rl", "student": "rl", "tool_format": tool_format, "teacher_method": "gap",
            "tools": list(tools), "tool_parser": "", "data": [], "data_sha256": "", "params_hash": "", "git_commit": "",
            "git_dirty": "", "training": {}, "trained_on": "", "date": "", "base_model": "", "teacher": "",
            "trained_by": "rl"}
    write_card(tmp_path, card)
    trained_under = student_format(tool_format, AutoTokenizer.from_pretrained(base_model_dir), tools, "gap").system
    assert (tmp_path / "system_prompt.txt").read_text() == trained_under and STUDENT_RULES["gap"] in trained_under
