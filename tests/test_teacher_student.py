"""Teacher and student are separate settings: params are checked when they load, the teacher's trajectories are
re-rendered under the student's tokenizer and chat template, and the loss mask stays token-exact."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from unison.config import ROOT, ParamsError, load_params, validate_params

DEFAULTS = yaml.safe_load((ROOT / "params.yaml").read_text())
# Another chat template: a different role header, the same eos closing each turn (what the runtime needs)
TEACHER_TEMPLATE = ("{% for m in messages %}### {{ m['role'] | upper }}:\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}### ASSISTANT:\n{% endif %}")


def with_(**blocks) -> dict:
    params = copy.deepcopy(DEFAULTS)
    for path, value in blocks.items():
        *head, last = path.split("__")
        node = params
        for k in head:
            node = node[k]
        node[last] = value
    return params


def test_default_params_are_valid_and_name_both_models():
    validate_params(DEFAULTS)
    assert DEFAULTS["student"]["model"] and DEFAULTS["teacher"]["model"]


@pytest.mark.parametrize("blocks, key", [
    ({"llm__backend": "openai"}, "llm.backend"),  # a student is never evaluated on a remote model
    ({"teacher__backend": "openai"}, "teacher.base_url"),
    ({"teacher__backend": "sglang"}, "teacher.backend"),
    ({"teacher__modle": "hf:x"}, "teacher.modle: unknown key"),
    ({"student__model": "Qwen/Qwen2.5-7B"}, "student.model"),
    ({"teacher__llm": {"backend": "openai"}}, "teacher.llm.backend"),
])
def test_bad_teacher_or_student_settings_fail_at_load_naming_the_key(blocks, key):
    with pytest.raises(ParamsError, match=key.replace(".", r"\.")):
        validate_params(with_(**blocks))


def test_a_params_file_without_the_teacher_block_is_refused(tmp_path):
    params = copy.deepcopy(DEFAULTS)
    del params["teacher"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError, match="missing the `teacher` block"):
        load_params(tmp_path / "params.yaml")


def test_a_served_teacher_gets_its_server_name_and_key_variable_never_the_key():
    engine = validate_params(with_(teacher={"model": "hf:Qwen/Qwen2.5-72B-Instruct", "backend": "openai",
                                            "base_url": "http://h:8000/v1", "served_name": "qwen72", "api_key_env": "MY_KEY",
                                            "llm": {"max_concurrency": 64}})).teacher_engine()
    assert (engine.backend, engine.api_model, engine.base_url, engine.api_key_env) == ("openai", "qwen72", "http://h:8000/v1", "MY_KEY")
    assert engine.max_concurrency == 64 and engine.dtype == DEFAULTS["llm"]["dtype"]  # overrides on top of llm.*
    served = validate_params(with_(teacher={"model": "hf:org/m", "backend": "openai", "base_url": "http://u/v1"}))
    assert served.teacher_engine().api_model == "org/m"


# ------------------------------------------------------------------ a teacher with another tokenizer and chat template

def permuted_tokenizer(src: Path, dst: Path, shift: int = 7919) -> None:
    """`src`'s tokenizer with every id moved by `shift` (mod the vocabulary) and TEACHER_TEMPLATE: the same text splits,
    other ids, another chat rendering."""
    from transformers import AutoTokenizer

    spec = json.loads((src / "tokenizer.json").read_text())
    size = len(spec["model"]["vocab"])
    spec["model"]["vocab"] = {t: (i + shift) % size for t, i in spec["model"]["vocab"].items()}
    for t in spec["added_tokens"]:
        t["id"] = (t["id"] + shift) % size
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    for f in ("tokenizer_config.json",):
        (dst / f).write_text((src / f).read_text())
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = TEACHER_TEMPLATE
    tok.save_pretrained(dst)


@pytest.fixture(scope="module")
def teacher_rows(base_model_dir, tmp_path_factory):
    """Trajectories of a tiny random teacher on the permuted tokenizer: real `single` episodes, scaffolded, with tools."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from unison.agents.methods import MethodContext, run_method
    from unison.agents.runtime import EpisodeSettings
    from unison.agents.toolbox import Toolbox
    from unison.llm.hf_backend import HFBackend

    from .test_runtime_sft import CorpusRetriever

    path = tmp_path_factory.mktemp("teacher-other-tokenizer")
    permuted_tokenizer(Path(base_model_dir), path)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(path)
    backend = HFBackend(str(path), dtype="float32")
    ctx = MethodContext(backend, Toolbox(CorpusRetriever()), EpisodeSettings(temperature=0.7, top_p=0.95, max_tokens_per_turn=12), "teacher",
                        scaffold={"qa": ["search", "answer"]})
    questions = [{"id": f"q{i}", "question": q, "answers": ["Tarsk"], "task": "qa"}
                 for i, q in enumerate(["In which city was Zorvan Kelt born?", "Where is Tarsk?"])]
    return run_method("single", questions, 2, ctx, episodes_in_flight=8), tok


def test_teacher_trajectories_are_re_rendered_under_the_student_template_with_exact_masks(teacher_rows, base_model_dir):
    from transformers import AutoTokenizer

    from unison.protocol import chat_prompt
    from unison.token_view import generated_by, token_view, tokenizer_fingerprint
    from unison.tool_format import TagFormat
    from unison.train.sft import build_examples

    rows, teacher_tok = teacher_rows
    student_tok = AutoTokenizer.from_pretrained(base_model_dir)
    assert {r["tokenizer"] for r in rows} == {tokenizer_fingerprint(teacher_tok)} != {tokenizer_fingerprint(student_tok)}
    assert not any(generated_by(student_tok, r) for r in rows) and all(generated_by(teacher_tok, r) for r in rows)
    examples, _ = build_examples(TagFormat(student_tok), rows, max_length=4096)
    for r, (ids, mask) in zip(rows, examples):
        turns = r["student"][2:]
        assert any(m["token_ids"] for m in turns)  # the teacher's own ids are stored, and are not the student's
        head = chat_prompt(student_tok, [{"role": m["role"], "content": m["content"]} for m in r["student"][:2]])
        assert ids[: len(head)] == head and not any(mask[: len(head)])  # the student's chat template, not the teacher's
        assert "### USER" not in student_tok.decode(ids)
        learned = [t for t, m in zip(ids, mask) if m]
        expected = [t for m in turns if m["role"] == "assistant" for t in student_tok(m["content"], add_special_tokens=False)["input_ids"]]
        assert learned == expected + [student_tok.eos_token_id]  # every assistant token, only those, in the student's ids
        observed = [t for t, m in zip(ids[len(head):], mask[len(head):]) if not m]
        assert observed == [t for m in turns if m["role"] == "tool" for t in student_tok(m["content"], add_special_tokens=False)["input_ids"]]
        assert (ids, mask) != token_view(student_tok, r["student"])  # reading the teacher's ids as the student's would differ


def test_same_tokenizer_keeps_the_ids_as_generated(teacher_rows):
    from unison.token_view import row_view, token_view

    rows, teacher_tok = teacher_rows
    for r in rows:
        assert row_view(teacher_tok, r) == token_view(teacher_tok, r["student"], as_generated=True)
