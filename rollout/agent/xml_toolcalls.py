"""Tool calls in Qwen3.5's format (Qwen3-Coder's XML) <-> OpenAI.

Qwen3.5's chat template asks for each call as::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

and renders an assistant message's ``tool_calls`` back that way from an arguments *object*
(``arguments|items``): a string value verbatim, an object or array as JSON, anything else
through Jinja's ``string`` (Python's ``str``). Values are text, so the OpenAI arguments
are typed from the request's tool schema, as SGLang's ``qwen3_coder`` parser
(srt/function_call/qwen3_coder_detector.py) types them: ``null`` is None, an integer or
number parameter a number, a boolean ``true``/``false``, an object or array its JSON,
anything else (a string, a parameter the schema does not name) the text itself. A value
that does not read as its type stays the text, as SGLang leaves it.

An answer the agent sends back unchanged is rendered as the model's own text (the
session's echo), so typing never costs token-exactness. Rendered from its arguments, a
call reads back as the model wrote it except for values Jinja's ``string`` spells
otherwise (``true`` / ``null`` come back as ``True`` / ``None``, as Qwen3.5's own template
writes them). A message the agent wrote or
edited goes to the template with its arguments as the object the template needs
(``arguments_as_objects``), as SGLang's server converts them.

Strict as the JSON format (rollout/agent/toolcalls.py): a block that is not one
``<function=...>`` of ``<parameter=...>`` blocks is not repaired; it becomes a call with
``error`` set, its arguments the model's raw text.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from rollout.agent.toolcalls import UNPARSED_NAME, Parsed, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MARKER = "<function="  # in a chat template: it writes this format
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^<>\n]+)>\n(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^<>\n]+)>\n(.*?)\n</parameter>\n", re.DOTALL)
_NAME = re.compile(r"<function=([^<>\n]+)>")


def _types(tools: Optional[list], name: str) -> dict[str, str]:
    """Each parameter's JSON-schema type in tool ``name``'s schema ({} when unknown)."""
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or fn.get("name") != name:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties", {}) if isinstance(params, dict) else {}
        out = {}
        for key, schema in props.items() if isinstance(props, dict) else ():
            kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
            if isinstance(kind, list):  # e.g. ["integer", "null"]
                kind = next((k for k in kind if k != "null"), "string")
            out[key] = kind if isinstance(kind, str) else "string"
        return out
    return {}


def _typed(text: str, kind: Optional[str]) -> Any:
    if text.lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            value = float(text)
            return int(value) if value.is_integer() and not any(c in text for c in ".eE") \
                else value
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            value = json.loads(text)
            if isinstance(value, dict if kind == "object" else list):
                return value
    except ValueError:
        pass
    return text


def _one_call(body: str, tools: Optional[list]) -> ToolCall:
    function = _FUNCTION.fullmatch(body)
    if function is None:
        found = _NAME.search(body)
        return ToolCall(name=found.group(1) if found else UNPARSED_NAME, arguments=body,
                        error="the tool call is not one <function=...> block ending in "
                              "</function>")
    name, params = function.group(1), function.group(2)
    types, values, at = _types(tools, name), {}, 0
    for m in _PARAMETER.finditer(params):
        if m.start() != at or m.group(1) in values:
            break
        values[m.group(1)] = _typed(m.group(2), types.get(m.group(1)))
        at = m.end()
    if at != len(params):
        return ToolCall(name=name, arguments=body,
                        error="the function's body is not a sequence of <parameter=...> "
                              "blocks with distinct names")
    return ToolCall(name=name, arguments=json.dumps(values, ensure_ascii=False))


def parse_tool_calls(text: str, tools: Optional[list] = None) -> Parsed:
    """Split model text into content and tool calls (malformed ones with ``error`` set);
    ``tools``: the request's tools, whose schemas type the arguments."""
    blocks = list(_BLOCK.finditer(text))
    tail_from = blocks[-1].end() if blocks else 0
    unclosed = text.find(OPEN, tail_from)
    if not blocks and unclosed < 0:
        return Parsed(content=text, tool_calls=[])
    calls = [_one_call(m.group(1), tools) for m in blocks]
    trailing = text[tail_from:unclosed if unclosed >= 0 else len(text)]
    if unclosed >= 0:
        body = text[unclosed + len(OPEN):]
        found = _NAME.search(body)
        calls.append(ToolCall(name=found.group(1) if found else UNPARSED_NAME,
                              arguments=body.strip(),
                              error=f"the {OPEN} block is not closed with {CLOSE}"))
    first = blocks[0].start() if blocks else unclosed
    # The template writes "content\n\n<tool_call>": content is the text before the first
    # call without that separator.
    content = text[:first]
    content = content[:-2] if content.endswith("\n\n") else content
    return Parsed(content=content or None, tool_calls=calls,
                  stray_text=bool(blocks) and bool(trailing.strip()))


def _value_text(value: Any) -> str:
    """A value as the template writes it: strings verbatim, objects and arrays as
    transformers' ``tojson``, anything else as Jinja's ``string`` (Python's str)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def format_tool_calls(calls: list[ToolCall], content: Optional[str] = None) -> str:
    """The text Qwen3.5's template renders for an assistant message with these calls (what a
    scripted player emits, and what a well-formed model output looks like)."""
    blocks = []
    for call in calls:
        params = "".join(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n"
                         for k, v in json.loads(call.arguments).items())
        blocks.append(f"{OPEN}\n<function={call.name}>\n{params}</function>\n{CLOSE}")
    calls_text = "\n".join(blocks)
    if content and content.strip():
        return f"{content}\n\n{calls_text}" if calls_text else content
    return calls_text


def arguments_as_objects(messages: list) -> list:
    """Messages with each assistant tool call's ``arguments`` JSON text as the object the
    template iterates (left as it is when it is not a JSON object: the template's error
    then names it)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and any(_text_arguments(c) for c in calls):
            message = dict(message, tool_calls=[_as_object(c) for c in calls])
        out.append(message)
    return out


def _text_arguments(call: Any) -> bool:
    fn = call.get("function", call) if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("arguments"), str)


def _as_object(call: Any) -> Any:
    if not _text_arguments(call):
        return call
    fn = call.get("function", call)
    try:
        value = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(value, dict):
        return call
    fn = dict(fn, arguments=value)
    return dict(call, function=fn) if "function" in call else fn
