"""The token view of a student trajectory (DESIGN §3): input ids and a loss mask that is 1 only on assistant tokens.

Under the tokenizer that generated them, ids are concatenated from each turn's tokens as generated (token-in/token-out),
never by re-tokenising the decoded text; `retokenization_drift` compares with a full re-tokenisation and counts where
they differ. A trajectory from a teacher with another tokenizer or chat template is re-rendered: the student's template
for the prompt, each turn's text tokenised on its own, so the mask still covers exactly the assistant turns.
"""
from __future__ import annotations

from .protocol import chat_prompt


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what decides token ids and chat rendering: the vocabulary, special tokens and chat template."""
    cached = getattr(tokenizer, "_unison_fingerprint", None)
    if cached is None:
        import hashlib
        import json

        key = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token, tokenizer.bos_token,
                          getattr(tokenizer, "chat_template", None)])
        cached = hashlib.sha256(key.encode()).hexdigest()[:16]
        tokenizer._unison_fingerprint = cached
    return cached


def generated_by(tok, row: dict) -> bool:
    """Whether `row`'s token ids are `tok`'s (its `tokenizer` fingerprint matches, or is unknown)."""
    return row.get("tokenizer", "") in ("", tokenizer_fingerprint(tok))


def token_view(tok, student: list[dict], as_generated: bool = True) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one student rendering: prompt (system+user) and tool observations carry mask 0.
    `as_generated` False ignores the stored token ids (another tokenizer's) and tokenises every turn's text."""
    head = [{"role": m["role"], "content": m["content"]} for m in student[:2]]
    ids = chat_prompt(tok, head)
    mask = [0] * len(ids)
    for m, t in turn_ids(tok, student, as_generated):
        ids += t
        mask += [1 if m["role"] == "assistant" else 0] * len(t)
    return ids, mask


def turn_ids(tok, student: list[dict], as_generated: bool = True) -> list[tuple[dict, list[int]]]:
    """Each turn after the prompt with its ids in the token view: as generated, or its text tokenised (a rendered turn,
    or `as_generated` False; as text, so a "<|im_end|>" in it is no turn marker; the last assistant turn closes with
    eos)."""
    turns, out = student[2:], []
    for k, m in enumerate(turns):
        t = list(m["token_ids"]) if as_generated else []
        if not t:
            t = tok(m["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if m["role"] == "assistant" and k == len(turns) - 1:
                t.append(tok.eos_token_id)
        out.append((m, t))
    return out


def row_view(tok, row: dict) -> tuple[list[int], list[int]]:
    """The token view of a trajectory row under `tok` in the tag protocol: as generated when its ids are tok's, else
    re-rendered (a native student's: tool_format.NativeFormat.view)."""
    return token_view(tok, row["student"], generated_by(tok, row))


def retokenization_drift(tok, ids: list[int]) -> int:
    """How many tokens differ between `ids` and a re-tokenisation of their decoded text (0 = identical)."""
    again = tok(tok.decode(ids), add_special_tokens=False)["input_ids"]
    same_prefix = next((k for k, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
    same_suffix = next((k for k, (a, b) in enumerate(zip(reversed(ids), reversed(again))) if a != b),
                       min(len(ids), len(again)))
    return max(len(ids), len(again)) - min(same_prefix + same_suffix, min(len(ids), len(again)))
