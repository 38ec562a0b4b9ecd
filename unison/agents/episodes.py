"""Building episodes from questions, and turning finished episodes into Trajectory rows (DESIGN §3)."""
from __future__ import annotations

import hashlib
import json

from ..config import CONVERSING_METHODS, METHODS
from ..protocol import question_messages
from ..tool_format import NativeFormat, TagFormat
from ..tools.registry import DEFAULT_TOOLS, SYSTEM_PROMPT
from .runtime import REQUEST_FAILED, Episode, Segment

PLACEHOLDER = "\x00unison-assistant\x00"


def stable_seed(*parts) -> int:
    """A seed that depends only on its parts (question id, sample, agent, round), never on batching."""
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:8], 16)


def start_episode(format: NativeFormat | TagFormat, key: str, question: str, seed: int, scaffold: list[str],
                  tools: tuple[str, ...] = DEFAULT_TOOLS) -> Episode:
    """A fresh episode in `format` (the tag protocol, or the student's chat template with the tools): its system prompt
    (the student protocol's unless a role has its own) and one user turn."""
    return Episode(key=key, prompt_ids=format.prompt_ids(question_messages(question, format.system)), seed=seed,
                   scaffold=list(scaffold), tools=tuple(tools), format=format)


def continuation_ids(tok, user_text: str) -> list[int]:
    """Tokens that close an assistant turn (after its eos) and open a user turn then a new assistant turn."""
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{tok.name_or_path}: no chat template (a base model), so it cannot be given a "
                         f"new user turn: the methods that continue a conversation ({', '.join(CONVERSING_METHODS)}) "
                         "need a model with one; a base model acts in "
                         f"{', '.join(m for m in METHODS if m not in CONVERSING_METHODS)}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": PLACEHOLDER}, {"role": "user", "content": user_text}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    after = text.split(PLACEHOLDER, 1)[1]
    assert after.startswith(tok.eos_token), "chat template must close an assistant turn with eos"
    return tok(after[len(tok.eos_token):], add_special_tokens=False)["input_ids"]


def continue_episode(tok, prev: Episode, key: str, user_text: str, seed: int, scaffold: list[str],
                     tools: tuple[str, ...] | None = None) -> Episode:
    """A new episode whose prompt is `prev`'s whole conversation plus one more user turn (multi-turn agent context),
    in the tag protocol."""
    ids = prev.ids
    if not ids or ids[-1] != tok.eos_token_id:
        ids = ids + [tok.eos_token_id]
    return Episode(key=key, prompt_ids=ids + continuation_ids(tok, user_text), seed=seed, scaffold=list(scaffold),
                   tools=prev.tools if tools is None else tuple(tools), format=TagFormat(tok))


def merge_tool_stats(episodes: list[Episode]) -> dict[str, dict[str, int]]:
    merged: dict[str, dict[str, int]] = {}
    for e in episodes:
        for tool, stats in e.tool_stats.items():
            into = merged.setdefault(tool, {})
            for k, v in stats.items():
                into[k] = into.get(k, 0) + v
    return merged


def tool_totals(rows: list[dict]) -> dict[str, int]:
    """Trajectory rows' tool stats summed: {"tool_search_calls": n, "tool_search_timeout": n, ...}."""
    totals: dict[str, int] = {}
    for r in rows:
        for tool, stats in json.loads(r.get("tool_stats") or "{}").items():
            for k, v in stats.items():
                totals[f"tool_{tool}_{k}"] = totals.get(f"tool_{tool}_{k}", 0) + v
    return dict(sorted(totals.items()))


def student_messages(question: str, segments: list[Segment], system: str = SYSTEM_PROMPT) -> list[dict]:
    """The single-agent rendering: system + user, then assistant segments and tool observations with their ids."""
    msgs = [{"role": "system", "content": system, "token_ids": []},
            {"role": "user", "content": question, "token_ids": []}]
    for s in segments:
        msgs.append({"role": "assistant" if s.kind == "gen" else "tool", "content": s.text, "token_ids": list(s.ids)})
    return msgs


def agent_messages(e: Episode, name: str) -> list[dict]:
    """One agent's turns in the multi-agent transcript."""
    return [{"role": "assistant" if s.kind == "gen" else "tool", "name": name if s.kind == "gen" else "search/python",
             "content": s.text} for s in e.segments]


def teacher_as_served(teacher: str, episodes: list[Episode]) -> str:
    """The teacher as recorded: its id ("<served name>@<url>" for a server), plus the names the server answered with
    where they differ from the one asked for (a hosted alias resolved to a dated model)."""
    served = sorted(set().union(*(e.served_models for e in episodes)) - {teacher.split("@", 1)[0]})
    return f"{teacher} (server: {', '.join(served)})" if served else teacher


def trajectory_row(q: dict, sample: int, method: str, teacher: str, messages: list[dict], student: list[dict],
                   final_answer: str | None, episodes: list[Episode], finish_reason: str) -> dict:
    """A trajectory as stored; one of whose episodes ended on a request that failed for good finishes `request_failed`
    whatever its method made of the rest (it is counted against llm.max_failed_share)."""
    if any(e.finish_reason == REQUEST_FAILED for e in episodes):
        finish_reason = REQUEST_FAILED
    return {
        "id": f"{q['id']}/{method}/{sample}",
        "question_id": q["id"],
        "sample": sample,
        "method": method,
        "teacher": teacher_as_served(teacher, episodes),
        "teacher_name": "",  # run_method stamps the name of the teacher that ran it
        "question": q["question"],
        "answers": list(q["answers"]),
        "task": q["task"],
        "messages": [{"role": m["role"], "name": m.get("name"), "content": m["content"]} for m in messages],
        "student": student,
        "final_answer": final_answer or "",
        "n_llm_calls": sum(e.n_llm_calls for e in episodes),
        "n_tool_calls": sum(e.n_tool_calls for e in episodes),
        "n_tokens": sum(e.n_tokens for e in episodes),
        "tool_errors": sum(e.tool_errors for e in episodes),
        "tool_stats": json.dumps(merge_tool_stats(episodes), sort_keys=True),
        "finish_reason": finish_reason,
        "tokenizer": "",  # run_method stamps the fingerprint of the backend's tokenizer
        # a chat teacher's top log-probs by generated segment (in memory only: run_method lays them out,
        # teacher_topk.py)
        **({"teacher_tops": tops}
           if (tops := {tuple(s.ids): s.top for e in episodes for s in e.segments if s.top}) else {}),
    }
