"""EngineGroup end to end: real Ray actors, real hf engine servers, the real sglang-router."""

import os
import signal

import pytest
import ray
import requests
import torch

from conftest import push_tensors
from config import HomegymConfig, RolloutConfig
from trainer.driver import components

pytestmark = pytest.mark.slow


def gen(url, n_tokens=3):
    r = requests.post(url + "/generate", json={"input_ids": [3, 4, 5], "sampling_params": {
        "max_new_tokens": n_tokens, "temperature": 0}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def group(ray_local, tiny_model_path, tmp_path_factory):
    config = HomegymConfig(rollout=RolloutConfig(num_engines=2))
    g = components.engine_group(config, model_path=tiny_model_path,
                                log_dir=str(tmp_path_factory.mktemp("grp")))
    yield g
    g.shutdown()


def test_group_serves_through_router_and_syncs_weights(group, tiny_model_path):
    assert group.router_url.startswith("http://127.0.0.1:")
    assert all(u.startswith("http://127.0.0.1:") for u in group.urls)  # loopback, not 0.0.0.0
    assert group.health() == [True, True]
    before = gen(group.router_url)
    from transformers import AutoModelForCausalLM
    sd = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    new = torch.randn_like(sd[name])  # non-uniform, and not tied to the output layer
    for client in group.clients:
        push_tensors(client, [(name, new)], version="7")
    assert group.weight_versions() == ["7", "7"]
    for client in group.clients:  # every engine holds exactly the pushed values
        assert torch.equal(torch.tensor(client.get_weights_by_name(name, 10 ** 6)), new)
    outs = [gen(group.router_url) for _ in range(4)]  # round-robin: both engines answer
    assert {o["meta_info"]["weight_version"] for o in outs} == {"7"}
    group.pause_generation()
    group.continue_generation()
    group.abort_all()
    for client in group.clients:
        push_tensors(client, [(name, sd[name])], version="8")
    # An update keeps the prefix cache (SGLang's rule): the pusher flushes the KV that
    # version 7 computed for this prompt (trainer/weight_sync/engine_updates.py).
    group.flush_cache()
    assert gen(group.router_url)["output_ids"] == before["output_ids"]


def values(client, name):
    return torch.tensor(client.get_weights_by_name(name, 10 ** 6))


def test_dead_engine_traffic_moves_then_restart_add_remove(group, tiny_model_path):
    from transformers import AutoModelForCausalLM

    name = "model.layers.0.mlp.down_proj.weight"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()[name]
    new = torch.randn_like(base)  # non-uniform
    for client in group.clients:
        push_tensors(client, [(name, new)], version="9")
    pid = ray.get(group.engines[0].pid.remote())
    os.kill(pid, signal.SIGKILL)
    # Requests keep succeeding: the router retries on and then drops the dead worker.
    for _ in range(6):
        gen(group.router_url)
    assert group.health()[0] is False
    group.restart_engine(0)
    assert group.health() == [True, True]
    # A restarted server starts from model_path until it is pushed to; the survivor keeps
    # what it was given.
    assert torch.equal(values(group.clients[0], name), base)
    assert torch.equal(values(group.clients[1], name), new)
    idx = group.add_engine()
    assert idx == 2 and len(group.router.healthy_urls()) == 3
    for client in group.clients:
        push_tensors(client, [(name, new)], version="10")
    assert group.weight_versions() == ["10"] * 3
    assert all(torch.equal(values(c, name), new) for c in group.clients)
    group.remove_engine(idx)
    assert set(group.router.healthy_urls()) == set(group.urls)
    gen(group.router_url)


def test_shutdown_removes_only_the_log_directory_the_group_made(tiny_model_path, tmp_path):
    """Without a log_dir (the eval CLI, serving) the engines log to a temporary directory,
    gone after shutdown; a directory the caller gave (a run's logs/engines) stays."""
    config = HomegymConfig(rollout=RolloutConfig(num_engines=1))
    made = components.engine_group(config, model_path=tiny_model_path, start=False)
    given = components.engine_group(config, model_path=tiny_model_path,
                                    log_dir=str(tmp_path / "logs"), start=False)
    for group in (made, given):
        os.makedirs(os.path.join(group.log_dir, "router"), exist_ok=True)
        with open(os.path.join(group.log_dir, "engine0.log"), "w") as f:
            f.write("serving\n")
        group.shutdown()
    assert os.path.basename(made.log_dir).startswith("hg-engines-")
    assert not os.path.exists(made.log_dir)
    assert sorted(os.listdir(given.log_dir)) == ["engine0.log", "router"]
