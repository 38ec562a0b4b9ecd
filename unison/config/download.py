"""`download.*`: the dataset, its corpus and the generated world."""
from __future__ import annotations

from pydantic import Field

from .base import Section


class BuiltinWorldConfig(Section):
    n_people: int = Field(120)
    n_orgs: int = Field(30)
    n_cities: int = Field(24)
    n_countries: int = Field(8)
    train_size: int = Field(200, description='train questions (the teacher samples each up to generate.samples '
                            'times; its verified trajectories are what SFT learns from)')
    test_size: int = Field(200, description='>= 200, so a 95% interval is narrow enough to tell systems apart')
    mix: dict[str, float] = Field(default_factory=lambda: {'hop1': 0.5, 'hop2': 0.25, 'math': 0.25})


class DownloadConfig(Section):
    dataset: str = Field('builtin', description='builtin | hf:<name>[:<config>] | local:<path> (`{split}` in '
                         'it -> split name)')
    format: str = Field('', description='hf/local: gsm8k | math500 | hotpotqa | 2wikimultihopqa | musique | bamboogle '
                        '| nq | qa | math, or a seed\'s rows: verl | agentflow | agentflow_test | '
                        'agentark; "" = detect')
    fields: dict[str, str] = Field(default_factory=dict, description='hf/local: column renames on top of the format, '
                                   'e.g. {question: q, answers: gold}')
    split_train: str = Field('train', description='hf/local: split names')
    split_test: str = Field('test')
    test_fraction: float = Field(0.2, description='local: when both splits are one file, the seeded share '
                                 'held out as test')
    corpus: str = Field('', description='hf/local: passages file, {id, contents} (wiki-18, FlashRAG) or {id, title, '
                        'text}: .jsonl[.gz]/.parquet streamed, .json/.csv; required for QA')
    inputs: str = Field('imports', min_length=1, description="the folder of the files the pipeline takes in (local "
                        "datasets, corpora, generate.source): a DVC dependency of download and generate, so those "
                        "paths must lie in it")
    builtin: BuiltinWorldConfig = Field(default_factory=BuiltinWorldConfig)
    max_train: int = Field(0, description='0 = all')
    max_test: int = Field(0)
