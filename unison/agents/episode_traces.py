"""Episodes for MLflow traces (episode -> agent turn -> LLM call / tool call), rebuilt from a trajectory's
transcript."""
from __future__ import annotations

import random

from ..protocol import parse_tool_call
from ..tools.registry import TOOLS


def episode_from_row(row: dict) -> dict:
    """Turns of every role in transcript order; an agent's round counts its separate blocks of turns (any method)."""
    turns, rounds, current = [], {}, None
    for m in row["messages"]:
        if m["role"] == "assistant":
            agent = m["name"] or "agent"
            if agent != current:
                rounds[agent], current = rounds.get(agent, -1) + 1, agent
            turns.append({"agent": agent, "round": rounds[agent],
                          "llm_calls": [{"prompt": "", "completion": m["content"], "n_tokens": None,
                                         "latency_s": None}], "tool_calls": []})
        elif m["role"] == "tool" and turns:
            call = parse_tool_call(turns[-1]["llm_calls"][-1]["completion"], tuple(TOOLS))
            tool, arg = call if call else ("unknown", "")
            turns[-1]["tool_calls"].append({"tool": tool, "input": arg, "output": m["content"],
                                            "error": "error" if m["content"].startswith("\n<result>\nerror") else None,
                                            "latency_s": None})
        else:  # a user/moderator/critic prompt ends the current block of turns
            current = None
    return {"question": row["question"], "method": row["method"], "final_answer": row["final_answer"], "turns": turns}


def sample_traces(rows: list[dict], n: int, seed: int) -> list[dict]:
    picked = random.Random(seed).sample(rows, min(n, len(rows)))
    return [episode_from_row(r) for r in picked]
