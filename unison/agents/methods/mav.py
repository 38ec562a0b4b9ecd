"""`mav`: AgentArk multi-agent verification — `solutions` generator answers (with tools), each checked by `verifiers`
aspect verifiers (aspects drawn per question by seed, at `verifier_temperature`): a verifier writes an analysis, then is
asked for "FINAL VERIFICATION ANSWER: True/False". A solution's score is its fraction of approvals; output = the
best-scoring solution (ties -> the first). The aspect instructions are ours, one line each (AgentArk's are longer).
"""
from __future__ import annotations

import random
import re
from dataclasses import replace

from ...config import MAVConfig
from ...tool_format import TagFormat
from ..episodes import agent_messages, continue_episode, stable_seed, start_episode, trajectory_row
from ..runtime import Episode, run_episodes
from .common import response, student_rendering

GENERATE = "Solve the problem concisely. Include only the final answer."
VERIFIER_SYSTEM = "You are a verifier who checks one aspect of a proposed solution. {}"
ASPECTS = {
    "units_steps": "Check that every quantity has the right units and that unit conversions are correct.",
    "general_summarize": "Summarise what the solution claims and check that it answers exactly what was asked.",
    "general_edge": "Look for edge cases or special conditions the solution may have missed.",
    "general_mistakes": "Look for common mistakes: a misread question, the wrong entity, an arithmetic slip.",
    "general_domain": "Use your knowledge of the domain to judge whether the answer is plausible and correct.",
    "math_steps": "Check each mathematical step and calculation for errors.",
    "logic_steps": "Check that each reasoning step follows from the previous ones and from the evidence.",
    "general_diff": "Solve the problem yourself briefly and compare your answer with the proposed one.",
}
VERDICT = ("Based on your analysis, is the proposed answer correct? Reply with exactly FINAL VERIFICATION ANSWER: True "
           "or FINAL VERIFICATION ANSWER: False.")


def aspects_for(question_id: str, k: int) -> list[str]:
    return random.Random(stable_seed(question_id, "mav-aspects")).sample(sorted(ASPECTS), min(k, len(ASPECTS)))


def verify_prompt(question: str, solution: Episode) -> str:
    return (f"Question: {question}\n\nProposed solution: {response(solution)}\n\nWrite a short analysis of the "
            "proposed solution.")


def parse_verdict(text: str) -> bool:
    """True only for an approval: the last "FINAL VERIFICATION ANSWER: True/False", else a reply that starts with
    True."""
    found = re.findall(r"FINAL VERIFICATION ANSWER\W*(true|false)\b", text, re.IGNORECASE)
    return found[-1].lower() == "true" if found else bool(re.match(r"\W*true\b", text, re.IGNORECASE))


def best_solution(scores: list[float], answers: list[str | None]) -> int:
    """The highest-scoring solution that has an answer (ties -> the first); 0 when none has one."""
    return next((i for i in sorted(range(len(scores)), key=lambda i: -scores[i]) if answers[i]), 0)


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    p = ctx.params or MAVConfig()
    n_solutions, n_verifiers = p.solutions, p.verifiers
    verifier, vcfg = ctx.backend_for("verifier"), replace(ctx.settings, temperature=p.verifier_temperature)
    groups = [(q, s) for q in questions for s in samples]
    sols = [[ctx.solver_episode(f"{q['id']}/{s}/sol{k}", f"{q['question']}\n\n{GENERATE}",
                                stable_seed(q["id"], s, "sol", k), q["task"])
             for k in range(n_solutions)] for q, s in groups]
    run_episodes([e for g in sols for e in g], ctx.backend, ctx.toolbox, ctx.settings, desc="mav generate")
    checks = [[(k, aspect, start_episode(TagFormat(verifier.tokenizer, VERIFIER_SYSTEM.format(ASPECTS[aspect])),
                                         f"{q['id']}/{s}/sol{k}/{aspect}", verify_prompt(q["question"], e),
                                         stable_seed(q["id"], s, k, aspect), [], tools=()))
               for k, e in enumerate(g) for aspect in aspects_for(q["id"], n_verifiers)]
              for (q, s), g in zip(groups, sols)]
    run_episodes([e for g in checks for *_, e in g], verifier, ctx.toolbox, vcfg, desc="mav verify")
    verdicts = [[continue_episode(verifier.tokenizer, e, f"{e.key}/verdict", VERDICT, stable_seed(e.key, "verdict"), [])
                 for *_, e in g] for g in checks]
    run_episodes([e for g in verdicts for e in g], verifier, ctx.toolbox, vcfg, desc="mav verdict")

    rows = []
    for (q, s), g, chk, ver in zip(groups, sols, checks, verdicts):
        approvals = [[parse_verdict(response(v)) for (k, _, _), v in zip(chk, ver) if k == i] for i in range(len(g))]
        pick = best_solution([sum(a) / max(1, len(a)) for a in approvals], [e.answer for e in g])
        final = g[pick].answer
        messages = [{"role": "user", "name": None, "content": q["question"]}]
        for k, e in enumerate(g):
            messages += ([{"role": "user", "name": "moderator", "content": f"{q['question']}\n\n{GENERATE}"}]
                         + agent_messages(e, f"generator{k}"))
        for (k, aspect, e), v in zip(chk, ver):
            name = f"verifier({aspect})@{k}"
            messages += ([{"role": "user", "name": name, "content": verify_prompt(q["question"], g[k])}]
                         + agent_messages(e, name))
            messages += [{"role": "user", "name": name, "content": VERDICT}] + agent_messages(v, name)
        messages.append({"role": "assistant", "name": "aggregator(verified)",
                         "content": f"<answer>{final or ''}</answer>"})
        rows.append(trajectory_row(q, s, "mav", ctx.teacher, messages,
                                   student_rendering(q["question"], g[pick:pick + 1], g[pick:pick + 1], final,
                                                     ctx.system), final, g + [e for *_, e in chk] + ver,
                                   "answer" if final else "no_answer"))
    return rows
