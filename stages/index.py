"""Stage `index`: embed the retrieval corpus and build the faiss index (data/raw/corpus.parquet -> data/index/)."""
from __future__ import annotations

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import write_json
from unison.tools.retrieval import Retriever, build_index, title_recall_at_1

CORPUS = layout.CORPUS
METRICS = layout.report("index")


def main() -> None:
    params = load_params()
    p = params.index
    with track.stage_run("index", {"seed": params.seed, **p.model_dump()}) as run:
        meta = build_index(CORPUS, layout.INDEX, encoder=p.encoder, kind=p.kind, nlist=p.nlist, nprobe=p.nprobe,
                           hnsw_m=p.hnsw_m, hnsw_ef_search=p.hnsw_ef_search, batch_size=p.batch_size,
                           query_prefix=p.query_prefix, passage_prefix=p.passage_prefix, seed=params.seed,
                           train_sample=p.train_sample)
        recall = title_recall_at_1(Retriever(layout.INDEX, topk=1), p.recall_sample, params.seed)
        metrics = {"count": meta["count"], "dim": meta["dim"], "embed_seconds": meta["embed_seconds"],
                   "build_seconds": meta["build_seconds"],
                   "title_recall_at_1": recall}
        write_json(metrics, METRICS)
        run.log_metrics(metrics)
        print(f"index: title recall@1 {recall:.3f} on {min(p.recall_sample, meta['count'])} passages", flush=True)


if __name__ == "__main__":
    stage_main("index", main)
