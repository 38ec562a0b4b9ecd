"""unison's agent loop for verl: the student's tag protocol, run the way the in-house runtime runs it
(agents/runtime.py).

verl's tool_agent loop parses tool calls in the chat template's format and answers them in tool-role turns. unison's
student writes <search>q</search> / <python>code</python> and reads the observation inline. This loop generates each
turn with the tool close tags and </answer> as stop strings. It runs the call through one of verl's tools (unison's
UnisonTool entries of the tool config, so unison's Toolbox) and appends the observation block's tokens with
response_mask 0. An answer closes the turn with EOS. An unparsable call is answered with an error observation. The
episode ends at max_turns, max_tool_calls, a turn without a call, or the response budget.
stages/rl.py registers it as `unison_agent` (actor_rollout_ref.rollout.agent.agent_loop_config_path); rows whose
agent_name is unison_agent (params.yaml export.verl_agent) run it.
"""
from __future__ import annotations

from uuid import uuid4

from ..config import VERL_AGENT_LOOP
from ..protocol import parse_tool_call, stops_for
from ..tools.registry import call_arguments

NAME = VERL_AGENT_LOOP  # the agent loop's name in verl's registry
UNPARSABLE = "error: could not parse the tool call"  # the runtime's observation for a call it cannot parse


async def tag_protocol_episode(generate, call_tool, tokenizer, prompt_ids: list[int], tools: tuple[str, ...],
                               max_turns: int, max_tool_calls: int, max_tokens_per_turn: int,
                               response_length: int) -> dict:
    """One episode: `generate(ids, sampling) -> (token ids, log-probs or None)` per turn, `call_tool(tool, argument)
    -> observation block` per call. Returns response_ids, response_mask, response_logprobs and num_turns."""
    ids, mask, logprobs = [], [], []
    turns = calls = 0

    def append(tokens: list[int], generated: int, lps=None) -> None:
        ids.extend(tokens)
        mask.extend([generated] * len(tokens))
        logprobs.extend(lps if lps else [0.0] * len(tokens))

    while turns < max_turns and len(ids) < response_length:
        sampling = {"stop": stops_for(tools), "include_stop_str_in_output": True,
                    "max_tokens": min(max_tokens_per_turn, response_length - len(ids))}
        tokens, lps = await generate(prompt_ids + ids, sampling)
        turns += 1
        append(tokens, 1, lps)
        text = tokenizer.decode(tokens, skip_special_tokens=True).rstrip()
        if text.endswith("</answer>"):
            if tokens and tokens[-1] != tokenizer.eos_token_id:
                append([tokenizer.eos_token_id], 1)
            break
        tool = next((t for t in tools if text.endswith(f"</{t}>")), None)
        if tool is None or calls >= max_tool_calls:
            break
        calls += 1
        call = parse_tool_call(text, tools)
        block = await call_tool(*call) if call else await call_tool(None, UNPARSABLE)
        append(tokenizer(block, add_special_tokens=False)["input_ids"], 0)
    return {"response_ids": ids[:response_length], "response_mask": mask[:response_length],
            "response_logprobs": logprobs[:response_length], "num_turns": turns}


try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
except ImportError:  # verl is not installed (the CPU lock): the episode function above is still tested
    AgentLoopBase = None

if AgentLoopBase is not None:
    from ..protocol import observation

    class UnisonAgentLoop(AgentLoopBase):
        """verl's agent loop interface over tag_protocol_episode; the tools are the worker's (the tool config's)."""

        def __init__(self, *args, max_tokens_per_turn: int, tools=None, **kwargs):
            super().__init__(*args, **kwargs)
            multi_turn = self.rollout_config.multi_turn
            self.max_turns, self.max_tool_calls = multi_turn.max_assistant_turns, multi_turn.max_user_turns
            self.response_length, self.max_tokens_per_turn = self.rollout_config.response_length, max_tokens_per_turn
            self.tools = {t.name: t for t in (tools.tools if tools is not None else [])}

        async def run(self, sampling_params: dict, **kwargs) -> AgentLoopOutput:
            prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
            request_id = uuid4().hex

            async def generate(ids: list[int], sampling: dict):
                out = await self.server_manager.generate(request_id=request_id, prompt_ids=ids,
                                                         sampling_params={**sampling_params, **sampling})
                return out.token_ids, out.log_probs

            async def call_tool(tool: str | None, argument: str) -> str:
                if tool is None:
                    return observation(argument)
                response, _, _ = await self.tools[tool].execute(request_id, call_arguments(tool, argument))
                return response.text

            episode = await tag_protocol_episode(generate, call_tool, self.tokenizer, prompt_ids, tuple(self.tools),
                                                 self.max_turns, self.max_tool_calls, self.max_tokens_per_turn,
                                                 self.response_length)
            return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=episode["response_ids"],
                                   response_mask=episode["response_mask"],
                                   response_logprobs=(episode["response_logprobs"]
                                                      if sampling_params.get("logprobs") else None),
                                   num_turns=episode["num_turns"], metrics={},
                                   extra_fields={"turn_scores": [], "tool_rewards": []})
