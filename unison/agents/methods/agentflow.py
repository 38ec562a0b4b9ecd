"""`agentflow`: AgentFlow — a planner analyses the query once, then each step picks a sub-goal and a tool; an executor
writes the tool command (a search query or python code), run as the runtime's tool turn; the memory of "Action Step k"
{tool_name, sub_goal, command, result} goes into every later prompt; a verifier says STOP or CONTINUE (at most
`max_steps` steps); a generator writes the final <answer> from the query and the memory.

Student rendering: per step <think>sub_goal</think>, the executor's tool call and its <result>, then the answer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ...config import AgentFlowConfig
from ...tool_format import TagFormat
from ...tools.registry import SCAFFOLD
from ..episodes import agent_messages, stable_seed, start_episode, student_messages, trajectory_row
from ..runtime import Episode, Segment, run_episodes

RESULT_CHARS = 400  # of a tool result kept in the memory (AgentFlow truncates results too)
ANALYSIS = ("Task: Analyze the given query to determine necessary skills and tools.\n\nQuery: {question}\nAvailable "
            "tools: {tools}\n\nIdentify the main objectives, the skills and tools needed and how each helps, and any "
            "additional considerations. Be brief and precise.")
NEXT_STEP = ("Task: Determine the optimal next step to address the query using available tools and previous steps.\n\n"
             "Query: {question}\nQuery Analysis: {analysis}\nAvailable Tools: {tools}\nPrevious Steps: {memory}\n\n"
             "Select the single best tool and a specific, achievable sub-goal for it. End with:\nSub-Goal: <sub_goal>\n"
             "Tool Name: <tool_name>")
EXECUTOR = " This step serves the query: {question}"  # its user turn is the sub-goal alone (a small
# teacher writes a usable call only then; AgentFlow's executor sees the query, the sub-goal and the planner's context)
VERIFY = ("Task: Evaluate if the current memory is complete and accurate enough to answer the query, or "
          "if more tools are needed.\n\nQuery: {question}\nAvailable Tools: {tools}\nInitial Analysis: {analysis}\n"
          "Memory (Tools Used & Results): {memory}\n\nExplain briefly, then end with either \"Conclusion: STOP\" or "
          "\"Conclusion: CONTINUE\".")
ANSWER = "Actions Taken: {memory}\n\nAnswer concisely from the results, as <answer>...</answer>: {question}"


@dataclass
class Flow:
    """One (question, sample): its analysis, memory, student segments, transcript and role episodes."""
    q: dict
    sample: int
    analysis: str = ""
    memory: list[dict] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)  # the role of each of `episodes`
    answer: Episode | None = None  # the generator's

    def of(self, role: str) -> list[Episode]:
        return [e for e, r in zip(self.episodes, self.roles) if r == role]

    def prompt(self, template: str, **kw) -> str:
        return template.format(question=self.q["question"], analysis=self.analysis,
                               memory=memory_text(self.memory), **kw)


def memory_text(memory: list[dict]) -> str:
    """The memory as AgentFlow puts it in prompts: {"Action Step k": {tool_name, sub_goal, command, result}}."""
    return str({f"Action Step {k + 1}": {**m, "result": m["result"][:RESULT_CHARS]} for k, m in enumerate(memory)})


def parse_next_step(text: str, tools: tuple[str, ...], default_tool: str, question: str) -> tuple[str, str]:
    """(sub_goal, tool) of a planner turn: the last "Sub-Goal:" (else the question) and the "Tool Name:" matched
    case/space/underscore-insensitively (else the first available tool named in the text, else `default_tool`)."""
    text = text.replace("**", "")
    goals = re.findall(r"sub[- _]?goal\s*:\s*(.*\S)", text, re.I)
    names = [re.sub(r"[ _]+", "_", n.strip(" .`'\"").lower())
             for n in re.findall(r"tool[- _]?name\s*:\s*(.*\S)", text, re.I)]
    hits = sorted((m.start(), t) for t in tools for m in [re.search(rf"(?<!\w){t}(?!\w)", text, re.I)] if m)
    tool = names[-1] if names and names[-1] in tools else hits[0][1] if hits else default_tool
    return (goals[-1] if goals else question), tool


def verdict(text: str) -> str:
    """STOP or CONTINUE, as AgentFlow reads its verifier: the last "Conclusion: X", else any "stop", else CONTINUE."""
    found = [c.upper() for c in re.findall(r"conclusion\**:?\s*\**\s*(\w+)", text, re.I)]
    if found and found[-1] in ("STOP", "CONTINUE"):
        return found[-1]
    return "STOP" if "stop" in text.lower() else "CONTINUE"


def executed(e: Episode, tool: str) -> tuple[str, str]:
    """(command, result) of an executor turn; a turn that wrote no tool call at all counts as an unparsable call."""
    call = next((ev for ev in e.events if ev["type"] == "tool"), None)
    if call:
        return call["input"], call["output"]
    if len(e.segments) < 2:
        e.count_tool(tool, "unparsable")
    return (e.segments[0].text if e.segments else ""), "error: could not parse the tool call"


def phase(flows: list[Flow], role: str, prompts: list[str], step: str, ctx, system: str | list[str] | None = None,
          scaffolds: list[list[str]] | None = None, tools: list[tuple[str, ...]] | None = None) -> list[Episode]:
    """One turn of `role` for every flow (one run_episodes call; `system`: one, or one per flow); returns the
    episodes."""
    tok = ctx.backend_for(role).tokenizer
    systems = system if isinstance(system, list) else [system] * len(flows)
    eps = [start_episode(TagFormat(tok, systems[i]), f"{f.q['id']}/{f.sample}/{step}", p,
                         stable_seed(f.q["id"], f.sample, step), scaffolds[i] if scaffolds else [],
                         tools=tools[i] if tools else ())
           for i, (f, p) in enumerate(zip(flows, prompts))]
    run_episodes(eps, ctx.backend_for(role), ctx.toolbox, replace(ctx.settings, max_turns=1), desc=f"agentflow {step}")
    for f, e in zip(flows, eps):
        f.episodes.append(e)
        f.roles.append(role)
        f.messages += agent_messages(e, role)
    return eps


def own_ids(segments: list[Segment], ctx, role: str) -> list[Segment]:
    """A role's segments for the student: with their ids where the role ran on the main tokenizer, else re-tokenised."""
    same = ctx.backend_for(role).tokenizer is ctx.backend.tokenizer
    return segments if same else [Segment(s.kind, s.text, []) for s in segments]


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    rows = []
    for f in run_flows(questions, samples, ctx):
        rows.append(trajectory_row(f.q, f.sample, "agentflow", ctx.teacher, f.messages,
                                   student_messages(f.q["question"], f.segments, ctx.system), f.answer.answer,
                                   f.episodes, "answer" if f.answer.answer else "no_answer"))
    return rows


def run_flows(questions: list[dict], samples: range, ctx) -> list[Flow]:
    """Every (question, sample)'s flow, run to its answer: its segments end with the generator's."""
    max_steps = (ctx.params or AgentFlowConfig()).max_steps
    tools, system = ctx.tools, ctx.system
    flows = [Flow(q, s, messages=[{"role": "user", "name": None, "content": q["question"]}]) for q in questions
             for s in samples]
    for f, e in zip(flows, phase(flows, "planner", [f.prompt(ANALYSIS, tools=tools) for f in flows], "analysis", ctx)):
        f.analysis = e.text.strip()
    live = flows
    for k in range(1, max_steps + 1):
        if not live:
            break
        nexts = phase(live, "planner", [f.prompt(NEXT_STEP, tools=tools) for f in live], f"step{k} plan", ctx)
        picks = [parse_next_step(e.text, tools, "python" if f.q["task"] == "math" else "search", f.q["question"])
                 for f, e in zip(live, nexts)]
        runs = phase(live, "executor", [g for g, _ in picks], f"step{k} execute", ctx,
                     [system + EXECUTOR.format(question=f.q["question"]) for f in live],
                     [[t] if ctx.scaffold and t in SCAFFOLD else [] for _, t in picks], [(t,) for _, t in picks])
        for f, (goal, tool), e in zip(live, picks, runs):
            command, result = executed(e, tool)
            f.memory.append({"tool_name": tool, "sub_goal": goal, "command": command, "result": result})
            f.segments.append(Segment("gen", f"<think>{goal}</think>", []))
            if len(e.segments) > 1:  # the tool call as the executor wrote it, and its observation
                f.segments += own_ids(e.segments, ctx, "executor")
        if k < max_steps:
            checks = phase(live, "verifier", [f.prompt(VERIFY, tools=tools) for f in live], f"step{k} verify", ctx)
            live = [f for f, e in zip(live, checks) if verdict(e.text) == "CONTINUE"]
    answers = phase(flows, "generator", [f.prompt(ANSWER) for f in flows], "answer", ctx, system,
                    [["answer"] if ctx.scaffold else [] for _ in flows])
    for f, e in zip(flows, answers):
        f.segments += own_ids(e.segments, ctx, "generator")
        f.answer = e
    return flows
