"""An HTTP search server speaking Search-R1's retrieval contract, over an index built by the `index` stage.

    UNISON_SEARCH_TOKEN=... python -m unison.tools.search_server --index data/index --port 8000 \\
        --token-env UNISON_SEARCH_TOKEN

`POST /retrieve` {"queries": [...], "topk": k, "return_scores": true}
  -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...] per query]}
  (bare documents when return_scores is false, as AFM's server answers). Documents are wiki-18 corpus rows, contents =
  '"Title"\\ntext', and the answer is byte for byte what Search-R1's and AFM's servers send for the same hits, so their
  clients (Search-R1, verl's SearchTool, AFM, GAP) work against this server as they do against theirs.
`GET /health` -> {"status": "ok", "count": N, "encoder": ..., "kind": ..., "dim": ...}.

Closed by default: it binds 127.0.0.1, and any other address needs a token. With `--token-env VAR` every request must
carry `Authorization: Bearer <$VAR>` (compared in constant time; 401 otherwise). A body over `max_body_bytes` is
answered 413 as soon as that many bytes arrived (whatever Content-Length says), a body not received within
`body_timeout_s` 408, a malformed one or one over the bounds on queries, their length and `topk` 422 with pydantic's
description of what is wrong. A connection that has not sent a whole request head within `head_timeout_s` is closed,
so slow clients hold no connection for long, and beyond `max_connections` requests are answered 503.
"""
# No `from __future__ import annotations`: FastAPI must see the route's body type, a class made in create_app, as a
# class.

import argparse
import asyncio
import hmac
import ipaddress
import os
import sys
from typing import Annotated

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import layout
from .retrieval import Retriever

MAX_TOPK = 50
MAX_QUERIES = 64
MAX_QUERY_CHARS = 2000
MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 10.0
HEAD_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 128


def request_model(max_topk: int, max_queries: int, max_query_chars: int) -> type[BaseModel]:
    """The /retrieve body, with these bounds."""

    class RetrieveRequest(BaseModel):
        queries: list[Annotated[str, Field(max_length=max_query_chars)]] = Field(min_length=1, max_length=max_queries)
        topk: int | None = Field(default=None, ge=1, le=max_topk)
        return_scores: bool = False

    return RetrieveRequest


class Guard:
    """ASGI middleware run before routing: the bearer token (401), then the body read with a cap (413) and a deadline
    (408); the app gets the body replayed from memory."""

    def __init__(self, app, token: str | None, max_body_bytes: int, body_timeout_s: float):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await JSONResponse({"detail": "missing or wrong bearer token"}, 401,
                                      {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if int(headers.get(b"content-length", b"0")) > self.max_body_bytes:  # the server checked it is a number
            return await self.refuse(413, scope, receive, send)
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                return await self.refuse(408, scope, receive, send)
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await self.refuse(413, scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    async def refuse(self, status: int, scope, receive, send):
        detail = {413: f"request body over {self.max_body_bytes} bytes",
                  408: f"request body not received within {self.body_timeout_s} s"}[status]
        await JSONResponse({"detail": detail}, status, {"Connection": "close"})(scope, receive, send)


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head is not complete within HEAD_TIMEOUT_S of
    connecting or of the last response (uvicorn's keep-alive timer restarts on every byte, so a trickle kept it
    open)."""

    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # first: the next head may already be buffered, and parsing it replaces self.scope
        super().on_response_complete()

    def _arm(self) -> None:
        waiting_for = self.scope  # replaced when the next request head has been parsed

        def expire():
            if self.scope is waiting_for and not self.transport.is_closing():
                self.transport.close()

        self.loop.call_later(self.head_timeout_s, expire)


def create_app(retriever: Retriever, token: str | None = None, max_topk: int = MAX_TOPK, max_queries: int = MAX_QUERIES,
               max_query_chars: int = MAX_QUERY_CHARS, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app; `token` (None: no auth) and the bounds as in the module's docstring. No /docs or /openapi.json."""
    app = FastAPI(title="unison search", docs_url=None, redoc_url=None, openapi_url=None)
    RetrieveRequest = request_model(max_topk, max_queries, max_query_chars)

    @app.get("/health")
    def health() -> dict:
        meta = retriever.meta
        return {"status": "ok", "count": meta["count"], "encoder": meta["encoder"], "kind": meta["kind"],
                "dim": meta["dim"]}

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict:  # sync: FastAPI runs it in its thread pool
        result = []
        for hits in retriever.search(request.queries, request.topk):
            documents = [{"id": h["id"], "contents": f'"{h["title"]}"\n{h["text"]}'} for h in hits]
            if request.return_scores:
                result.append([{"document": d, "score": h["score"]} for d, h in zip(documents, hits)])
            else:
                result.append(documents)
        return {"result": result}

    app.add_middleware(Guard, token=token, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    return app


def server_config(app, host: str = "127.0.0.1", port: int = 8000, max_connections: int = MAX_CONNECTIONS,
                  head_timeout_s: float = HEAD_TIMEOUT_S) -> uvicorn.Config:
    """uvicorn settings that keep slow or many clients from holding the server (HeadDeadline, limit_concurrency)."""
    protocol = type("HeadDeadline", (HeadDeadline,), {"head_timeout_s": head_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, timeout_keep_alive=5,
                          limit_concurrency=max_connections, log_level="warning")


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--index", default=layout.INDEX, help="index directory written by the index stage")
    parser.add_argument("--host", default="127.0.0.1", help="an address other than loopback needs --token-env")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="default k when a request gives none")
    parser.add_argument("--token-env", default="",
                        help="environment variable holding the bearer token clients must send")
    parser.add_argument("--max-topk", type=int, default=MAX_TOPK)
    parser.add_argument("--max-queries", type=int, default=MAX_QUERIES, help="queries per request")
    parser.add_argument("--max-query-chars", type=int, default=MAX_QUERY_CHARS)
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, help="beyond this, requests get 503")
    args = parser.parse_args()
    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        sys.exit(f"search server: --token-env {args.token_env}: that environment variable is not set")
    if not token and not loopback(args.host):
        sys.exit(f"search server: refusing to serve on {args.host} without a token; pass --token-env VAR")
    retriever = Retriever(args.index, topk=args.topk)
    app = create_app(retriever, token, args.max_topk, args.max_queries, args.max_query_chars, args.max_body_bytes)
    print(f"search server: {retriever.meta['count']} passages ({retriever.meta['kind']}) on "
          f"http://{args.host}:{args.port}{' (token required)' if token else ''}", flush=True)
    uvicorn.Server(server_config(app, args.host, args.port, args.max_connections)).run()


if __name__ == "__main__":
    main()
