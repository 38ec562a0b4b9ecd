"""Episodes for MLflow traces (episode -> agent turn -> LLM call / tool call), rebuilt from a trajectory's transcript."""
from __future__ import annotations

import random

from .protocol import parse_tool_call


def episode_from_row(row: dict) -> dict:
    turns, rounds = [], {}
    for m in row["messages"]:
        if m["role"] == "user" and m["name"] == "moderator":
            rounds["pending"] = rounds.get("pending", 0) + 1
        elif m["role"] == "assistant":
            agent = m["name"] or "agent"
            if rounds.get("pending"):
                rounds[agent] = rounds.get(agent, 0) + 1
                rounds["pending"] -= 1
            turns.append({"agent": agent, "round": rounds.get(agent, 0),
                          "llm_calls": [{"prompt": "", "completion": m["content"], "n_tokens": None, "latency_s": None}], "tool_calls": []})
        elif m["role"] == "tool" and turns:
            call = parse_tool_call(turns[-1]["llm_calls"][-1]["completion"])
            tool, arg = call if call else ("unknown", "")
            turns[-1]["tool_calls"].append({"tool": tool, "input": arg, "output": m["content"],
                                            "error": "error" if m["content"].startswith("\n<result>\nerror") else None,
                                            "latency_s": None})
    return {"question": row["question"], "method": row["method"], "final_answer": row["final_answer"], "turns": turns}


def sample_traces(rows: list[dict], n: int, seed: int) -> list[dict]:
    picked = random.Random(seed).sample(rows, min(n, len(rows)))
    return [episode_from_row(r) for r in picked]
