"""A verifiers (0.4) environment written with verifiers' own classes, for the tests: the
calculator questions as a ``Taskset`` scored by a ``@vf.reward``, and a ``Harness`` whose
loop runs in-process (so it needs no ``uv`` or package index), speaking the dialect its
config names to verifiers' interception endpoint (tests/dialect_agents.py): streamed chat
completions with usage, the Responses API or Anthropic's Messages API. Taskset id:
``vf_calculator``.
"""

from __future__ import annotations

import json

import dialect_agents
import verifiers.v1 as vf

from envs import calculator


class CalcData(vf.TaskData):
    answer: int = 0


class CalcTask(vf.Task[CalcData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(calculator.extract_answer(trace.last_reply) == self.data.answer)


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 4


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        for row in calculator.CalculatorEnv.dataset("eval", size=self.config.num_tasks):
            task = json.loads(row["label"])
            yield CalcTask(CalcData(prompt=task["question"], answer=task["answer"]),
                           self.config.task)


class CalcHarnessConfig(vf.HarnessConfig):
    dialect: str = "chat_stream"  # chat_stream | responses | messages
    max_turns: int = 4


class CalcHarness(vf.Harness[CalcHarnessConfig]):
    """The agent loop in-process: every model call goes to ``endpoint`` with ``secret``."""

    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        dialect, options = self.config.dialect, {}
        # The anthropic client appends /v1/messages itself (as verifiers' claude_code does).
        base = endpoint.removesuffix("/v1") if dialect == "messages" else endpoint
        if dialect == "chat_stream" and isinstance(ctx.client, vf.TrainClientConfig):
            # verifiers writes the train client's stream itself: one chunk, no usage.
            options["require_usage"] = False
        await dialect_agents.LOOPS[dialect](base, secret, ctx.model, data.prompt,
                                            self.config.max_turns, **options)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CalcTaskset", "CalcHarness"]
