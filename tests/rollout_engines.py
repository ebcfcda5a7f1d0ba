"""Real CPU engines behind the real sglang-router for the rollout tests (no mocks)."""

from __future__ import annotations

import contextlib
from typing import Iterator


def config(**rollout):
    from trainer.config import build_config

    base = {"num_engines": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
            "max_response_len": 8}
    base.update(rollout)
    return build_config({"rollout": base})


@contextlib.contextmanager
def engines(model_path: str, num_engines: int = 2) -> Iterator[str]:
    """Yield the router URL of ``num_engines`` hf engines (Ray actors) serving the model."""
    from rollout.engines.group import EngineGroup

    group = EngineGroup(config(num_engines=num_engines), model_path=model_path)
    try:
        yield group.router_url
    finally:
        group.shutdown()
