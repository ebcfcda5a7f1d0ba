"""Megatron backend save/load (DP=2, distributed optimizer) as real Ray actors on CPU."""

import pytest
import torch

pytest.importorskip("megatron.core")

from train_batches import make_batch, make_config  # noqa: E402
from trainer.train_group import TrainGroup  # noqa: E402

pytestmark = pytest.mark.slow


def _params(group):
    return {n: t for bucket in group.named_weight_buckets(1 << 20) for n, t in bucket}


def test_save_load_restores_params_and_optimizer(ray_local, tiny_model_path, tmp_path):
    config = make_config(train={"backend": "megatron", "ranks_per_node": 2, "lr": 1e-3,
                                "max_tokens_per_micro_batch": 128})
    group = TrainGroup(config)
    try:
        batch = make_batch(num_groups=2, group_size=4, seed=7)
        group.train_step(batch)  # non-trivial Adam state from here on
        group.save(str(tmp_path / "ckpt"))
        saved = _params(group)
        group.train_step(batch)
        after_first = _params(group)
        group.load(str(tmp_path / "ckpt"))
        assert all(torch.equal(saved[n], t) for n, t in _params(group).items())
        # Same step from the restored state -> same weights: Adam moments and the step
        # counter (LR schedule position) came back too.
        group.train_step(batch)
        for name, tensor in _params(group).items():
            assert torch.equal(after_first[name], tensor), name
    finally:
        group.shutdown()
