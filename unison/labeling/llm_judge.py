"""An LLM judge through any backend (AgentArk label.py, docs/seeds.md#agentarks-labels): does the answer match the gold
answers?

The verdict is the first word of the model's reply, "true" or "false"; anything else counts as false and is tallied in
`unparsable`. The judge name recorded in each row names the model, the prompt template's sha256 and the temperature.
"""
from __future__ import annotations

import hashlib

from ..judge.answers import judged_answer
from ..llm import Sampling
from ..protocol import chat_prompt

PROMPT = (
    "You are labeling whether an answer correctly answers a question.\n\n"
    "QUESTION:\n{question}\n\n"
    "GROUND TRUTH ANSWER(S) (any one is enough):\n{gold}\n\n"
    "CANDIDATE ANSWER:\n{answer}\n\n"
    "Does the candidate answer match the ground truth? Numbers must match in value; names may differ in form "
    "(initials, titles, spelling of the same entity). Respond ONLY with: true or false"
)
PROMPT_SHA256 = hashlib.sha256(PROMPT.encode()).hexdigest()


class LLMJudge:
    """A batch judge (see unison.judge.steps): one generate call for all items."""

    def __init__(self, backend, model: str, temperature: float = 0.0, max_tokens: int = 4, seed: int = 0):
        self.backend, self.model, self.temperature, self.max_tokens, self.seed = (backend, model, temperature,
                                                                                   max_tokens, seed)
        self.name = f"llm:{model}:prompt-sha256={PROMPT_SHA256}:temperature={temperature}"
        self.calls = self.unparsable = 0

    def __call__(self, items: list[tuple[str, str, str | None, list[str]]]) -> list[tuple[bool, float, str]]:
        answers = [judged_answer(pred) for _, _, pred, _ in items]
        asked = [k for k, a in enumerate(answers) if a]
        tok = self.backend.tokenizer
        prompts = [chat_prompt(tok, [{"role": "user", "content": PROMPT.format(
            question=items[k][1], gold="\n".join(items[k][3]), answer=answers[k])}]) for k in asked]
        sampling = [Sampling(temperature=self.temperature, max_tokens=self.max_tokens, seed=self.seed + k)
                    for k in asked]
        replies = self.backend.generate(prompts, sampling) if prompts else []
        out = [(False, 0.0, "no-answer")] * len(items)
        for k, c in zip(asked, replies):
            verdict = parse_verdict(c.text)
            self.unparsable += verdict is None
            out[k] = (bool(verdict), float(bool(verdict)), self.name)
        self.calls += len(asked)
        return out


def parse_verdict(text: str) -> bool | None:
    """The reply's first word as true/false (case, punctuation and markdown ignored); None if it is neither."""
    word = (text.strip().split() or [""])[0].strip(".,:;!*\"'`").lower()
    return {"true": True, "false": False}.get(word)
