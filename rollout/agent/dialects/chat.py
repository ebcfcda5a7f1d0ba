"""OpenAI chat completions: the sessions' own format; ``stream=True`` as
``chat.completion.chunk`` events (the role, the content, one chunk per tool call, the
finish reason; with ``stream_options={"include_usage": true}`` a last chunk with the usage
and no choices), then ``data: [DONE]``."""

from __future__ import annotations

from rollout.agent.dialects.base import completion_parts, openai_error_body, sse

ROUTES = ("/v1/chat/completions",)


def to_chat(body: dict) -> dict:
    return body


def from_chat(completion: dict, request: dict) -> dict:
    return completion


def stream(completion: dict, request: dict) -> list[bytes]:
    message, finish, usage = completion_parts(completion)
    options = request.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    head = {k: completion[k] for k in ("id", "created", "model")}
    head.update(object="chat.completion.chunk", system_fingerprint=None)
    if include_usage:  # OpenAI sends "usage": null on every chunk but the last
        head["usage"] = None

    def chunk(delta: dict, finish_reason=None) -> bytes:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]})

    events = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        events.append(chunk({"content": message["content"]}))
    for index, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": index, **call}]}))
    events.append(chunk({}, finish))
    if include_usage:
        events.append(sse({**head, "choices": [], "usage": usage}))
    return events + [b"data: [DONE]\n\n"]


error_body = openai_error_body
