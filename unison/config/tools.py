"""`tools.*`: the tools, their sandbox and MCP servers."""
from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, model_validator

from .base import Section


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
