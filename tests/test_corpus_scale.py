"""Corpora at real scale: wiki-18 and FlashRAG corpora read as they ship and streamed a batch at a time through the
download step and the index build (never one Python list), ivf trained on a sample, and a Retriever that reads its
hits' passages by row. The encoder is the cheap `hash:64` (no model): what is tested is the pipeline around it."""
from __future__ import annotations

import gzip
import json
import re
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unison.config import DownloadConfig
from unison.data.corpus import BATCH_ROWS, corpus_tables, write_corpus
from unison.data.schemas import DataError
from unison.data.splits import write_splits
from unison.tools import retrieval
from unison.tools.retrieval import Passages, Retriever, build_index

BAMBOOGLE = Path(__file__).parent / "fixtures" / "data" / "bamboogle_test.jsonl"
WORDS = "river stone abbey harbour bridge county founded village railway church school market castle valley".split()


def wiki18_rows(n: int) -> list[dict]:
    """Rows as wiki-18.jsonl has them: {"id": "7", "contents": "\"Title\"\ntext"}, ~300 characters of text each."""
    return [{"id": str(i), "contents": f'"Article {i}"\nArticle {i} ' + " ".join(WORDS[(i * 7 + j * 3) % 14] for j in range(45))}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """3,000 wiki-18 passages through the download step's conversion: data/raw/corpus.parquet."""
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(corpus_tables(write_jsonl(root / "wiki-18.jsonl", wiki18_rows(3000))), root / "corpus.parquet")
    return root / "corpus.parquet"


def spy_encoder(monkeypatch) -> list[list[str]]:
    """The texts of every encode call build_index makes, in order."""
    calls, load = [], retrieval.load_encoder

    class Spy:
        def __init__(self, encoder):
            self.encoder, self.dim = encoder, encoder.dim
            self.query_prefix, self.passage_prefix = encoder.query_prefix, encoder.passage_prefix

        def encode(self, texts, passages=False, batch_size=64):
            calls.append(list(texts))
            return self.encoder.encode(texts, passages, batch_size)

    monkeypatch.setattr(retrieval, "load_encoder", lambda *args: Spy(load(*args)))
    return calls


def test_download_reads_wiki18_and_flashrag_corpora_as_they_ship(tmp_path):
    rows = wiki18_rows(2500)
    gz = write_jsonl(tmp_path / "wiki-18.jsonl.gz", rows)  # as PeterJinGo/wiki-18-corpus ships it
    counts = write_splits(DownloadConfig(dataset=f"local:{BAMBOOGLE}", format="bamboogle", corpus=str(gz)), 0, tmp_path / "raw")
    written = pq.ParquetFile(tmp_path / "raw" / "corpus.parquet")
    assert counts["corpus"] == {"n": 2500} and written.num_row_groups == 3  # a row group per batch of BATCH_ROWS
    expected = written.read()
    assert expected.slice(2499).to_pylist() == [{"id": "2499", "title": "Article 2499", "text": rows[-1]["contents"].split("\n", 1)[1]}]
    # FlashRAG's corpora as the hub converts them to parquet: the same two columns (integer ids here), others beside them
    flashrag = tmp_path / "wiki18_100w.parquet"
    pq.write_table(pa.table({"id": list(range(2500)), "contents": [r["contents"] for r in rows], "source": ["wiki"] * 2500}), flashrag)
    titled = tmp_path / "titled.parquet"  # {id, title, text}
    pq.write_table(expected, titled)
    for path in (write_jsonl(tmp_path / "wiki-18.jsonl", rows), flashrag, titled):
        tables = list(corpus_tables(path))
        assert [len(t) for t in tables] == [BATCH_ROWS, BATCH_ROWS, 2500 - 2 * BATCH_ROWS]
        assert pa.concat_tables(tables).equals(expected), path.name


def test_bad_corpora_name_the_file_row_and_setting(tmp_path):
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps(wiki18_rows(1)[0]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad.jsonl.gz: line 2 is not valid JSON"):
        list(corpus_tables(bad))
    pq.write_table(pa.table({"id": ["a", "b"], "contents": ['"A"\na', None]}), tmp_path / "nulls.parquet")
    with pytest.raises(DataError, match=r"nulls.parquet, row 1, field 'contents'"):
        list(corpus_tables(tmp_path / "nulls.parquet"))
    (tmp_path / "corpus.txt").write_text("A\tB\n")
    with pytest.raises(DataError, match=r"unsupported corpus file type.*\(download.corpus\)"):
        list(corpus_tables(tmp_path / "corpus.txt"))
    with pytest.raises(DataError, match=r"missing.jsonl: file not found \(download.corpus\)"):
        list(corpus_tables(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match=r"empty.jsonl: no rows"):
        list(corpus_tables(write_jsonl(tmp_path / "empty.jsonl", [])))
    pq.write_table(pa.table({"id": ["a", "b"], "title": ["A", "B"], "text": ["a", None]}), tmp_path / "holes.parquet")
    with pytest.raises(DataError, match=r"holes.parquet, row 1, field 'text': missing value"):
        build_index(tmp_path / "holes.parquet", tmp_path / "index", encoder="hash:64")
    assert not (tmp_path / "index").exists()


def python_peak(run) -> int:
    """The most memory Python objects, lists and numpy arrays held at once while `run()` ran (tracemalloc)."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """8x the passages, the same peak: the download step and the index build hold one batch, never the corpus (as one
    list it would add ~0.7 kB a passage, 10 MB at 16,000)."""
    sources = {n: write_jsonl(tmp_path / f"wiki-{n}.jsonl", wiki18_rows(n)) for n in (2000, 16000)}
    write_corpus(corpus_tables(sources[2000]), tmp_path / "warm.parquet")  # imports and caches first, outside the peaks
    build_index(tmp_path / "warm.parquet", tmp_path / "warm", encoder="hash:64")
    peaks = {}
    for n, source in sources.items():
        peaks["download", n] = python_peak(lambda: write_corpus(corpus_tables(source), tmp_path / f"corpus-{n}.parquet"))
        peaks["index", n] = python_peak(lambda: build_index(tmp_path / f"corpus-{n}.parquet", tmp_path / f"index-{n}", encoder="hash:64"))
    for step in ("download", "index"):
        assert peaks[step, 16000] < 1.3 * peaks[step, 2000], peaks


def test_the_build_embeds_a_batch_at_a_time_with_a_progress_bar(corpus, tmp_path, monkeypatch, capfd):
    calls = spy_encoder(monkeypatch)
    assert build_index(corpus, tmp_path / "index", encoder="hash:64")["count"] == 3000
    assert [len(texts) for texts in calls] == [BATCH_ROWS, BATCH_ROWS, 3000 - 2 * BATCH_ROWS]
    # tqdm on stderr: done/total, elapsed<remaining (the ETA) and the rate
    assert re.search(r"index: 100%\|[^|]*\| 3\.00k/3\.00k \[\d\d:\d\d<00:00, +[\d.]+k? passages/s\]", capfd.readouterr().err)


def test_ivf_trains_on_a_seeded_sample(corpus, tmp_path, monkeypatch):
    calls = spy_encoder(monkeypatch)
    every = [f"{r['title']}\n{r['text']}" for r in pq.read_table(corpus).to_pylist()]
    samples = {}
    for name, seed, train_sample in (("a", 1, 300), ("again", 1, 300), ("other", 2, 300), ("default", 1, 0)):
        calls.clear()
        build_index(corpus, tmp_path / name, encoder="hash:64", kind="ivf", nlist=4, seed=seed, train_sample=train_sample)
        sampled = len(calls) - 3  # k-means' training set is embedded first, each corpus batch's share as it streams by
        samples[name] = [text for texts in calls[:sampled] for text in texts]
        assert [len(texts) for texts in calls[sampled:]] == [BATCH_ROWS, BATCH_ROWS, 3000 - 2 * BATCH_ROWS]
        assert all(len(texts) <= BATCH_ROWS for texts in calls[:sampled])
    positions = [every.index(text) for text in samples["a"]]
    assert len(set(positions)) == 300 and positions == sorted(positions) and positions[-1] > 2500  # spread over the corpus
    assert samples["again"] == samples["a"] != samples["other"] and len(samples["default"]) == 256 * 4  # 256 x nlist
    assert (tmp_path / "again/index.faiss").read_bytes() == (tmp_path / "a/index.faiss").read_bytes()
    assert (tmp_path / "other/index.faiss").read_bytes() != (tmp_path / "a/index.faiss").read_bytes()


def test_the_retriever_reads_hits_by_row_keeping_few_groups_decoded(corpus, tmp_path, monkeypatch):
    build_index(corpus, tmp_path / "index", encoder="hash:64")
    monkeypatch.setattr(Passages, "GROUPS_KEPT", 1)
    retriever = Retriever(tmp_path / "index", topk=2)
    rows = pq.read_table(corpus).to_pylist()
    assert len(retriever.passages) == 3000 and retriever.passages.get([2999, 0, 1500]) == [rows[2999], rows[0], rows[1500]]
    assert len(retriever.passages._groups) == 1  # of the file's 3 row groups, only the last one read stays decoded
    queries = [rows[i]["text"] for i in (5, 1100, 2900)]  # one from each row group
    scores, ids = retriever.index.search(retriever.encoder.encode(queries), 2)
    assert retriever.search(queries) == [[{**rows[i], "score": float(s)} for s, i in zip(row_scores, row_ids)]
                                         for row_scores, row_ids in zip(scores, ids)]
