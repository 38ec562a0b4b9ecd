"""The teacher's top-k log-probs on the tokens SFT trains, for logit distillation (`generate.topk`, `sft.kd_weight`).

After generate, the teacher scores each trajectory's student rendering (its token view under the teacher's tokenizer,
`token_view`) in one `score` call: prompt = the tokens before the first assistant token, completion = the rest. For
every assistant token (loss mask 1) it keeps the k likeliest next tokens and their log-probs, best first: the teacher's
distribution in the very context the student is trained in. Stored compactly in data/trajectories/teacher_topk.parquet,
a row per trajectory: ids as little-endian int32 and log-probs as float16, k per token (6k bytes a token before
parquet's compression; DistillKit's capture takes ~300). SFT reads them back per assistant token, in order
(`topk_for`, `build_examples`), when the student's tokenizer is the one they were scored under.

A chat API teacher cannot score given tokens: it returns `top_logprobs` (token strings) with what it generates, which
the backend carries over to the student's tokens as it generates (llm/chat.py `student_top`); `generated_row` lays them
out in this format. A position with no teacher distribution (a tag the protocol wrote, a tool call's arguments, a
student token inside a teacher token) holds log-probs of -inf (MISSING), which `distill_loss` leaves out.
"""
from __future__ import annotations

import gc
import time

import numpy as np
import pyarrow as pa

from . import layout
from .token_view import generated_by, token_view, tokenizer_fingerprint, turn_ids

TEACHER_TOPK = pa.schema([("id", pa.string()), ("tokenizer", pa.string()), ("k", pa.int32()), ("tokens", pa.int32()),
                          ("top_ids", pa.binary()), ("top_logprobs", pa.binary())])
# the log-prob of a top-k slot with no token (a chat teacher's position without its distribution)
MISSING = float("-inf")
SCORE_BATCH = 8  # trajectories per `score` call (the backend splits a call further by its own token budget)


def scored_span(tok, row: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt, completion, assistant positions in the completion) of a row's token view under `tok`."""
    ids, mask = token_view(tok, row["student"], generated_by(tok, row))
    first = mask.index(1) if 1 in mask else len(ids)
    first = max(first, 1)  # the first scored token needs a context
    return ids[:first], ids[first:], [i for i, m in enumerate(mask[first:]) if m]


def capture_topk(backend, rows: list[dict], k: int, progress=print) -> tuple[list[dict], dict]:
    """Each row's teacher top-k at its assistant tokens, as TEACHER_TOPK rows; and the capture's figures."""
    tok, out, t0 = backend.tokenizer, [], time.perf_counter()
    fingerprint = tokenizer_fingerprint(tok)
    for start in range(0, len(rows), SCORE_BATCH):
        chunk = rows[start : start + SCORE_BATCH]
        spans = [scored_span(tok, r) for r in chunk]
        scores = backend.score([p for p, _, _ in spans], [c for _, c, _ in spans], top_k=k)
        for row, (_, _, keep), s in zip(chunk, spans, scores):
            ids = np.asarray([s.top_ids[i] for i in keep], dtype="<i4").reshape(len(keep), k)
            logps = np.asarray([s.top_logprobs[i] for i in keep], dtype="<f2").reshape(len(keep), k)
            out.append({"id": row["id"], "tokenizer": fingerprint, "k": k, "tokens": len(keep),
                        "top_ids": ids.tobytes(), "top_logprobs": logps.tobytes()})
        done = start + len(chunk)
        rate = done / max(1e-9, time.perf_counter() - t0)
        progress(f"generate: teacher top-{k} of {done}/{len(rows)} trajectories ({rate:.1f}/s, ETA "
                 f"{(len(rows) - done) / rate:.0f} s)")
    tokens = sum(r["tokens"] for r in out)
    return out, {"topk_k": k, "topk_tokens": tokens, "topk_s": time.perf_counter() - t0}


def topk_by_teacher(backend_of, rows: list[dict], k: int, generated: list[dict],
                    progress=print) -> tuple[list[dict], dict]:
    """Each row's top-k from the teacher that made it (its teacher_name): a chat teacher's as it generated (`generated`,
    TEACHER_TOPK rows by id), any other's scored by `backend_of(name)` (capture_topk), one teacher's engine at a time;
    the table in the rows' order, and the figures, with each teacher's tokens under "teachers"."""
    kept, stored, figures = {t["id"]: t for t in generated}, {}, {"topk_k": k, "topk_s": 0.0, "teachers": {}}
    by_name: dict[str, list[dict]] = {}
    for r in rows:
        by_name.setdefault(r.get("teacher_name") or "teacher", []).append(r)
    for name, own in by_name.items():
        scored = [r for r in own if r["id"] not in kept]
        if scored:
            backend = backend_of(name)
            table, captured = capture_topk(backend, scored, k, progress)
            del backend
            gc.collect()  # this teacher's engine, before the next one's starts
            stored.update((t["id"], t) for t in table)
            figures["topk_s"] += captured["topk_s"]
        stored.update((r["id"], kept[r["id"]]) for r in own if r["id"] in kept)
        figures["teachers"][name] = {"topk_tokens": sum(stored[r["id"]]["tokens"] for r in own)}
    out = [stored[r["id"]] for r in rows]
    tokens = sum(t["tokens"] for t in out)
    covered = sum(int(np.isfinite(topk_arrays(t)[1][:, 0]).sum()) for t in out)
    return out, {**figures, "topk_tokens": tokens, "topk_covered": covered / max(1, tokens)}


def generated_row(tok, row: dict, tops: dict[tuple, list], k: int) -> dict:
    """The TEACHER_TOPK row of a chat teacher's trajectory: each assistant token of its token view gets the top-k the
    teacher returned with it (`tops`: a generated segment's ids -> its Segment.top), padded with MISSING to k."""
    ids, logps = [], []
    for m, t in turn_ids(tok, row["student"], generated_by(tok, row)):
        if m["role"] != "assistant":
            continue
        top = tops.get(tuple(t)) or []
        for i in range(len(t)):
            pairs = (top[i] if i < len(top) and top[i] else [])[:k]
            ids.append([a for a, _ in pairs] + [0] * (k - len(pairs)))
            logps.append([lp for _, lp in pairs] + [MISSING] * (k - len(pairs)))
    return {"id": row["id"], "tokenizer": tokenizer_fingerprint(tok), "k": k, "tokens": len(ids),
            "top_ids": np.asarray(ids, dtype="<i4").reshape(len(ids), k).tobytes(),
            "top_logprobs": np.asarray(logps, dtype="<f2").reshape(len(ids), k).tobytes()}


def topk_arrays(row: dict) -> tuple[np.ndarray, np.ndarray]:
    """(ids [tokens, k] int64, log-probs [tokens, k] float32) of one TEACHER_TOPK row."""
    shape = (row["tokens"], row["k"])
    return (np.frombuffer(row["top_ids"], dtype="<i4").reshape(shape).astype(np.int64),
            np.frombuffer(row["top_logprobs"], dtype="<f2").reshape(shape).astype(np.float32))


def topk_for(tok, rows: list[dict], table: list[dict], path: str = layout.TOPK) -> list[tuple[np.ndarray, np.ndarray]]:
    """The stored top-k of each row (its assistant tokens' in order), checked against the student's tokenizer `tok`: a
    row missing, or scored under another tokenizer, is an error naming it (build_examples checks the token counts)."""
    from .data.schemas import DataError

    by_id = {r["id"]: r for r in table}
    fingerprint, out = tokenizer_fingerprint(tok), []
    for r in rows:
        stored = by_id.get(r["id"])
        if stored is None:
            raise DataError(path, f"no teacher top-k for trajectory {r['id']} (sft.kd_weight > 0 needs "
                            "generate.topk > 0)", field="id")
        if stored["tokenizer"] != fingerprint:
            raise DataError(path, f"trajectory {r['id']} was scored under another tokenizer than the student's (by "
                                  f"{r.get('teacher_name') or 'teacher'}): logit distillation needs the teacher's "
                                  "vocabulary to be the student's", field="tokenizer")
        out.append(topk_arrays(stored))
    return out
