"""The environment each process of a run gets: SGLang engine servers vs training ranks."""

import os

import pytest

from conftest import REPO, clean_env, compose_config, run_group
from rollout.engines.actor import releases_cuda_graphs
from trainer.driver import components

DISAGG = ("cluster.colocate=false", "rollout.num_gpus=4", "train.ranks_per_node=4")


def engine_env(*overrides):
    config = compose_config("+recipe=qwen_4b", *overrides)
    return components.engine_spec(config, config.model.path), config


def test_colocated_engines_put_their_cuda_graphs_in_the_memory_saver():
    """SGLang captures decode graphs into the memory saver's region (so release frees
    them) only with SGLANG_MEMORY_SAVER_CUDA_GRAPH set (0.5.18
    model_executor/runner_backend/full_cuda_graph_backend.py:65-68)."""
    spec, _ = engine_env()
    assert spec.enable_memory_saver and "--enable-memory-saver" in spec.command(1, None, "h")
    assert spec.env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "true" and releases_cuda_graphs(spec)
    spec, _ = engine_env(*DISAGG)  # nothing is released: no memory saver, no graphs in it
    assert not spec.enable_memory_saver and "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in spec.env
    assert not releases_cuda_graphs(spec)


@pytest.mark.parametrize("user, args, want", [(None, (), "0"), ("1", (), "1"),
                                              ("0", ("--enable-symm-mem",), "1")])
def test_engines_and_ranks_agree_on_nccl_cumem(monkeypatch, user, args, want):
    """SGLang sets NCCL_CUMEM_ENABLE=0 in its processes unless it is set, and 1 with
    --enable-symm-mem (0.5.18 srt/entrypoints/engine.py:1659-1660); rank 0 shares the
    weight-broadcast communicator with them, so every rank gets the same value."""
    if user is None:
        monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_CUMEM_ENABLE", user)
    overrides = DISAGG + (f"rollout.sglang_args=[{','.join(args)}]",)
    spec, config = engine_env(*overrides)
    assert spec.env["NCCL_CUMEM_ENABLE"] == want
    assert components.rank_env(config)["NCCL_CUMEM_ENABLE"] == want


def test_a_training_rank_process_runs_with_that_environment(ray_local, monkeypatch):
    """The value reaches the rank's own process (set there as the rank starts), not only
    the spec: the Ray workers here started without the variable."""
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    config = compose_config("train.ranks_per_node=1", "rollout.num_engines=1")
    group = components.train_group(config)
    try:
        got = ray_local.get([a.__ray_call__.remote(
            lambda _: (os.environ.get("NCCL_CUMEM_ENABLE"), os.environ.get("OMP_NUM_THREADS")))
            for a in group.actors])
    finally:
        group.shutdown()
    assert got == [("1", str(config.cluster.torch_threads))]


PROBE = """
import os, ray
from config import compose_config
from trainer.driver.runtime import connect_ray, worker_env

config = compose_config(["cluster.torch_threads=2"])
before = dict(os.environ)  # Ray adds variables of its own: compare the run's
assert connect_ray(config)

want = worker_env(config)

@ray.remote
def worker(keys):
    return {key: os.environ.get(key) for key in keys}

print(want == ray.get(worker.remote(list(want))),
      all(os.environ.get(key) == before.get(key) for key in want),
      ray.get_runtime_context().runtime_env == {})
ray.shutdown()
"""


@pytest.mark.subprocess
def test_a_local_instance_hands_its_workers_the_runs_variables_without_a_runtime_env():
    """The Ray instance a run starts for itself gives every worker the run's variables
    (threads, tokenizers, the model cache) through the environment it starts with, and
    no runtime_env (which would start each worker through Ray's setup shim, a second
    interpreter start); the driver's own environment is left as it was."""
    import sys

    out = run_group([sys.executable, "-c", PROBE], cwd=REPO, env=clean_env(), timeout_s=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True True True"
