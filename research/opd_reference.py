"""OPD's probe against a reference implementation, on a real student and teacher: TRL's GKD loss at beta 1
(`GKDTrainer.generalized_jsd_loss`, the reverse KL summed over the whole vocabulary at every scored position) against
the probe's one-sample estimate (the student's log-prob of each sampled token minus the teacher's), on the very same
episodes: the held-out probe prompts of the project's params (rl.probe.prompts, rl.seed), rolled out by the student
with the probe's seeds on transformers (the rl stage rolls out on rl.rollout.backend, so its episodes may differ). The
two measure the same quantity, so they should agree within the estimate's standard error; the teacher's log-probs the
probe used are checked against TRL's teacher logits too.

Run in a project whose rl stage has run (a research.token_distillation copy, for example), for one or more students:

    python -m research.opd_reference --project DIR [--student models/sft --student models/rl] [--micro-batch 4]

Same vocabulary only (a teacher of another tokenizer has no logits over the student's vocabulary). Figures merge into
reports/bench.json under "opd_reference".
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

from bench.bench_rollout import git_commit, save_report


def compare(student_dir: str, micro_batch: int) -> dict:
    """In the project (cwd): the probe's estimate and TRL's full-vocabulary reverse KL on the same probe episodes of the
    student in `student_dir`, with the teacher in models/teacher."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDTrainer

    from unison import layout
    from unison.agents.wiring import make_toolbox
    from unison.config import load_params
    from unison.llm.hf_backend import HFBackend
    from unison.tool_format import student_format
    from unison.tools.registry import enabled_tools
    from unison.train.batches import collate
    from unison.train.probe import probe_samples, span_kls, split_probe
    from unison.train.rl import RLSetup, load_rl_data
    from unison.train.rollout import SoloRollout, make_rollout_backend

    params = load_params()
    rl = params.rl
    if not rl.probe.prompts:
        raise SystemExit("research.opd_reference: set rl.probe.prompts in params.yaml (the held-out prompts to compare on)")
    if rl.opd.teacher_context != "student":
        raise SystemExit("research.opd_reference: the teacher reads the student's prompt here (rl.opd.teacher_context student)")
    tok = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(layout.TEACHER, dtype=torch.float32).eval()
    if teacher.config.vocab_size != student.config.vocab_size:
        raise SystemExit("research.opd_reference: the teacher's vocabulary is not the student's; TRL's loss needs the same one")
    tools = enabled_tools(params.tools)  # the rl stage's setup, with the teacher on transformers (TRL reads its logits)
    acting = SoloRollout(make_toolbox(params.tools), tools,
                         student_format(params.student.tool_format, tok, tools, params.generate.method))
    setup = RLSetup(rl=rl, label=params.label, llm=params.llm, tools=tools, acting=acting,
                    teacher=HFBackend(model=teacher, tokenizer=tok))
    _, probe_rows = split_probe(load_rl_data(sorted(Path(layout.RL_DATA).glob("level*.parquet"))), rl.probe.prompts, rl.seed)
    t0 = time.perf_counter()
    backend = make_rollout_backend("transformers", student, tok, student_dir, setup.llm, 0)
    samples = probe_samples(probe_rows, backend, student, tok, setup, tok.eos_token_id, torch.device("cpu"), "fp32")
    values, tokens = span_kls(samples)
    trl_sum, scored, worst = 0.0, 0, 0.0
    with torch.no_grad():
        for i in range(0, len(samples), micro_batch):  # the whole vocabulary's logits of every sample at once would not fit
            batch = collate(samples[i : i + micro_batch], tok.eos_token_id)
            s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            mask = batch["teacher_span"] > 0
            labels = batch["input_ids"][:, 1:].masked_fill(~mask, -100)
            n = int(mask.sum())
            # batchmean over the label tokens: a token-weighted sum over micro-batches is the mean over all of them
            trl_sum += GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels=labels, beta=1.0).item() * n
            scored += n
            t_logp = torch.log_softmax(t_logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
            worst = max(worst, float((t_logp[mask] - batch["teacher_logp"][mask]).abs().max()))
    return {"student": student_dir, "episodes": len(samples), "tokens": tokens, "probe_kl": sum(values) / tokens,
            "probe_se": statistics.pstdev(values) / math.sqrt(len(values)), "trl_reverse_kl": trl_sum / scored,
            "teacher_logp_max_diff": worst, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True, type=Path, help="a project whose rl stage has run (params with rl.probe.prompts)")
    ap.add_argument("--student", action="append", help="a student's model folder in the project (default: models/sft, models/rl)")
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    here = Path.cwd()
    os.chdir(args.project)
    results = []
    for student in args.student or ["models/sft", "models/rl"]:
        results.append(compare(student, args.micro_batch))
        r = results[-1]
        print(f"opd_reference: {student}: the probe's estimate {r['probe_kl']:.4f} +- {r['probe_se']:.4f}, TRL's reverse KL "
              f"over the whole vocabulary {r['trl_reverse_kl']:.4f}, on {r['tokens']} tokens of {r['episodes']} episodes; "
              f"teacher log-probs within {r['teacher_logp_max_diff']:.1e} of TRL's teacher logits", flush=True)
    os.chdir(here)
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "project": str(args.project.resolve()),
                 "rows": results}, key="opd_reference")


if __name__ == "__main__":
    main()
