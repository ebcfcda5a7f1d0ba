"""What every dialect shares: the request error, server-sent events, message text."""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Optional


class RequestError(Exception):
    """A request the endpoint answers with an error status (the dialect shapes the body)."""

    def __init__(self, status: int, message: str, code: str,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


def bad_request(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, message, code)


# Request keys every dialect hands on unchanged: the sampling trainer.serve applies (a
# rollout's session samples with the run's own) and the template's keyword arguments.
PASSED_ON = ("model", "temperature", "top_p", "top_k", "seed", "chat_template_kwargs")


def passed_on(body: dict) -> dict:
    return {key: body[key] for key in PASSED_ON if body.get(key) is not None}


def sse(data: dict, event: Optional[str] = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def text_of(content: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """The text of a message's content: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in part_types
                    and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}: content part of type {kind!r} is not supported "
                                  f"(text only: {', '.join(part_types)})", "unsupported_content")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts
    raise bad_request(f"{where}: content must be a string or a list of text parts",
                      "invalid_content")


def chat_tools(tools: Any, *, accepts: Callable[[dict], bool], schema_key: str,
               what: str) -> Optional[list]:
    """A dialect's tool declarations as chat tools, in OpenAI's key order (the template
    writes them as given)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "invalid_tools")
    out = []
    for k, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("name") and accepts(tool)):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{k}]: only {what} are supported (got type {kind!r})",
                              "unsupported_tool")
        function = {"name": tool["name"], "description": tool.get("description"),
                    "parameters": tool.get(schema_key), "strict": tool.get("strict")}
        out.append({"type": "function",
                    "function": {key: v for key, v in function.items() if v is not None}})
    return out


def completion_parts(completion: dict) -> tuple[dict, str, dict]:
    """(message, finish_reason, usage) of a chat.completion."""
    choice = completion["choices"][0]
    return choice["message"], choice["finish_reason"], completion["usage"]


def openai_error_body(error: RequestError) -> dict:
    """OpenAI's error shape, which the ``openai`` client reads into its exceptions."""
    return {"error": {"message": error.message, "type": error.kind, "param": None,
                      "code": error.code}}
