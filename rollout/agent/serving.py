"""The agent session's chat, served in front of the router for ``trainer.serve``: chat
completions (``stream`` too), Responses and Anthropic Messages rendered, parsed and
answered exactly as a rollout's session does (tools, tool calls, a malformed call as an
answerable call, an answered turn sent back rendered as the model wrote it), but with
each request's own sampling (``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
``max_tokens``, ``chat_template_kwargs``) and nothing recorded.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

from rollout.agent.dialects.base import RequestError
from rollout.agent.session import Session
from rollout.engines.client import EngineError
from rollout.http import post

# Request keys -> the engine's sampling params (SGLang's names).
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "stop": "stop", "seed": "sampling_seed"}


class _RouterPolicy:
    """One request's sampling over the router's ``/generate`` (token ids in and out)."""

    def __init__(self, generate_url: str, params: dict) -> None:
        self.generate_url, self.params = generate_url, params

    async def act(self, token_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], list[float], str]:
        payload = {"input_ids": token_ids,
                   "sampling_params": {**self.params, "max_new_tokens": max_new_tokens}}
        try:
            out = await post(self.generate_url, payload)
        except EngineError as e:
            if e.status is not None and 400 <= e.status < 500:  # e.g. temperature=-1
                raise RequestError(400, f"the engine refused the request: {e.message}",
                                   "invalid_value") from e
            raise
        finish = ((out.get("meta_info") or {}).get("finish_reason") or {}).get("type", "stop")
        return list(out.get("output_ids") or []), [], finish


class ChatService:
    """``complete(chat_body) -> chat.completion`` for the router at ``router_url``."""

    def __init__(self, router_url: str, tokenizer: Any, max_context_len: int) -> None:
        self.generate_url = router_url.rstrip("/") + "/generate"
        self.tokenizer, self.max_context_len = tokenizer, max_context_len
        self.answers: dict = {}  # answered tool calls, shared by the requests (bounded)

    async def complete(self, body: dict) -> dict:
        params = {name: body[key] for key, name in _SAMPLING.items()
                  if body.get(key) is not None}
        kwargs: Optional[Any] = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError(400, "'chat_template_kwargs' must be an object", "invalid_value")
        session = Session(id=uuid.uuid4().hex, policy=_RouterPolicy(self.generate_url, params),
                          tokenizer=self.tokenizer, max_new_tokens=self.max_context_len,
                          max_context_len=self.max_context_len,
                          chat_template_kwargs=dict(kwargs or {}), answers=self.answers)
        return await session.complete(body)
