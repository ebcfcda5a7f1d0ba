"""A tool-use task for agents written against the OpenAI API: two-digit arithmetic that the
model gets right only by calling a calculator.

    python -m trainer.main +recipe=calculator_agent_cpu

``agent`` is plain ``openai`` client code (homegym passes an ``AsyncOpenAI`` whose base URL
is the episode's session): it offers one tool, ``calculator(expression)``, runs the calls
the model makes, sends the results back as ``tool`` messages and scores the final
``<answer>N</answer>``. A ~1M-parameter model cannot multiply 47 by 38, but it can copy the
question into a tool call and the tool's result into its answer.

``demo_reply`` is the warm-up's scripted player: mostly it calls the tool and copies the
result, sometimes (``direct_prob``) it answers straight away with a guess (almost always
wrong). The warmed-up base therefore skips the tool in about that share of its episodes,
and RL learns that the tool pays. Copying is what the warm-up has to teach: the copy circuit
forms late in a tiny model's SFT (the loss drops steeply once it does), so the warm-up is
long and its transcripts are mostly tool calls.

``CalculatorEnv`` holds the dataset (rows from a seed, train and eval from different
seeds) and scores a direct answer when played by the built-in driver without tools.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any, Optional

from envs.base import Environment, StepResult, register

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
QUESTION = "What is {a} {op} {b}? Reply with <answer>N</answer>."
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv}
_SPLIT_SEEDS = {"train": 0, "eval": 1}


def make_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, expression, answer) with two-digit operands and a non-negative answer."""
    op = rng.choice(["+", "-", "*"])
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-" and b > a:
        a, b = b, a
    expression = f"{a} {op} {b}"
    return QUESTION.format(a=a, op=op, b=b), expression, calculate(expression)


def calculate(expression: str) -> int:
    """Integer + - * // of integer literals; anything else raises ValueError."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    if len(expression) > 64:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expression, mode="eval"))
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e}") from e


def extract_answer(text: Optional[str]) -> Optional[int]:
    matches = list(ANSWER_RE.finditer(text or ""))
    return int(matches[-1].group(1)) if matches else None


def task_of(sample: Any) -> dict:
    label = sample.label
    return json.loads(label) if isinstance(label, str) else dict(label)


def run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
        return str(calculate(str(args["expression"])))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


async def agent(client: Any, sample: Any, args: Any) -> float:
    """The agent, as written for the OpenAI API."""
    task = task_of(sample)
    messages: list[dict] = [{"role": "user", "content": task["question"]}]
    used_tool, answer = False, None
    for _ in range(int(getattr(args, "max_turns", 3))):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL])
        message = response.choices[0].message
        if not message.tool_calls:
            answer = extract_answer(message.content)
            break
        used_tool = True
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    success = answer == task["answer"]
    sample.metadata.update({"success": success, "format_error": answer is None,
                            "used_tool": used_tool})
    return 1.0 if success else (0.0 if answer is not None else -1.0)


def demo_reply(sample: Any, messages: list[dict], tools: Optional[list[dict]],
               rng: random.Random, direct_prob: float = 0.3) -> str:
    """The scripted player's assistant text for the next call."""
    last = messages[-1]
    if last["role"] == "tool":
        return f"<answer>{last['content']}</answer>"
    task = task_of(sample)
    if rng.random() < direct_prob:
        guess = task["answer"] + rng.choice([-1, 1]) * rng.randint(1, 20)
        return f"<answer>{guess}</answer>"
    arguments = json.dumps({"expression": task["expression"]})
    return ('<tool_call>\n{"name": "calculator", "arguments": ' + arguments
            + '}\n</tool_call>')


def tokenizer_corpus() -> list[str]:
    """Texts the tiny-qwen3-tools tokenizer is trained on (frequent strings -> one token)."""
    rng = random.Random(0)
    texts = []
    for _ in range(200):
        question, expression, answer = make_problem(rng)
        texts += [question, '<tool_call>\n{"name": "calculator", "arguments": '
                  + json.dumps({"expression": expression}) + "}\n</tool_call>",
                  f"<tool_response>\n{answer}\n</tool_response>", f"<answer>{answer}</answer>"]
    texts += [json.dumps(CALCULATOR_TOOL)] * 50
    return texts


@register("calculator")
class CalculatorEnv(Environment):
    """The task without tools (built-in driver): a direct answer, scored."""

    def __init__(self, max_turns: int = 1, seed: Optional[int] = None, **_: Any) -> None:
        super().__init__(max_turns=1, seed=seed)
        self.answer = 0

    async def reset(self, sample: Any) -> str:
        self.answer = task_of(sample)["answer"]
        return ""

    async def step(self, action_text: str) -> StepResult:
        guess = extract_answer(action_text)
        info = {"success": guess == self.answer, "format_error": guess is None}
        return "", (-1.0 if guess is None else float(guess == self.answer)), True, info

    @classmethod
    def dataset(cls, split: str, size: Optional[int] = None, **_: Any) -> list[dict]:
        if split not in _SPLIT_SEEDS:
            raise ValueError(f"calculator: split must be 'train' or 'eval' (got {split!r})")
        rng = random.Random(1000 + _SPLIT_SEEDS[split])
        rows = []
        for _ in range(size if size is not None else (1000 if split == "train" else 64)):
            question, expression, answer = make_problem(rng)
            rows.append({"messages": [{"role": "user", "content": question}],
                         "label": json.dumps({"question": question, "expression": expression,
                                              "answer": answer})})
        return rows
