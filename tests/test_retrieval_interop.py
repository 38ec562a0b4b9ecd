"""Retrieval servers both ways: our client against servers that answer byte for byte as the seeds' do (Search-R1/AFM
/retrieve, FlashRAG /batch_search; tests/seed_retrievers.py), and Search-R1's clients against our search server.

A wiki-18-shaped corpus ({id, contents} jsonl) goes through the download step's corpus conversion and build_index (the
cheap `hash:128` encoder: the HTTP contract is what is tested, not the encoder); the seed servers rank with the same
faiss index, so every client must return exactly what the in-process Retriever does."""
from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import requests
import uvicorn

from unison.config import ToolsConfig
from unison.data.corpus import corpus_tables, write_corpus
from unison.tools.retrieval import RemoteRetriever, Retriever, build_index, make_retriever, retrieve_hits
from unison.tools.search_server import create_app

from .local_http import LocalServer, free_port, uvicorn_serving
from .seed_retrievers import flashrag_app, search_r1_app
from .test_retrieval import invented_passages, serving

QUERIES = ["Velmora Abbey", "who built the green stone theatre?", "Oskeby Harbour visitors"]


@contextmanager
def seed_server(app):
    """A seed system's app as it runs (`uvicorn.run(app, ...)`), on 127.0.0.1 and a free port; yields its URL."""
    port = free_port()
    with uvicorn_serving(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    """wiki-18 rows, the in-process Retriever over their index, and the seed servers' ranking over the same index."""
    root = tmp_path_factory.mktemp("wiki")
    rows = [{"id": str(i), "contents": f'"{p["title"]}"\n{p["text"]}'} for i, p in enumerate(invented_passages(40))]
    (root / "wiki-18.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    write_corpus(corpus_tables(root / "wiki-18.jsonl"), root / "corpus.parquet")
    build_index(root / "corpus.parquet", root / "index", encoder="hash:128")
    retriever = Retriever(root / "index", topk=3)

    def rank(queries: list[str], k: int):
        scores, ids = retriever.index.search(retriever.encoder.encode(queries), k)
        return [[rows[i] for i in row] for row in ids], [[float(s) for s in row] for row in scores]

    return SimpleNamespace(rows=rows, retriever=retriever, rank=rank)


def test_the_client_reads_search_r1_and_afm_answers(wiki):
    """Their documents are corpus rows {id, contents} with no title field (the client once failed on them with
    KeyError 'title'): the title is the first line of contents, unquoted."""
    sent = []
    with seed_server(search_r1_app(wiki.rank, requests=sent)) as url:
        raw = requests.post(url + "/retrieve", json={"queries": QUERIES[:1], "topk": 2, "return_scores": True}).json()
        assert raw["result"][0][0]["document"] in wiki.rows and set(raw["result"][0][0]["document"]) == {"id", "contents"}
        for address in (url, url + "/retrieve"):  # Search-R1's retriever.url names the route
            remote = make_retriever("unused", ToolsConfig(search_url=address, search_topk=3))
            assert remote.search(QUERIES) == wiki.retriever.search(QUERIES)  # ids, titles, texts and scores
            assert remote.search(QUERIES[:1], topk=1) == wiki.retriever.search(QUERIES[:1], topk=1)
    assert sent[1:] == [{"queries": QUERIES, "topk": 3, "return_scores": True},
                        {"queries": QUERIES[:1], "topk": 1, "return_scores": True}] * 2


def test_bare_documents_without_scores_are_read_too(wiki):
    with seed_server(search_r1_app(wiki.rank)) as url:
        body = {"queries": QUERIES, "topk": 2}
        bare = requests.post(url + "/retrieve", json={**body, "return_scores": False}).json()
        scored = requests.post(url + "/retrieve", json={**body, "return_scores": True}).json()
    assert bare["result"][0][0] in wiki.rows  # AFM: the corpus rows themselves
    assert retrieve_hits(bare, 3) == [[{**hit, "score": None} for hit in hits] for hits in retrieve_hits(scored, 3)]
    assert retrieve_hits(scored, 3) == wiki.retriever.search(QUERIES, topk=2)


def test_the_client_reads_flashrag_batch_search(wiki):
    sent = []
    with seed_server(flashrag_app(wiki.rank, requests=sent)) as url:
        raw = requests.post(url + "/batch_search", json={"query": QUERIES[:2], "top_n": 2, "return_score": True}).json()
        documents, scores = raw  # [[documents per query], [scores per query]]
        assert documents[0][0] in wiki.rows and isinstance(scores[0][0], float) and len(documents) == len(scores) == 2
        for address in (url, url + "/batch_search", url + "/search"):  # ET-Agent's client posts to /search
            remote = make_retriever("unused", ToolsConfig(search_url=address, search_api="flashrag", search_topk=3))
            assert remote.search(QUERIES) == wiki.retriever.search(QUERIES)
    assert sent[1:] == [{"query": QUERIES, "top_n": 3, "return_score": True}] * 3


@pytest.mark.parametrize("api, answer", [
    ("retrieve", {"result": [[{"document": {"id": "1", "title": "T"}, "score": 1.0}]]}),  # a document without contents
    ("retrieve", {"result": []}),  # no list of hits for the query
    ("flashrag", [[{"id": "1", "contents": "\"T\"\nx"}]]),  # documents without the scores
    ("flashrag", "<html>not json</html>"),
])
def test_a_malformed_answer_is_an_error_naming_the_server(api, answer):
    with LocalServer(lambda request: (200, answer, None)) as server:
        remote = RemoteRetriever(server.url, api=api, retries=0)
        with pytest.raises((ValueError, RuntimeError),  # not JSON at all: unison.http_client's HTTPFailure
                           match=rf"POST {server.url}/(retrieve|batch_search)(: unexpected answer| failed after 1 attempt: the answer is not JSON)"):
            remote.search(["q"])
    assert remote.stats == {"requests": 1, "retries": 0, "failures": 1}


def test_an_unknown_search_api_names_the_setting():
    with pytest.raises(ValueError, match=r"search_api\n  Input should be 'retrieve' or 'flashrag'"):  # the config's Literal
        ToolsConfig(search_api="serper")


def test_our_server_answers_byte_for_byte_as_search_r1(wiki):
    """Same hits, same bytes, with and without scores: Search-R1's clients (its generation loop, verl's SearchTool, AFM,
    GAP) read our server as they read theirs."""
    with serving(create_app(wiki.retriever)) as (_, ours), seed_server(search_r1_app(wiki.rank)) as theirs:
        for body in ({"queries": QUERIES, "topk": 3, "return_scores": True}, {"queries": QUERIES, "topk": 2}):
            mine, seed = (requests.post(url + "/retrieve", json=body) for url in (ours, theirs))
            assert (mine.status_code, mine.headers["content-type"]) == (seed.status_code, seed.headers["content-type"])
            assert mine.content == seed.content
        # as verl's search_r1_like_utils reads a hit: title = the first line of contents, the text the rest
        hit = requests.post(ours + "/retrieve", json={"queries": QUERIES[:1], "topk": 1, "return_scores": True}).json()
        title, text = hit["result"][0][0]["document"]["contents"].split("\n", 1)
        local = wiki.retriever.search(QUERIES[:1], topk=1)[0][0]
        assert (title, text, hit["result"][0][0]["score"]) == (f'"{local["title"]}"', local["text"], local["score"])
