"""Disaggregated, asynchronous RL: bounded staleness and weight updates under generation.

Real engines, router, gloo broadcast and FSDP ranks; the driver runs as a subprocess.
"""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import compose_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# One engine and one rank either way, so the two layouts do identical work.
SMALL = ["rollout.num_engines=1", "train.ranks_per_node=1", "warmup.steps=30",
         "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
         "eval.before_and_after=false", "logging.wandb_mode=disabled"]


def run_main(out: Path, name: str, *overrides: str) -> Path:
    cmd = [sys.executable, "-m", "trainer.main", *SMALL, *overrides,
           f"logging.output_dir={out}", f"logging.run_name={name}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / name


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_staleness_zero_trains_on_exactly_the_colocated_batches(tmp_path):
    # Greedy decoding makes generation a function of the weights, so identical batches
    # mean identical updates step after step.
    common = ["train.num_steps=3", "rollout.temperature=0"]
    colocated = run_main(tmp_path, "colocated", *common)
    disagg = run_main(tmp_path, "async0", *common, "cluster.colocate=false", "algo.max_staleness=0")
    a = read_jsonl(colocated / "data_order.jsonl")
    b = read_jsonl(disagg / "data_order.jsonl")
    assert len(a) == 3 and a == b
    staleness = [r.get("async/max_staleness") for r in read_jsonl(disagg / "metrics.jsonl")
                 if r.get("step", 0) > 0]
    assert staleness == [0.0, 0.0, 0.0]


def test_no_trained_sample_is_staler_than_the_bound(tmp_path):
    run = run_main(tmp_path, "async1", "train.num_steps=4", "cluster.colocate=false",
                   "algo.max_staleness=1")
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if "async/trained_max_staleness" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["async/trained_max_staleness"] <= 1 for r in steps)
    # Generation of step s+1 overlapped training of step s: its samples are one version old.
    assert any(r["async/max_staleness"] == 1 for r in steps)
    for key in ("perf/trainer_wait_time", "perf/engine_idle_time", "perf/weight_sync_time",
                "perf/weight_sync_bytes"):
        assert all(key in r for r in steps), key


@pytest.mark.parametrize("pause", [False, True])
def test_update_mid_generation_is_recorded_per_request(ray_local, tiny_model_path, pause):
    """Two buckets land while a long request decodes. Unpaused, the request's forward
    passes ran on half-updated weights and the engine says so ("+partial"); paused in
    place, the update is atomic between passes and only the two full versions appear."""
    from conftest import push_tensors
    from rollout.engines.group import EngineGroup
    from transformers import AutoModelForCausalLM

    config = compose_config("rollout.num_engines=1")
    engines = EngineGroup(config)
    try:
        state = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
        names = sorted(state)
        buckets = [[(n, state[n] * 1.01) for n in names[: len(names) // 2]],
                   [(n, state[n] * 1.01) for n in names[len(names) // 2:]]]
        result = {}

        def long_request():
            result["out"] = requests.post(f"{engines.router_url}/generate", timeout=120, json={
                "input_ids": [1, 2, 3], "sampling_params": {
                    "max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}}).json()

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 60
        while not any(info.get("num_running_reqs") for info in engines.server_infos()):
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.005)
        if pause:
            engines.pause_generation(mode="in_place")
        client = engines.clients[0]
        push_tensors(client, buckets[0])
        if not pause:  # let at least one decode step run on the half-updated weights
            steps = engines.server_infos()[0]["decode_steps"]
            while engines.server_infos()[0]["decode_steps"] == steps:
                assert time.monotonic() < deadline, "no decode step after the first bucket"
                time.sleep(0.002)
        push_tensors(client, buckets[1], version=1)
        if pause:
            engines.continue_generation()
        thread.join(timeout=120)
        versions = result["out"]["meta_info"]["weight_versions"]
        assert versions[0] == "default" and versions[-1] == "1"
        if pause:  # atomic between forward passes: only whole versions
            assert versions == ["default", "1"]
        else:
            assert versions == ["default", "default+partial", "1"]
    finally:
        engines.shutdown()
