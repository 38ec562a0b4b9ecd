"""`student.*` and `teacher.*`: which models, and where the teacher runs."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section, check_model_spec
from .llm import check_base_url, check_llm_overrides


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
