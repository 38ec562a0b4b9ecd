"""The typed settings (unison/config): params.yaml equals the models' defaults, recipes validate through the same
models, and a bad setting fails at load naming the file and the key."""
from __future__ import annotations

import typing

import pytest
import yaml

from unison.agents.methods import METHODS
from unison.config import ROOT, GenerateConfig, Params, ParamsError, load_params, validate_params
from unison.recipes import names, recipe_params


def leaves(tree: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested mapping."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_params_yaml_is_exactly_the_models_defaults():
    """One place for defaults: every key of params.yaml is a field, every field is in params.yaml, with the same value."""
    in_file = leaves(yaml.safe_load((ROOT / "params.yaml").read_text()))
    defaults = leaves(Params().model_dump())
    assert sorted(in_file) == sorted(defaults)
    assert {k: v for k, v in in_file.items() if defaults[k] != v} == {}
    assert load_params(ROOT / "params.yaml") == Params()


def test_each_settings_comment_in_params_yaml_is_its_one_description():
    """params.yaml's comments are the Field descriptions (`python -m unison.params_doc` writes them): a comment edited
    in the file alone, or a description changed in the model alone, fails here."""
    from unison.params_doc import sync

    text = (ROOT / "params.yaml").read_text()
    assert sync(text) == text, "params.yaml's comments differ from unison/config's descriptions: run python -m unison.params_doc"
    stale = text.replace("# questions per resumable shard", "# shards of questions", 1)
    assert stale != text and sync(stale) == text  # the model's description wins
    assert "ParetoConfig" not in text and "Pareto front" in Params.model_fields["pareto"].annotation.model_fields["counts"].description


@pytest.mark.parametrize("recipe", names())
def test_every_recipe_and_its_tiny_overlay_validate(recipe):
    for tiny in (False, True):
        validate_params(recipe_params(recipe, tiny), f"{recipe} (tiny={tiny})")


def test_the_method_names_are_the_methods():
    """One list of methods (config.METHODS): the Literal, the modules of unison/agents/methods, the conversing ones (those
    that give an agent a new user turn) and the error messages all read it."""
    from unison.agents.episodes import continuation_ids
    from unison.agents.methods import get_method
    from unison.config import CONVERSING_METHODS

    assert typing.get_args(GenerateConfig.model_fields["method"].annotation) == METHODS
    folder = ROOT / "unison" / "agents" / "methods"
    assert sorted(METHODS) == sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "common"))
    assert sorted(CONVERSING_METHODS) == sorted(m for m in METHODS if "continue_episode" in (folder / f"{m}.py").read_text())
    with pytest.raises(ValueError) as unknown:
        get_method("panel")
    assert all(m in str(unknown.value) for m in METHODS)

    class Base:  # a tokenizer without a chat template
        name_or_path, chat_template = "base", None

    with pytest.raises(ValueError) as base:
        continuation_ids(Base(), "next")
    assert all(m in str(base.value) for m in METHODS)


def test_the_estimator_names_are_the_estimators():
    """One list of RL estimators (config.RL_ESTIMATORS): the Literal, unison's sequence estimators and verl's map."""
    from unison.config import RL_ESTIMATORS, SEQUENCE_ESTIMATORS, RLConfig
    from unison.train.advantages import ESTIMATORS
    from unison.train.verl_trainer import ESTIMATORS as VERL_ESTIMATORS

    assert typing.get_args(RLConfig.model_fields["loss"].annotation.model_fields["estimator"].annotation) == RL_ESTIMATORS
    assert tuple(ESTIMATORS) == tuple(VERL_ESTIMATORS) == SEQUENCE_ESTIMATORS
    assert set(RL_ESTIMATORS) - set(SEQUENCE_ESTIMATORS) == {"flow_grpo"}  # advantages.flow_grpo, over turns


def overlay(**sections) -> dict:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in sections.items():
        raw[section] = {**raw[section], **values}
    return raw


@pytest.mark.parametrize("sections, message", [
    ({"sft": {"epochz": 3}}, r"params-bad.yaml sft.epochz: unknown key"),
    ({"rl": {"loss": {"estimator": "ppo"}}}, r"params-bad.yaml rl.loss.estimator: Input should be 'grpo', 'dr_grpo', 'rloo' or 'flow_grpo'"),
    ({"sft": {"batch_size": "four"}}, r"params-bad.yaml sft.batch_size: Input should be a valid integer"),
    ({"generate": {"roles": {"critic": {"temperture": 0.2}}}}, r"generate.roles.critic: unknown key\(s\) \['temperture'\]"),
    ({"label": {"llm": {"dtyp": "bf16"}}}, r"label.llm: unknown key"),
    ({"sft": {"seed": 3}}, r"sft.seed: set the top-level seed"),
    ({"tools": {"python_total_memory_mb": 256}}, r"tools.python_total_memory_mb \(256\) is below tools.python_memory_mb \(512\)"),
    ({"tools": {"sandbox_isolation": "none"}}, r"tools.sandbox_isolation: Input should be 'strict' or 'rlimits'"),
])
def test_a_bad_setting_fails_at_load_naming_the_file_and_the_key(tmp_path, sections, message):
    path = tmp_path / "params-bad.yaml"
    path.write_text(yaml.safe_dump(overlay(**sections)))
    with pytest.raises(ParamsError, match=message):
        load_params(path)


def test_yaml_exponents_without_a_dot_load_as_numbers(tmp_path):
    """PyYAML reads `lr: 1e-5` as the string "1e-5"; the models make it the float it means."""
    path = tmp_path / "params.yaml"
    path.write_text((ROOT / "params.yaml").read_text().replace("lr: 1.0e-5 ", "lr: 1e-5 "))
    assert yaml.safe_load(path.read_text())["rl"]["lr"] == "1e-5"
    assert load_params(path).rl.lr == 1e-5


def test_trainer_configs_take_the_global_seed():
    params = validate_params({**yaml.safe_load((ROOT / "params.yaml").read_text()), "seed": 7})
    assert params.sft.seed == params.dpo.seed == params.prm.seed == params.rl.seed == 7
    assert "seed" not in params.sft.model_dump()  # params.yaml has one seed, at the top
