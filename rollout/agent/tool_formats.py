"""Which tool-call format a chat template writes, named as SGLang's ``--tool-call-parser``
names them: ``hermes`` (Qwen3's ``<tool_call>`` JSON, rollout/agent/toolcalls.py) or
``qwen3_coder`` (Qwen3.5's ``<function=...>`` XML, rollout/agent/xml_toolcalls.py). Each
gives the session its parser, the text a scripted player writes for a call, and the form
the template needs an agent's messages in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import rollout.agent.toolcalls as toolcalls
import rollout.agent.xml_toolcalls as xml_toolcalls
from rollout.agent.toolcalls import Parsed, ToolCall


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parse: Callable[[str, Optional[list]], Parsed]  # (model text, request tools)
    format: Callable[[list[ToolCall], Optional[str]], str]  # (calls, content) -> text
    prepare: Callable[[list], list]  # messages as the template takes them


HERMES = ToolFormat("hermes", lambda text, tools: toolcalls.parse_tool_calls(text),
                    toolcalls.format_tool_calls, lambda messages: messages)
QWEN3_CODER = ToolFormat("qwen3_coder", xml_toolcalls.parse_tool_calls,
                         xml_toolcalls.format_tool_calls, xml_toolcalls.arguments_as_objects)


def tool_format(tokenizer: Any) -> ToolFormat:
    """The format the tokenizer's chat template writes tool calls in."""
    template = getattr(tokenizer, "chat_template", None) or ""
    texts = template.values() if isinstance(template, dict) else [template]
    return QWEN3_CODER if any(xml_toolcalls.MARKER in t for t in texts) else HERMES
