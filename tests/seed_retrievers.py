"""Small servers that answer byte for byte as the seed systems' retrieval servers do (FastAPI apps, as theirs are), over
a ranking function the test supplies: the HTTP contract is theirs, the retriever behind it is a test's.

Their contracts, read from the code (docs/seeds.md#afms-tools, #et-agents-training-settings):
- Search-R1 `search_r1/search/retrieval_server.py` (PeterGriffinJin/Search-R1@a14dc3a) and AFM's copy of it
  `AFM/tool_servers/wiki_server/wiki_rag_server.py` (OPPO-PersonalAI/Agent_Foundation_Models@8f94516; GAP uses the same):
  `POST /retrieve` {queries: [str], topk: int | null (null: the server's --topk, 3), return_scores: bool = false} ->
  {"result": [[{"document": <corpus row>, "score": float}, ...] per query]}, or the bare corpus rows per query when
  return_scores is false (AFM; Search-R1's own server then fails with HTTP 500 unless there are exactly two queries).
  A corpus row is the jsonl record as `datasets` loads it: wiki-18's `{"id": "0", "contents": "\"Title\"\ntext"}`.
- FlashRAG's server as ET-Agent and ARPO run it, `retriever/host_wiki.py` (asilverlight/ET-Agent@3351775):
  `POST /search` {query: str, top_n: int = 10, return_score: bool = false} -> [Document] or [[Document], [float]] (400
  on an empty query); `POST /batch_search` {query: [str], top_n, return_score} -> [[Document] per query] or
  [[[Document] per query], [[float] per query]]; Document = {id: str, contents: str} (a response model: other columns
  are dropped); `GET /health` -> {"status": "healthy", "retrievers": {"total": n, "available": n}}. Clients batch, so
  only /batch_search is served here.
No AgentFlow code serves retrieval (its search tools call Google, Wikipedia and web APIs); the FlashRAG server the seeds
run is ET-Agent's.
"""
# No `from __future__ import annotations`: FastAPI must see the request models, classes made inside the app builders.
from typing import Callable, List, Optional, Tuple, Union

from fastapi import FastAPI
from pydantic import BaseModel

# rank(queries, k) -> (corpus rows per query, scores per query), best first
Rank = Callable[[list[str], int], tuple[list[list[dict]], list[list[float]]]]


def search_r1_app(rank: Rank, default_topk: int = 3, requests: list | None = None) -> FastAPI:
    """Search-R1's /retrieve as AFM's wiki server answers it; every request body is appended to `requests`."""
    app = FastAPI()

    class QueryRequest(BaseModel):
        queries: List[str]
        topk: Optional[int] = None
        return_scores: bool = False

    @app.post("/retrieve")
    def retrieve(request: QueryRequest):
        if requests is not None:
            requests.append(request.model_dump())
        rows, scores = rank(request.queries, request.topk or default_topk)
        if request.return_scores:
            return {"result": [[{"document": row, "score": score} for row, score in zip(hits, hit_scores)]
                               for hits, hit_scores in zip(rows, scores)]}
        return {"result": rows}

    return app


def flashrag_app(rank: Rank, requests: list | None = None) -> FastAPI:
    """FlashRAG's /batch_search as ET-Agent's host_wiki.py answers it."""
    app = FastAPI()

    class Document(BaseModel):
        id: str
        contents: str

    class BatchQueryRequest(BaseModel):
        query: List[str]
        top_n: int = 10
        return_score: bool = False

    def documents(rows: list[dict]) -> list[Document]:
        return [Document(id=str(row["id"]), contents=row["contents"]) for row in rows]

    @app.post("/batch_search", response_model=Union[List[List[Document]], Tuple[List[List[Document]], List[List[float]]]])
    async def batch_search(request: BatchQueryRequest):
        if requests is not None:
            requests.append(request.model_dump())
        rows, scores = rank(request.query, request.top_n)
        hits = [documents(r) for r in rows]
        return (hits, scores) if request.return_score else hits

    return app
