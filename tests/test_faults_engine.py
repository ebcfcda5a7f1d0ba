"""Fault injection, for real: an engine's server process (and then its Ray actor) dies in
the middle of a rollout. The step completes with no failed sample (the router and ``post``
retry the in-flight requests on the other engine), ``EngineGroup.recover`` restarts the
engine, re-registers it with the router and pushes the current weights, and the restart is
counted (``rollout/engine_restarts``).
"""

import asyncio
import os
import signal

import pytest
import ray
import torch

from rollout.generate import generate as default_generate
from rollout.http import close_session
from rollout.manager import RolloutManagerCore
from rollout_engines import config, start_decoding
from trainer.driver import components

pytestmark = pytest.mark.slow

LONG_TOKENS = 256


async def long_generate(args, sample, sampling_params):
    """The default single-turn generate, always LONG_TOKENS tokens long (ignore_eos), so
    the rollout is still in flight when the engine is killed."""
    params = dict(sampling_params, max_new_tokens=LONG_TOKENS, ignore_eos=True)
    return await default_generate(args, sample, params)


async def constant_rm(args, sample, **kwargs):
    return 1.0


@pytest.fixture()
def group(ray_local, tiny_model_path, tmp_path):
    g = components.engine_group(config(num_engines=2), model_path=tiny_model_path,
                                log_dir=str(tmp_path / "engines"))
    yield g
    g.shutdown()


def _weights(tiny_model_path, value):
    from safetensors.torch import load_file

    norm = load_file(os.path.join(tiny_model_path, "model.safetensors"))["model.norm.weight"]
    ramp = torch.linspace(0.5, 1.5, norm.numel()).reshape(norm.shape)  # non-uniform
    return [("model.norm.weight", value * ramp)]


def assert_every_engine_holds(group, named_tensors):
    """The values themselves, read back from every engine (a version label alone would
    pass for a restarted engine still on the base weights)."""
    for i, client in enumerate(group.clients):
        for name, want in named_tensors:
            got = torch.tensor(client.get_weights_by_name(name, 10 ** 6)).reshape(want.shape)
            assert torch.equal(got, want), f"engine {i}: {name} differs from the pushed tensor"


def _rollout_while(cfg, router_url, fault):
    """Run one rollout step; call ``fault()`` once it is well under way."""
    async def go():
        core = RolloutManagerCore(router_url=router_url, **components.manager_args(cfg))
        task, _ = await start_decoding(router_url, core.generate(1), steps=20)
        await asyncio.get_running_loop().run_in_executor(None, fault)
        try:
            return await task
        finally:
            await close_session()
    return asyncio.run(go())


def test_engine_dies_mid_rollout_step_completes_and_engine_recovers(group, tiny_model_path):
    from trainer.weight_sync.push import send_weights

    cfg = config(num_engines=2, rollout_batch_size=4, n_samples_per_prompt=4,
                 max_response_len=LONG_TOKENS, sample_timeout_s=120.0,
                 custom_generate_function="test_faults_engine:long_generate",
                 custom_rm_function="test_faults_engine:constant_rm")

    class Policy:  # one training rank, in this process: the ranks' own send_weights
        def send_weights(self, plan):
            return send_weights([_weights(tiny_model_path, 2.0)], plan, rank=0, world_size=1)

    sync = components.weight_sync(cfg, Policy(), group)

    def push_current(view):
        # The very push the driver makes (Runtime.recover_engines): WeightSync over a view.
        sync.push(5, engines=view)

    pushed = _weights(tiny_model_path, 2.0)
    push_current(group)
    assert group.weight_versions() == ["5", "5"]
    assert_every_engine_holds(group, pushed)

    # 1. The server process of engine 0 dies mid-rollout.
    server_pid = ray.get(group.engines[0].pid.remote())
    batch = _rollout_while(cfg, group.router_url, lambda: os.kill(server_pid, signal.SIGKILL))
    assert len(batch) == 16 and "failed" not in batch.statuses
    assert batch.metrics.get("rollout/failed_samples", 0.0) == 0.0
    assert all(L == LONG_TOKENS for L in batch.response_lengths)
    assert group.health() == [False, True]

    old_url = group.urls[0]
    metrics = group.recover(push_weights=push_current)
    assert metrics["rollout/engine_restarts"] == 1.0
    assert metrics["rollout/engines_restarted_now"] == 1.0
    assert group.health() == [True, True]
    assert group.urls[0] != old_url  # a new server (new port)...
    assert group.router.healthy_urls() == set(group.urls)  # ...registered, the old one gone
    assert group.weight_versions() == ["5", "5"]  # and on the current weights
    assert_every_engine_holds(group, pushed)

    # 2. Engine 1's Ray actor itself dies (its server follows it): the actor is re-created.
    batch = _rollout_while(cfg, group.router_url,
                           lambda: ray.kill(group.engines[1], no_restart=True))
    assert len(batch) == 16 and batch.metrics.get("rollout/failed_samples", 0.0) == 0.0
    metrics = group.recover(push_weights=push_current)
    assert metrics["rollout/engine_restarts"] == 2.0
    assert group.health() == [True, True]
    assert group.router.healthy_urls() == set(group.urls)
    assert group.weight_versions() == ["5", "5"]
    assert_every_engine_holds(group, pushed)

    # 3. Nothing dead: recover is a cheap no-op; both engines serve the pushed weights.
    assert group.recover(push_weights=push_current)["rollout/engines_restarted_now"] == 0.0
    batch = _rollout_while(cfg, group.router_url, lambda: None)
    assert set(batch.weight_versions) == {5}


def test_an_engine_dying_before_a_push_settles_leaves_the_others_generating(group,
                                                                           tiny_model_path):
    """The async loop settles a push to generating engines (read-back, continue, flush,
    release) while the ranks train the next step. An engine that dies in between fails
    the settle, but every part of it still reaches the live engine, which generates
    again with its prefix cache flushed, and the held requests are let through; recovery
    then brings the dead one back on the pushed weights."""
    from rollout.engines.client import EngineError
    from trainer.weight_sync.engine_updates import update_generating_engines
    from trainer.weight_sync.push import send_weights

    pushed = _weights(tiny_model_path, 3.0)

    class Policy:  # one training rank, in this process: the ranks' own send_weights
        def send_weights(self, plan):
            return send_weights([pushed], plan, rank=0, world_size=1)

    sync = components.weight_sync(config(num_engines=2), Policy(), group)
    live = group.clients[1]

    def generate(ids: list[int]) -> dict:
        return live.call("/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})

    first = generate(list(range(5, 45)))
    turn_2 = list(range(5, 45)) + first["output_ids"] + [9]  # over turn 1's cached KV

    def cached_tokens() -> int:
        return generate(turn_2)["meta_info"]["cached_tokens"]

    assert cached_tokens() > 0
    gate: list[str] = []
    _, settle = update_generating_engines(
        group, sync, 7, update_in_flight="pause", hold=lambda: gate.append("hold"),
        release=lambda: gate.append("release"), flush_timeout_s=30)
    assert [c.server_info()["paused"] for c in group.clients] == [True, True]
    os.kill(ray.get(group.engines[0].pid.remote()), signal.SIGKILL)
    with pytest.raises(EngineError):
        settle()
    assert gate == ["hold", "release"]
    assert live.server_info()["paused"] is False
    assert cached_tokens() == 0  # flushed: no KV of the old weights
    assert group.recover(push_weights=lambda view: sync.push(7, engines=view))[
        "rollout/engines_restarted_now"] == 1.0
    assert group.weight_versions() == ["7", "7"]
    assert_every_engine_holds(group, pushed)


def test_each_engine_has_its_own_broadcast_group_so_a_death_mid_push_holds_no_other_engine(
        group, tiny_model_path):
    """Distributed pushes go over one broadcast group per engine. A restarted engine gets a
    group of its own and its predecessor's is destroyed on rank 0 (torch's registry of
    groups), the survivor keeping its group. An engine that dies mid-push fails the push at
    once while the other engine receives the whole push: a group shared by both would hold
    it in a receive until WEIGHT_GROUP_TIMEOUT_S. Every group of a failed push is left, and
    the next pushes form them anew, leaving none behind."""
    import time

    import psutil
    from safetensors.torch import load_file

    from conftest import process_groups, wait_for
    from rollout.engines.client import EngineError
    from rollout.engines.hf.server import WEIGHT_GROUP_TIMEOUT_S
    from trainer.training.train_group import TrainActor
    from trainer.weight_sync.push import WeightSyncError, send_weights

    cfg = config(num_engines=2)
    # the rank's own methods, in this process
    rank0 = TrainActor(rank=0, world_size=1, **components.backend_args(cfg))

    def dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    class Policy:
        init_weight_broadcast = rank0.init_weight_broadcast
        destroy_weight_broadcast = rank0.destroy_weight_broadcast
        dying = None  # an engine server to SIGKILL once the push's sessions are open

        def send_weights(self, plan):
            return send_weights(self.buckets(), plan, rank=0, world_size=1,
                                weight_groups=[rank0._weight_groups[n] for n in plan.group_names])

        def buckets(self):
            if self.dying is None:
                yield _weights(tiny_model_path, 2.0)
                return
            os.kill(self.dying, signal.SIGKILL)
            wait_for(lambda: dead(self.dying), timeout_s=30, what="the engine server to die")
            # The whole model, broadcast to both engines.
            yield sorted(load_file(os.path.join(tiny_model_path, "model.safetensors")).items())

    def weight_groups() -> set[str]:
        return {n for n in process_groups() if n.startswith("homegym_weights")}

    others = weight_groups()  # another test's, in this pytest process

    def rank0_groups() -> list[str]:
        return sorted(weight_groups() - others)

    def engine_holds(client, name: str) -> bool:
        """Whether the engine is still in group ``name`` (destroying it is the only probe
        SGLang's contract has: it fails for a group the engine is not in)."""
        try:
            client.destroy_weights_update_group(name)
            return True
        except EngineError:
            return False

    policy = Policy()
    sync = components.weight_sync(cfg, policy, group, mode="distributed")
    sync.push(1)
    assert rank0_groups() == ["homegym_weights_1", "homegym_weights_2"]

    os.kill(ray.get(group.engines[0].pid.remote()), signal.SIGKILL)
    group.recover(push_weights=lambda view: sync.push(1, engines=view))  # group 3: engine 0
    assert rank0_groups() == ["homegym_weights_2", "homegym_weights_3"]  # 1 went with engine 0
    sync.push(2)  # the same two groups
    assert rank0_groups() == ["homegym_weights_2", "homegym_weights_3"]
    assert group.weight_versions() == ["2", "2"]

    # Engine 1 dies with the push's sessions open, engine 0 receiving the same buckets.
    survivor = group.clients[0]
    policy.dying = ray.get(group.engines[1].pid.remote())
    start = time.monotonic()
    with pytest.raises(WeightSyncError):
        sync.push(3)
    assert time.monotonic() - start < WEIGHT_GROUP_TIMEOUT_S / 2
    assert survivor.weight_version() == "3"  # it received the whole push, held by no one
    assert rank0_groups() == []  # a failed push's groups are left
    assert not engine_holds(survivor, "homegym_weights_3")

    policy.dying = None
    group.recover(push_weights=lambda view: sync.push(3, engines=view))  # group 4: engine 1
    sync.push(4)  # group 5: engine 0
    assert rank0_groups() == ["homegym_weights_4", "homegym_weights_5"]
    assert group.weight_versions() == ["4", "4"]
    assert engine_holds(group.clients[1], "homegym_weights_4")
    assert engine_holds(survivor, "homegym_weights_5")
    rank0.destroy_weight_broadcast()
    assert rank0_groups() == []
