"""An HTTP search server speaking Search-R1's retrieval contract, over an index built by the `index` stage.

    python -m unison.tools.search_server --index data/index --host 127.0.0.1 --port 8000

`POST /retrieve` {"queries": [...], "topk": k, "return_scores": true}
  -> {"result": [[{"document": {"id", "title", "contents"}, "score": s}, ...] per query]}
  (bare documents when return_scores is false; contents = '"Title"\\ntext' as in Search-R1's wiki-18 corpus).
`GET /health` -> {"status": "ok", "count": N, "encoder": ..., "kind": ..., "dim": ...}.
A malformed body is answered 422 with pydantic's description of what is wrong.
"""
from __future__ import annotations

import argparse

from fastapi import FastAPI
from pydantic import BaseModel, Field

from .retrieval import Retriever


class RetrieveRequest(BaseModel):
    queries: list[str] = Field(min_length=1)
    topk: int | None = Field(default=None, ge=1)
    return_scores: bool = False


def create_app(retriever: Retriever) -> FastAPI:
    app = FastAPI(title="unison search")

    @app.get("/health")
    def health() -> dict:
        meta = retriever.meta
        return {"status": "ok", "count": meta["count"], "encoder": meta["encoder"], "kind": meta["kind"], "dim": meta["dim"]}

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict:  # sync: FastAPI runs it in its thread pool
        result = []
        for hits in retriever.search(request.queries, request.topk):
            documents = [{"id": h["id"], "title": h["title"], "contents": f'"{h["title"]}"\n{h["text"]}'} for h in hits]
            if request.return_scores:
                result.append([{"document": d, "score": h["score"]} for d, h in zip(documents, hits)])
            else:
                result.append(documents)
        return {"result": result}

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--index", default="data/index", help="index directory written by the index stage")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="default k when a request gives none")
    args = parser.parse_args()
    retriever = Retriever(args.index, topk=args.topk)
    print(f"search server: {retriever.meta['count']} passages ({retriever.meta['kind']}) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(create_app(retriever), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
