"""Agents written for the OpenAI API as rollouts.

    rollout.agent.function=mypkg.agents:solve

    async def solve(client, sample, args) -> float | dict | None:
        r = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...

``client`` is an ``openai.AsyncOpenAI`` whose base URL is this episode's session
(rollout/agent/session.py) in front of the engines. The session also speaks streamed chat
completions, OpenAI's Responses API and Anthropic's Messages API
(``anthropic.AsyncAnthropic(base_url=str(client.base_url), ...)``), each converted to the
chat completion it renders (rollout/agent/dialects/). Every call is recorded token-exactly
and the episode becomes one or more samples (rollout/agent/trace.py). The agent returns
the episode's reward, or None to leave it to rollout.custom_rm_function.

Behaves as the other generate paths: the run's sampling params and evaluation seeds,
rollout.sample_timeout_s (the episode is cancelled), the step's abort (the session answers
503 and the episode is restarted next step under rollout.partial_rollout, as a custom
generate function is), an agent that raises fails its sample (and group).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

from rollout.agent.session import Session, SessionServer
from rollout.agent.toolcalls import ToolCall, format_tool_calls, parse_tool_calls
from rollout.agent.trace import Call, HistoryRewriteError, Trace, build_samples
from rollout.sample import Sample

__all__ = ["run_agent", "make_agent_generate", "ScriptedChatPolicy", "Session",
           "SessionServer", "Trace", "Call", "build_samples", "HistoryRewriteError",
           "ToolCall", "parse_tool_calls", "format_tool_calls"]


async def run_agent(agent: Callable, args: Any, sample: Sample, policy: Any, *,
                    tokenizer: Any, max_new_tokens: int, max_context_len: int,
                    chat_template_kwargs: Optional[dict] = None,
                    history_policy: str = "split", timeout: float = 300.0) -> list[Sample]:
    """Run ``agent`` for one episode against ``policy``; return the episode's samples."""
    server = await SessionServer.get()
    session = server.open(policy=policy, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                          max_context_len=max_context_len,
                          chat_template_kwargs=dict(chat_template_kwargs or {}))
    client = server.client(session, timeout=timeout)
    try:
        try:
            reward = await agent(client, sample, args)
        except Exception:
            if session.aborted:  # the agent only saw the abort's 503
                sample.status = Sample.Status.ABORTED
                return [sample]
            raise
    finally:
        server.close_session(session)
    if session.aborted:  # an agent that caught the 503 and returned anyway
        sample.status = Sample.Status.ABORTED
        return [sample]
    samples = build_samples(session.trace, sample, policy=history_policy)
    tokenizer_decode = tokenizer.decode
    for s in samples:
        s.prompt = tokenizer_decode(s.tokens[:s.prompt_length])
        s.response = tokenizer_decode(s.response_tokens, skip_special_tokens=True)
        if reward is not None:
            s.reward = reward
    return samples


def make_agent_generate(agent: Callable, history_policy: str) -> Callable:
    """The agent as a custom generate function ``(args, sample, sampling_params)``."""
    from rollout.generate import EnginePolicy, GenerateState

    async def agent_generate(args: Any, sample: Sample, sampling_params: dict) -> list[Sample]:
        state = GenerateState(args)
        policy = EnginePolicy(state, sampling_params)
        return await run_agent(
            agent, args, sample, policy, tokenizer=state.tokenizer,
            max_new_tokens=int(sampling_params.get("max_new_tokens",
                                                   state.sampling_params["max_new_tokens"])),
            max_context_len=state.max_context_len,
            chat_template_kwargs=state.chat_template_kwargs, history_policy=history_policy,
            timeout=float(args.rollout.sample_timeout_s))

    agent_generate.__name__ = f"agent_generate[{getattr(agent, '__name__', 'agent')}]"
    return agent_generate


class ScriptedChatPolicy:
    """A scripted player behind a session: ``reply(sample, messages, tools, rng) -> str``
    is tokenized and closed with eos where the model's output ids would go (log-prob 0),
    so warm-up transcripts of an agent have the token layout of its RL rollouts."""

    def __init__(self, reply: Callable, sample: Sample, tokenizer: Any,
                 rng: random.Random) -> None:
        self.reply, self.sample, self.tokenizer, self.rng = reply, sample, tokenizer, rng
        self.eos = tokenizer.eos_token_id
        self.weight_version = None
        self._request: tuple[list, Optional[list]] = ([], None)

    def observe_request(self, messages: list[dict], tools: Optional[list[dict]]) -> None:
        self._request = (messages, tools)

    async def act(self, token_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], list[float], str]:
        text = self.reply(self.sample, *self._request, self.rng)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
        finish = "stop"
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        return ids, [0.0] * len(ids), finish
