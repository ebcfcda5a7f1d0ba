"""The async loop's two pieces on their own: `filter_stale` (which samples a step may train
on) and `RolloutPipeline` (how far generation runs ahead of training). The pipeline drives
a real Ray actor that records the steps it was asked to generate."""

import pytest

from rollout.sample import RolloutBatch
from trainer.loop import RolloutPipeline, filter_stale


def batch(versions, groups):
    n = len(versions)
    return RolloutBatch(tokens=[[i, i + 1] for i in range(n)], response_lengths=[1] * n,
                        loss_masks=[[1]] * n, rollout_log_probs=[[-0.5]] * n,
                        rewards=[float(i) for i in range(n)], group_ids=list(groups),
                        weight_versions=list(versions), statuses=["completed"] * n,
                        labels=[f"g{g}" for g in groups], metrics={"rollout/raw_reward": 1.0})


def test_drop_removes_whole_groups_staler_than_the_bound():
    # Policy at version 3, bound 1: group 2 is two versions old; group 1 has one sample two
    # versions old, so the whole group goes (a group's baseline needs all its samples).
    b = batch(versions=[3, 3, 2, 1, 1, 1], groups=[0, 0, 1, 1, 2, 2])
    kept, m = filter_stale(b, version=3, max_staleness=1, drop=True)
    assert kept.group_ids == [0, 0]
    assert kept.rewards == [0.0, 1.0] and kept.tokens == [[0, 1], [1, 2]]
    assert kept.labels == ["g0", "g0"] and kept.weight_versions == [3, 3]
    assert kept.metrics == {"rollout/raw_reward": 1.0}
    assert m["async/max_staleness"] == 2.0
    assert (m["async/staleness_0"], m["async/staleness_1"], m["async/staleness_2"]) == (2.0, 1.0, 3.0)
    assert m["async/stale_samples"] == 4.0 and m["async/dropped_stale_samples"] == 4.0
    assert m["async/trained_max_staleness"] == 0.0


def test_keep_trains_on_stale_samples_and_counts_them():
    """algo.stale_policy=keep: nothing is dropped; the stale samples are counted and the
    trained staleness is the batch's own."""
    b = batch(versions=[3, 3, 1, 1], groups=[0, 0, 1, 1])
    kept, m = filter_stale(b, version=3, max_staleness=1, drop=False)
    assert kept is b
    assert m["async/stale_samples"] == 2.0 and m["async/dropped_stale_samples"] == 0.0
    assert m["async/trained_max_staleness"] == 2.0


def test_within_the_bound_nothing_is_dropped_and_unknown_versions_count_as_fresh():
    b = batch(versions=[2, 1, -1, -1], groups=[0, 0, 1, 1])
    kept, m = filter_stale(b, version=2, max_staleness=1, drop=True)
    assert kept is b
    assert m["async/stale_samples"] == 0.0 and m["async/trained_max_staleness"] == 1.0
    assert (m["async/staleness_0"], m["async/staleness_1"]) == (3.0, 1.0)


@pytest.fixture()
def recorder(ray_local):
    @ray_local.remote
    class Recorder:
        """Stands in for the RolloutManager: its `generate` returns the step it was given."""

        def __init__(self):
            self.calls = []

        def generate(self, step):
            self.calls.append(step)
            return f"batch-{step}"

        def seen(self):
            return list(self.calls)

    actor = Recorder.remote()
    yield actor
    ray_local.kill(actor)


def launched(pipeline, recorder, ray_local):
    """Steps queued so far, once their generation has run."""
    steps = [s for s, _ in pipeline.prefetched()]
    assert ray_local.get(recorder.seen.remote()) == steps
    return steps


@pytest.mark.parametrize("max_staleness,ahead", [(0, 1), (1, 2), (2, 3)])
def test_generation_runs_ahead_by_the_staleness_bound(recorder, ray_local, max_staleness, ahead):
    """Generation of step s starts once the policy is at version >= s - 1 - max_staleness."""
    p = RolloutPipeline(recorder, max_staleness=max_staleness, last_step=6)
    try:
        p.launch_ready(0)
        assert launched(p, recorder, ray_local) == list(range(1, ahead + 1))
        p.launch_ready(0)  # same version: nothing more may start
        assert launched(p, recorder, ray_local) == list(range(1, ahead + 1))
        for step in range(1, 7):
            result, metrics = p.take(step)
            assert result == f"batch-{step}" and metrics["perf/rollout_time"] >= 0
            p.launch_ready(step)  # trained on step: version is now `step`
            queued = [s for s, _ in p.prefetched()]
            assert queued == list(range(step + 1, min(step + ahead, 6) + 1))
            assert all(s - 1 - max_staleness <= step for s in queued)
        assert ray_local.get(recorder.seen.remote()) == [1, 2, 3, 4, 5, 6]  # never past last_step
    finally:
        p.close()


def test_prefetched_batches_are_taken_first_and_not_generated_again(recorder, ray_local):
    """Batches a checkpoint saved (generated, not yet trained on) come back on resume; the
    manager is asked only for the steps after them."""
    saved = [(3, ("batch-3", {})), (4, ("batch-4", {}))]
    p = RolloutPipeline(recorder, max_staleness=1, last_step=6, prefetched=saved)
    try:
        assert p.prefetched() == saved
        p.launch_ready(2)  # queue already holds max_staleness + 1 steps
        assert ray_local.get(recorder.seen.remote()) == []
        assert p.take(3) == ("batch-3", {})
        p.launch_ready(3)
        assert [s for s, _ in p.prefetched()] == [4, 5]
        assert ray_local.get(recorder.seen.remote()) == [5]
    finally:
        p.close()
