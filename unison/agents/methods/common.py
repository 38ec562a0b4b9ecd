"""What several teacher methods share: reading an agent's response, the debate update prompt, majority votes, the LLM
aggregator role and the transcript's end it writes, and the student rendering of one agent closed by the team's
answer."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ...protocol import normalize_answer
from ...tool_format import TagFormat
from ..episodes import agent_messages, stable_seed, start_episode, student_messages
from ..runtime import Episode, Segment, run_episodes

END = "----- END OF THE AGENT RESPONSE -----"
AGGREGATOR_SYSTEM = "You read several solutions to a task and give the one final answer they support best."


def update_prompt(question: str, others: list[Episode]) -> str:
    opinions = "\n".join(f"One agent solution: ```{response(e)}```\n{END}" for e in others)
    return (f"These are the solutions to the problem from other agents:\n{opinions}\n"
            f"Use these opinions carefully as additional advice, can you provide an updated answer to the question: "
            f"{question}\nState your final answer as <answer>...</answer>.")


def response(e: Episode) -> str:
    """What an agent said (its generated text, without the tool observations it read)."""
    return "".join(s.text for s in e.segments if s.kind == "gen").strip()


def aggregate_prompt(question: str, finals: list[Episode]) -> str:
    sols = "\n\n".join(f"Solution {k + 1}: {response(e)}" for k, e in enumerate(finals))
    return (f"Task: {question}\n\n{sols}\n\nGiven all the above solutions, reason over them carefully and provide a "
            f"final answer to the task as <answer>...</answer>.")


def aggregate(groups: list[tuple[dict, int]], prompts: list[str], ctx, desc: str) -> list[Episode]:
    """One LLM aggregator per (question, sample), a judging role: on the `aggregator` role's backend, without tools."""
    backend = ctx.backend_for("aggregator")
    episodes = [start_episode(TagFormat(backend.tokenizer, AGGREGATOR_SYSTEM), f"{q['id']}/{s}/agg", prompt,
                              stable_seed(q["id"], s, "agg"), ["answer"] if ctx.scaffold else [], tools=())
                for (q, s), prompt in zip(groups, prompts)]
    return run_episodes(episodes, backend, ctx.toolbox, ctx.settings, desc=desc)


def aggregated(question: str, agents: list[Episode], agg: Episode | None, prompt: Callable[[str, list[Episode]], str],
               aggregator: str) -> tuple[str | None, list[dict]]:
    """The team's final answer (the LLM aggregator's `agg`, else the agents' majority vote) and the messages that end
    its transcript: the aggregator's `prompt` and turns where it ran, then the final answer in `aggregator`'s name."""
    final = (agg.answer if agg is not None else None) or majority([e.answer for e in agents])
    messages = []
    if agg is not None:
        messages += ([{"role": "user", "name": "aggregator", "content": prompt(question, agents)}]
                     + agent_messages(agg, "aggregator"))
    messages.append({"role": "assistant", "name": f"aggregator({aggregator})",
                     "content": f"<answer>{final or ''}</answer>"})
    return final, messages


def majority(answers: list[str | None]) -> str | None:
    """Most frequent normalised answer; ties go to the earliest agent."""
    votes = Counter(normalize_answer(a) for a in answers if a)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a and votes[normalize_answer(a)] == best)


def student_rendering(question: str, first: list[Episode], last: list[Episode], final: str | None,
                      system: str) -> list[dict]:
    """The first-round tool turns of the agent that ended agreeing with `final`, closed by the final answer."""
    pick = next((a for a, e in enumerate(last)
                 if final and e.answer and normalize_answer(e.answer) == normalize_answer(final)), 0)
    segments = list(first[pick].segments)
    while segments and segments[-1].kind == "gen" and "<answer>" in segments[-1].text:
        segments.pop()
    segments.append(Segment("gen", f"<answer>{final or ''}</answer>", []))
    return student_messages(question, segments, system)
