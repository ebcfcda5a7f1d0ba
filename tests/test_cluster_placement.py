"""Multi-node placement on one machine: Ray's own multi-node test cluster
(``ray.cluster_utils.Cluster``) with a GPU-less head and three worker nodes that each
declare 4 logical GPUs. ``trainer.training.placement.Placement`` lays out engines and training ranks
from the cluster config; lightweight probe actors scheduled with the placement's strategies
and resources (as the real engines and ranks are) report where they landed.

Checked: engines spanning ``rollout.num_gpus_per_engine`` GPUs keep all their GPUs on one
node; disaggregated engines and ranks use disjoint GPUs; colocated engine i shares node and
GPUs with the ranks of its slots; every (node, GPU) is used once per role.

The cluster runs in a subprocess (this file run as a script), so it never meets the test
session's own local Ray instance.
"""

import json
import sys
from collections import Counter

import pytest

from conftest import REPO, clean_env, run_group
from trainer.driver import components

pytestmark = pytest.mark.slow


def _config(**groups):
    from config import build_config

    base = {"cluster": {"device": "cuda", "num_nodes": 2, "gpus_per_node": 4},
            "rollout": {"engine": "sglang"}, "train": {"backend": "fsdp"}}
    for key, values in groups.items():
        base.setdefault(key, {}).update(values)
    return build_config(base)


def _layout(config):
    """Probe every engine and training rank; returns JSON-able facts about the layout."""
    import ray


    @ray.remote
    class Probe:
        def where(self):
            return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]

    placement = components.placement(config, timeout_s=120)
    try:
        er, tr = placement.engine_resources(), placement.train_resources()
        engines = [Probe.options(num_cpus=er.num_cpus, num_gpus=er.num_gpus,
                                 scheduling_strategy=placement.engine_strategy(i)).remote()
                   for i in range(placement.num_engines)]
        ranks = [Probe.options(num_cpus=tr.num_cpus, num_gpus=tr.num_gpus,
                               scheduling_strategy=placement.train_strategy(r)).remote()
                 for r in range(placement.num_train)]
        e_where = ray.get([p.where.remote() for p in engines], timeout=300)
        r_where = ray.get([p.where.remote() for p in ranks], timeout=300)
        out = {
            "engines": [{"node": node, "gpus": gpus,
                         "slot_nodes": [placement.node_of_slot(s)
                                        for s in placement.engine_slots(i)],
                         "server_gpus": placement.engine_gpu_ids(i)}
                        for i, (node, gpus) in enumerate(e_where)],
            "ranks": [{"node": node, "gpus": gpus,
                       "slot_node": placement.node_of_slot(placement.train_slot(r))}
                      for r, (node, gpus) in enumerate(r_where)],
        }
        for p in engines + ranks:
            ray.kill(p)
        return out
    finally:
        placement.shutdown()


def _main():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    gpu_nodes = [cluster.add_node(num_cpus=4, num_gpus=4) for _ in range(3)]
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    try:
        result = {
            "gpu_nodes": [n.node_id for n in gpu_nodes],
            "head": cluster.head_node.node_id,
            # 2 engines x 2 GPUs + 4 training ranks, disaggregated: 8 GPUs on 2 nodes.
            "disaggregated": _layout(_config(
                cluster={"colocate": False},
                rollout={"num_gpus": 4, "num_gpus_per_engine": 2},
                train={"num_nodes": 1, "ranks_per_node": 4})),
            # 2 nodes x 4 ranks, colocated with 2 engines x 4 GPUs (one engine per node).
            "colocated": _layout(_config(
                cluster={"colocate": True},
                rollout={"num_gpus": 8, "num_gpus_per_engine": 4},
                train={"num_nodes": 2, "ranks_per_node": 4})),
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))


@pytest.fixture(scope="module")
def layouts():
    env = clean_env()
    proc = run_group([sys.executable, __file__], cwd=REPO, timeout_s=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check_engine_on_one_node(engine, gpus_per_engine):
    assert len(set(engine["slot_nodes"])) == 1, engine  # all its GPUs on one node
    assert engine["node"] == engine["slot_nodes"][0]  # its actor runs there too
    assert len(set(engine["server_gpus"])) == gpus_per_engine
    assert engine["gpus"] and engine["gpus"][0] == engine["server_gpus"][0]


def test_disaggregated_engines_keep_their_gpus_on_one_node(layouts):
    lay, gpu_nodes = layouts["disaggregated"], set(layouts["gpu_nodes"])
    for engine in lay["engines"]:
        _check_engine_on_one_node(engine, 2)
    for rank in lay["ranks"]:
        assert rank["node"] == rank["slot_node"] and len(rank["gpus"]) == 1
    # Nothing on the GPU-less head; 8 distinct (node, GPU) pairs over exactly two nodes.
    engine_gpus = [(e["slot_nodes"][0], g) for e in lay["engines"] for g in e["server_gpus"]]
    rank_gpus = [(r["node"], r["gpus"][0]) for r in lay["ranks"]]
    used = engine_gpus + rank_gpus
    assert len(set(used)) == 8
    assert {n for n, _ in used} <= gpu_nodes and len({n for n, _ in used}) == 2
    # PACK fills one node with the engines (slots 0..3) and the next with the ranks.
    assert len({n for n, _ in engine_gpus}) == 1 and len({n for n, _ in rank_gpus}) == 1


def test_colocated_engine_shares_node_and_gpus_with_its_ranks(layouts):
    lay = layouts["colocated"]
    assert len(lay["engines"]) == 2 and len(lay["ranks"]) == 8
    for i, engine in enumerate(lay["engines"]):
        _check_engine_on_one_node(engine, 4)
        mine = lay["ranks"][4 * i:4 * i + 4]
        assert {r["node"] for r in mine} == {engine["node"]}
        assert sorted(r["gpus"][0] for r in mine) == sorted(engine["server_gpus"])
    per_node = Counter(r["node"] for r in lay["ranks"])
    assert sorted(per_node.values()) == [4, 4]  # 2 nodes x 4 ranks, as configured
    assert layouts["head"] not in per_node


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _main()
