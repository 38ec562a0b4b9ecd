"""AgentFlow's Wikipedia_RAG_Search_Tool and Web_RAG_Search_Tool as the agentflow recipe declares them: function tools
(unison/tools/agentflow.py) run in the function workers, over the project's index (a hash-encoder one here) and a page
served on 127.0.0.1."""
from __future__ import annotations

import json

import pytest
import yaml

from unison.config import ROOT
from unison.data.corpus import corpus_tables, write_corpus
from unison.recipes import recipe_params
from unison.tools.agentflow import CHUNK_WORDS, chunks
from unison.tools.functions import FunctionRunner
from unison.tools.retrieval import build_index

from .local_http import LocalServer

SPECS = ["unison.tools.agentflow:wikipedia_rag_search", "unison.tools.agentflow:web_rag_search"]
PASSAGES = [("Vrodoun", "Vrodoun is the capital of Kelmar and lies on the river Ost."),
            ("Mothazhix Collective", "The Mothazhix Collective is an astronomy organisation founded in 1903."),
            ("Ilse Varga", "Ilse Varga is a violinist born in Laevask.")]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder with params.yaml (crawl may reach 127.0.0.1) and a hash-encoder index of three passages."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(k), "title": t, "text": x}) + "\n" for k, (t, x) in enumerate(PASSAGES)))
    (tmp_path / "data").mkdir()
    write_corpus(corpus_tables(corpus), tmp_path / "data/corpus.parquet")
    build_index(tmp_path / "data/corpus.parquet", tmp_path / "data/index", encoder="hash:256")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["tools"].update(search_topk=2, web_allow_networks=["127.0.0.1/32"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)  # the workers start in the stage's directory, the project root
    runner = FunctionRunner(SPECS, 1, 2048, 4000)
    yield runner
    runner.close()


def test_wikipedia_rag_search_returns_agentflows_page_shape_from_the_projects_index(project):
    text, kind, _ = project.call("wikipedia_rag_search", {"query": "What is the capital of Kelmar?"}, 60)
    assert kind is None, text
    answer = json.loads(text)
    pages = answer["relevant_pages"]
    assert answer["query"] == "What is the capital of Kelmar?" and len(pages) == 2  # tools.search_topk
    assert pages[0] == {"title": "Vrodoun", "url": "https://en.wikipedia.org/wiki/Vrodoun", "retrieved_information": PASSAGES[0][1]}


def test_web_rag_search_ranks_a_pages_200_word_chunks_by_the_query_and_refuses_what_crawl_refuses(project, monkeypatch):
    filler = " ".join(f"word{k}" for k in range(450))
    page = f"<html><body><p>{filler}</p><p>The observatory of Vrodoun was opened by Ilse Varga in 1931.</p></body></html>"
    server = LocalServer(lambda req: (200, page, None))
    with server:
        text, kind, _ = project.call("web_rag_search", {"query": "Who opened the observatory of Vrodoun?", "url": server.url + "/p"}, 60)
    assert kind is None, text
    first = text.split("Chunk [2]")[0]
    assert first.startswith("Chunk [1]\n") and "opened by Ilse Varga" in first, text[:600]
    assert text.count("Chunk [") == len(chunks(filler + " The observatory of Vrodoun was opened by Ilse Varga in 1931."))
    text, kind, _ = project.call("web_rag_search", {"query": "x", "url": "http://10.1.2.3/"}, 60)  # not allowed: a private address
    assert kind == "tool_error" and "raised Blocked: 10.1.2.3 is a private address" in text, text
    text, kind, _ = project.call("web_rag_search", {"query": "x", "url": "file:///etc/passwd"}, 60)
    assert kind == "tool_error" and "root:" not in text, text


def test_chunks_are_agentflows_windows():
    words = [f"w{k}" for k in range(400)]
    got = [c.split() for c in chunks(" ".join(words))]
    assert [len(c) for c in got] == [CHUNK_WORDS, CHUNK_WORDS, 40]
    assert got[1][:20] == got[0][-20:] and got[-1][-1] == "w399"  # 20 words overlap; nothing lost at the end


def test_the_agentflow_recipe_declares_both_and_its_tiny_run_the_corpus_one():
    full, tiny = recipe_params("agentflow"), recipe_params("agentflow", tiny=True)
    assert full["tools"]["functions"] == SPECS
    assert tiny["tools"]["functions"] == SPECS[:1]  # the tiny world has no web pages
