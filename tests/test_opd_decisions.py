"""research/opd_decisions: which episodes it reads as looping, which answers it takes as written before training, and the
turn log-prob it compares (a tiny random model)."""
from __future__ import annotations

import torch

from research.opd_decisions import first_answers, looping, turn_logps


def row(qid: str, roles: list[str], finish: str) -> dict:
    contents = {"assistant": "<search>x</search>", "tool": "\n<result>\nr\n</result>\n"}
    student = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    student += [{"role": role, "content": contents[role]} for role in roles]
    return {"question_id": qid, "student": student, "finish_reason": finish}


def test_looping_episodes_called_again_after_their_first_result_and_answers_come_right_after_it():
    again = row("a", ["assistant", "tool", "assistant", "tool", "assistant", "tool"], "max_tool_calls")
    answered_late = row("b", ["assistant", "tool", "assistant", "tool", "assistant"], "answer")
    long_turn = row("c", ["assistant", "tool", "assistant"], "max_tool_calls")  # its second turn was cut, not a call
    answered = row("d", ["assistant", "tool", "assistant"], "answer")
    answered["student"][-1]["content"] = "<answer>Paris</answer>"
    assert looping([again, answered_late, long_turn, answered]) == [again]
    assert first_answers([again, answered_late, long_turn, answered]) == {"d": "<answer>Paris</answer>"}


def test_turn_logps_sums_the_turns_tokens_up_to_its_end_and_gives_its_first(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids, mask = [5, 9, 14, 3, 8, 21, 30, 2], [0, 0, 0, 1, 1, 1, 0, 0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    expected = [logp[k - 1, ids[k]].item() for k in (3, 4, 5)]
    total, first = turn_logps(model, ids, mask, 3)
    assert abs(total - sum(expected)) < 1e-4 and abs(first - expected[0]) < 1e-5
    assert abs(turn_logps(model, ids, mask, 5)[0] - expected[2]) < 1e-5  # from a later start: that token alone
