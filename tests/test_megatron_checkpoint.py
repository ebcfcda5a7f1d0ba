"""Megatron backend save/load (DP=2, distributed optimizer) as real Ray actors on CPU."""

import pytest

pytest.importorskip("megatron.core")

from train_batches import (assert_a_fresh_checkpoint_leaves_adams_first_update_whole,  # noqa: E402
                           assert_save_load_round_trip, make_batch, make_config)
from trainer.driver import components

pytestmark = pytest.mark.slow


def test_save_load_restores_params_and_optimizer(ray_local, tiny_model_path, tmp_path):
    """A checkpoint saved before the first step (the optimizer stays fresh), then the
    round trip of a trained state, on one group."""
    config = make_config(train={"backend": "megatron", "ranks_per_node": 2, "lr": 1e-3,
                                "max_tokens_per_micro_batch": 128, "global_batch_size": 8})
    group = components.train_group(config)
    batch = make_batch(num_groups=2, group_size=4, seed=7)
    try:
        assert_a_fresh_checkpoint_leaves_adams_first_update_whole(group, batch,
                                                                  str(tmp_path / "fresh"))
        assert_save_load_round_trip(group, batch, str(tmp_path / "ckpt"))
    finally:
        group.shutdown()
