"""Real CPU engines behind the real sglang-router for the rollout tests (no mocks)."""

from __future__ import annotations

import contextlib
from typing import Iterator
from trainer.driver import components


def config(**rollout):
    from config import build_config

    base = {"num_engines": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
            "max_response_len": 8}
    base.update(rollout)
    return build_config({"rollout": base})


@contextlib.contextmanager
def engines(model_path: str, num_engines: int = 2) -> Iterator[str]:
    """Yield the router URL of ``num_engines`` hf engines (Ray actors) serving the model."""
    group = components.engine_group(config(num_engines=num_engines), model_path=model_path)
    try:
        yield group.router_url
    finally:
        group.shutdown()


async def start_decoding(router_url: str, coro, steps: int = 5):
    """Start ``coro`` as a task and return (task, engine URLs) once the engines have run
    ``steps`` more decode steps, i.e. its work is under way and not finished: a readiness
    check where a fixed sleep would race a fast engine."""
    import asyncio

    from rollout.http import post

    async def decode_steps(urls):
        return sum([(await post(f"{u}/get_server_info", method="GET"))["decode_steps"]
                    for u in urls])

    workers = await post(f"{router_url}/workers", method="GET")
    workers = workers.get("workers", workers) if isinstance(workers, dict) else workers
    urls = [w["url"] for w in workers]
    before = await decode_steps(urls)
    task = asyncio.create_task(coro)
    while await decode_steps(urls) < before + steps:
        assert not task.done(), "the work finished before it was seen decoding"
        await asyncio.sleep(0.005)
    assert not task.done(), "the work finished before it was seen decoding"
    return task, urls
