"""`agentverse`: AgentArk AgentVerse — per turn a solver answers (with tools) and `agents - 1` critics review it; a
critic whose reply contains "[Agree]" adds nothing; when all agree the review stops, else the solver revises with the
critiques (at most `critic_rounds` times). An evaluator then writes "Correctness: 0|1" and "Response: advice": 1 ends
the group, 0 sends the advice into the solver's next turn. Output = the last solution.

Simplifications: AgentVerse's LLM role recruiter is replaced by fixed role descriptions (the solver follows the
student protocol; critic k is CRITICS[k]); the solver keeps its whole conversation (AgentArk: the last 5 messages)
and critics start fresh each round (AgentArk: the last 3); the last turn is not evaluated (it cannot change the output).
"""
from __future__ import annotations

import re

from ...config import AgentVerseConfig
from ...tool_format import TagFormat
from ..episodes import agent_messages, continue_episode, stable_seed, start_episode, trajectory_row
from ..runtime import Episode, run_episodes
from .common import response, student_rendering

CRITICS = ("You are a meticulous fact checker who reviews solutions for factual errors.",
           "You are a rigorous logician who reviews solutions for reasoning and calculation errors.",
           "You are a domain expert who reviews whether a solution really answers the question asked.")
EVALUATOR_SYSTEM = "You are an evaluator who judges whether a solution to a problem is correct."


def critic_prompt(question: str, solution: Episode) -> str:
    return (f"Problem: {question}\n\nProposed solution: {response(solution)}\n\nReview the solution. If it is "
            f"correct, end your reply with [Agree]. Otherwise say briefly what is wrong and how to fix it.")


def revise_prompt(question: str, critiques: list[str]) -> str:
    notes = "\n".join(f"- {c}" for c in critiques)
    return (f"Critics reviewed your solution:\n{notes}\nRevise your solution to the problem: {question}\n"
            f"State your final answer as <answer>...</answer>.")


def evaluate_prompt(question: str, solution: Episode) -> str:
    return (f"Problem: {question}\n\nSolution: {response(solution)}\n\nIs the solution correct? Reply in this form:\n"
            f"Correctness: 1 if it is correct, 0 if not\nResponse: advice on how to solve the problem better")


def advice_prompt(question: str, advice: str) -> str:
    return (f"An evaluator judged your solution incorrect. Advice: {advice}\nSolve the problem again: {question}\n"
            f"State your final answer as <answer>...</answer>.")


def agrees(critique: str) -> bool:
    return "[agree]" in critique.lower()


def parse_evaluation(text: str) -> tuple[bool, str]:
    """(correct, advice) from "Correctness: 0|1 / Response: ..."; no readable verdict counts as incorrect."""
    verdicts = re.findall(r"Correctness\W*([01])\b", text, re.IGNORECASE)
    advice = re.search(r"Response\W*(.*)", text, re.IGNORECASE | re.DOTALL)
    return bool(verdicts) and verdicts[-1] == "1", (advice.group(1) if advice else text).strip()


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    tok, p = ctx.backend.tokenizer, ctx.params or AgentVerseConfig()
    n_critics, turns, critic_rounds = max(1, p.agents - 1), p.turns, p.critic_rounds
    critic, evaluator, follow = (ctx.backend_for("critic"), ctx.backend_for("evaluator"),
                                 ["answer"] if ctx.scaffold else [])
    groups = [(q, s) for q in questions for s in samples]
    texts = [q["question"] for q, _ in groups]
    messages = [[{"role": "user", "name": None, "content": text}] for text in texts]
    episodes: list[list[Episode]] = [[] for _ in groups]
    solutions: list[list[Episode]] = [[] for _ in groups]

    def phase(items: list[tuple[int, str, str | None, Episode]], backend, desc: str) -> None:
        """Run every listed (group, agent name, prompt shown in the transcript, episode) in one batch."""
        if not items:
            return
        run_episodes([e for *_, e in items], backend, ctx.toolbox, ctx.settings, desc=desc)
        for g, name, prompt, e in items:
            if prompt:
                messages[g].append({"role": "user", "name": "moderator" if name == "solver" else name,
                                    "content": prompt})
            messages[g].extend(agent_messages(e, name))
            episodes[g].append(e)
            if name == "solver":
                solutions[g].append(e)

    def revise(g: int, key: str, prompt: str) -> tuple[int, str, str, Episode]:
        (q, s), last = groups[g], solutions[g][-1]
        return (g, "solver", prompt,
                continue_episode(tok, last, f"{q['id']}/{s}/{key}", prompt, stable_seed(q["id"], s, key), follow))

    def judge(g: int, name: str, key: str, prompt: str, system: str, backend) -> tuple[int, str, str, Episode]:
        (q, s) = groups[g]
        return g, name, prompt, start_episode(TagFormat(backend.tokenizer, system), f"{q['id']}/{s}/{key}", prompt,
                                              stable_seed(q["id"], s, key), [], tools=())

    phase([(g, "solver", None,
            ctx.solver_episode(f"{q['id']}/{s}/solve0", q["question"], stable_seed(q["id"], s, "solve0"), q["task"]))
           for g, (q, s) in enumerate(groups)], ctx.backend, "agentverse solve t1")
    live, advice = list(range(len(groups))), {}
    for t in range(turns):
        if t:
            phase([revise(g, f"solve{t}", advice_prompt(texts[g], advice[g])) for g in live], ctx.backend,
                  f"agentverse solve t{t + 1}")
        reviewing = list(live)
        for c in range(critic_rounds):
            items = [judge(g, f"critic{k + 1}", f"t{t}/c{c}/critic{k}", critic_prompt(texts[g], solutions[g][-1]),
                           CRITICS[k % len(CRITICS)], critic)
                     for g in reviewing for k in range(n_critics)]
            phase(items, critic, f"agentverse critique t{t + 1}/{c + 1}")
            critiques = {g: [] for g in reviewing}
            for g, _, _, e in items:
                if not agrees(response(e)):
                    critiques[g].append(response(e))
            reviewing = [g for g in reviewing if critiques[g]]
            phase([revise(g, f"t{t}/revise{c}", revise_prompt(texts[g], critiques[g])) for g in reviewing], ctx.backend,
                  f"agentverse revise t{t + 1}/{c + 1}")
        if t == turns - 1:
            break
        items = [judge(g, "evaluator", f"t{t}/eval", evaluate_prompt(texts[g], solutions[g][-1]), EVALUATOR_SYSTEM,
                       evaluator) for g in live]
        phase(items, evaluator, f"agentverse evaluate t{t + 1}")
        verdicts = {g: parse_evaluation(response(e)) for g, _, _, e in items}
        advice = {g: a for g, (_, a) in verdicts.items()}
        live = [g for g in live if not verdicts[g][0]]

    rows = []
    for g, (q, s) in enumerate(groups):
        # the last solution that gave an answer
        final = next((e.answer for e in reversed(solutions[g]) if e.answer), None)
        messages[g].append({"role": "assistant", "name": "aggregator(last)",
                            "content": f"<answer>{final or ''}</answer>"})
        student = student_rendering(q["question"], solutions[g][:1], solutions[g][:1], final, ctx.system)
        rows.append(trajectory_row(q, s, "agentverse", ctx.teacher, messages[g], student, final, episodes[g],
                                   "answer" if final else "no_answer"))
    return rows
