"""Stage `index`: embed the retrieval corpus and build the faiss index (data/raw/corpus.parquet -> data/index/)."""
from __future__ import annotations

from unison import track
from unison.data.schemas import write_json
from unison.params import stage_params
from unison.tools.retrieval import Retriever, build_index, title_recall_at_1

CORPUS = "data/raw/corpus.parquet"
INDEX_DIR = "data/index"
METRICS = "reports/index.json"


def main() -> None:
    params = stage_params("index")
    with track.stage_run("index", params) as run:
        meta = build_index(
            CORPUS, INDEX_DIR,
            encoder=params["encoder"], kind=params["kind"], nlist=params["nlist"], nprobe=params["nprobe"],
            hnsw_m=params["hnsw_m"], hnsw_ef_search=params["hnsw_ef_search"], batch_size=params["batch_size"], query_prefix=params.get("query_prefix"),
            passage_prefix=params.get("passage_prefix"), seed=params["seed"],
        )
        recall = title_recall_at_1(Retriever(INDEX_DIR, topk=1), params["recall_sample"], params["seed"])
        metrics = {"count": meta["count"], "dim": meta["dim"], "embed_seconds": meta["embed_seconds"],
                   "build_seconds": meta["build_seconds"],
                   "title_recall_at_1": recall}
        write_json(metrics, METRICS)
        run.log_metrics(metrics)
        print(f"index: title recall@1 {recall:.3f} on {min(params['recall_sample'], meta['count'])} passages", flush=True)


if __name__ == "__main__":
    main()
