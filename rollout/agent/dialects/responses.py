"""OpenAI's Responses API (``POST /responses``) <-> the session's chat messages.

Request: ``instructions`` become a system message; ``input`` (a string, or items) becomes
messages -- ``message`` items by role (``developer`` as ``system``), a run of assistant-side
items (an assistant ``message`` and ``function_call`` items) one assistant message with
``tool_calls``, ``function_call_output`` items ``tool`` messages; ``reasoning`` items are
dropped (the chat template renders no reasoning items). ``function`` tools become chat
tools, ``max_output_tokens`` the token budget. Sessions keep no server-side state, so
``previous_response_id`` is refused: send the whole input, as a stateless client does.

Response: a ``response`` object whose ``output`` is an assistant ``message`` item (when
there is text or no call) and one ``function_call`` item per tool call (``call_id`` is the
chat tool call's id, so a ``function_call_output`` answers it); ``status`` is
``incomplete`` when the token budget ran out. Streamed as Responses events, from
``response.created`` to ``response.completed`` (or ``response.incomplete``).
"""

from __future__ import annotations

from typing import Any, Optional

from rollout.agent.dialects.base import (bad_request, chat_tools, completion_parts, new_id,
                                         openai_error_body, passed_on, sse, text_of)

ROUTES = ("/v1/responses",)
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def to_chat(body: dict) -> dict:
    if body.get("previous_response_id"):
        raise bad_request("previous_response_id: sessions keep no server-side state; send "
                          "the whole conversation as 'input'", "unsupported_parameter")
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system",
                         "content": text_of(body["instructions"], "instructions", _TEXT_PARTS)})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items",
                          "invalid_input")
    assistant: Optional[dict] = None  # the assistant message the current run folds into
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{k}] must be an object", "invalid_input")
        kind = item.get("type") or "message"
        role = item.get("role")
        if kind == "reasoning":
            continue
        if kind == "function_call" or (kind == "message" and role == "assistant"):
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
                messages.append(assistant)
            if kind == "message":
                assistant["content"] += text_of(item.get("content"), f"input[{k}]", _TEXT_PARTS)
            else:
                assistant.setdefault("tool_calls", []).append({
                    "id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
            continue
        assistant = None
        if kind == "message" and role in _ROLES:
            messages.append({"role": _ROLES[role], "content": text_of(
                item.get("content"), f"input[{k}]", _TEXT_PARTS)})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": text_of(item.get("output"), f"input[{k}].output",
                                                _TEXT_PARTS)})
        else:
            raise bad_request(f"input[{k}]: item type {kind!r} (role {role!r}) is not "
                              "supported", "unsupported_input")
    for m in messages:
        if m["role"] == "assistant" and not m["content"] and m.get("tool_calls"):
            m["content"] = None
    chat: dict[str, Any] = {**passed_on(body), "messages": messages}
    tools = chat_tools(body.get("tools"), accepts=lambda t: t.get("type") == "function",
                       schema_key="parameters", what="function tools")
    if tools:
        chat["tools"] = tools
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def from_chat(completion: dict, request: dict) -> dict:
    message, finish, usage = completion_parts(completion)
    incomplete = finish == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append({"id": new_id("msg"), "type": "message", "role": "assistant",
                       "status": status, "content": [{
                           "type": "output_text", "text": message.get("content") or "",
                           "annotations": [], "logprobs": []}]})
    for call in calls:
        output.append({"id": new_id("fc"), "type": "function_call", "status": "completed",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"]})
    return {
        "id": new_id("resp"), "object": "response", "created_at": completion["created"],
        "model": completion["model"], "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"), "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice") or "auto", "tools": request.get("tools") or [],
        "max_output_tokens": request.get("max_output_tokens"), "previous_response_id": None,
        "temperature": None, "top_p": None, "truncation": "disabled",
        "text": {"format": {"type": "text"}}, "metadata": request.get("metadata") or {},
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }


def stream(response: dict, request: dict) -> list[bytes]:
    events: list[bytes] = []

    def emit(kind: str, **data: Any) -> None:
        events.append(sse({"type": kind, "sequence_number": len(events), **data}, kind))

    head = {**response, "status": "in_progress", "output": [], "usage": None,
            "incomplete_details": None}
    emit("response.created", response=head)
    emit("response.in_progress", response=head)
    for index, item in enumerate(response["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", **at, content_index=0,
                 part={**part, "text": ""})
            emit("response.output_text.delta", **at, content_index=0, delta=part["text"],
                 logprobs=[])
            emit("response.output_text.done", **at, content_index=0, text=part["text"],
                 logprobs=[])
            emit("response.content_part.done", **at, content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"],
                 arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit(f"response.{response['status']}", response=response)
    return events


error_body = openai_error_body
