"""Generated arithmetic word problems: deterministic, checkable, single turn."""

import asyncio
import json

from envs.arithmetic import ArithmeticEnv
from rollout import Sample


def test_dataset_is_deterministic_and_splits_differ():
    a, b = ArithmeticEnv.dataset("train", size=50), ArithmeticEnv.dataset("train", size=50)
    assert a == b
    assert a != ArithmeticEnv.dataset("eval", size=50)
    assert len(ArithmeticEnv.dataset("eval")) == 100


def test_answers_are_verifiable():
    for row in ArithmeticEnv.dataset("train", size=30):
        env = ArithmeticEnv()

        async def go():
            await env.reset(Sample(label=row["label"]))
            return await env.step(env.demo_action())
        obs, reward, done, info = asyncio.run(go())
        assert (reward, done, info["success"]) == (1.0, True, True)
        q = row["messages"][0]["content"]
        assert "<answer>" in q and json.loads(row["label"])["answer"] >= 0


def test_wrong_and_malformed_answers():
    async def go(text):
        env = ArithmeticEnv()
        await env.reset(Sample(label={"answer": 12}))
        return await env.step(text)
    assert asyncio.run(go("<answer>11</answer>"))[1] == 0.0
    _, reward, done, info = asyncio.run(go("twelve"))
    assert (reward, done, info["format_error"]) == (-1.0, True, True)
