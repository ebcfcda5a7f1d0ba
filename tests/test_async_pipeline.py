"""The async loop's pieces on their own: `filter_stale` (which samples a step may train
on), `RolloutPipeline` (how far generation runs ahead of training) and `TrailingWork`
(what a step leaves to run behind it). The pipeline drives
a real Ray actor that records the steps it was asked to generate and stores their batches
as the rollout manager does (`BatchRef.put`, `RolloutBatch.select`)."""

import threading

import pytest

from rollout.batch_ref import BatchRef
from rollout.sample import RolloutBatch
from trainer.driver.pipeline import RolloutPipeline, TrailingWork, filter_stale


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
    keep, m = filter_stale(b, version=3, max_staleness=1, drop=True)
    assert keep == [0, 1]
    kept = b.select(keep)
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
    keep, m = filter_stale(b, version=3, max_staleness=1, drop=False)
    assert keep is None
    assert m["async/stale_samples"] == 2.0 and m["async/dropped_stale_samples"] == 0.0
    assert m["async/trained_max_staleness"] == 2.0


def test_within_the_bound_nothing_is_dropped_and_unknown_versions_count_as_fresh():
    b = batch(versions=[2, 1, -1, -1], groups=[0, 0, 1, 1])
    keep, m = filter_stale(b, version=2, max_staleness=1, drop=True)
    assert keep is None
    assert m["async/stale_samples"] == 0.0 and m["async/trained_max_staleness"] == 1.0
    assert (m["async/staleness_0"], m["async/staleness_1"]) == (3.0, 1.0)


@pytest.fixture()
def recorder(ray_local):
    @ray_local.remote
    class Recorder:
        """Stands in for the RolloutManager: `generate_ref` stores a batch whose versions are
        the step it was given; `select` and `requeue_groups` are recorded."""

        def __init__(self):
            self.calls, self.requeued = [], []

        def generate_ref(self, step):
            self.calls.append(step)
            n = 4  # (the module's `batch` helper is not importable in a Ray worker)
            return BatchRef.put(RolloutBatch(
                tokens=[[step, i] for i in range(n)], response_lengths=[1] * n,
                loss_masks=[[1]] * n, rollout_log_probs=[[-0.5]] * n, rewards=[0.0] * n,
                group_ids=[2 * step] * 2 + [2 * step + 1] * 2, weight_versions=[step] * n,
                statuses=["completed"] * n, labels=["x"] * n))

        def select(self, b, indices):
            return BatchRef.put(b.select(indices))

        def requeue_groups(self, groups, why):
            self.requeued.append((list(groups), why))

        def seen(self):
            return list(self.calls)

        def seen_requeued(self):
            return list(self.requeued)

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
            assert result.weight_versions == [step] * 4 and metrics["perf/rollout_time"] >= 0
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
    saved = [(3, (batch([3, 3], [6, 6]), {})), (4, (batch([4, 4], [8, 8]), {}))]
    p = RolloutPipeline(recorder, max_staleness=1, last_step=6, prefetched=saved)
    try:
        assert p.checkpoint_state() == saved  # saved again whole, e.g. by the next checkpoint
        p.launch_ready(2)  # queue already holds max_staleness + 1 steps
        assert ray_local.get(recorder.seen.remote()) == []
        ref, metrics = p.take(3)
        assert ref.get() == saved[0][1][0] and metrics == {}
        p.launch_ready(3)
        assert [s for s, _ in p.prefetched()] == [4, 5]
        assert ray_local.get(recorder.seen.remote()) == [5]
    finally:
        p.close()


def test_stale_groups_are_cut_where_the_batch_lives_and_requeued(recorder, ray_local):
    """The pipeline's filter cuts a stored batch through the manager's `select` (one
    selection method, RolloutBatch.select) and requeues the dropped groups as "stale";
    the trained batch's summary (groups, labels, versions, digest) matches the cut."""
    from rollout.batch_ref import tokens_digest

    p = RolloutPipeline(recorder, max_staleness=0, last_step=6, drop_stale=True)
    try:
        b = batch(versions=[3, 3, 2, 2], groups=[5, 5, 6, 6])
        kept, m = p.filter_stale(BatchRef.put(b), version=3)
        assert m["async/dropped_stale_samples"] == 2.0 and m["async/stale_samples"] == 2.0
        whole = kept.get()
        assert whole == b.select([0, 1]) and whole.group_ids == [5, 5]
        assert (kept.group_ids, kept.labels, kept.weight_versions, len(kept)) == (
            [5, 5], ["g5", "g5"], [3, 3], 2)
        assert kept.tokens_sha256 == tokens_digest(whole.tokens)
        assert ray_local.get(recorder.seen_requeued.remote()) == [([6], "stale")]
        # Within the bound: the stored batch itself, nothing requeued.
        fresh = BatchRef.put(batch(versions=[3, 3], groups=[7, 7]))
        same, _ = p.filter_stale(fresh, version=3)
        assert same is fresh and ray_local.get(recorder.seen_requeued.remote()) == [([6], "stale")]
    finally:
        p.close()


def test_trailing_work_runs_in_order_behind_the_caller_and_join_raises_the_first_error():
    gate, ran = threading.Event(), []

    def fail(n):
        ran.append(n)
        raise ValueError(f"job {n} failed")
    trailing = TrailingWork()
    trailing.start(lambda: (gate.wait(30), ran.append(1)))
    trailing.start(lambda: fail(2))
    trailing.start(lambda: fail(3))
    # A slow last job: join must wait for it, not raise as soon as job 2 has failed.
    trailing.start(lambda: (threading.Event().wait(0.5), ran.append(4)))
    assert ran == []  # start returned while the first job still waits
    gate.set()
    with pytest.raises(ValueError, match="job 2 failed"):
        trailing.join()
    assert ran == [1, 2, 3, 4]  # every job had run when join raised
    trailing.join()  # nothing left
    trailing.close()
