"""What every dialect shares: the request error, server-sent events, message text."""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional


class RequestError(Exception):
    """A request the endpoint answers with an error status (the dialect shapes the body)."""

    def __init__(self, status: int, message: str, code: str,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


def bad_request(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, message, code)


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


def completion_parts(completion: dict) -> tuple[dict, str, dict]:
    """(message, finish_reason, usage) of a chat.completion."""
    choice = completion["choices"][0]
    return choice["message"], choice["finish_reason"], completion["usage"]


def openai_error_body(error: RequestError) -> dict:
    """OpenAI's error shape, which the ``openai`` client reads into its exceptions."""
    return {"error": {"message": error.message, "type": error.kind, "param": None,
                      "code": error.code}}
