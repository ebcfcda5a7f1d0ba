"""Anthropic's Messages API (``POST /v1/messages``) <-> the session's chat messages.

Request: ``system`` becomes a system message; a user turn's ``tool_result`` blocks become
``tool`` messages and its text blocks a user message (in block order); an assistant turn's
text blocks its content and its ``tool_use`` blocks its ``tool_calls`` (``input`` as JSON
text; ``thinking`` blocks are dropped). Tools (``name``, ``description``,
``input_schema``) become chat tools, ``max_tokens`` (required, as Anthropic requires it)
the token budget.

Response: a ``message`` with a text block (when there is text or no call) and one
``tool_use`` block per tool call; ``stop_reason`` ``tool_use`` / ``max_tokens`` /
``end_turn``. A malformed call's ``input`` is ``{"INVALID_JSON": <the model's text>}``,
Anthropic's own wrapping of invalid JSON; sent back, it becomes that text again, so the
turn renders as the model wrote it. Streamed as Anthropic's events, ``message_start`` to
``message_stop``.
"""

from __future__ import annotations

import json
from typing import Any

from rollout.agent.dialects.base import (RequestError, bad_request, chat_tools,
                                         completion_parts, new_id, passed_on, sse, text_of)

# The anthropic client appends /v1/messages to its base URL: the session's own base URL
# (which ends in /v1) and its root both work.
ROUTES = ("/v1/messages", "/v1/v1/messages")
INVALID_JSON = "INVALID_JSON"
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 503: "overloaded_error"}


def _arguments(tool_input: Any) -> str:
    if isinstance(tool_input, dict) and set(tool_input) == {INVALID_JSON} \
            and isinstance(tool_input[INVALID_JSON], str):
        return tool_input[INVALID_JSON]
    return json.dumps(tool_input, ensure_ascii=False)


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {INVALID_JSON: arguments}


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where}: content must be a string or a list of blocks",
                          "invalid_content")
    return content


def _user(content: Any, where: str) -> list[dict]:
    out: list[dict] = []
    text: list[dict] = []
    for k, block in enumerate(_blocks(content, where)):
        if block.get("type") == "tool_result":
            if text:
                out.append({"role": "user", "content": text_of(text, where)})
                text = []
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": text_of(block.get("content"), f"{where}[{k}].content")})
        else:
            text.append(block)
    if text:
        out.append({"role": "user", "content": text_of(text, where)})
    return out


def _assistant(content: Any, where: str) -> dict:
    text: list[dict] = []
    calls: list[dict] = []
    for block in _blocks(content, where):
        kind = block.get("type")
        if kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": _arguments(block.get("input"))}})
        elif kind not in ("thinking", "redacted_thinking"):
            text.append(block)
    message: dict[str, Any] = {"role": "assistant", "content": text_of(text, where) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"any": "required"}.get(kind, kind)


def to_chat(body: dict) -> dict:
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad_request("'max_tokens' is required (a positive integer)", "invalid_value")
    messages: list[dict] = []
    if body.get("system"):
        messages.append({"role": "system", "content": text_of(body["system"], "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad_request("'messages' must be a non-empty list", "invalid_messages")
    for k, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role == "user":
            messages += _user(turn.get("content"), f"messages[{k}]")
        elif role == "assistant":
            messages.append(_assistant(turn.get("content"), f"messages[{k}]"))
        else:
            raise bad_request(f"messages[{k}]: role must be 'user' or 'assistant' (the system "
                              "prompt goes in 'system')", "invalid_messages")
    chat: dict[str, Any] = {**passed_on(body), "messages": messages,
                            "max_tokens": body["max_tokens"]}
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    tools = chat_tools(body.get("tools"), accepts=lambda t: t.get("type") in (None, "custom"),
                       schema_key="input_schema", what="client tools (name, input_schema)")
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return chat


def from_chat(completion: dict, request: dict) -> dict:
    message, finish, usage = completion_parts(completion)
    calls = message.get("tool_calls") or []
    content: list[dict] = []
    if message.get("content") or not calls:
        content.append({"type": "text", "text": message.get("content") or ""})
    for call in calls:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    return {"id": new_id("msg"), "type": "message", "role": "assistant",
            "model": completion["model"], "content": content,
            "stop_reason": _STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "output_tokens": usage["completion_tokens"]}}


def stream(message: dict, request: dict) -> list[bytes]:
    events: list[bytes] = []

    def emit(kind: str, **data: Any) -> None:
        events.append(sse({"type": kind, **data}, kind))

    emit("message_start", message={**message, "content": [], "stop_reason": None,
                                   "usage": {**message["usage"], "output_tokens": 0}})
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            emit("content_block_start", index=index, content_block={"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            emit("content_block_start", index=index, content_block={**block, "input": {}})
            delta = {"type": "input_json_delta",
                     "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        emit("content_block_delta", index=index, delta=delta)
        emit("content_block_stop", index=index)
    emit("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": None},
         usage={"output_tokens": message["usage"]["output_tokens"]})
    emit("message_stop")
    return events


def error_body(error: RequestError) -> dict:
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
