"""The prompt ledger: every prompt group trained exactly once per epoch, through failures,
aborts, dropped groups and a checkpoint round trip."""

import asyncio
import pickle
import zlib

import pytest

from rollout.http import close_session
from rollout.ledger import Ledger, LedgerError
from trainer.driver import components


def test_ledger_rejects_training_twice_and_losing_a_row():
    ledger = Ledger()
    ledger.drawn("0:0", 10)
    ledger.generated(10)
    ledger.mark_trained([10, 10])  # one group, two samples
    assert ledger.trained["0:0"] == 1
    with pytest.raises(LedgerError, match="not in the ledger"):
        ledger.mark_trained([10])  # the same group again
    ledger.drawn("0:1", 11)
    ledger.requeue(11, "failed")
    assert ledger.next_requeued() == "0:1"
    ledger.drawn("0:1", 12)  # generated again as a new group
    ledger.generated(12)
    with pytest.raises(LedgerError, match="drawn while generated"):
        ledger.drawn("0:1", 13)
    ledger.mark_trained([12])
    # Rows 0 and 1 trained, row 2 never drawn although the epoch is complete.
    with pytest.raises(LedgerError, match="never drawn"):
        ledger.verify(num_rows=3, complete_epochs=1)
    assert ledger.verify(num_rows=2, complete_epochs=1)["ledger/trained"] == 2
    # A checkpoint that double-counts is caught.
    state = ledger.state_dict()
    state["trained"]["0:0"] = 2
    bad = Ledger()
    bad.load_state_dict(pickle.loads(pickle.dumps(state)))
    with pytest.raises(LedgerError, match="more than once"):
        bad.verify(num_rows=2, complete_epochs=1)


FLAKY: dict = {"failed_once": set()}


async def flaky_generate(args, sample, sampling_params):
    """The default generate, except that the first attempt at every third prompt fails."""
    from rollout.generate import generate

    label = str(sample.label)
    if zlib.crc32(label.encode()) % 3 == 0 and label not in FLAKY["failed_once"]:
        FLAKY["failed_once"].add(label)
        raise RuntimeError("injected failure")
    return await generate(args, sample, sampling_params)


async def constant_rm(args, sample, **kwargs):
    return 1.0


@pytest.mark.slow
def test_manager_trains_every_group_once_through_failures_extras_and_a_checkpoint(
        shared_router, tmp_path):
    from rollout.manager import RolloutManagerCore
    from rollout_engines import config

    cfg = config(num_engines=1, rollout_batch_size=3, n_samples_per_prompt=2,
                 over_sampling_batch_size=5, max_response_len=4,
                 custom_generate_function="test_rollout_ledger:flaky_generate",
                 custom_rm_function="test_rollout_ledger:constant_rm")

    async def go():
        core = RolloutManagerCore(router_url=shared_router, **components.manager_args(cfg))
        num_rows = len(core.train_data)
        steps = 0
        # Train (mark trained) until two full epochs have been drawn; checkpoint and
        # restore into a new manager half-way, as a resume does.
        while core.train_data.epoch < 2:
            batch = await core.generate(steps)
            core.mark_trained(batch.group_ids)
            steps += 1
            if steps == 3:
                state = pickle.loads(pickle.dumps(core.state_dict()))
                core = RolloutManagerCore(router_url=shared_router, **components.manager_args(cfg))
                core.load_state_dict(state)
        summary = core.verify_ledger()
        # What is not trained was dropped (an unused extra, a failure) and is generated
        # again before any new row: one more step draws every such group first. Which
        # groups end up extras depends on the order the engine finishes them in.
        outstanding = {k for k, s in core.ledger.state.items() if s != "trained"}
        pending = list(core.ledger.requeued)
        replaced = core.ledger.counts["replaced"]
        core.mark_trained((await core.generate(steps)).group_ids)
        redrawn = core.ledger.counts["replaced"] - replaced
        await close_session()
        return core, num_rows, summary, outstanding, pending, redrawn

    core, num_rows, summary, outstanding, pending, redrawn = asyncio.run(go())
    # Every row of the first two epochs trained exactly once (none filtered here), apart
    # from those dropped in the last step.
    for epoch in (0, 1):
        for row in range(num_rows):
            key = f"{epoch}:{row}"
            assert core.ledger.trained[key] == 1 or key in outstanding, key
    assert sorted(pending) == sorted(outstanding) and pending, (pending, outstanding)
    assert redrawn >= len(pending)
    assert summary["ledger/trained_twice"] == 0
    # Failed groups are requeued as failed whether they end before or during the drain
    # at the step's end; an unused over-sampled group ends as an extra when it finishes
    # with the last accepted one, or as aborted when the drain stops it.
    assert summary["ledger/requeued_failed"] == len(FLAKY["failed_once"]) > 0
    assert summary.get("ledger/requeued_extra", 0) + summary.get("ledger/requeued_aborted", 0) > 0
    assert summary["ledger/replaced"] > 0


def test_sampling_seeds_are_distinct_across_groups_and_epochs_and_fixed_per_group():
    """rollout.seed gives every sample of every (epoch, row) group a seed of its own, and
    the same seed when the group is generated again (requeued, or drawn by a resumed run)."""
    from rollout.manager import RolloutManagerCore
    from rollout_engines import config

    def manager(seed):  # drawing groups posts nothing: no engine behind the URL
        return RolloutManagerCore(router_url="http://127.0.0.1:9", **components.manager_args(
            config(seed=seed, n_samples_per_prompt=3)))

    def draw(m, groups):
        return [[it.seed for it in m._draw_group()] for _ in range(groups)]

    m = manager(7)
    num_rows = len(m.train_data)
    seeds = draw(m, 2 * num_rows + 3)  # into a third epoch
    flat = [s for group in seeds for s in group]
    assert len(set(flat)) == len(flat)  # across samples, groups and epochs
    assert draw(manager(7), len(seeds)) == seeds  # a new run draws the same again
    assert set(flat).isdisjoint(s for g in draw(manager(8), len(seeds)) for s in g)
    # A dropped group is generated again with the seeds it had.
    last = m.train_data.last_row
    m.ledger.requeue(max(m.ledger.group_key), "failed")  # the last group drawn
    assert draw(m, 1) == [seeds[-1]] and m.train_data.last_row == last
