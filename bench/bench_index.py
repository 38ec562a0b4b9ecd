"""Corpus and index at scale: a generated corpus shaped like wiki-18 (jsonl rows {id, contents}, 100-word passages)
through the download step's corpus conversion (unison/data/corpus.py), the index stage's build_index and a Retriever
over the result, each step of each size in a fresh process: passages/s and peak RSS, and how they grow from the
smallest size to the largest.

The encoder is `hash:<dim>` (character trigrams hashed into dim buckets; no model), and every report says so: the
demo's MiniLM would take hours for 1M passages on 2 CPU cores, and what is measured here is the pipeline around the
encoder (streaming, parquet, faiss, memory). With a real encoder the build's rate is the encoder's; its memory is the
same (dim 384 = MiniLM's, the default).
Prints a table and merges the figures into reports/bench.json under "index".

    python -m bench.bench_index [--sizes 100000,1000000] [--dim 384] [--kind flat] [--nlist 1024] [--workdir /tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.bench_rollout import git_commit, save_report

SYLLABLES = "ka lo mir tan vel os ri den sa qua bre nix tor el um pha".split()
QUERIES = 64  # passages' own texts, searched in batches of 8 (self-recall@1: each comes back first, read by its row)


def generate_corpus(path: Path, n: int, seed: int = 0) -> None:
    """`n` wiki-18-like rows: contents '"Title"\\nTitle' + 98 words, drawn from 4,352 made-up words of 2-3 syllables."""
    vocab = [a + b for a in SYLLABLES for b in SYLLABLES] + [a + b + c for a in SYLLABLES for b in SYLLABLES for c in SYLLABLES]
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, n, 10_000):
            for i, words in enumerate(rng.integers(0, len(vocab), size=(min(10_000, n - start), 100)), start):
                title = f"{vocab[words[0]].title()} {vocab[words[1]].title()}"
                f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{title} ' + " ".join(vocab[w] for w in words[2:])}) + "\n")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_step(step: str, folder: Path, args) -> dict:
    """One step in this process (the child's side); its figures."""
    from unison.data.corpus import corpus_tables, write_corpus
    from unison.tools.retrieval import Retriever, build_index

    t0 = time.perf_counter()
    if step == "imports":
        import faiss  # noqa: F401  (what every step loads before it starts)
        return {"peak_rss_mb": peak_rss_mb()}
    if step == "convert":
        n = write_corpus(corpus_tables(folder / "wiki-18.jsonl"), folder / "corpus.parquet")
        seconds = time.perf_counter() - t0
        return {"passages": n, "seconds": round(seconds, 2), "passages_per_s": round(n / seconds), "peak_rss_mb": peak_rss_mb(),
                "parquet_mb": round((folder / "corpus.parquet").stat().st_size / 2**20, 1)}
    if step == "index":
        meta = build_index(folder / "corpus.parquet", folder / "index", encoder=f"hash:{args.dim}", kind=args.kind, nlist=args.nlist)
        seconds = time.perf_counter() - t0
        return {"passages": meta["count"], "seconds": round(seconds, 2), "passages_per_s": round(meta["count"] / seconds),
                "embed_seconds": meta["embed_seconds"], "peak_rss_mb": peak_rss_mb(),
                "index_faiss_mb": round((folder / "index" / "index.faiss").stat().st_size / 2**20, 1)}
    retriever = Retriever(folder / "index", topk=3)
    load_seconds = time.perf_counter() - t0
    rows = np.random.default_rng(1).choice(len(retriever.passages), QUERIES, replace=False)
    wanted = retriever.passages.get([int(r) for r in rows])
    queries = [f"{p['title']}\n{p['text']}" for p in wanted]  # what was embedded: the top hit is that passage, if rows map right
    t1 = time.perf_counter()
    tops = [hits[0]["id"] for i in range(0, QUERIES, 8) for hits in retriever.search(queries[i:i + 8])]
    search_seconds = time.perf_counter() - t1
    return {"load_seconds": round(load_seconds, 2), "ms_per_query": round(1000 * search_seconds / QUERIES, 2),
            "self_recall_at_1": sum(top == p["id"] for top, p in zip(tops, wanted)) / QUERIES, "peak_rss_mb": peak_rss_mb()}


def child(step: str, folder: Path, args) -> dict:
    """Run `step` in a fresh interpreter (so its peak RSS is its own); its figures."""
    cmd = [sys.executable, "-m", "bench.bench_index", "--step", step, "--folder", str(folder), "--dim", str(args.dim),
           "--kind", args.kind, "--nlist", str(args.nlist)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def format_table(result: dict) -> str:
    lines = [f"encoder {result['encoder']}, {result['kind']} index; each step a fresh process "
             f"(baseline RSS after imports {result['baseline_rss_mb']:.0f} MB)",
             "| passages | convert passages/s | convert peak RSS MB | index passages/s | index peak RSS MB | index.faiss MB "
             "| search ms/query | self-recall@1 | search peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for s in result["sizes"]:
        c, i, q = s["convert"], s["index"], s["search"]
        lines.append(f"| {s['passages']:,} | {c['passages_per_s']:,} | {c['peak_rss_mb']:.0f} | {i['passages_per_s']:,} | "
                     f"{i['peak_rss_mb']:.0f} | {i['index_faiss_mb']:.0f} | {q['ms_per_query']} | {q['self_recall_at_1']:.2f} | "
                     f"{q['peak_rss_mb']:.0f} |")
    g = result["growth"]
    lines.append(f"growth {g['from']:,} -> {g['to']:,} passages: " + "; ".join(
        f"{step} peak RSS +{g[step]['rss_mb']:.0f} MB ({g[step]['bytes_per_passage']:.0f} B a passage)"
        for step in ("convert", "index", "search")) + f"; index.faiss +{g['index_faiss_mb']:.0f} MB")
    return "\n".join(lines)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,1000000", help="corpus sizes, passages, comma-separated")
    parser.add_argument("--dim", type=int, default=384, help="hash encoder dimensions (384 = MiniLM's)")
    parser.add_argument("--kind", default="flat", choices=("flat", "ivf", "hnsw"))
    parser.add_argument("--nlist", type=int, default=1024, help="ivf lists")
    parser.add_argument("--workdir", default=None, help="where the corpora and indexes are written (deleted afterwards)")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # the child's side
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(run_step(args.step, Path(args.folder), args)), flush=True)
        return {}

    sizes, load_start = sorted(int(s) for s in args.sizes.split(",")), os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_index.") as tmp:
        baseline = child("imports", Path(tmp), args)["peak_rss_mb"]
        runs = []
        for n in sizes:
            folder = Path(tmp) / str(n)
            folder.mkdir()
            print(f"bench_index: generating {n:,} passages", flush=True)
            generate_corpus(folder / "wiki-18.jsonl", n)
            run = {"passages": n, "jsonl_mb": round((folder / "wiki-18.jsonl").stat().st_size / 2**20, 1)}
            for step in ("convert", "index", "search"):
                print(f"bench_index: {step}, {n:,} passages", flush=True)
                run[step] = child(step, folder, args)
            runs.append(run)
            shutil.rmtree(folder)  # the next size needs the disk
    first, last = runs[0], runs[-1]
    growth = {"from": first["passages"], "to": last["passages"],
              "index_faiss_mb": last["index"]["index_faiss_mb"] - first["index"]["index_faiss_mb"]}
    for step in ("convert", "index", "search"):
        rss = last[step]["peak_rss_mb"] - first[step]["peak_rss_mb"]
        growth[step] = {"rss_mb": round(rss, 1), "bytes_per_passage": round(rss * 2**20 / max(1, last["passages"] - first["passages"]), 1)}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
              "machine": {"cpus_usable": len(os.sched_getaffinity(0)), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
              "encoder": f"hash:{args.dim} (character-trigram hashing, no model: measures the pipeline, not an encoder)",
              "kind": args.kind, "nlist": args.nlist if args.kind == "ivf" else None, "baseline_rss_mb": baseline,
              "sizes": runs, "growth": growth}
    print(format_table(result), flush=True)
    save_report(result, key="index")
    print("bench_index: wrote reports/bench.json (key 'index')", flush=True)
    return result


if __name__ == "__main__":
    main()
