"""Placement on a CPU box: {"CPU": 1} bundles, colocated and disaggregated layouts."""

import pytest
import ray

from train_batches import make_config
from trainer.driver import components

pytestmark = pytest.mark.slow  # needs a real Ray instance (~6 s to start)


@ray.remote(num_cpus=0)
def _where() -> str:
    return ray.get_runtime_context().get_placement_group_id() or ""


@ray.remote
class _Holder:
    def ping(self) -> bool:
        return True


def test_colocated_shares_bundles(ray_local):
    config = make_config(train={"ranks_per_node": 2}, rollout={"num_engines": 2})
    placement = components.placement(config)
    try:
        assert placement.num_slots == 2
        assert placement.train_slot(1) == placement.engine_slots(1)[0] == 1
        res = placement.train_resources()
        assert res.num_cpus + placement.engine_resources().num_cpus <= 1.0 and res.num_gpus == 0
        # An engine holding its whole bundle still leaves room for the training rank.
        engine = _Holder.options(num_cpus=1,
                                 scheduling_strategy=placement.engine_strategy(0)).remote()
        rank = _Holder.options(num_cpus=res.num_cpus,
                               scheduling_strategy=placement.train_strategy(0)).remote()
        assert ray.get([engine.ping.remote(), rank.ping.remote()], timeout=60) == [True, True]
        strategy = placement.train_strategy(0)
        assert strategy.placement_group == placement.pg
        # Something scheduled with the strategy really runs inside the placement group.
        pg_id = ray.get(_where.options(scheduling_strategy=placement.engine_strategy(1)).remote())
        assert pg_id == placement.pg.id.hex()
        with pytest.raises(ValueError, match="training rank 2"):
            placement.train_strategy(2)
    finally:
        placement.shutdown()


def test_disaggregated_uses_disjoint_bundles(ray_local):
    config = make_config(train={"ranks_per_node": 2}, rollout={"num_engines": 3},
                         cluster={"colocate": False})
    placement = components.placement(config)
    try:
        assert placement.num_slots == 5
        engines = {s for j in range(3) for s in placement.engine_slots(j)}
        trains = {placement.train_slot(r) for r in range(2)}
        assert engines.isdisjoint(trains) and engines | trains == set(range(5))
        assert placement.train_resources().num_cpus == 1.0
        bundles = {placement.train_strategy(r).placement_group_bundle_index for r in range(2)}
        assert len(bundles) == 2
    finally:
        placement.shutdown()
