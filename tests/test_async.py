"""Disaggregated, asynchronous RL: bounded staleness and weight updates under generation.

Real engines, router, gloo broadcast and FSDP ranks; the driver runs as a subprocess.
"""

import threading
from pathlib import Path

import pytest
import requests

from conftest import compose_config, read_jsonl, run_main

pytestmark = pytest.mark.slow

# One engine and one rank either way, so the two layouts do identical work.
SMALL = ["rollout.num_engines=1", "train.ranks_per_node=1", "warmup.steps=0",
         "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
         "eval.before_and_after=false", "logging.wandb_mode=disabled"]


def run(tmp_path, name: str, *overrides: str, ray_address: str) -> Path:
    return run_main(tmp_path, *SMALL, *overrides, run_name=name, ray_address=ray_address).run_dir


# The bound with max_staleness=1 (no trained sample staler than 1, generation overlapping
# training) is asserted on the async run of tests/test_faults_async.py.
def test_staleness_zero_trains_on_exactly_the_colocated_batches(tmp_path, ray_address):
    # Greedy decoding makes generation a function of the weights, so identical batches
    # mean identical updates step after step. Greedy samples of a group are identical
    # (zero GRPO advantage): the entropy bonus is what makes every step move the weights,
    # so that each step's generation depends on the step before it.
    common = ["train.num_steps=3", "rollout.temperature=0", "algo.entropy_coef=0.01"]
    colocated = run(tmp_path, "colocated", *common, ray_address=ray_address)
    # A checkpoint after every step waits for the push's read-back between steps.
    disagg = run(tmp_path, "async0", *common, "cluster.colocate=false", "algo.max_staleness=0",
                 "train.save_interval=1", ray_address=ray_address)
    a = read_jsonl(colocated / "data_order.jsonl")
    b = read_jsonl(disagg / "data_order.jsonl")
    assert len(a) == 3 and a == b
    steps = {name: [r for r in read_jsonl(d / "metrics.jsonl") if "train/grad_norm" in r]
             for name, d in (("colocated", colocated), ("async0", disagg))}
    assert [r["async/max_staleness"] for r in steps["async0"]] == [0.0, 0.0, 0.0]
    # Every step trained (the weights moved), and on the same weights and batch in both
    # layouts: one rank, the same micro-batches, so the same float operations.
    norms = {name: [r["train/grad_norm"] for r in rows] for name, rows in steps.items()}
    assert all(n > 0 for n in norms["colocated"]) and norms["colocated"] == norms["async0"]
    # Every push is read back from the engines: colocated within its step; async while the
    # next step trains, so a step reports the previous push's read-back, also where a
    # checkpoint between them waited for it.
    checked = {name: [r.get("perf/weight_sync_checked_tensors", 0) for r in rows]
               for name, rows in steps.items()}
    assert all(n > 0 for n in checked["colocated"]), checked
    assert checked["async0"][0] == 0 and all(n > 0 for n in checked["async0"][1:]), checked


@pytest.fixture(scope="module")
def one_engine(ray_local, tiny_model_path, tmp_path_factory):
    """One engine behind the router for the three modes below (each pushes its own version
    of the same weights, so none depends on what the one before it left)."""
    from trainer.driver import components

    group = components.engine_group(compose_config("rollout.num_engines=1",
                                                   "model.max_context_len=1024"),
                                    model_path=tiny_model_path,
                                    log_dir=str(tmp_path_factory.mktemp("engines")))
    yield group
    group.shutdown()


@pytest.mark.parametrize("mode", [None, "in_place", "abort"])
def test_update_mid_generation_is_recorded_per_request(one_engine, tiny_model_path, mode):
    """Two buckets land while a long request decodes. Unpaused, the request's forward
    passes ran on half-updated weights and the engine says so ("+partial"); paused in
    place (rollout.update_in_flight=pause), the update is atomic between passes and only
    the two full versions appear; aborted (update_in_flight=abort), the request ends at
    once with the tokens it has, all from the old weights, and the next runs on the new."""
    from conftest import push_tensors, wait_for
    from transformers import AutoModelForCausalLM

    engines = one_engine
    old, new = engines.weight_versions()[0], f"v-{mode}"
    state = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    names = sorted(state)
    buckets = [[(n, state[n] * 1.01) for n in names[: len(names) // 2]],
               [(n, state[n] * 1.01) for n in names[len(names) // 2:]]]
    result = {}
    # Long enough to be decoding still when the pushes land, however loaded the machine
    # (~1.3 ms a token on 2 cores).
    payload = {"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 1000, "ignore_eos": True, "temperature": 1.0}}

    def long_request():
        result["out"] = requests.post(f"{engines.router_url}/generate", timeout=120,
                                      json=payload).json()

    def decode_steps():
        return engines.server_infos()[0]["decode_steps"]

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_for(lambda: engines.server_infos()[0].get("num_running_reqs"), timeout_s=60,
             what="the request to reach the engine")
    if mode is not None:
        engines.pause_generation(mode=mode)
    if mode == "abort":
        thread.join(timeout=60)
        assert not thread.is_alive(), "an aborted request did not return"
    client = engines.clients[0]
    push_tensors(client, buckets[0])
    if mode is None:  # let at least one decode step run on the half-updated weights
        steps = decode_steps()
        wait_for(lambda: decode_steps() > steps, timeout_s=60,
                 what="a decode step after the first bucket", interval_s=0.002)
    push_tensors(client, buckets[1], version=new)
    if mode is not None:
        engines.continue_generation()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the long request never finished"
    meta = result["out"]["meta_info"]
    versions = meta["weight_versions"]
    if mode == "abort":
        assert meta["finish_reason"]["type"] == "abort"
        assert len(result["out"]["output_ids"]) < 1000 and versions == [old]
        # What the partial rollout continues with next step runs on the new weights.
        rest = requests.post(f"{engines.router_url}/generate", timeout=60, json=dict(
            payload, sampling_params={"max_new_tokens": 4, "ignore_eos": True})).json()
        assert rest["meta_info"]["weight_versions"] == [new]
    elif mode == "in_place":  # atomic between forward passes: only whole versions
        assert versions == [old, new]
    else:
        assert versions == [old, f"{old}+partial", new]
