"""Shared fixtures: one torch thread per process, a model cache, a real local Ray."""

import os
import tempfile
from pathlib import Path

# Before torch is imported anywhere: on a 2-core box one thread per process is fastest.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HOMEGYM_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "homegym"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from trainer.models import resolve_model_path

    return resolve_model_path("tiny-qwen3")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance for the whole session (started and stopped here)."""
    import ray

    tmp = tempfile.mkdtemp(prefix="hg-ray-")
    # Logical CPUs above the 2 physical cores: actors here mostly wait on I/O.
    # address="local": always a fresh instance, never one already running on the machine.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "HOMEGYM_CACHE": os.environ["HOMEGYM_CACHE"]}},
             _temp_dir=tmp)
    yield ray
    ray.shutdown()


def push_tensors(client, named_tensors, version=None) -> dict:
    """Load (name, tensor) pairs into one engine through SGLang's own tensor route, in
    SGLang's payload format (what the training ranks send)."""
    from rollout.engines.weights_io import serialize_for_sglang

    payloads, load_format = serialize_for_sglang(list(named_tensors))
    return client.update_weights_from_tensor(payloads, load_format=load_format, version=version)
