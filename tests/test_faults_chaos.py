"""The chaos soak, short (scripts/chaos_soak.py runs the long one), in both layouts: 6-12
steps with an engine server SIGKILLed while it generates and one SIGKILLed in the layout's
weight phase (async: paused for a weight push; colocated: its memory released for
training). The async run also has its training rank SIGKILLed (crash, then resume) and one
SIGTERM (graceful stop, then resume), among the engine faults. Every fault lands, every
killed engine is restarted, the run finishes every step, and its prompt ledger shows each
group trained exactly once.

The colocated run takes no crash or stop: a colocated crash and resume is
tests/test_loop.py's killed run (the data order continued exactly, the ledger verified at
the end), and a colocated graceful stop and resume is tests/test_faults_shutdown.py's."""

import random

import pytest

from conftest import chaos_module, read_jsonl


# Steps for each schedule: engine faults only after a step has been logged, away from the
# step of (and before) the crash and the stop, and two steps before the end so that the
# run outlives their recovery (schedule()). Async: engine kills after steps 1 and 2, the
# crash in step 5 (resumed from step 4's checkpoint), the stop in step 6, a third launch
# for the rest. Each fault waits for the recovery from the one before and lands in the
# first step in its phase after it is armed; a tiny model's async steps take ~0.1 s, so a
# fault can slip a step or two (engine kills have landed in steps 3 and 5, a stop two
# steps after the resumed launch's first), and the stop must still find a step left in
# the resumed launch: five steps of room beyond the seven the schedule needs (seed 15
# draws steps 1 and 2 for the engine kills). Colocated: two of steps 1-3 drawn for the
# engine kills; seed 4 draws 1 and 2, which leaves the most steps for their recovery.
SHORT = {"async": dict(steps=12, kill_rank_at=4, sigterm_at=5, seed=15),
         "colocated": dict(steps=6, kill_rank_at=None, sigterm_at=None, seed=4)}


@pytest.mark.parametrize("mode", ["async", "colocated"])
@pytest.mark.parametrize("steps", [8, 30])
def test_the_schedule_kills_engines_in_both_phases_away_from_the_crash_and_the_stop(mode, steps):
    chaos = chaos_module()
    rank_at, sigterm_at = steps // 2, (3 * steps) // 4
    for seed in range(20):
        faults = chaos.schedule(mode, steps=steps, engine_kills=2, kill_rank_at=rank_at,
                                sigterm_at=sigterm_at, rng=random.Random(seed))
        engine = [f for f in faults if f.kind == "engine"]
        assert sorted(f.phase for f in engine) == sorted(["generation",
                                                          chaos.WEIGHT_PHASE[mode]])
        assert [f.kind for f in faults if f.kind != "engine"] == ["rank", "sigterm"]
        assert [f.after for f in faults] == sorted(f.after for f in faults)
        # Not in the step of (or before) the crash or the stop, and not in the last ones.
        assert all(f.after not in (rank_at - 1, rank_at, sigterm_at - 1, sigterm_at)
                   and 1 <= f.after < steps - 2 for f in engine)


@pytest.mark.parametrize("mode", ["async", "colocated"])
def test_the_short_soaks_schedule_every_fault(mode):
    """The short soaks' step counts leave room for both engine kills, whatever the draw."""
    chaos = chaos_module()
    short = {k: v for k, v in SHORT[mode].items() if k != "seed"}
    for seed in range(20):
        faults = chaos.schedule(mode, engine_kills=2, rng=random.Random(seed), **short)
        assert sorted(f.phase for f in faults if f.kind == "engine") == sorted(
            ["generation", chaos.WEIGHT_PHASE[mode]])
        assert len(faults) == (4 if short["kill_rank_at"] else 2)
    drawn = chaos.schedule(mode, engine_kills=2, rng=random.Random(SHORT[mode]["seed"]), **short)
    assert [f.after for f in drawn if f.kind == "engine"] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "colocated"])
def test_short_chaos_soak_lands_every_fault_and_trains_every_group_exactly_once(tmp_path, mode):
    chaos = chaos_module()
    crash_and_stop = mode == "async"
    steps = SHORT[mode]["steps"]
    figures = chaos.soak(tmp_path, mode, engine_kills=2, **SHORT[mode], reference=False,
                         timeout_s=600)
    print(figures.report())
    assert figures.engine_kills == {"generation": 1, chaos.WEIGHT_PHASE[mode]: 1}
    if crash_and_stop:
        assert figures.rank_kills == 1 and figures.sigterms == 1 and figures.faults == 4
        assert figures.sigterm_outcome == "stopped after the step, saved"
        assert figures.launches == 3  # the first crashed, the second stopped, the third finished
        # The crash lands at a random moment of the step running when it is armed or of
        # the next one, not some steps later: the resumed launch needs steps for the stop.
        crash = next(f for f in figures.landed if f.kind == "rank")
        assert crash.landed_in - crash.armed <= 2, crash
    else:
        assert figures.faults == 2 and figures.launches == 1
    assert figures.engine_restarts == 2  # each killed engine, once
    assert figures.ledger["ledger/trained_twice"] == 0
    # 2 groups a step, each trained once in the final lineage, none left on the way.
    assert figures.ledger["ledger/trained"] == 2 * steps
    assert sum(figures.ledger[f"ledger/{s}"]
               for s in ("pending", "in_flight", "buffered", "generated")) == 0
    run_dir = tmp_path / f"{mode}-chaos"
    logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "perf/train_time" in r]
    assert max(logged) == steps and set(logged) == set(range(1, steps + 1))
