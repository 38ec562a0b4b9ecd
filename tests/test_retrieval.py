"""The search tool: index build (flat / ivf / hnsw), in-process and HTTP retrieval, with the real encoder and faiss."""
from __future__ import annotations

import hashlib
import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from unison.config import ToolsConfig
from unison.data.schemas import DataError
from unison.tools.retrieval import (
    KINDS,
    RemoteRetriever,
    Retriever,
    build_index,
    format_passages,
    make_retriever,
    title_recall_at_1,
)
from unison.tools.search_server import create_app, server_config

from .local_http import free_port, uvicorn_serving

NAMES = ["Velmora", "Quillon", "Brastow", "Ishkar", "Tolvane", "Meridan", "Oskeby", "Praxil", "Caudrel", "Zennith"]
PLACES = ["abbey", "bridge", "harbour", "observatory", "library", "vineyard", "lighthouse", "foundry", "theatre", "garden"]


def invented_passages(n: int = 50) -> list[dict]:
    """Passages about invented places; titles share words with each other, so ranking has to be right."""
    rows = []
    for i in range(n):
        name, place = NAMES[i % 10], PLACES[(i // 10 + i) % 10]
        title = f"{name} {place.title()}"
        text = (f"The {title} is a {place} built in {1700 + 7 * i} by the engineer {NAMES[(i * 3) % 10]} Holt. "
                f"It is known for its {['red', 'blue', 'green', 'white', 'black'][i % 5]} stone and hosts "
                f"{i + 2} visitors each day.")
        rows.append({"id": f"p{i:03d}", "title": title, "text": text})
    return rows


PASSAGES = invented_passages()


def write_corpus(path: Path, rows: list[dict]) -> Path:
    schema = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.parquet", PASSAGES)


@pytest.fixture(scope="module")
def index_dirs(corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("indexes")
    for kind in KINDS:
        build_index(corpus, root / kind, kind=kind, nlist=8, nprobe=4, hnsw_m=16)
    return {kind: root / kind for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_title_query_ranks_its_own_passage_first(index_dirs, kind):
    retriever = Retriever(index_dirs[kind], topk=3)
    results = retriever.search([p["title"] for p in PASSAGES])
    assert [hits[0]["id"] for hits in results] == [p["id"] for p in PASSAGES]
    for hits, passage in zip(results, PASSAGES):
        assert len(hits) == 3 and hits[0] == {**passage, "score": hits[0]["score"]}
        assert hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]
    assert title_recall_at_1(retriever, sample=20) == 1.0


def test_meta_and_passages_files(index_dirs, corpus):
    meta = json.loads((index_dirs["ivf"] / "meta.json").read_text())
    assert meta["encoder"] == "builtin:all-minilm-l6-v2" and meta["kind"] == "ivf"
    assert (meta["dim"], meta["count"], meta["nlist"], meta["nprobe"]) == (384, 50, 8, 4)
    assert meta["corpus_sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert meta["query_prefix"] == meta["passage_prefix"] == ""
    assert "build_seconds" not in meta  # timings are metrics: the index files depend on the corpus and params only
    assert pq.read_table(index_dirs["ivf"] / "passages.parquet").to_pylist() == PASSAGES
    hnsw = Retriever(index_dirs["hnsw"])
    assert (hnsw.meta["hnsw_m"], hnsw.meta["hnsw_ef_search"], hnsw.index.hnsw.efSearch) == (16, 64, 64)


@pytest.mark.parametrize("kind", KINDS)
def test_rebuild_gives_identical_index_and_results(index_dirs, corpus, tmp_path, kind):
    queries = ["Velmora engineer", "a green stone theatre", "Oskeby Harbour"]
    before = Retriever(index_dirs[kind], topk=5).search(queries)
    again = tmp_path / "index"
    build_index(corpus, again, kind=kind, nlist=8, nprobe=4, hnsw_m=16)
    for name in ("index.faiss", "meta.json", "passages.parquet"):  # DVC caches the same output for the same inputs
        assert (again / name).read_bytes() == (index_dirs[kind] / name).read_bytes(), name
    assert Retriever(again, topk=5).search(queries) == before


def test_rebuild_replaces_the_index_dir_in_place(corpus, tmp_path):
    build_index(corpus, tmp_path / "index")
    (tmp_path / "index" / "stale.txt").write_text("from an older build")
    build_index(corpus, tmp_path / "index")
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["index.faiss", "meta.json", "passages.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # no temp or old dirs left behind


def test_concurrent_searches_match_sequential(index_dirs):
    queries = [[p["title"]] for p in PASSAGES[:16]]
    sequential = [Retriever(index_dirs["hnsw"], topk=2).search(q) for q in queries]
    with ThreadPoolExecutor(8) as pool:  # a fresh retriever: nothing cached
        assert list(pool.map(Retriever(index_dirs["hnsw"], topk=2).search, queries)) == sequential


def test_a_repeated_search_is_answered_from_the_cache(index_dirs):
    retriever = Retriever(index_dirs["flat"], topk=2)
    encoded = []
    encode = retriever.encoder.encode
    retriever.encoder = type("CountingEncoder", (), {"encode": lambda self, texts: encoded.append(texts) or encode(texts)})()
    first = retriever.search(["Praxil", "Tolvane Garden"])
    first[0][0]["title"] = "edited by the caller"
    again = retriever.search(["Praxil", "Tolvane Garden"])
    assert encoded == [["Praxil", "Tolvane Garden"]]  # the second call ran no encoder
    assert again == Retriever(index_dirs["flat"], topk=2).search(["Praxil", "Tolvane Garden"])  # and is unedited
    retriever.search(["Praxil"])  # another call (one query, not the pair): encoded on its own
    retriever.search(["Praxil"], topk=1)  # another k
    assert encoded[1:] == [["Praxil"], ["Praxil"]]


def test_the_cache_keeps_only_the_most_recent_calls(index_dirs):
    retriever = Retriever(index_dirs["flat"], topk=1)
    retriever.CACHE_SIZE = 2
    for q in ("a", "b", "a", "c"):  # "b" is least recently used when "c" arrives
        retriever.search([q])
    assert [key[0] for key in retriever._cache] == [("a",), ("c",)]
    retriever.clear_cache()
    assert not retriever._cache


def test_the_cache_is_bounded_in_bytes_too(index_dirs):
    sizes = Retriever(index_dirs["flat"], topk=2)
    for q in ("bcd", "cde"):
        sizes.search([q])
    assert all(size > 2 * 256 for _, size in sizes._cache.values())  # the hits' dicts and their passages' text count
    retriever = Retriever(index_dirs["flat"], topk=2)
    retriever.CACHE_BYTES = sum(size for _, size in sizes._cache.values())  # room for those two calls only
    for q in ("abc", "bcd", "cde"):
        retriever.search([q])
    assert [key[0] for key in retriever._cache] == [("bcd",), ("cde",)] and retriever._cache_bytes == retriever.CACHE_BYTES
    retriever.search(["x" * retriever.CACHE_BYTES])  # larger than the whole cache: answered, not remembered
    assert [key[0] for key in retriever._cache] == [("bcd",), ("cde",)]


def test_topk_is_capped_and_empty_batch(index_dirs):
    retriever = Retriever(index_dirs["flat"], topk=2)
    assert retriever.search([]) == []
    assert len(retriever.search(["Praxil"], topk=500)[0]) == 50


def test_observation_format_truncates_each_passage(index_dirs):
    retriever = Retriever(index_dirs["flat"], topk=2, max_chars=20)
    first, second = retriever.search(["Ishkar Library"])[0]
    assert retriever.observation("Ishkar Library") == (
        f"Doc 1 (Title: {first['title']})\n{first['text'][:20]}\nDoc 2 (Title: {second['title']})\n{second['text'][:20]}")
    assert format_passages([{"title": "T", "text": "abc"}], 300) == "Doc 1 (Title: T)\nabc"


def test_explicit_prefixes_are_recorded_and_used(corpus, tmp_path):
    meta = build_index(corpus, tmp_path / "idx", query_prefix="query: ", passage_prefix="passage: ")
    assert (meta["query_prefix"], meta["passage_prefix"]) == ("query: ", "passage: ")
    retriever = Retriever(tmp_path / "idx", topk=1)
    model = retriever.encoder.model
    stored = retriever.index.reconstruct(0)
    expected = model.encode(f"passage: {PASSAGES[0]['title']}\n{PASSAGES[0]['text']}", normalize_embeddings=True)
    assert stored == pytest.approx(expected, abs=1e-5)
    expected = model.encode("query: Tolvane Garden", normalize_embeddings=True)
    assert retriever.encoder.encode(["Tolvane Garden"])[0] == pytest.approx(expected, abs=1e-5)


def test_bad_corpora_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="no rows"):
        build_index(write_corpus(tmp_path / "empty.parquet", []), tmp_path / "idx")
    with pytest.raises(DataError, match="row 1, field 'id'.*duplicate"):
        build_index(write_corpus(tmp_path / "dup.parquet", [PASSAGES[0], PASSAGES[0]]), tmp_path / "idx")
    pq.write_table(pa.Table.from_pylist([{"id": "a", "text": "t"}]), tmp_path / "notitle.parquet")
    with pytest.raises(DataError, match="field 'title'"):
        build_index(tmp_path / "notitle.parquet", tmp_path / "idx")
    with pytest.raises(DataError, match="no index here"):
        Retriever(tmp_path / "idx")
    assert not (tmp_path / "idx").exists()


# ---------------------------------------------------------------- HTTP server


@contextmanager
def serving(app, port: int | None = None, **config):
    """The search server's app under uvicorn in a thread, with the CLI's settings (server_config), on a free port or
    `port`; yields the uvicorn.Server and its URL, and stops it afterwards."""
    port = port or free_port()
    with uvicorn_serving(server_config(app, port=port, **config)) as uv:
        yield uv, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def retriever(index_dirs):
    return Retriever(index_dirs["flat"], topk=2)


@pytest.fixture(scope="module")
def server(retriever):
    with serving(create_app(retriever)) as (_, url):
        yield url


def test_health(server):
    assert requests.get(server + "/health").json() == {
        "status": "ok", "count": 50, "encoder": "builtin:all-minilm-l6-v2", "kind": "flat", "dim": 384}


def test_retrieve_with_and_without_scores(server):
    body = {"queries": ["Meridan Vineyard", "Caudrel Bridge"], "topk": 3, "return_scores": True}
    scored = requests.post(server + "/retrieve", json=body).json()["result"]
    assert [len(hits) for hits in scored] == [3, 3]
    top = scored[0][0]
    assert 0 < top["score"] <= 1.0001 and set(top["document"]) == {"id", "contents"}  # wiki-18's rows: no title field
    passage = next(p for p in PASSAGES if p["id"] == top["document"]["id"])
    assert top["document"]["contents"] == f'"Meridan Vineyard"\n{passage["text"]}'
    bare = requests.post(server + "/retrieve", json={**body, "return_scores": False}).json()["result"]
    assert bare == [[hit["document"] for hit in hits] for hits in scored]
    default_k = requests.post(server + "/retrieve", json={"queries": ["Oskeby"]}).json()["result"]
    assert len(default_k[0]) == 2 and "score" not in default_k[0][0]  # server's --topk; return_scores defaults off


@pytest.mark.parametrize("body", [{}, {"queries": "Velmora"}, {"queries": []}, {"queries": ["x"], "topk": 0},
                                  {"queries": [1, None]}])
def test_bad_request_is_422_with_a_message(server, body):
    response = requests.post(server + "/retrieve", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["msg"]


def test_remote_retriever_equals_in_process(server, index_dirs):
    queries = [p["title"] for p in PASSAGES[::5]] + ["who built the black stone foundry?"]
    local = Retriever(index_dirs["flat"], topk=3).search(queries)
    remote = make_retriever("unused", ToolsConfig(search_url=server, search_topk=3, search_max_chars=300))
    assert isinstance(remote, RemoteRetriever)
    got = remote.search(queries)
    assert [[h["id"] for h in hits] for hits in got] == [[h["id"] for h in hits] for hits in local]
    for remote_hits, local_hits in zip(got, local):
        for r, l in zip(remote_hits, local_hits):
            assert (r["title"], r["text"]) == (l["title"], l["text"]) and r["score"] == pytest.approx(l["score"], abs=1e-5)
    assert isinstance(make_retriever(index_dirs["flat"], ToolsConfig(search_url="")), Retriever)


def test_remote_retriever_gives_up_on_a_dead_server():
    dead = RemoteRetriever(f"http://127.0.0.1:{free_port()}", timeout=1, retries=1)
    with pytest.raises(RuntimeError, match="failed after 2 attempts"):
        dead.search(["anything"])
    assert dead.stats == {"requests": 1, "retries": 1, "failures": 1}


def test_remote_retriever_counts_a_search_server_going_down_mid_run_and_coming_back(retriever):
    port = free_port()
    remote = RemoteRetriever(f"http://127.0.0.1:{port}", topk=1, timeout=2, retries=2, backoff_s=0.05)
    with serving(create_app(retriever), port):
        assert remote.search(["Praxil Theatre"])[0][0]["title"] == "Praxil Theatre"
    with pytest.raises(RuntimeError, match=rf"POST http://127.0.0.1:{port}/retrieve failed after 3 attempts: connection failed"):
        remote.search(["Praxil Theatre"])  # the server is gone: retried, then reported
    with serving(create_app(retriever), port):  # back on the same address: the next call works again
        assert remote.search(["Oskeby Lighthouse"])[0][0]["title"] == "Oskeby Lighthouse"
    assert remote.stats == {"requests": 3, "retries": 2, "failures": 1}


# ---------------------------------------------------------------- the server closed by default

TOKEN = f"st-{uuid.uuid4().hex}"
LIMITS = {"max_topk": 5, "max_queries": 4, "max_query_chars": 50, "max_body_bytes": 4096, "body_timeout_s": 0.5}


@pytest.fixture(scope="module")
def guarded(retriever):
    """A search server that wants TOKEN, with small bounds and a 0.5 s deadline for a request head and body."""
    with serving(create_app(retriever, TOKEN, **LIMITS), head_timeout_s=0.5) as (_, url):
        yield url


def bearer(token: str = TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_the_token_is_required(guarded):
    body = {"queries": ["Praxil Theatre"]}
    assert requests.post(guarded + "/retrieve", json=body).status_code == 401
    assert requests.post(guarded + "/retrieve", json=body, headers=bearer(TOKEN[:-1])).status_code == 401
    assert requests.get(guarded + "/health", headers=bearer("x" + TOKEN)).status_code == 401
    assert requests.get(guarded + "/openapi.json", headers=bearer()).status_code == 404  # no schema or docs pages
    answer = requests.post(guarded + "/retrieve", json=body, headers=bearer()).json()
    assert answer["result"][0][0]["contents"].startswith('"Praxil Theatre"\n')


@pytest.mark.parametrize("body", [{"queries": ["x"], "topk": 6}, {"queries": ["q1", "q2", "q3", "q4", "q5"]},
                                  {"queries": ["ok", "x" * 51]}])
def test_topk_queries_and_query_length_are_bounded(guarded, body):
    response = requests.post(guarded + "/retrieve", json=body, headers=bearer())
    assert response.status_code == 422 and response.json()["detail"][0]["msg"]


def raw_request(url: str, head: str, body: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(head.encode() + body)
    return sock


def status_of(sock: socket.socket) -> int:
    with sock:
        return int(sock.recv(65536).split(b" ", 2)[1])


def test_a_large_body_is_413_before_it_is_read(guarded):
    auth = f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
    # announced: refused on the header, before any of the gigabyte is sent
    assert status_of(raw_request(guarded, f"POST /retrieve HTTP/1.1\r\nHost: t\r\n{auth}Content-Length: 1000000000\r\n\r\n")) == 413
    # not announced (chunked): refused once 4097 bytes arrived, the end of the body never sent
    chunk = b"1001\r\n" + b"x" * 0x1001 + b"\r\n"
    assert status_of(raw_request(guarded, f"POST /retrieve HTTP/1.1\r\nHost: t\r\n{auth}Transfer-Encoding: chunked\r\n\r\n", chunk)) == 413


def test_a_body_that_never_arrives_is_408(guarded):
    t0 = time.perf_counter()
    sock = raw_request(guarded, f"POST /retrieve HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n",
                       b'{"queries": ')
    assert status_of(sock) == 408 and 0.4 < time.perf_counter() - t0 < 3


def test_a_slow_client_does_not_block_others_and_is_dropped(guarded):
    """A client trickling its request head a byte at a time (uvicorn's keep-alive timer restarts on every byte)."""
    head = f"POST /retrieve HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
    sock = raw_request(guarded, head[:10])
    t0 = time.perf_counter()
    dropped = None
    with sock:
        for byte in head[10:]:
            t1 = time.perf_counter()
            answer = requests.post(guarded + "/retrieve", json={"queries": ["Praxil Theatre"]}, headers=bearer(), timeout=5)
            assert answer.status_code == 200 and time.perf_counter() - t1 < 1.5  # others are served meanwhile
            try:
                sock.sendall(byte.encode())
                time.sleep(0.1)
                sock.settimeout(0.01)
                if sock.recv(1) == b"":
                    dropped = time.perf_counter() - t0
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                dropped = time.perf_counter() - t0
                break
    assert dropped is not None and 0.4 < dropped < 3, dropped  # closed at the 0.5 s head deadline, not kept alive


def test_remote_retriever_sends_the_token_from_the_named_variable(guarded, monkeypatch):
    tools = ToolsConfig(search_url=guarded, search_topk=1, search_token_env="UNISON_TEST_SEARCH_TOKEN")
    with pytest.raises(ValueError, match="tools.search_token_env: the environment variable UNISON_TEST_SEARCH_TOKEN is not set"):
        make_retriever("unused", tools)
    monkeypatch.setenv("UNISON_TEST_SEARCH_TOKEN", TOKEN)
    assert make_retriever("unused", tools).search(["Praxil Theatre"])[0][0]["title"] == "Praxil Theatre"
    with pytest.raises(RuntimeError, match="HTTP 401"):  # a 4xx is not retried
        RemoteRetriever(guarded).search(["Praxil Theatre"])
