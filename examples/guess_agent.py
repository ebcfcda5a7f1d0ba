"""An agent of one's own on one's own data, with no environment class: plain ``openai``
client code with a ``guess`` tool, called over several turns, scoring itself.

    python -m examples.guess_agent guesses.jsonl      # writes 200 rows {messages, label}
    python -m trainer.main env=custom model=tiny_qwen3_tools \\
        rollout.agent.function=examples.guess_agent:guess_agent \\
        data.path=guesses.jsonl

homegym hands ``guess_agent`` an ``openai.AsyncOpenAI`` whose base URL is the episode's
session in front of the engines; every call is recorded token-exactly and the episode
becomes the training sample. The run is named after the agent (``guess_agent-<model>-...``).
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the hidden number; answers higher, lower or correct.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}},
                       "required": ["number"]},
    },
}
PROMPT = "A number between 1 and {top} is hidden. Find it with the guess tool."
TOP = 20


def feedback(number: Any, target: int) -> str:
    try:
        n = int(number)
    except (TypeError, ValueError):
        return "error: number must be an integer"
    return "correct" if n == target else ("higher" if n < target else "lower")


async def guess_agent(client: Any, sample: Any, args: Any) -> float:
    """Up to ``args.max_turns`` calls; reward 1 for finding the number, less per guess."""
    target = int(json.loads(sample.label)["target"] if isinstance(sample.label, str)
                 else sample.label["target"])
    messages: list[dict] = [{"role": "user", "content": PROMPT.format(top=TOP)}]
    guesses, found = 0, False
    for _ in range(int(getattr(args, "max_turns", 4))):
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=[GUESS_TOOL])
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                number = json.loads(call.function.arguments).get("number")
            except (json.JSONDecodeError, AttributeError):
                number = None
            result = feedback(number, target)
            guesses += 1
            found = found or result == "correct"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if found:
            break
    sample.metadata.update({"success": found, "guesses": guesses})
    return (1.0 - 0.1 * (guesses - 1)) if found else -0.1 * guesses


def write_rows(path: str, num_rows: int = 200, seed: int = 0) -> None:
    """JSONL rows: the prompt as chat messages, the hidden number as the label."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_rows):
            row = {"messages": [{"role": "user", "content": PROMPT.format(top=TOP)}],
                   "label": json.dumps({"target": rng.randint(1, TOP)})}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write_rows(sys.argv[1] if len(sys.argv) > 1 else "guesses.jsonl")
