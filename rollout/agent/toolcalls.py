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
``arguments`` is not a tool call; the whole text then stays content, and the caller counts
it as malformed (a policy being trained should see its broken calls fail, not be repaired).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ARGS_KEY = re.compile(r'"arguments"\s*:\s*')


@dataclass
class ToolCall:
    name: str
    arguments: str  # the model's JSON text of the arguments object, verbatim
    id: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: Optional[str]
    tool_calls: list[ToolCall]
    malformed: bool = False  # a <tool_call> block that is not a valid call


def _one_call(block: str) -> Optional[ToolCall]:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]
            and isinstance(obj.get("arguments"), dict)):
        return None
    match = _ARGS_KEY.search(block)
    raw = None
    if match is not None:
        try:
            value, end = json.JSONDecoder().raw_decode(block, match.end())
            if value == obj["arguments"]:
                raw = block[match.end():end]
        except ValueError:
            pass
    if raw is None:  # e.g. a duplicated key: fall back to the parsed value
        raw = json.dumps(obj["arguments"], ensure_ascii=False)
    return ToolCall(name=obj["name"], arguments=raw)


def parse_tool_calls(text: str) -> Parsed:
    """Split model text into content and tool calls (all-or-nothing per message)."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        malformed = "<tool_call>" in text
        return Parsed(content=text, tool_calls=[], malformed=malformed)
    calls = [_one_call(m.group(1)) for m in blocks]
    if any(c is None for c in calls):
        return Parsed(content=text, tool_calls=[], malformed=True)
    # Qwen3's template writes "content\n<tool_call>...": content is the text before the
    # first call, without that separating newline.
    content = text[:blocks[0].start()]
    if content.endswith("\n"):
        content = content[:-1]
    trailing = text[blocks[-1].end():].strip()
    if trailing:  # text after the calls has no place in an OpenAI message
        return Parsed(content=text, tool_calls=[], malformed=True)
    return Parsed(content=content or None, tool_calls=calls)


def format_tool_calls(calls: list[ToolCall], content: Optional[str] = None) -> str:
    """The text Qwen3's template renders for an assistant message with these calls (what a
    scripted player emits, and what a well-formed model output looks like)."""
    parts = [content] if content else []
    for call in calls:
        parts.append('<tool_call>\n{"name": ' + json.dumps(call.name, ensure_ascii=False)
                     + ', "arguments": ' + call.arguments + '}\n</tool_call>')
    return "\n".join(parts)
