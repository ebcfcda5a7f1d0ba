"""Megatron backend save/load (DP=2, distributed optimizer) as real Ray actors on CPU."""

import pytest

pytest.importorskip("megatron.core")

from train_batches import assert_save_load_round_trip, make_batch, make_config  # noqa: E402
from trainer.driver import components

pytestmark = pytest.mark.slow


def test_save_load_restores_params_and_optimizer(ray_local, tiny_model_path, tmp_path):
    config = make_config(train={"backend": "megatron", "ranks_per_node": 2, "lr": 1e-3,
                                "max_tokens_per_micro_batch": 128})
    group = components.train_group(config)
    try:
        assert_save_load_round_trip(group, make_batch(num_groups=2, group_size=4, seed=7),
                                    str(tmp_path / "ckpt"))
    finally:
        group.shutdown()
