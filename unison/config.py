"""Typed settings: one pydantic model per params.yaml section, unknown keys refused, and the only place defaults live.

params.yaml holds every setting that changes results (DVC tracks it) and equals these defaults (tests/test_config.py);
recipes (configs/recipes) and test overlays are validated by the same models. `load_params` names the file and the key
of anything that cannot work:

    params = load_params()              # params.yaml in the working directory (DVC runs stages at the project root)
    params.sft.lr, params.teacher.backend
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .redaction import redact

ROOT = Path(__file__).resolve().parent.parent
Precision = Literal["auto", "bf16", "fp32"]
VERL_AGENT_LOOP = "unison_agent"  # the name unison's agent loop registers with verl (unison/train/verl_agent.py)
MODEL_KINDS = ("builtin", "hf", "local")
LOCAL_BACKENDS = ("vllm", "transformers")
# AgentFlow's roles besides the planner (rl.student_role agentflow_planner)
FIXED_MODULES = ("executor", "verifier", "generator")
# the most top_logprobs a chat API returns a token (OpenAI's limit): generate.topk with a chat teacher
CHAT_TOP_LOGPROBS = 20
# generate.method: unison/agents/methods/<name>.py
METHODS = ("single", "self_consistency", "debate", "dylan", "agentverse", "mav", "chain_of_agents", "agentflow", "gap")
# methods that give an agent a new user turn: a chat template
CONVERSING_METHODS = ("debate", "dylan", "agentverse", "mav", "gap")
# one advantage per rollout: unison/train/advantages.py ESTIMATORS, verl_trainer.py's map
SEQUENCE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
RL_ESTIMATORS = (*SEQUENCE_ESTIMATORS, "flow_grpo")  # rl.estimator


class ParamsError(ValueError):
    """A setting that cannot work; the message names the file and the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_model_spec(spec: str, key: str) -> str:
    kind, _, name = spec.partition(":")
    if kind not in MODEL_KINDS or not name:
        raise ValueError(f"{key}: {spec!r} is not a model spec (builtin:<name> | hf:<name> | local:<dir>)")
    return spec


class LLMConfig(Section):
    backend: Literal["vllm", "transformers"] = Field("vllm", description="students always run locally (vllm | "
                                                     "transformers); a server can only be the teacher "
                                                     "(teacher.backend: openai)")
    dtype: str = Field("auto", description="auto = bf16 where the CPU has avx512_bf16 else fp32")
    max_model_len: int = Field(2048)
    enforce_eager: bool = Field(True, description="true = no CUDA graphs: quicker engine start, slower decoding; false "
                                "on GPUs for throughput (CPU: no effect on speed)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM on a GPU: the share of the GPU's memory "
                                          "the engine takes (weights + KV cache); beside a training policy "
                                          "(rl) see rl.colocate")
    max_num_seqs: int = Field(0, ge=0, description="vLLM: sequences decoded together at most; 0 = the engine's "
                              "default (256 on GPUs)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs one engine spans (a model too big for one GPU); "
                                      "with cluster.address, per replica")
    kv_cache_gb: float = Field(2, description='vLLM on CPU: RAM for the KV cache (VLLM_CPU_KVCACHE_SPACE wins if set); '
                               '2 = 93k tokens of SmolLM2 in bf16, enough for 256 episodes in flight without '
                               'preemption (bench_rollout)')
    block_size: int = Field(32, description='KV-cache block; the prefix cache reuses whole blocks only, so a small '
                            'block lets it hit the shared system prompt (docs/benchmarks.md); 0 = engine default')
    max_concurrency: int = Field(64, description="requests in flight at once: a served teacher's (openai backend), and "
                                 "the questions `unison evaluate --served` runs together")
    timeout_s: float = Field(120, description='openai backend: the most one request may take (connect, headers, body, '
                             'retries); with several base URLs each attempt gets an equal share of the time left (for '
                             'a retry on another)')
    max_retries: int = Field(3, description='on connection errors, timeouts, 429 and 5xx, with exponential backoff '
                             '(with several base URLs, on another server; one that failed is avoided for 30 s)')
    token_prompts: bool = Field(True, description="openai backend: prompt as token ids; false = decoded text "
                                "(auto-fallback if the server rejects ids)")
    vllm_extensions: bool = Field(True, description="openai backend: ask for token ids/stop reason (vLLM); false = "
                                  "plain OpenAI, completions re-tokenised here")
    scoring: Literal["prompt_logprobs", "sglang_generate"] = Field("prompt_logprobs",
                                                                   description="openai backend, api completions: how "
                                                                   "the server scores given tokens (on-policy and "
                                                                   "logit distillation): prompt_logprobs = vLLM's POST "
                                                                   "/completions extension | sglang_generate = "
                                                                   "SGLang's POST /generate")
    chat_tools: Literal["native", "text"] = Field("native", description="openai backend, api chat: native = the "
                                                  "server's tool calling (tools, tool_calls, tool messages); text = "
                                                  "the tag protocol in plain messages (auto-fallback if the "
                                                  "server rejects tools)")
    response_cache: bool = Field(True, description="openai backend: keep each answer under data/.cache/llm by a hash "
                                 "of the request (model, prompt, sampling, request format); a re-run with the same "
                                 "params sends no request")
    max_requests_per_minute: int = Field(0, ge=0, description='client-side rate limits (0 = none); 429 + Retry-After '
                                         'are honoured within timeout_s')
    max_tokens_per_minute: int = Field(0, ge=0, description="openai backend: client-side limit on prompt + max_tokens "
                                       "per minute (counted as the server reports once answered); 0 = none")
    budget_tokens: int = Field(0, ge=0, description='openai backend: the most prompt + completion tokens one stage may '
                               'spend, all its served models and replicas together; reached = the stage stops, keeping '
                               'its finished shards; 0 = none')
    price_input_per_million: float = Field(0, ge=0, description="openai backend: the price of a million prompt tokens, "
                                           "for budget_usd and the reported cost")
    price_output_per_million: float = Field(0, ge=0, description="openai backend: the price of a million "
                                            "completion tokens")
    budget_usd: float = Field(0, ge=0, description="openai backend: the most money one stage may spend at those "
                              "prices, all its served models and replicas together; 0 = none")
    max_failed_in_row: int = Field(8, ge=1, description='openai backend: requests failed for good, one after another, '
                                   'that mean the server is gone: the stage stops, keeping its finished shards; a '
                                   'single failure ends only its episode')
    max_failed_share: float = Field(0.05, ge=0, le=1, description='generate and evaluate: the share of trajectories '
                                    'that may end on a request failed for good (finish request_failed) before the '
                                    'stage stops, generate keeping its finished shards')

    @model_validator(mode="after")
    def _budget_needs_prices(self):
        if self.budget_usd and not (self.price_input_per_million or self.price_output_per_million):
            raise ValueError("budget_usd needs price_input_per_million and/or price_output_per_million")
        return self


SPENDING_LIMITS = ("response_cache", "max_requests_per_minute", "max_tokens_per_minute", "budget_tokens",
                   "price_input_per_million", "price_output_per_million", "budget_usd", "max_failed_in_row",
                   "max_failed_share")  # llm.* that stop or pace a run, never change an answer


class EngineConfig(LLMConfig):
    """What builds one model's backend: the llm.* engine settings, plus, for a server, where it is and what it calls
    the model. Not a params.yaml section: `Params.teacher_engine`, `Params.system_settings` and the role overrides make
    them."""
    backend: Literal["vllm", "transformers", "openai"] = "vllm"
    base_url: str | list[str] = Field("", description="openai: the server's /v1 URL, or a list of servers of the same "
                                      "model (balanced)")
    api: Literal["chat", "completions"] = Field("chat", description="openai: chat = POST /chat/completions with "
                                                "messages (any server, hosted APIs); completions = /completions with "
                                                "token prompts in the model's own tokenizer")
    api_model: str = Field("", description="openai: the served model's name; \"\" = the model dir")
    api_key_env: str = Field("OPENAI_API_KEY", description="openai: env var holding the key, sent as a Bearer "
                             "token; never logged")
    tokenizer: str = Field("", description="openai: the tokenizer that renders prompts; \"\" = the model dir")

    @property
    def chat(self) -> bool:
        """A model behind a chat API: it sees messages, and cannot score given tokens."""
        return self.backend == "openai" and self.api == "chat"


def check_llm_overrides(overrides: dict, key: str, allow_backend: bool) -> dict:
    """A mapping of llm.* overrides: known keys only (and, for the teacher, not its backend)."""
    known = set(LLMConfig.model_fields) | (set(EngineConfig.model_fields) | {"model"} if allow_backend else set())
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{key}: unknown key(s) {unknown} (llm.* keys: {', '.join(LLMConfig.model_fields)})")
    if not allow_backend and "backend" in overrides:
        raise ValueError(f"{key}.backend: set teacher.backend instead")
    if "base_url" in overrides:
        check_base_url(overrides["base_url"], f"{key}.base_url")
    return overrides


def check_base_url(value, key: str) -> None:
    """One server's http(s) URL, or a non-empty list of them with none twice (replicas of one served model)."""
    example = "e.g. http://127.0.0.1:8000/v1 or [http://10.0.0.1:8000/v1, http://10.0.0.2:8000/v1]"
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list) or not urls:
        raise ValueError(f"{key}: {'an empty list' if urls == [] else repr(redact(str(value)))}; give a "
                         f"server's URL or a list of servers of the same model, {example}")
    seen = set()
    for url in urls:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{key}: {redact(str(url))!r} is not an http:// or https:// URL, {example}")
        if url.rstrip("/") in seen:
            raise ValueError(f"{key}: {redact(url)!r} is listed twice (each server once)")
        seen.add(url.rstrip("/"))


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


class StudentConfig(Section):
    model: str = Field('builtin:smollm2-135m-instruct', description='builtin:smollm2-135m-instruct | '
                       'hf:<name> | local:<dir>')
    tool_format: Literal['native', 'tags'] = Field('native',
                                                   description="native = the chat template's own tool calls (a "
                                                   "ChatML template without them gets Hermes-style "
                                                   "<tool_call> JSON), served by vLLM's tool parser | tags = unison's "
                                                   "<search>...</search> tags")

    @model_validator(mode="after")
    def _spec(self):
        check_model_spec(self.model, "student.model")
        return self


class TeacherConfig(Section):
    model: str = Field('builtin:smollm2-135m-instruct', description='builtin:<name> | hf:<name> | local:<dir>; openai: '
                       'only its tokenizer is kept (api chat: unused)')
    backend: Literal['vllm', 'transformers', 'openai'] = Field('vllm',
                                                               description='vllm | transformers (models/teacher on '
                                                               'this machine) | openai (a server; nothing downloaded)')
    base_url: str | list[str] = Field('', description="openai: e.g. http://127.0.0.1:8000/v1 (`vllm serve`), or a "
                                      "hosted API's /v1 URL; a list of servers of the same model: each request goes to "
                                      "the one with the fewest outstanding")
    served_name: str = Field('', description='openai: the name the server knows the model by; "" = teacher.model '
                             'without its prefix')
    api: Literal['chat', 'completions'] = Field('chat', description='openai: chat = POST /chat/completions with native '
                                                'tool calls (any server or hosted API) | completions = /completions on '
                                                'token prompts in teacher.tokenizer (token-exact; vLLM, '
                                                'SGLang, llama.cpp)')
    tokenizer: str = Field('', description='openai: spec of the tokenizer that renders prompts; "" = teacher.model\'s '
                           '(api chat: the student\'s, in whose tokens a chat teacher\'s turns are kept)')
    api_key_env: str = Field('OPENAI_API_KEY', description='openai: env var holding the API key, sent as a Bearer '
                             'token when set; never logged')
    llm: dict = Field(default_factory=dict, description='overrides of llm.* for the teacher only, e.g. '
                      '{max_concurrency: 64, vllm_extensions: false}')

    @model_validator(mode="after")
    def _check(self):
        check_model_spec(self.model, "teacher.model")
        if self.tokenizer:
            check_model_spec(self.tokenizer, "teacher.tokenizer")
        if self.backend == "openai":
            if self.base_url == "":
                raise ValueError("teacher.base_url: the openai backend needs the server's URL, e.g. "
                                 "http://127.0.0.1:8000/v1")
            check_base_url(self.base_url, "teacher.base_url")
        check_llm_overrides(self.llm, "teacher.llm", allow_backend=False)
        return self


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


class McpServerConfig(Section):
    name: str = Field(description='what errors and reports call the server')
    command: list[str] = Field(default_factory=list, description='a stdio server: the command the stage starts (and '
                               'stops at its end)')
    url: str = Field('', description='a streamable HTTP server: its endpoint, e.g. http://127.0.0.1:8765/mcp')
    tools: list[str] = Field(default_factory=list, description='the tools of the server the agent sees; '
                             '[] = all it lists')
    env: dict[str, str] = Field(default_factory=dict, description='stdio: environment variables the server gets '
                                'besides PATH and HOME')

    @model_validator(mode="after")
    def _one_transport(self):
        if bool(self.command) == bool(self.url):
            raise ValueError(f"tools.mcp {self.name!r}: give exactly one of command (stdio) or url (streamable HTTP)")
        return self


class ToolsConfig(Section):
    search_topk: int = Field(2)
    search_max_chars: int = Field(300, description='per passage in an observation')
    search_url: str = Field('', description='"" = in-process; else http://host:port of a retrieval server '
                            '(see search_api)')
    search_api: Literal['retrieve', 'flashrag'] = Field('retrieve', description="retrieve = POST /retrieve (unison's "
                                                        "search_server, Search-R1, AFM, GAP) | flashrag = POST "
                                                        "/batch_search (FlashRAG servers: ET-Agent, ARPO)")
    search_timeout_s: int = Field(30, description='remote search: the most one query may take as a whole (connecting, '
                                  'headers, body, every retry)')
    search_token_env: str = Field('', description='remote search: env var whose value is sent as a Bearer token (the '
                                  'server\'s --token-env); "" = none')
    python_timeout_s: int = Field(5)
    python_memory_mb: int = Field(512, description='per python run, in all: its processes, memfd, shared memory '
                                  'and /tmp (a cgroup)')
    python_total_memory_mb: int = Field(4096, description='all python runs at once together (the runtime runs up to 8 '
                                        'tool calls at a time)')
    python_max_output_chars: int = Field(512)
    sandbox_isolation: Literal['strict', 'rlimits'] = Field('strict', description='strict = bubblewrap + a cgroup per '
                                                            'run and one for all runs, else the stage refuses to start '
                                                            '| rlimits = bubblewrap + per-process rlimits only '
                                                            '(weaker; logged)')
    call_deadline_s: float = Field(60.0, description='the runtime gives up on a tool call after this many seconds: a '
                                   'timeout observation')
    web_search_url: str = Field('', description='"" = off; else a Serper-like POST endpoint: {q, num} -> {"organic": '
                                '[{title, link, snippet}]}')
    crawl: bool = Field(False, description='true = <crawl>url</crawl> fetches pages (HTML stripped to text)')
    web_topk: int = Field(3, description='results per web query')
    web_timeout_s: int = Field(15, description='total deadline of one web tool call: every URL or query, redirects, '
                               'body, 2 retries and backoff')
    web_max_chars: int = Field(2000, description='crawled page text kept in an observation')
    web_max_bytes: int = Field(2000000, description='web answers are read up to this many decoded bytes (a longer page '
                               'is cut, a longer search answer is an error)')
    web_api_key_env: str = Field('', description='env var whose value is sent as X-API-KEY (Serper); "" = none')
    web_allow_networks: list[str] = Field(default_factory=list, description='tests/operators only: non-public address '
                                          'ranges crawl may fetch, e.g. ["127.0.0.1/32"]; [] = public addresses only')
    functions: list[str] = Field(default_factory=list, description='your Python functions as tools: '
                                 '"imports/tools.py:lookup_order" or "mypkg.tools:convert"; the schema comes from type '
                                 'hints and the docstring')
    mcp: list[McpServerConfig] = Field(default_factory=list, description='your MCP servers: {name, command: [...]} '
                                       '(stdio) or {name, url} (streamable HTTP), tools: an allow-list')
    custom_timeout_s: float = Field(30.0, description='a call of a function or MCP tool is cut after this many seconds '
                                    '(a hung function is killed)')
    custom_max_output_chars: int = Field(2000, description='a function or MCP tool result is cut here')
    custom_max_argument_chars: int = Field(4000, description="a call's JSON arguments longer than this are "
                                           "refused before the call")
    function_workers: int = Field(2, description='processes that run function tools (each call in one; a hung one is '
                                  'killed and replaced)')
    function_memory_mb: int = Field(2048, description='address space of each function-tool process')
    accept_changed_tools: bool = Field(False, description='true = a stage runs although its tool set differs from the '
                                       'one generate recorded')

    @model_validator(mode="after")
    def _networks(self):
        for net in self.web_allow_networks:
            try:
                ipaddress.ip_network(net)
            except ValueError:
                raise ValueError(f"tools.web_allow_networks: {net!r} is not an address range "
                                 "(e.g. 127.0.0.1/32)") from None
        return self

    @model_validator(mode="after")
    def _custom_names(self):
        names = [m.name for m in self.mcp]
        if len(set(names)) != len(names):
            raise ValueError(f"tools.mcp: two servers are named alike: {names}")
        for spec in self.functions:
            if spec.count(":") != 1 or not all(spec.split(":")):
                raise ValueError(f"tools.functions: {spec!r} is not file.py:function or module:function")
        return self

    @model_validator(mode="after")
    def _python_memory(self):
        if self.python_total_memory_mb < self.python_memory_mb:
            raise ValueError(f"tools.python_total_memory_mb ({self.python_total_memory_mb}) is below "
                             f"tools.python_memory_mb ({self.python_memory_mb}): no run could get its memory")
        return self


class SelfConsistencyConfig(Section):
    samples: int = Field(3, description='paths (AgentArk parallel_num: 5, the agentark recipe sets it; the demo takes '
                         '3 for its time budget)')
    aggregator: Literal['vote', 'llm'] = Field('vote', description="vote (free-form majority) | llm (AgentArk's "
                                               "aggregator prompt)")


class DebateConfig(Section):
    agents: int = Field(3)
    rounds: int = Field(2)
    aggregator: Literal['vote', 'llm'] = Field('vote', description='vote | llm')


class DylanConfig(Section):
    agents: int = Field(4)
    rounds: int = Field(3)
    top_k: int = Field(2)
    consensus: float = Field(0.667)


class AgentVerseConfig(Section):
    agents: int = Field(2)
    turns: int = Field(3)
    critic_rounds: int = Field(3)


class MAVConfig(Section):
    solutions: int = Field(2)
    verifiers: int = Field(2)
    verifier_temperature: float = Field(0.0)


class ChainOfAgentsConfig(Section):
    max_cycles: int = Field(2, description='re-plans after a double_check score <= 2')
    accept_score: int = Field(3, description='double_check score (1-4) that lets the answer through')


class AgentFlowConfig(Section):
    max_steps: int = Field(3, description='AgentFlow train TOOL_STEPS (eval uses 10)')


class GAPConfig(Section):
    max_levels: int = Field(3)
    max_parallel: int = Field(4)


class GenerateConfig(Section):
    method: Literal[METHODS] = Field('single', description=f"{' | '.join(METHODS)}  (defaults below from the "
                                     "seed systems, docs/seeds.md)")
    samples: int = Field(8, ge=1, description="samples the teacher draws per train question (label keeps those that "
                         "verify: rejection sampling); reports/label.json and the report show the coverage per k")
    stop_at_verified: int = Field(1, ge=0, description="> 0: a question stops drawing samples once this many of its "
                                  "trajectories verify (label's rule judge); 0 = every question draws generate.samples")
    temperature: float = Field(0.7, description="the teacher's sampling temperature (docs/guide.md compares the demo's "
                               "methods at several)")
    top_p: float = Field(1.0, description='< 1 slows decoding on CPU: vLLM sorts the vocabulary per request '
                         '(docs/benchmarks.md)')
    max_turns: int = Field(4)
    max_tokens_per_turn: int = Field(96)
    max_tool_calls: int = Field(3)
    scaffold: dict[str, list[str]] = Field(default_factory=lambda: {'qa': ['search', 'answer'],
                                                                    'math': ['python', 'answer']})
    demonstrations: str = Field('configs/demonstrations/builtin.txt', description='worked examples the teacher\'s '
                                'acting agents see after the system prompt; students never see them, they learn to act '
                                'alone (context distillation); "" = none')
    source: str = Field('', description='"" = the teacher runs generate.method | local:<file>: import SFT trajectories '
                        'from a jsonl/json/parquet file under download.inputs instead (Alpaca, ShareGPT, OpenAI '
                        'messages: docs/guide.md)')
    shard_size: int = Field(64, description='questions per resumable shard (a killed run keeps its finished shards)')
    topk: int = Field(0, ge=0, le=64, description="> 0: keep the teacher's top-k log-probs at the trajectories' "
                      "assistant tokens (data/trajectories/teacher_topk.parquet) for sft.kd_weight; a chat API gives "
                      "at most 20; 0 = none")
    episodes_in_flight: int = Field(256, description='episodes (agents x samples of all running questions) the engine '
                                    'works on at once in generate, evaluate and pareto; the next question starts '
                                    'whenever fewer are live')
    roles: dict[str, dict] = Field(default_factory=dict, description="role -> its own model, e.g. {aggregator: {model: "
                                   "Qwen/Qwen2.5-7B-Instruct, backend: openai}}; other keys override the teacher's "
                                   "llm.*; {} = every role on the teacher")
    self_consistency: SelfConsistencyConfig = Field(default_factory=SelfConsistencyConfig,
                                                    description='AgentArk self_consistency: parallel paths, '
                                                    'then an aggregator')
    debate: DebateConfig = Field(default_factory=DebateConfig, description='AgentArk llm_debate')
    dylan: DylanConfig = Field(default_factory=DylanConfig, description='AgentArk DyLAN: 4 agents, 3 rounds, listwise '
                               'top-2 from round 3, 2/3 consensus exit')
    agentverse: AgentVerseConfig = Field(default_factory=AgentVerseConfig, description='AgentArk AgentVerse: 2 agents '
                                         '(solver + critic), 3 turns, up to 3 critique rounds')
    mav: MAVConfig = Field(default_factory=MAVConfig, description='AgentArk multi-agent verification: 2 solutions x 2 '
                           'verifier aspects, verifiers greedy')
    chain_of_agents: ChainOfAgentsConfig = Field(default_factory=ChainOfAgentsConfig, description='AFM: '
                                                 'think/plan/tool/reflection/suggested_answer/double_check role agents')
    agentflow: AgentFlowConfig = Field(default_factory=AgentFlowConfig, description='AgentFlow: planner, executor, '
                                       'verifier, generator with a memory of action steps')
    gap: GAPConfig = Field(default_factory=GAPConfig, description="GAP: a plan of sub-tasks with dependencies; each "
                           "level's queries in one parallel turn")


class LabelConfig(Section):
    qa_metric: Literal['em', 'subem', 'f1'] = Field('subem', description='em | subem | f1  (the one that '
                                                    'decides `correct`)')
    f1_threshold: float = Field(0.8)
    first_only: bool = Field(False, description='`a | b` answers: false = every item must be right (GAP train), true = '
                             'first item only (GAP eval)')
    math_timeout_s: int = Field(5)
    judge: Literal['rule', 'llm'] = Field('rule', description='rule (EM/F1, math equivalence) | llm (label.judge_model '
                                          'asked true/false, AgentArk label.py)')
    judge_model: str = Field('models/base', description='llm judge: a model dir, or a served name with label.llm '
                             '{backend: openai, base_url: ...}')
    judge_temperature: float = Field(0.0)
    step_labels: Literal['outcome', 'montecarlo', 'agent'] = Field('outcome',
                                                                   description="outcome (each step gets the episode's "
                                                                   "score) | montecarlo (Math-Shepherd) | agent "
                                                                   "(AgentArk: each agent's solution in the transcript "
                                                                   "is a step, judged on its own answer)")
    mc_model: str = Field('student', description='montecarlo completer: student (models/base) | teacher (the teacher '
                          'block) | a model dir / served name')
    mc_rollouts: int = Field(8, description='completions per step prefix (Math-Shepherd N)')
    mc_temperature: float = Field(0.7)
    mc_scaffold: bool = Field(True, description='completions continue generate.scaffold from the next turn '
                              '(false = unscaffolded)')
    llm: dict = Field(default_factory=dict, description='llm.* overrides for the judge and completer models (e.g. '
                      '{backend: openai, base_url: ...})')


class TrainConfig(Section):
    """How sft, dpo, prm and rl train (on what hardware), not what they learn: one process, or several."""
    num_processes: int = Field(1, ge=1, description="training processes, one per GPU; > 1 = sft, dpo, prm and rl "
                               "re-launch themselves through `accelerate launch` (DeepSpeed with the stage's "
                               "deepspeed_config) and split each step's micro-batches")
    hostfile: str = Field("", description="a DeepSpeed hostfile (`<host> slots=<GPUs>` a line; passwordless ssh and "
                          "pdsh) to train on several machines; needs the stage's deepspeed_config; '' = this machine")
    main_process_ip: str = Field("", description="with a hostfile: the address of rank 0's machine; '' = the "
                                 "hostfile's first host")
    main_process_port: int = Field(29500, ge=0, le=65535, description="rank 0's rendezvous port (accelerate's default "
                                   "29500); 0 = any free port of this machine (one machine only)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward instead of keeping them "
                                         "(transformers' non-reentrant checkpointing): ~1/3 more compute, activation "
                                         "memory from every layer to about one; same results")


class TrainingSettings(Section):
    """How sft, dpo, prm and rl optimise, one set of settings the Trainer (unison/train/loop.py) takes whole; each stage
    keeps its own defaults (they decide its results) and adds what it learns from."""
    seed: int = Field(0, exclude=True, description='the global seed (params.yaml seed), set by Params')
    lr: float = Field(5e-05, description='AdamW peak learning rate')
    schedule: Literal['linear', 'constant'] = Field('linear', description='after warm-up: linear = decay to 0 at the '
                                                    'last step | constant')
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0, description='share of the optimiser steps with a linear warm-up '
                                '(at least one step when > 0); 0 = none')
    weight_decay: float = Field(0.0, ge=0.0, description='AdamW weight decay')
    max_grad_norm: float | None = Field(1.0, description='clip the gradient norm at this; null = no clipping')
    precision: Precision = Field('auto', description='auto = bf16 autocast where the hardware has bf16 matmuls (GPU; '
                                 'CPU with AVX512-BF16/AMX), else fp32 | bf16 | fp32')
    checkpoint_every: int = Field(0, ge=0, description='optimiser steps between checkpoints '
                                  '(data/.cache/<stage>-checkpoint/<settings and inputs hash>) a killed run '
                                  'resumes from; 0 = none')
    deepspeed_config: str = Field('', description='e.g. configs/deepspeed/zero2.json (ZeRO through accelerate)')

    def warmup_steps(self, total: int) -> int:
        """Warm-up steps of a run of `total` optimiser steps."""
        return max(1, int(self.warmup_ratio * total)) if self.warmup_ratio > 0 else 0


class PRMConfig(TrainingSettings):
    enabled: bool = Field(False, description='false = models/prm holds a marker only (then evaluate.rerank_samples 1, '
                          'rl.prm_weight 0)')
    separator: str = Field('\n', description='TRL/AgentArk step separator')
    freeze_backbone: bool = Field(False, description='AgentArk fix_llm: train only the head')
    epochs: int = Field(1, description='passes over the step-labelled trajectories')
    batch_size: int = Field(8)
    max_length: int = Field(1024, description='training examples are cut here (steps past it lose their labels)')
    eval_fraction: float = Field(0.2, description='held-out share of questions (split by question id) for '
                                 'reports/prm.json')


class SFTConfig(TrainingSettings):
    max_per_question: int = Field(2)
    dedupe: bool = Field(True)
    lora: bool = Field(False)
    lora_r: int = Field(16)
    lora_alpha: int = Field(32)
    epochs: int = Field(2, description='passes over the correct teacher trajectories')
    batch_size: int = Field(4)
    grad_accum: int = Field(1, ge=1, description='micro-batches per optimiser step (with DeepSpeed: its '
                            'gradient accumulation)')
    max_length: int = Field(768)
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0, description="share of the optimiser steps with a linear warm-up "
                                "(the demo: its first step)")
    packing: bool = Field(False, description='true = several examples per row of up to max_length (positions restart, '
                          'attention never crosses examples), fewer pad tokens; false = a row each, their shared first '
                          'tokens run once')
    kd_weight: float = Field(0.0, ge=0.0, description="> 0: logit distillation, loss = cross-entropy + kd_weight x "
                             "divergence from the teacher's top-k (needs generate.topk > 0)")
    kd_loss: Literal['forward_kl', 'jsd'] = Field('forward_kl', description="forward_kl (teacher || student) | jsd, "
                                                  "both over the teacher's top-k tokens renormalised")


class ParetoConfig(Section):
    k: int = Field(3, description='rollouts per train question by models/sft (ET-Agent: 8; the demo: 3)')
    temperature: float = Field(0.7, description="the student's rollouts (ET-Agent: 1.0; the demo's student gives more "
                               "mixed groups below it: docs/results.md)")
    counts: int = Field(64, description='groups taken by Pareto front + crowding before the mixed-outcome filter '
                        '(ET-Agent: 8000)')
    qa_threshold: float = Field(0.75, description="a QA rollout counts as solved at this score "
                                "(ET-Agent's post-filter)")
    levels: int = Field(2, description='curriculum levels for rl, easiest (highest mean correctness) first')
    min_groups: int = Field(8, description='fewer mixed groups -> top up with Pareto-selected unmixed ones; 0 = none '
                            '(then none mixed = error)')
    max_questions: int = Field(64, description='train questions the SFT student rolls out (the demo: 64 of 200, '
                               'for its time); 0 = the whole train split')


class DPOConfig(TrainingSettings):
    enabled: bool = Field(False, description='the demo has ~1 sample per question, so pairs are rare; false = '
                          'models/dpo holds a marker only')
    loss: Literal['sigmoid', 'ipo'] = Field('sigmoid', description='sigmoid (DPO) | ipo')
    beta: float = Field(0.1)
    lr: float = Field(5e-06, description='AFM: 1e-6 at 32B')
    schedule: Literal['linear', 'constant'] = Field('constant')
    epochs: int = Field(2, description='AFM: 4')
    batch_size: int = Field(4, description='pairs per optimiser step')
    max_length: int = Field(768)
    max_pairs_per_question: int = Field(2)
    lora: bool = Field(False)
    lora_r: int = Field(16)
    lora_alpha: int = Field(32)


class EvaluateConfig(Section):
    max_questions: int = Field(0, description='0 = whole test split')
    temperature: float = Field(0.0)
    bootstrap: int = Field(1000)
    teacher: bool = Field(True)
    rerank_samples: int = Field(1, description='prm_rerank: SFT-student samples per question, the PRM keeps one; <= 1 '
                                '= skip that system (the demo skips it: docs/benchmarks.md; the '
                                'agentark recipe reranks)')
    rerank_temperature: float = Field(0.7)
    first_only: bool | None = Field(None, description='`a | b` answers when scoring: null = label.first_only; true = '
                                    'the first item only (GAP eval)')
    engine_per_process: bool | Literal['auto'] = Field('auto', description='each model\'s engine in its own process, '
                                                       'which gives all its GPU memory back when it exits; auto = on '
                                                       'CUDA only (on CPU a child costs ~10 s of imports and toolbox '
                                                       'per engine); same rows either way')


class RLConfig(TrainingSettings):
    trainer: Literal['unison', 'verl'] = Field('unison', description='unison = the in-house loop below (one machine, '
                                               'tests) | verl = verl\'s PPO trainer on its Ray cluster over '
                                               'data/export/verl (pip install verl; docs/scale.md "RL through verl")')
    verl_nnodes: int = Field(1, ge=1, description='trainer verl: trainer.nnodes')
    verl_gpus_per_node: int = Field(8, ge=1, description='trainer verl: trainer.n_gpus_per_node')
    verl_max_prompt_length: int = Field(1024, ge=1, description='trainer verl: data.max_prompt_length (tokens)')
    verl_max_response_length: int = Field(2048, ge=1, description='trainer verl: data.max_response_length, tool '
                                          'observations included (tokens)')
    objective: Literal['reward', 'opd'] = Field('reward', description="reward = the estimator's advantages of the "
                                                "rewards below | opd = on-policy distillation: teacher minus student "
                                                "log-prob on every sampled token (docs/design.md §7), plus "
                                                "outcome_weight x advantage")
    outcome_weight: float = Field(0.0, ge=0.0, description='opd: weight of the verifiable-reward advantage beside the '
                                  'teacher term; 0 = pure distillation')
    opd_steps: int = Field(0, ge=0, description="objective reward: the first opd_steps steps distil on-policy as "
                           "objective opd does (outcome_weight, kd_weight and teacher_context with them), the rest "
                           "train on the rewards, in one run; 0 = none")
    opd_switch: Literal['restart', 'continue'] = Field('restart', description="opd_steps > 0: restart = the RL steps "
                                                        "start as a second run would (fresh AdamW moments, the lr "
                                                        "schedule again) | continue = one optimiser and schedule")
    kd_weight: float = Field(0.0, ge=0.0, description="opd: > 0 adds kd_weight x the divergence from the teacher's "
                             "top-k at each sampled token (on-policy logit distillation): it raises teacher tokens "
                             "the student never samples; same vocabulary only")
    kd_topk: int = Field(8, ge=1, description="kd_weight > 0: the teacher's likeliest tokens kept at each position")
    kd_loss: Literal['forward_kl', 'jsd'] = Field('forward_kl', description="kd_weight > 0: forward_kl (teacher || "
                                                  "student) | jsd, both over the teacher's top-k renormalised (as "
                                                  "sft.kd_loss)")
    teacher_context: Literal['student', 'worked_examples'] = Field('student',
                                                                   description="opd: what the teacher reads before the "
                                                                   "student's completion: student = the student's own "
                                                                   "prompt | worked_examples = that prompt with "
                                                                   "generate.demonstrations (context distillation)")
    probe_prompts: int = Field(0, ge=0, description="> 0: curriculum prompts (seeded) held out of training; the "
                               "reverse KL to the teacher on group_size fixed-seed episodes each, before step 1 and "
                               "after each step; 0 = off")
    probe_every: int = Field(1, ge=1, description="the probe runs after every Nth step and after the last one (it "
                             "costs group_size episodes a held-out prompt)")
    estimator: Literal[RL_ESTIMATORS] = Field('grpo', description=f"{' | '.join(RL_ESTIMATORS)} (flow_grpo, "
                                              "AgentFlow's: every assistant turn a sample with the final reward)")
    student_role: Literal['agent', 'agentflow_planner'] = Field('agent', description="agent = the student acts alone | "
                                                                "agentflow_planner = the student plans AgentFlow's "
                                                                "flow (generate.agentflow), only its turns trained; "
                                                                "generate.roles' executor, verifier and "
                                                                "generator do the rest")
    group_size: int = Field(4, description='rollouts per prompt (seeds: 8)')
    prompts_per_step: int = Field(4, description='curriculum: data/rl level 1 prompts first, then level 2, ...')
    steps: int = Field(4, description='optimiser steps (the demo: 4, for its time; docs/results.md has what more did)')
    lr: float = Field(1e-05, description="the demo's 135M student; GAP/AgentFlow 1e-6, AgentArk 5e-7 at 3-7B")
    schedule: Literal['linear', 'constant'] = Field('constant')
    weight_decay: float = Field(0.1, ge=0.0)
    clip_low: float = Field(0.2, description='DAPO clip-higher: 0.2 / 0.28')
    clip_high: float = Field(0.28)
    dual_clip: float | None = Field(10.0, description='null = off')
    kl_coef: float = Field(0.0, description='> 0: k3 KL to a frozen copy of the SFT model (AgentFlow 0.001; GAP none)')
    loss_agg: Literal['token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum_norm'] = Field(
        'token_mean', description='token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (Dr.GRPO)')
    dynamic_sampling: bool = Field(True, description='DAPO: drop groups whose rewards are all equal')
    max_refills: int = Field(2, description='DAPO: up to this many more rollout batches (next curriculum prompts) '
                             'while fewer than prompts_per_step groups are kept (verl max_num_gen_batches - 1); 0 = '
                             'train on what is kept')
    ppo_epochs: int = Field(1)
    mini_batches: int = Field(1, description='optimiser steps per epoch')
    micro_batch_size: int = Field(4, description='sequences per forward/backward (memory)')
    temperature: float = Field(1.0, description="rollouts; the loss's ratio scores tokens under the same temperature, "
                               "opd's teacher term compares student and teacher at temperature 1 (a "
                               "teacher scores at 1)")
    top_p: float = Field(1.0)
    max_turns: int = Field(4)
    max_tokens_per_turn: int = Field(96)
    max_tool_calls: int = Field(3)
    verifiable_weight: float = Field(1.0, description="s = the label judge's score (label.qa_metric, math-verify)")
    format_weight: float = Field(1.0, description='f_fmt = -1 when the response breaks the protocol')
    efficiency_weight: float = Field(0.0, description='ET-Agent tool/length efficiency')
    sigma_tool: float = Field(0.2)
    sigma_len: float = Field(0.5)
    sigma_decay: bool = Field(True, description='sigmas x (T - step)/(T - 1)')
    prm_weight: float = Field(0.0, description='> 0: AgentArk PRMVR step rewards from models/prm (soft-min, '
                              'leave-one-out baseline)')
    prm_temperature: float = Field(0.1)
    prm_baseline: Literal['token', 'step'] = Field('token', description='token | step')
    rollout_backend: Literal['vllm', 'transformers'] = Field('vllm', description='vllm (weights pushed into the engine '
                                                             'after each update) | transformers (the live model)')
    rollout_batch_size: int = Field(32, description='transformers: sequences per generate call')
    colocate: Literal['auto', 'sleep', 'off'] = Field('auto', description="vllm rollouts on the policy's GPU: sleep = "
                                                      "the engine frees its GPU memory while the policy trains, then "
                                                      "wakes with the new weights; auto = sleep on CUDA, else off; off "
                                                      "= it keeps its memory")
    checkpoint_every: int = Field(1, ge=0, description='steps; to data/.cache/rl-checkpoint/<params+inputs hash>, '
                                  'resumed by a re-run')

    @property
    def scores_with_teacher(self) -> bool:
        """Whether the teacher block scores the student's tokens: opd's advantage, or the KL probe."""
        return self.objective == "opd" or self.opd_steps > 0 or self.probe_prompts > 0

    def at_step(self, step: int) -> RLConfig:
        """The settings of step `step` (0-based): objective opd during the first opd_steps steps, these after."""
        return self.model_copy(update={"objective": "opd", "opd_steps": 0}) if step < self.opd_steps else self

    @model_validator(mode="after")
    def _rules(self):
        if self.colocate == "sleep" and self.rollout_backend != "vllm":
            raise ValueError("rl.colocate: sleep puts the vLLM engine to sleep, but rl.rollout_backend is "
                             f"{self.rollout_backend!r}; set rl.rollout_backend: vllm or rl.colocate: auto")
        distils = self.objective == "opd" or self.opd_steps > 0
        if distils and (self.estimator == "flow_grpo" or self.trainer == "verl"):
            raise ValueError("rl.objective opd and rl.opd_steps run on rl.trainer unison with a sequence estimator "
                             f"({' | '.join(SEQUENCE_ESTIMATORS)}) for the outcome term")
        if self.opd_steps and self.objective == "opd":
            raise ValueError(f"rl.opd_steps {self.opd_steps} starts an RL run with on-policy distillation, but "
                             "rl.objective is opd already: every step distils; set rl.objective: reward or "
                             "rl.opd_steps: 0")
        if self.opd_steps and self.opd_steps >= self.steps:
            raise ValueError(f"rl.opd_steps {self.opd_steps} leaves none of rl.steps {self.steps} to RL: set "
                             "rl.objective: opd for a run of distillation only, or fewer opd_steps")
        if self.kd_weight > 0 and not distils:
            raise ValueError("rl.kd_weight > 0 distils the teacher's top-k on the student's own episodes, a part of "
                             "on-policy distillation: set rl.objective: opd (or rl.opd_steps), or rl.kd_weight: 0")
        if self.prm_weight > 0 and self.estimator == "flow_grpo":
            raise ValueError("rl.prm_weight > 0 needs a sequence estimator "
                             f"({' | '.join(SEQUENCE_ESTIMATORS)}), not flow_grpo")
        if self.student_role == "agentflow_planner" and (self.estimator != "flow_grpo" or self.trainer != "unison"):
            raise ValueError("rl.student_role agentflow_planner trains the planner's turns of a flow, each its own "
                             "prompt: it needs rl.estimator flow_grpo on rl.trainer unison")
        if self.probe_prompts and (self.trainer == "verl" or self.student_role != "agent"):
            raise ValueError("rl.probe_prompts measures the KL of a student acting alone on rl.trainer unison "
                             "(rl.student_role agent)")
        if self.trainer == "verl":
            self._verl_rules()
        return self

    def _verl_rules(self) -> None:
        """What verl's trainer cannot honour (unison/train/verl_trainer.py maps the rest)."""
        if self.estimator == "flow_grpo":
            raise ValueError("rl.estimator: 'flow_grpo' has no verl estimator with rl.trainer verl (one of "
                             f"{', '.join(SEQUENCE_ESTIMATORS)}; flow_grpo runs with rl.trainer: unison)")
        if self.efficiency_weight or self.prm_weight:
            raise ValueError("rl.efficiency_weight and rl.prm_weight must be 0 with rl.trainer verl: the "
                             "ET-Agent efficiency term and the PRM are relative to a response's group, and verl's "
                             "reward function scores one response at a time")
        if self.dual_clip is None:
            raise ValueError("rl.dual_clip: verl always applies dual clip (actor.clip_ratio_c); give a value")
        if self.prompts_per_step % self.mini_batches:
            raise ValueError(f"rl.mini_batches ({self.mini_batches}) must divide rl.prompts_per_step "
                             f"({self.prompts_per_step}) with rl.trainer verl "
                             "(actor.ppo_mini_batch_size is in prompts)")
        if self.schedule != "constant" or self.max_grad_norm is None:
            raise ValueError("rl.schedule: trainer verl's optimiser warms up then holds the lr constant "
                             "and always clips; set rl.schedule: constant and a rl.max_grad_norm")


class FlywheelConfig(Section):
    rounds: int = Field(0, description="round k's teacher: round k-1's last student under generate.method + scaffold; "
                        "its correct train trajectories fine-tune a new student from models/base (sft.*); 0 = off "
                        "(et_agent runs 2)")
    sft_epochs: int = Field(2, ge=0, description="epochs of a round's student over its round's trajectories (the other "
                            "settings are sft.*); 0 = sft.epochs")


class ExportConfig(Section):
    name: str = Field('unison', pattern=r'^[A-Za-z0-9_.-]+$', description="LLaMA-Factory: dataset_info.json names the "
                      "datasets <name>_sft and <name>_dpo")
    verl_agent: str = Field('tool_agent', description="verl: each RL row's agent_name, the agent loop that rolls it "
                            "out (tool_agent = verl's ToolAgentLoop; unison_agent = unison's tag protocol, required by "
                            "rl.trainer verl)")


def check_remote(url: str, key: str) -> str:
    """A DVC remote: "" (none), a URL such as s3://bucket/path, or an absolute path (a directory every machine
    mounts)."""
    scheme, _, rest = url.partition("://")
    if url and not rest and not os.path.isabs(url):
        raise ValueError(f"{key}: {url!r} is neither a URL (s3://bucket/path) nor an absolute path of a "
                         "shared directory")
    if rest and "@" in rest.split("/")[0]:
        raise ValueError(f"{key}: credentials do not go in the URL; set them in the environment (AWS_ACCESS_KEY_ID, "
                         f"AWS_SECRET_ACCESS_KEY), where DVC reads them")
    return url


class StorageConfig(Section):
    remote: str = Field("", description='the DVC remote machines share: s3://bucket/path (endpoint: AWS_ENDPOINT_URL) '
                        'or a shared directory\'s absolute path; "" = none; UNISON_DVC_REMOTE overrides it; '
                        'credentials only in the environment')

    @model_validator(mode="after")
    def _remote(self):
        check_remote(self.remote, "storage.remote")
        return self


class ClusterConfig(Section):
    address: str = Field("", description='"" = every stage in this process | auto (the local Ray cluster) | '
                         'ray://host:port: generate, label\'s montecarlo completions, pareto and evaluate run on Ray '
                         'actors, one engine each (docs/scale.md)')
    replicas: int = Field(2, ge=1, description="engine actors (data-parallel); each asks llm.tensor_parallel_size GPUs "
                          "where the cluster has GPUs")
    cpus_per_replica: float = Field(1, gt=0, description="CPUs each actor asks of Ray (its torch threads on CPU)")
    shard_size: int = Field(16, ge=1, description="questions (label: trajectories) per shard an actor runs in "
                            "evaluate, pareto and label; generate's are generate.shard_size")
    max_shard_retries: int = Field(2, ge=0, description="a shard whose actor died runs again on another actor (a new "
                                   "one takes the dead one's place), this many times at most")


class Params(Section):
    seed: int = Field(0)
    download: DownloadConfig = Field(default_factory=DownloadConfig)
    student: StudentConfig = Field(default_factory=StudentConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig, description='the local engine (students; a local teacher unless '
                           'teacher.llm overrides it)')
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    label: LabelConfig = Field(default_factory=LabelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig, description='how sft, dpo, prm and rl train: processes '
                               '(accelerate launch / DeepSpeed), machines, gradient checkpointing')
    prm: PRMConfig = Field(default_factory=PRMConfig, description='AgentArk prm/finetune2.py: backbone + 2-class head '
                           'on a separator token after each step')
    sft: SFTConfig = Field(default_factory=SFTConfig)
    pareto: ParetoConfig = Field(default_factory=ParetoConfig, description='ET-Agent direct rollout + group-wise '
                                 'Pareto sampling (docs/seeds.md#et-agent)')
    dpo: DPOConfig = Field(default_factory=DPOConfig, description='AFM DPO (docs/seeds.md#afm): chosen = correct, '
                           'rejected = wrong rendering of one question')
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    rl: RLConfig = Field(default_factory=RLConfig, description='GRPO family on live multi-turn tool rollouts of the '
                         'SFT student (docs/seeds.md)')
    flywheel: FlywheelConfig = Field(default_factory=FlywheelConfig, description="ET-Agent's data flywheel / STaR "
                                     "rounds after the pipeline (round 0 = teacher -> SFT -> RL)")
    export: ExportConfig = Field(default_factory=ExportConfig, description='the SFT conversations, DPO pairs and RL '
                                 'prompts in LLaMA-Factory, verl and TRL formats (data/export)')
    storage: StorageConfig = Field(default_factory=StorageConfig, description='where DVC data is shared between '
                                   'machines (unison/storage.py); no stage depends on it')
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description='Ray for rollouts and evaluation '
                                   '(docs/scale.md); same seeds and order as in process')

    @model_validator(mode="after")
    def _seeds(self):
        for name in ("prm", "sft", "dpo", "rl"):
            section = getattr(self, name)
            if "seed" in section.model_fields_set:
                raise ValueError(f"{name}.seed: set the top-level seed (one seed for every stage)")
            object.__setattr__(section, "seed", self.seed)
        check_llm_overrides(self.label.llm, "label.llm", allow_backend=True)
        for role, spec in self.generate.roles.items():
            check_llm_overrides(spec, f"generate.roles.{role}", allow_backend=True)
        return self

    @model_validator(mode="after")
    def _across_sections(self):
        if not self.prm.enabled and self.rl.prm_weight > 0:
            raise ValueError("rl.prm_weight > 0 scores steps with models/prm, but prm.enabled is false")
        if not self.prm.enabled and self.evaluate.rerank_samples > 1:
            raise ValueError("evaluate.rerank_samples > 1 reranks with models/prm, but prm.enabled is false")
        chat_teacher = self.teacher_engine().chat
        if self.rl.scores_with_teacher and chat_teacher:
            raise ValueError(f"rl.objective opd, rl.opd_steps or rl.probe_prompts: the teacher ({self.teacher.model}) "
                             "must score given tokens, and teacher.api chat cannot (a chat API returns no log-probs of "
                             "given tokens): set teacher.api: completions with a vLLM server, or a local teacher "
                             "(teacher.backend vllm | transformers)")
        if self.generate.topk and chat_teacher and self.generate.source:
            raise ValueError("generate.topk with imported trajectories (generate.source) needs a teacher that "
                             "scores them, and teacher.api chat cannot: a chat API's top log-probs come only with what "
                             "it generates itself")
        if self.generate.topk > CHAT_TOP_LOGPROBS and chat_teacher:
            raise ValueError(f"generate.topk {self.generate.topk}: a chat API teacher returns at most "
                             f"{CHAT_TOP_LOGPROBS} top log-probs a token (OpenAI's top_logprobs limit)")
        if (self.rl.scores_with_teacher and self.rl.teacher_context == "worked_examples"
                and not self.generate.demonstrations):
            raise ValueError("rl.teacher_context worked_examples puts generate.demonstrations in the "
                             "teacher's prompt, but generate.demonstrations is \"\": name the worked examples' file, "
                             "or set rl.teacher_context: student")
        if (self.rl.student_role == "agentflow_planner"
                and (missing := [r for r in FIXED_MODULES if r not in self.generate.roles])):
            raise ValueError(f"rl.student_role agentflow_planner: generate.roles has no {', '.join(missing)}: name "
                             "the fixed modules that play them (e.g. {model: gpt-4o-mini, backend: openai, api: chat, "
                             "base_url: ...}); without them the student would play them too")
        if self.sft.kd_weight > 0 and not self.generate.topk:
            raise ValueError("sft.kd_weight > 0 distils the teacher's top-k log-probs, but generate.topk is 0: "
                             "set generate.topk (e.g. 8) so generate keeps them")
        if self.generate.stop_at_verified and self.label.judge != "rule":
            raise ValueError("generate.stop_at_verified verifies each trajectory as it is generated, with label's "
                             f"rule judge, but label.judge is {self.label.judge}: set label.judge: rule or "
                             "generate.stop_at_verified: 0")
        if self.generate.stop_at_verified > self.generate.samples:
            raise ValueError(f"generate.stop_at_verified {self.generate.stop_at_verified} is more than "
                             f"generate.samples {self.generate.samples}: no question could stop early")
        if self.rl.trainer == "verl" and self.export.verl_agent != VERL_AGENT_LOOP:
            raise ValueError(f"export.verl_agent must be {VERL_AGENT_LOOP} with rl.trainer verl: unison's student "
                             f"writes tag tool calls (<search>q</search>), which verl's {self.export.verl_agent!r} "
                             "loop does not parse")
        return self

    @model_validator(mode="after")
    def _local_files_in_inputs(self):
        """DVC sees the local files the pipeline takes in only through download.inputs (a dependency of download and
        generate in dvc.yaml): a file elsewhere could change unseen."""
        d, source = self.download, self.generate.source
        kind, _, dataset = d.dataset.partition(":")
        local = (([("download.dataset", dataset)] if kind == "local" else [])
                 + ([("download.corpus", d.corpus)] if d.corpus else []))
        if source:
            kind, _, path = source.partition(":")
            if kind != "local":
                raise ValueError(f"generate.source: {source!r} is not local:<file> (a file under "
                                 f"download.inputs, {d.inputs}/)")
            local.append(("generate.source", path))
        root = os.path.abspath(d.inputs)
        for key, path in local:
            if os.path.commonpath([root, os.path.abspath(path)]) != root:
                raise ValueError(f"{key}: {path} is outside download.inputs ({d.inputs}), the folder DVC watches "
                                 "for the files the pipeline takes in; move it there or set download.inputs to a "
                                 "folder holding it")
        return self

    def stage(self, name: str) -> BaseModel:
        """One stage's section (e.g. params.stage("sft") is params.sft)."""
        return getattr(self, name)

    def teacher_engine(self) -> EngineConfig:
        """The teacher's engine: the shared llm.* settings, the teacher's overrides, its backend and server."""
        t = self.teacher
        return EngineConfig(**{**self.llm.model_dump(), **t.llm, "backend": t.backend, "base_url": t.base_url,
                               "api": t.api, "api_model": t.served_name or t.model.partition(":")[2],
                               "api_key_env": t.api_key_env})

    def system_settings(self) -> SystemSettings:
        """What running a system needs, taken out of these params (stages call this; the library never sees Params)."""
        return SystemSettings(generate=self.generate, tools=self.tools,
                              student_engine=EngineConfig(**self.llm.model_dump()),
                              teacher_engine=self.teacher_engine(), teacher_model=self.teacher.model, seed=self.seed,
                              student_format=self.student.tool_format)


class SystemSettings(BaseModel):
    """What running a system needs, the teacher's method with its roles or a student alone: the generate and tools
    sections, both engines, the teacher's model spec and the seed. Built by `Params.system_settings()` in a stage;
    picklable, so Ray replicas build their Workbench from it."""
    model_config = ConfigDict(frozen=True)
    generate: GenerateConfig
    tools: ToolsConfig
    student_engine: EngineConfig
    teacher_engine: EngineConfig
    teacher_model: str
    seed: int
    student_format: Literal['native', 'tags'] = 'native'

    @property
    def chat_top_logprobs(self) -> int:
        """generate.topk for a chat API teacher, which returns its top log-probs as it generates (0 for a teacher that
        scores the trajectories afterwards, teacher_topk.capture_topk)."""
        return self.generate.topk if self.teacher_engine.chat else 0


def load_params(path: str | os.PathLike | None = None) -> Params:
    """All settings from params.yaml (in the working directory unless `path`), validated."""
    path = Path(path or "params.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such file (run from the project root)") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({e})") from None
    return validate_params(raw, path)


def validate_params(raw: dict, where: str | os.PathLike = "params.yaml") -> Params:
    """`raw` (a parsed params file or overlay) as Params; ParamsError naming `where` and the key otherwise."""
    for block in ("teacher", "student"):
        if not isinstance((raw or {}).get(block), dict):
            raise ParamsError(f"{where}: missing the `{block}` block (teacher and student are separate, "
                              "explicit settings)")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError("\n".join(map(lambda err: describe_error(err, where), e.errors()))) from None


def describe_error(err: dict, where) -> str:
    """One validation error as `<file> <key>: <what is wrong>`; a refused value gets the field's own description."""
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "value_error":  # our validators name the key themselves
        return f"{where} {err['msg'].removeprefix('Value error, ')}"
    if err["type"] == "extra_forbidden":
        return f"{where} {key}: unknown key"
    model, field = Params, None
    for part in err["loc"]:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            break
        model = field.annotation
    hint = f"; {field.description}" if field is not None and field.description else ""
    return f"{where} {key}: {err['msg']} (got {err['input']!r}){hint}"


def engine_with(base: EngineConfig, overrides: dict) -> EngineConfig:
    """`base` with llm.* overrides (a role's, the judge's), validated."""
    return EngineConfig(**{**base.model_dump(), **overrides})
