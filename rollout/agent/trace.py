"""An agent episode's chat-completion calls -> training samples.

Each call records the prompt ids the engine was sent (the chat template's render of the
messages and tools), the engine's output ids verbatim and their log-probs. A call whose
prompt starts with the previous call's whole context (its prompt + output) continues the
same sample: the new tokens in between (the template's turn markup, tool results, new user
text) get loss mask 0, the model's output loss mask 1. A call whose prompt does not extend
it rewrote the history (dropped or edited an earlier turn, a template that re-renders old
turns differently): the context the model saw is not a continuation, so those tokens
cannot be trained as one sequence. Policy ``split`` starts a new sample of the same episode
(same group, same reward); ``drop`` raises, which fails the episode (and its group).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

from rollout.sample import Sample

HISTORY_POLICIES = ("split", "drop")


class HistoryRewriteError(RuntimeError):
    """A call rewrote the episode's history and the policy is ``drop``."""


@dataclass
class Call:
    prompt_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]
    finish: str  # the engine's finish type: stop | length | abort
    weight_version: Optional[int] = None
    tool_calls: int = 0
    malformed_tool_calls: int = 0  # malformed calls in the output (toolcalls.Parsed)


@dataclass
class Trace:
    calls: list[Call] = field(default_factory=list)

    def history_rewrites(self) -> int:
        n, context = 0, None
        for call in self.calls:
            if context is not None and not _extends(call.prompt_ids, context):
                n += 1
            context = call.prompt_ids + call.output_ids
        return n


def _extends(prompt: list[int], context: list[int]) -> bool:
    return len(prompt) >= len(context) and prompt[:len(context)] == context


def build_samples(trace: Trace, sample: Sample, *, policy: str = "split") -> list[Sample]:
    """The episode's samples; ``sample`` itself becomes the first (its index, group,
    label and metadata are kept; further samples are copies of it)."""
    if policy not in HISTORY_POLICIES:
        raise ValueError(f"history policy {policy!r}: expected one of {HISTORY_POLICIES}")
    if not trace.calls:
        raise ValueError("the agent made no chat completion call: nothing to train on")
    template = copy.deepcopy(sample)
    samples: list[Sample] = []
    current: Optional[Sample] = None
    for k, call in enumerate(trace.calls):
        if current is not None and _extends(call.prompt_ids, current.tokens):
            current.append(call.prompt_ids[len(current.tokens):], trainable=False)
        else:
            if current is not None and policy == "drop":
                raise HistoryRewriteError(
                    f"chat completion call {k + 1} does not extend call {k}'s tokens (the "
                    "agent rewrote its history) and rollout.agent.history_policy=drop")
            current = sample if not samples else copy.deepcopy(template)
            current.set_prompt(call.prompt_ids)
            current.weight_version = None
            samples.append(current)
        current.append(call.output_ids, trainable=True, log_probs=call.log_probs)
        current.status = (Sample.Status.TRUNCATED if call.finish == "length"
                          else Sample.Status.COMPLETED)
        if call.weight_version is not None:
            current.weight_version = (call.weight_version if current.weight_version is None
                                      else min(current.weight_version, call.weight_version))
    info = {"calls": len(trace.calls), "samples": len(samples),
            "history_rewrites": len(samples) - 1,
            "tool_calls": sum(c.tool_calls for c in trace.calls),
            "malformed_tool_calls": sum(c.malformed_tool_calls for c in trace.calls)}
    for k, s in enumerate(samples):
        s.metadata = dict(s.metadata)
        s.metadata["agent"] = dict(info)
        s.metadata["_agent_segment"] = k  # "_": not a logged metric
    return samples
