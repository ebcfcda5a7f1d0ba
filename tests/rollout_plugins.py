"""User plug-ins for the rollout manager tests, loaded by dotted path like a user's own."""

import asyncio

from envs.base import Environment
from envs.number_guess import NumberGuessEnv
from rollout.generate import generate as default_generate
from rollout.http import ABORT


async def group_parity_rm(args, sample, **kwargs) -> float:
    """Even groups get differing rewards, odd groups identical ones (nonzero_std drops them)."""
    if sample.group_index % 2 == 0:
        return float(sample.index % 2)
    return 1.0


async def flaky_rm(args, sample, **kwargs) -> float:
    if sample.index % 7 == 3:
        raise RuntimeError("reward service exploded")
    return 0.5


async def group_rm(args, samples, **kwargs) -> list:
    return [{"reward": float(i), "rank": i} for i in range(len(samples))]


async def hang_on_group_1(args, sample, sampling_params):
    if sample.group_index == 1:
        await asyncio.sleep(3600)
    return await default_generate(args, sample, sampling_params)


async def fail_group_1_during_the_drain(args, sample, sampling_params):
    """Group 1's first sample fails at once; its second runs until the step's drain aborts
    it, so the group ends during the drain with one failed sample."""
    if sample.group_index == 1:
        if sample.index % 2 == 0:
            raise RuntimeError("injected failure")
        while not ABORT.on:
            await asyncio.sleep(0.01)
    return await default_generate(args, sample, sampling_params)


class SlowStartEnv(NumberGuessEnv):
    """Odd groups are held in reset until the step aborts what is in flight or a test
    releases them (``SlowStartEnv.hold = False``): still in flight, for certain, when the
    step has enough groups."""

    hold = True
    HOLD_LIMIT_S = 300  # a test that never releases them fails on its own timeout first

    async def reset(self, sample):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.HOLD_LIMIT_S
        while (sample.group_index % 2 == 1 and SlowStartEnv.hold and not ABORT.on
               and loop.time() < deadline):
            await asyncio.sleep(0.01)
        return await super().reset(sample)


class EndlessEnv(Environment):
    """Always answers with feedback and never ends: exercises the turn budget."""

    def __init__(self, max_turns: int = 4, seed=None, **_):
        super().__init__(max_turns=max_turns, seed=seed)
        self.turns = 0

    async def reset(self, sample):
        return "Say anything."

    @classmethod
    def dataset(cls, split, **kwargs):
        return [{"messages": [{"role": "user", "content": "Say anything."}], "label": None}]

    async def step(self, action_text):
        self.turns += 1
        return "<feedback>higher</feedback>", 0.25, False, {"turns_taken": self.turns}
