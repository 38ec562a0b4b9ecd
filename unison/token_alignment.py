"""A teacher of another tokenizer scores the student's text: its token log-probs mapped onto the student's tokens by
character offsets (the approach of TRL's GOLD), for on-policy distillation across tokenizers.

The student's completion (its tokens after the prompt) alternates sampled segments with context it did not sample
(tool observations, scaffold prefills). It is decoded token by token into one text (each token's [start, end)
characters), and the teacher tokenises each segment's text on its own and scores them all, in order, after its own
rendering of the prompt: no teacher token crosses from sampled text into an observation or back, and over each sampled
segment the mapped log-probs sum to the teacher's log-prob of that segment after the same context. A sampled segment
ending with the student's end of turn (a special token: no text) ends with the teacher's end token, scored at that
position; a teacher without an end token leaves that position unscored.

Within a sampled segment each teacher token's log-prob goes to the student token holding the teacher token's last
character, and the student tokens are grouped into spans: the shortest runs of whole student tokens whose text both
tokenisations begin and end at (each token alone when they agree), which the segment's end closes. A span holds the
log-probs of exactly the teacher tokens inside it, so OPD compares the teacher's and the student's log-prob of the same
text span by span. A sampled token that no teacher token covers (an unscored end of turn; text the teacher's tokenizer
drops, such as WordPiece's whitespace) has span 0: no teacher score, masked rather than scored 0.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import groupby

from .protocol import chat_prompt


@dataclass
class Aligned:
    logprobs: list[float]  # one per student token: the log-probs of the teacher tokens whose last character it holds
    span_ids: list[int]  # one per student token: its span (1, 2, ... in order), 0 = no teacher score
    teacher_tokens: int = 0
    straddling: int = 0  # teacher tokens across a student token boundary that begin or end inside a student token


@dataclass
class _Segment:
    """A sampled segment of one completion: student tokens [lo, hi), its teacher tokens' offsets and the index of the
    first in the teacher's completion, and whether its last student token is an end of turn scored as the teacher's."""
    lo: int
    hi: int
    first: int
    offsets: list[tuple[int, int]]
    scored_end: bool


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
        # an incomplete UTF-8 character: its bytes go on the next token
        if piece.endswith("\ufffd") and k + 1 < len(ids):
            spans.append((len(text), len(text)))
            continue
        spans.append((len(text), len(text) + len(piece)))
        text += piece
        pending = []
    return text, spans


def map_to_student(spans: list[tuple[int, int]], offsets: list[tuple[int, int]], logprobs: list[float]) -> Aligned:
    """One sampled segment: each teacher token's log-prob (`offsets[j]` its characters) added to the student token
    (`spans`) holding its last character (a teacher token without characters: the character before it, or the
    segment's first), and each student token's span (module docstring), numbered from 1."""
    ends, origin = [end for _, end in spans], spans[0][0] if spans else 0
    # the student token holding the last character
    holders = [bisect_right(ends, max(end - 1, origin)) for _, end in offsets]
    mapped = [0.0] * len(spans)
    for i, lp in zip(holders, logprobs):
        mapped[i] += lp
    teacher_starts, teacher_ends = [start for start, _ in offsets], {end for _, end in offsets}
    last_text = max((i for i, (start, end) in enumerate(spans) if end > start), default=-1)
    groups, members = [], []
    for i, (start, end) in enumerate(spans):
        j = bisect_left(teacher_starts, end) - 1  # the last teacher token starting before this token's end
        if end > start and (j < 0 or offsets[j][1] <= start):
            continue  # text no teacher token covers (whitespace a WordPiece teacher drops): no teacher score
        members.append(i)
        if end > start and end in teacher_ends:  # a boundary of both tokenisations
            groups.append(members)
            members = []
    # the segment's end closes the last span, not its trailing end of turn
    groups.append([k for k in members if k <= last_text])
    span_ids, held, n_spans = [0] * len(spans), set(holders), 0
    for group in groups:
        if held.intersection(group):
            n_spans += 1
            for k in group:
                span_ids[k] = n_spans
    bounds = sorted({b for span in spans for b in span})
    bound_set, straddling = set(bounds), 0
    for start, end in offsets:
        k = bisect_right(bounds, start)
        crosses = k < len(bounds) and bounds[k] < end
        straddling += crosses and (start not in bound_set or end not in bound_set)
    return Aligned(mapped, span_ids, len(offsets), straddling)


def score_across(teacher, student_tok, items: list[tuple[list[dict], list[int], list[int]]]) -> list[Aligned]:
    """The teacher's log-probs of student completions, one per student token, and their spans (module docstring), in one
    `score` call. Each item: the prompt `messages`, the student's token ids after the prompt, and for each id whether
    the student sampled it (1) or it is context (0: an observation, a prefill); context tokens get no score."""
    ttok, prompts, completions, plans = teacher.tokenizer, [], [], []
    for messages, ids, sampled in items:
        text, spans = char_spans(student_tok, ids)
        teacher_ids, segments, lo = [], [], 0
        for flag, run in groupby(sampled):
            hi = lo + len(list(run))
            start, end = spans[lo][0], spans[hi - 1][1]
            enc = ttok(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
            if flag:
                scored_end = ids[hi - 1] == student_tok.eos_token_id and ttok.eos_token_id is not None
                segments.append(_Segment(lo, hi, len(teacher_ids),
                                         [(start + a, start + b) for a, b in enc["offset_mapping"]], scored_end))
            teacher_ids += list(enc["input_ids"]) + ([ttok.eos_token_id] if flag and scored_end else [])
            lo = hi
        prompts.append(chat_prompt(ttok, messages))
        completions.append(teacher_ids)
        plans.append((spans, segments))
    out = []
    for (spans, segments), scores in zip(plans, teacher.score(prompts, completions)):
        aligned = Aligned([0.0] * len(spans), [0] * len(spans))
        n_spans = 0
        for seg in segments:
            hi = seg.hi - seg.scored_end
            part = map_to_student(spans[seg.lo : hi], seg.offsets,
                                  scores.logprobs[seg.first : seg.first + len(seg.offsets)])
            aligned.logprobs[seg.lo : hi] = part.logprobs
            aligned.span_ids[seg.lo : hi] = [k + n_spans if k else 0 for k in part.span_ids]
            n_spans += max(part.span_ids, default=0)
            aligned.teacher_tokens += part.teacher_tokens
            aligned.straddling += part.straddling
            if seg.scored_end:
                n_spans += 1
                aligned.logprobs[hi], aligned.span_ids[hi] = scores.logprobs[seg.first + len(seg.offsets)], n_spans
                aligned.teacher_tokens += 1
        out.append(aligned)
    return out
