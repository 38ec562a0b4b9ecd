"""The report's tables and sentences: the headline per system, the teacher-vs-student story, the paired comparisons,
the PRM rerank and flywheel rows, and any stage's metrics as metric/value rows."""
from __future__ import annotations

import numbers

LABELS = {"base": "base student", "sft": "SFT student", "prm_rerank": "SFT + PRM best-of-N", "dpo": "DPO student",
          "rl": "RL student", "teacher": "teacher"}
RERANK = {"prm_pick_accuracy": "PRM pick accuracy",
          "candidate_mean_accuracy": "candidate mean accuracy (a random pick)",
          "prm_beats_mean": "PRM pick beats the candidate mean", "vote_accuracy": "majority-vote accuracy",
          "pass_at_n": "pass@N", "prm_pick_answered_rate": "PRM picks with an answer",
          "prm_outcome_auc": "PRM outcome AUC", "samples_per_question": "samples per question"}
MAX_LIST_ITEMS = 8  # stage-metric lists longer than this are shortened in the tables


def number(value, spec: str) -> str:
    """`value` formatted with `spec`, or "-" when the metric is missing."""
    return "-" if value is None else format(value, spec)


def with_ci(m: dict, key: str) -> str:
    """`value [lo, hi]` of metric `key` (3 decimals), the bare value without an interval, "-" when missing."""
    if m.get(key) is None:
        return "-"
    if m.get(f"{key}_lo") is None:
        return f"{m[key]:.3f}"
    return f"{m[key]:.3f} [{m[f'{key}_lo']:.3f}, {m[f'{key}_hi']:.3f}]"


def teacher_first(metrics: dict) -> dict:
    """`metrics` with the teacher (if any) first, the students after it in their order."""
    return {**({"teacher": metrics["teacher"]} if "teacher" in metrics else {}), **metrics}


def headline_rows(metrics: dict) -> list[dict]:
    """One row per system: quality (EM, SubEM, F1, answer length) then cost, teacher first."""
    teacher_tokens = metrics.get("teacher", {}).get("tokens_per_question")
    rows = []
    for name, m in teacher_first(metrics).items():
        rows.append({"system": LABELS.get(name, name), "EM [95% CI]": with_ci(m, "em"),
                     "SubEM [95% CI]": with_ci(m, "subem"), "F1": number(m.get("f1"), ".3f"),
                     "answer tokens": number(m.get("answer_tokens"), ".1f"),
                     "LLM calls/q": number(m.get("llm_calls_per_question"), ".2f"),
                     "gen tokens/q": number(m.get("tokens_per_question"), ".0f"),
                     "% of teacher tokens": (f"{100 * m['tokens_per_question'] / teacher_tokens:.0f}%"
                                             if teacher_tokens else "-"),
                     "tool calls/q": number(m.get("tool_calls_per_question"), ".2f"),
                     "tokens/correct": number(m.get("tokens_per_correct"), ".0f"),
                     "wall s/q": number(m.get("wall_s_per_question"), ".2f")})
    return rows


def final_student(metrics: dict) -> str | None:
    """The system the pipeline ends with: the RL student (picking the best on the test split would flatter it), else the
    last student evaluated."""
    students = [n for n, m in metrics.items() if n.partition(":")[0] != "teacher" and m.get("em") is not None]
    return "rl" if "rl" in students else (students[-1] if students else None)


def headline_metrics(metrics: dict) -> dict:
    """What pipeline runs are compared by: the teacher's and the final student's EM and generated tokens per question,
    and the student's tokens as a share of the teacher's."""
    out = {}
    for who, name in (("teacher", "teacher" if "teacher" in metrics else None), ("student", final_student(metrics))):
        if name:
            out |= {f"{who}_em": metrics[name]["em"],
                    f"{who}_tokens_per_question": metrics[name]["tokens_per_question"]}
    if out.get("teacher_tokens_per_question") and "student_em" in out:
        out["student_to_teacher_tokens"] = out["student_tokens_per_question"] / out["teacher_tokens_per_question"]
    return out


def paired_sentence(c: dict, first: str, second: str) -> str:
    """How a paired comparison reads: the discordant questions and the exact McNemar p-value, significant or not."""
    verdict = "a significant difference" if c["p_mcnemar"] < 0.05 else "not a significant difference"
    return (f"paired on the same {c['questions']} questions, {c['only_first']} are right only for {first} and "
            f"{c['only_second']} only for {second}: exact McNemar p = {c['p_mcnemar']:.3g}, {verdict} at 0.05")


def paired_rows(paired: dict) -> list[dict]:
    """reports/paired.json as table rows, one comparison each."""
    return [{"comparison": f"{LABELS.get(a, a)} vs {LABELS.get(b, b)}", "EM first": f"{c['em_first']:.3f}",
             "EM second": f"{c['em_second']:.3f}", "difference (points)": f"{100 * c['difference']:+.1f}",
             "right only in first": c["only_first"], "right only in second": c["only_second"],
             "exact McNemar p": f"{c['p_mcnemar']:.3g}"}
            for a, b, c in ((*name.split("_vs_"), c) for name, c in paired.items())]


def story(metrics: dict, paired: dict | None = None) -> str:
    """One or two sentences: teacher EM vs the final student's, the token ratio, and either the share of the
    base-to-teacher EM gap the student closed or, when its EM is above the teacher's, by how many points it passes
    it; then whether that difference is significant, question by question (`paired`, reports/paired.json)."""
    best = final_student(metrics)
    if best is None:
        return ""
    b, label = metrics[best], LABELS.get(best, best)
    if "teacher" not in metrics:
        return f"No teacher was evaluated; the final student, the {label}, reaches EM {with_ci(b, 'em')}."
    t = metrics["teacher"]
    text = (f"The teacher reaches EM {with_ci(t, 'em')} with {t['tokens_per_question']:.0f} generated "
            f"tokens per question; the final student, the {label}, reaches {with_ci(b, 'em')} with "
            f"{b['tokens_per_question']:.0f} tokens ({b['tokens_per_question'] / t['tokens_per_question']:.0%} "
            "of the teacher's)")
    base = metrics.get("base")
    if b["em"] > t["em"]:
        text += f"; the student passes the teacher by {100 * (b['em'] - t['em']):.1f} EM points"
    elif base and t["em"] > base["em"]:
        text += (f", closing {(b['em'] - base['em']) / (t['em'] - base['em']):.0%} of the EM gap from the base student "
                 f"({base['em']:.3f})")
    elif base:
        text += f"; the teacher is not ahead of the base student ({base['em']:.3f}), so there is no gap to close"
    compared = (paired or {}).get(f"{best}_vs_teacher")
    return text + (f"; {paired_sentence(compared, 'the student', 'the teacher')}." if compared else ".")


def rerank_rows(metrics: dict) -> list[dict]:
    """The PRM best-of-N comparison (pick vs the candidates' mean, vote, pass@N) as measure/value rows; [] without
    it."""
    m = metrics.get("prm_rerank", {})
    return [{"measure": label, "value": format_value(m[key])} for key, label in RERANK.items() if key in m]


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts (and lists of dicts) as dotted keys; lists of plain values stay one entry."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value}


def format_value(value) -> str:
    """Floats to 4 significant digits, lists shortened past MAX_LIST_ITEMS, None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, list):
        shown = ", ".join(map(format_value, value[:MAX_LIST_ITEMS]))
        return shown + (f", ... ({len(value)} items)" if len(value) > MAX_LIST_ITEMS else "")
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        return f"{value:.4g}"
    return str(value)


def key_value_rows(stage_json: dict) -> list[dict]:
    """A stage's metrics as metric/value rows, nested keys dotted."""
    return [{"metric": k, "value": format_value(v)} for k, v in flatten(stage_json).items()]


def flywheel_rows(flywheel: dict) -> list[dict]:
    """reports/flywheel.json's `rounds` as table rows: round, teacher and student with EM (one "key [95% CI]" column
    where `_lo` and `_hi` are there) and tokens, the round's correct trajectories and SFT steps."""
    rounds = flywheel.get("rounds") or []
    shown = ("round", "teacher", "teacher_em", "teacher_tokens_per_question", "student", "student_em",
             "student_tokens_per_question",
             "correct_trajectories", "sft_steps")  # the rest stays in reports/flywheel.json
    present = {k for r in rounds for k in r}
    columns = [c for c in shown if c in present] + [f"{c}_{end}" for c in ("teacher_em", "student_em")
                                                    for end in ("lo", "hi") if f"{c}_{end}" in present]
    with_interval = {c for c in columns if f"{c}_lo" in columns and f"{c}_hi" in columns}
    bounds = {f"{c}_{end}" for c in with_interval for end in ("lo", "hi")}
    return [{(f"{c} [95% CI]" if c in with_interval else
              c): (with_ci(r, c) if c in with_interval else format_value(r.get(c)))
             for c in columns if c not in bounds} for r in rounds]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(map(str, r.values())) + " |" for r in rows]) + "\n"


