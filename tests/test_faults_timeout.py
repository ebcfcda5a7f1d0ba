"""A reward function or an environment that hangs: ``rollout.sample_timeout_s`` marks the
sample FAILED, its group is dropped and replaced, and the step returns on time.

(A hanging *generate* function is covered in test_rollout_manager.py.) The reward tests
need no engine: their generate function answers locally. The environment test runs the
built-in episode driver against real engines behind the router.
"""

import asyncio
import time

import pytest

from envs.number_guess import NumberGuessEnv
from rollout.http import close_session
from rollout.manager import RolloutManagerCore
from rollout_engines import config
from trainer.driver import components

HANG_S = 3600


async def local_generate(args, sample, sampling_params):
    """No engine: three fixed response tokens."""
    sample.append([5, 6, 7], trainable=True, log_probs=[-0.5, -0.5, -0.5])
    sample.status = sample.Status.COMPLETED
    return sample


async def rm_hangs_on_group_1(args, sample, **kwargs):
    if sample.group_index == 1:
        await asyncio.sleep(HANG_S)  # a reward service that never answers
    return 1.0


async def group_rm_hangs_on_group_1(args, samples, **kwargs):
    if samples[0].group_index == 1:
        await asyncio.sleep(HANG_S)
    return [float(i) for i in range(len(samples))]


class StepHangsOnGroup1(NumberGuessEnv):
    async def step(self, action_text):
        if self.sample_group == 1:
            await asyncio.sleep(HANG_S)  # e.g. a sandbox or tool call that never returns
        return await super().step(action_text)

    async def reset(self, sample):
        self.sample_group = sample.group_index
        return await super().reset(sample)


def _run(cfg, router="http://127.0.0.1:9"):
    async def go():
        try:
            return await RolloutManagerCore(router_url=router,
                                            **components.manager_args(cfg)).generate(0)
        finally:
            await close_session()
    t0 = time.monotonic()
    batch = asyncio.run(go())
    return batch, time.monotonic() - t0


@pytest.mark.parametrize("group_rm", [False, True], ids=["sample_rm", "group_rm"])
def test_hanging_reward_function_times_out_as_failed(group_rm):
    cfg = config(rollout_batch_size=2, n_samples_per_prompt=2, sample_timeout_s=1.0,
                 custom_generate_function="test_faults_timeout:local_generate",
                 custom_rm_function=("test_faults_timeout:group_rm_hangs_on_group_1" if group_rm
                                     else "test_faults_timeout:rm_hangs_on_group_1"),
                 group_rm=group_rm)
    batch, took = _run(cfg)
    assert len(batch) == 4 and 1 not in batch.group_ids  # the hung group was replaced
    assert set(batch.statuses) == {"completed"}
    assert batch.metrics["rollout/failed_samples"] >= 1
    assert batch.metrics["perf/rollout_time"] < 10  # one timeout, not the hang


@pytest.mark.slow
def test_hanging_environment_times_out_as_failed(shared_router):
    cfg = config(rollout_batch_size=2, n_samples_per_prompt=2, sample_timeout_s=3.0)
    from dataclasses import replace

    cfg = replace(cfg, env=replace(cfg.env, name="test_faults_timeout.StepHangsOnGroup1"))
    batch, took = _run(cfg, shared_router)
    assert len(batch) == 4 and 1 not in batch.group_ids
    assert "failed" not in batch.statuses
    assert batch.metrics["rollout/failed_samples"] >= 1
    assert batch.metrics["perf/rollout_time"] < 30
