"""Tool calls in the model's own format (Qwen3 / Hermes ``<tool_call>`` JSON) <-> OpenAI.

Qwen3's chat template asks for each call as::

    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

and renders an assistant message's ``tool_calls`` back the same way, with the
``arguments`` *string* written verbatim. So ``parse_tool_calls`` hands the agent the
arguments exactly as the model wrote them (the raw JSON text, not a re-serialisation):
when the agent sends the message back, the template reproduces the model's own tokens and
the next call's prompt extends this call's (one training sample, not a history rewrite).

Strict by design: a block that is not a JSON object with a string ``name`` and an object
``arguments`` is not repaired (a policy being trained should see its broken calls fail). It
becomes a call with ``error`` set, as OpenAI's API hands back arguments that do not parse:
the name the model wrote (``UNPARSED_NAME`` when there is none) and, as ``arguments``, its
raw text, so the agent answers it with a tool error the model then sees. An unclosed block
(cut off by the token budget) is such a call too; text after the last call is dropped from
the message, as vLLM's parser does, and counted as malformed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ARGS_KEY = re.compile(r'"arguments"\s*:\s*')
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The name of a malformed call whose name cannot be read: the agent answers "unknown tool".
UNPARSED_NAME = "invalid_tool_call"


@dataclass
class ToolCall:
    name: str
    arguments: str  # the model's JSON text of the arguments object, verbatim
    id: str = ""
    error: Optional[str] = None  # why the model's block is not a valid call; None: valid

    def to_openai(self) -> dict:
        return {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: Optional[str]
    tool_calls: list[ToolCall]  # valid and malformed (``error`` set) calls, in order
    stray_text: bool = False  # text after the last call (dropped from the message)

    @property
    def malformed(self) -> int:
        """Malformed calls, text after the calls counting as one."""
        return sum(c.error is not None for c in self.tool_calls) + self.stray_text


def _raw_value(block: str, key_match: Optional[re.Match], value: Any) -> Optional[str]:
    """The model's own text of the JSON value after ``"arguments":``, if it is ``value``."""
    if key_match is None:
        return None
    try:
        parsed, end = json.JSONDecoder().raw_decode(block, key_match.end())
    except ValueError:
        return None
    return block[key_match.end():end] if parsed == value else None


def _malformed(block: str, error: str) -> ToolCall:
    name = ""
    found = _NAME.search(block)
    if found is not None:
        try:
            name = json.loads(f'"{found.group(1)}"')
        except ValueError:
            pass
    return ToolCall(name=name or UNPARSED_NAME, arguments=block, error=error)


def _one_call(block: str) -> ToolCall:
    try:
        obj = json.loads(block)
    except ValueError as e:
        return _malformed(block, f"the tool call is not valid JSON: {e}")
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return _malformed(block, 'the tool call is not a JSON object with a string "name"')
    match = _ARGS_KEY.search(block)
    if not isinstance(obj.get("arguments"), dict):
        raw = _raw_value(block, match, obj.get("arguments")) if "arguments" in obj else ""
        return ToolCall(name=obj["name"], error='"arguments" is not a JSON object',
                        arguments=raw if raw is not None else json.dumps(obj["arguments"]))
    raw = _raw_value(block, match, obj["arguments"])
    if raw is None:  # e.g. a duplicated key: fall back to the parsed value
        raw = json.dumps(obj["arguments"], ensure_ascii=False)
    return ToolCall(name=obj["name"], arguments=raw)


def _content(text: str) -> Optional[str]:
    # Qwen3's template writes "content\n<tool_call>...": content is the text before the
    # first call, without that separating newline.
    return (text[:-1] if text.endswith("\n") else text) or None


def parse_tool_calls(text: str) -> Parsed:
    """Split model text into content and tool calls (malformed ones with ``error`` set)."""
    blocks = list(_BLOCK.finditer(text))
    tail_from = blocks[-1].end() if blocks else 0
    unclosed = text.find(OPEN, tail_from)
    if not blocks and unclosed < 0:
        return Parsed(content=text, tool_calls=[])
    calls = [_one_call(m.group(1)) for m in blocks]
    trailing = text[tail_from:unclosed if unclosed >= 0 else len(text)]
    if unclosed >= 0:
        calls.append(_malformed(text[unclosed + len(OPEN):].strip(),
                                f"the {OPEN} block is not closed with {CLOSE}"))
    first = blocks[0].start() if blocks else unclosed
    return Parsed(content=_content(text[:first]), tool_calls=calls,
                  stray_text=bool(blocks) and bool(trailing.strip()))


def format_tool_calls(calls: list[ToolCall], content: Optional[str] = None) -> str:
    """The text Qwen3's template renders for an assistant message with these calls (what a
    scripted player emits, and what a well-formed model output looks like)."""
    parts = [content] if content else []
    for call in calls:
        parts.append('<tool_call>\n{"name": ' + json.dumps(call.name, ensure_ascii=False)
                     + ', "arguments": ' + call.arguments + '}\n</tool_call>')
    return "\n".join(parts)
