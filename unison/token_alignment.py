"""A teacher of another tokenizer scores the student's text: its token log-probs mapped onto the student's tokens by
character offsets (the approach of TRL's GOLD), for on-policy distillation across tokenizers.

The student's completion is decoded token by token into one text (each token's [start, end) characters); the teacher
tokenises that text with offsets and scores it after its own prompt. Each teacher token's log-prob goes to the student
token holding the teacher token's last character, so over any span whose boundaries both tokenisations share, the
mapped log-probs sum to the teacher's log-prob of that span exactly; inside a span, a student token that holds no
teacher token's end gets 0 (its share went to a later token of the span). A teacher token that begins inside an
earlier student token straddles a boundary: it is counted (`straddling`). Special tokens of the student (its
end-of-turn) carry no text: the student's final end-of-turn is scored as the teacher's own end token.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from .protocol import chat_prompt


@dataclass
class Aligned:
    logprobs: list[float]  # one per student token
    teacher_tokens: int
    straddling: int  # teacher tokens that begin inside an earlier student token


def char_spans(tok, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of `ids` (special tokens left out) and each token's [start, end) in it: decoded prefix by prefix, so a
    token that completes a multi-byte character ends where the character does (its earlier bytes' tokens are empty)."""
    special = set(tok.all_special_ids)
    text, spans, pending = "", [], []
    for k, t in enumerate(ids):
        if t in special:
            spans.append((len(text), len(text)))
            continue
        pending.append(t)
        piece = tok.decode(pending, clean_up_tokenization_spaces=False)
        if piece.endswith("\ufffd") and k + 1 < len(ids):  # an incomplete UTF-8 character: its bytes go on the next token
            spans.append((len(text), len(text)))
            continue
        spans.append((len(text), len(text) + len(piece)))
        text += piece
        pending = []
    return text, spans


def map_to_student(spans: list[tuple[int, int]], offsets: list[tuple[int, int]], logprobs: list[float]) -> Aligned:
    """Each teacher token's log-prob (`offsets[j]` its characters) added to the student token (`spans`) holding its last
    character; a teacher token with no characters goes to the student token after the previous one's."""
    ends = [end for _, end in spans]
    mapped, straddling, last = [0.0] * len(spans), 0, 0
    for (start, end), lp in zip(offsets, logprobs):
        i = bisect_left(ends, end) if end > 0 else last
        i = min(i, len(spans) - 1)
        while i < len(spans) - 1 and spans[i][0] == spans[i][1] and end > 0:  # an empty token (special, partial byte) holds no character
            i += 1
        mapped[i] += lp
        straddling += start < spans[i][0]
        last = i
    return Aligned(mapped, len(offsets), straddling)


def score_across(teacher, student_tok, items: list[tuple[list[dict], list[int]]]) -> list[Aligned]:
    """The teacher's log-probs of student completions (each: the prompt `messages` and the student token ids after it),
    one per student token, through the character alignment above, in one `score` call; a final student end-of-turn
    gets the teacher's end token's log-prob."""
    ttok, prompts, completions, views = teacher.tokenizer, [], [], []
    for messages, completion in items:
        text, spans = char_spans(student_tok, completion)
        enc = ttok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        ends_turn = bool(completion) and completion[-1] == student_tok.eos_token_id and ttok.eos_token_id is not None
        prompts.append(chat_prompt(ttok, messages))
        completions.append(ids + [ttok.eos_token_id] if ends_turn else ids)
        views.append((spans[:-1] if ends_turn else spans, offsets, ends_turn))
    out = []
    for (spans, offsets, ends_turn), scores in zip(views, teacher.score(prompts, completions)):
        aligned = map_to_student(spans, offsets, scores.logprobs[: len(offsets)])
        if ends_turn:
            aligned.logprobs.append(scores.logprobs[-1])
            aligned.teacher_tokens += 1
        out.append(aligned)
    return out
