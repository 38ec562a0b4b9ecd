"""`index.*`: the retrieval index the search tool reads."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class IndexConfig(Section):
    encoder: str = Field('builtin:all-minilm-l6-v2', description='or any sentence-transformers name / local dir; '
                         'hash:<dim> = trigram hashing, no model (benchmarks, tests)')
    kind: Literal['flat', 'ivf', 'hnsw'] = Field('flat', description='flat | ivf | hnsw')
    nlist: int = Field(16, description='ivf')
    nprobe: int = Field(4, description='ivf')
    hnsw_m: int = Field(32, description='hnsw')
    hnsw_ef_search: int = Field(64, description='hnsw: candidates kept while searching (recall vs speed)')
    batch_size: int = Field(64)
    query_prefix: str | None = Field(None, description='null = automatic ("query: " for e5 models, else none)')
    passage_prefix: str | None = Field(None, description='null = automatic ("passage: " for e5 models, else none)')
    recall_sample: int = Field(500, description='passages whose title is used as a self-retrieval query '
                               '(reports/index.json)')
    train_sample: int = Field(0, ge=0, description='ivf: passages k-means trains on, drawn with the seed (0 = 256 x '
                              'nlist, the most faiss uses)')
