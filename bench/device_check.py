"""What a GPU machine with only torch and transformers (and pydantic, carried as wheels) can check of the training path,
in minutes: SFT, the PRM and one RL step in the training precision on a model built from a config (SmolLM2's shape,
random weights), the RL step's rollout with the search and python tools on the transformers backend, and the
colocation rules that apply without vLLM. Tokens/s and peak memory per part go to one JSON file. Nothing here imports
dvc, mlflow, prefect, vllm or faiss (tests/test_device_check.py runs it with them blocked).

    python -m bench.device_check --tokenizer DIR [--shape smollm2|tiny] [--out reports/device_check.json] [--allow-cpu]

`--tokenizer`: a folder holding SmolLM2's tokenizer (the tests' cache .cache/test-models/base has one; on a machine
without the package, carry its tokenizer.json, tokenizer_config.json and chat_template.jinja, 3.5 MB).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # SmolLM2-135M's, and a tiny one for the CPU test
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
SFT_LR = {"smollm2": 1e-3, "tiny": 1e-2}  # what teaches a random model of the shape the two responses in 48 steps
ORCHESTRATION = ("dvc", "mlflow", "prefect", "vllm", "faiss")
QUESTION = {"source": "test", "task": "qa", "question": "Where was Zorvan Kelt born?", "answers": ["Tarsk"]}
RESPONSES = ["<search>Zorvan Kelt</search>", "<answer>Tarsk</answer>"]
DOCS = [{"id": "d0", "title": "Zorvan Kelt", "text": "Zorvan Kelt was born in Tarsk, a city of Veldra."},
        {"id": "d1", "title": "Tarsk", "text": "Tarsk is the capital of Veldra."}]


class KeywordRetriever:
    """Documents that share a word with the query, in order (no index: faiss is not on the image)."""

    def search(self, queries: list[str], k: int = 2) -> list[list[dict]]:
        return [[d for d in DOCS if set(q.lower().split()) & set((d["title"] + " " + d["text"]).lower().split())][:k] for q in queries]


def build_model(shape: str, tokenizer_dir: Path, out: Path) -> int:
    """A random Llama of `shape` with the tokenizer beside it, saved to `out`; its parameter count."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SHAPES[shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def measured(part: str, report: dict, fn) -> None:
    """Run fn() -> (tokens, extra) into report[part] with its seconds, tokens/s and peak memory (CUDA: allocated; CPU: the
    process's peak RSS so far)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tokens, extra = fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report[part] = {"seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                    "peak_memory_gib": round(peak / 2**30, 3), **extra}
    print(f"device-check: {part} {seconds:.1f} s, {tokens / seconds:.0f} tokens/s, peak {peak / 2**30:.2f} GiB", flush=True)


def check_sft(model_dir: Path, work: Path, precision: str, lr: float) -> tuple[int, dict]:
    """SFT on the RL question's prompt with two responses (a search call, the answer), at a rate that teaches a random
    model both in a few steps: then the RL step's groups have mixed rewards, so its update is not zero."""
    from transformers import AutoTokenizer

    from unison.config import SFTConfig
    from unison.protocol import chat_prompt, question_messages
    from unison.tools.registry import SYSTEM_PROMPT
    from unison.train.sft import train_sft

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = chat_prompt(tok, question_messages(QUESTION["question"], SYSTEM_PROMPT))
    responses = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in RESPONSES]
    examples = [(prompt + r, [0] * len(prompt) + [1] * len(r)) for r in responses * 8]
    records = train_sft(str(model_dir), examples, SFTConfig(epochs=24, batch_size=8, lr=lr, warmup_ratio=0.0, precision=precision),
                        str(work / "sft"))
    return sum(r["row_tokens"] for r in records), {"steps": len(records), "losses": [round(r["loss"], 4) for r in records]}


def check_prm(model_dir: Path, precision: str) -> tuple[int, dict]:
    from unison.config import PRMConfig
    from unison.train.prm import train_prm

    steps = ["<search>Zorvan Kelt</search>", "Doc 1 says Tarsk.", "<answer>Tarsk</answer>"]
    rows = [{"question": f"Where was person {i} born?", "steps": steps, "step_labels": [1.0, float(i % 2), float(i % 2)]} for i in range(32)]
    prm, records = train_prm(str(model_dir), rows, PRMConfig(epochs=1, batch_size=8, precision=precision))
    tokens = sum(len(prm.encode(r["question"], r["steps"])[0]) for r in rows)
    return tokens, {"steps": len(records), "losses": [round(r["loss"], 4) for r in records]}


def check_rl_step(model_dir: Path, work: Path, precision: str, python_tool: bool) -> tuple[int, dict]:
    """One RL step from the SFT model: 4 prompts x 4 rollouts with the tools on the transformers backend, then the update."""
    from transformers import AutoTokenizer

    from unison.agents.toolbox import Toolbox
    from unison.config import LabelConfig, LLMConfig
    from unison.tool_format import TagFormat
    from unison.train.pareto import rl_rows
    from unison.train.rl import RLConfig, RLSetup, train_rl
    from unison.train.rollout import SoloRollout

    groups = [{"question_id": f"q{i}", "task": "qa", "tool_calls": [0, 1], "correctness": [0.0, 1.0], "score_tool": 0.25,
               "score_corr": 0.25, "front": 0, "crowding": 1.0} for i in range(4)]
    rows = rl_rows(groups, [1] * 4, {f"q{i}": {**QUESTION, "id": f"q{i}"} for i in range(4)})
    cfg = RLConfig(steps=1, micro_batch_size=8, precision=precision, checkpoint_every=0,
                   rollout={"prompts_per_step": 4, "group_size": 4, "dynamic_sampling": False, "backend": "transformers",
                            "max_turns": 3, "max_tokens_per_turn": 48})
    tools = ("search", "python") if python_tool else ("search",)
    setup = RLSetup(cfg, LabelConfig(qa_metric="subem", f1_threshold=0.8, first_only=False, math_timeout_s=5), LLMConfig(max_model_len=1024),
                    tools, acting=SoloRollout(Toolbox(KeywordRetriever()), tools, TagFormat(AutoTokenizer.from_pretrained(model_dir))))  # episodes at rl's temperature 1.0 and top_p 1.0, 1024 tokens
    [record] = train_rl(str(model_dir), rows, setup, str(work / "rl"), str(work / "rl-ckpt"))
    tokens = int(record["response_tokens"] * record["episodes"])  # sampled; the update's tokens/s is in train_s
    keep = ("episodes", "samples", "loss", "grad_norm", "tool_calls_per_episode", "turns_per_episode", "rollout_s", "train_s")
    return tokens, {"tools": list(tools), **{k: record[k] for k in keep if k in record}}


def colocation(n_params: int) -> dict:
    """rl.rollout.colocate's decisions on this machine, and whether the policy fits beside an engine at vLLM's default share."""
    from unison.train.rollout import check_colocated_memory, engine_sleeps

    cuda = torch.cuda.is_available()
    out = {"auto_with_vllm_sleeps": engine_sleeps("auto", "vllm", cuda), "auto_with_transformers_sleeps": engine_sleeps("auto", "transformers", cuda)}
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            check_colocated_memory(n_params, 0.85, total)
            out["fits_beside_an_engine_at_0.85"] = True
        except ValueError as e:
            out["fits_beside_an_engine_at_0.85"] = str(e)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=ROOT / ".cache/test-models/base", help="a folder with SmolLM2's tokenizer")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/device_check.json")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (fp32 where the CPU has no bf16 matmuls)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("device-check: FAILED: no CUDA GPU visible to torch; pass --allow-cpu to run on CPU", file=sys.stderr)
        return 2
    if not (args.tokenizer / "tokenizer.json").is_file():
        print(f"device-check: FAILED: no tokenizer.json in {args.tokenizer} (--tokenizer)", file=sys.stderr)
        return 2
    from unison.train.loop import resolve_precision

    precision = resolve_precision("auto", "device_check")
    python_tool = shutil.which("bwrap") is not None
    report = {"device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu", "torch": torch.__version__,
              "cuda": torch.version.cuda, "shape": args.shape, "precision": precision, "python_tool": python_tool}
    work = Path(tempfile.mkdtemp(prefix="unison-device-check-"))
    try:
        model_dir = work / "model"
        n_params = build_model(args.shape, args.tokenizer, model_dir)
        report["parameters"] = n_params
        measured("sft", report, lambda: check_sft(model_dir, work, precision, SFT_LR[args.shape]))
        measured("prm", report, lambda: check_prm(model_dir, precision))
        measured("rl_step", report, lambda: check_rl_step(work / "sft", work, precision, python_tool))
        report["colocation"] = colocation(n_params)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["imported"] = sorted(m for m in ORCHESTRATION if sys.modules.get(m) is not None)  # by anyone (DeepSpeed tries mlflow)
    report["ok"] = all(math.isfinite(v) for v in report["sft"]["losses"] + report["prm"]["losses"] + [report["rl_step"]["loss"]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"device-check: {'ok' if report['ok'] else 'FAILED'} on {report['device']} ({precision}) -> {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
