"""Async mode (disaggregated engines, weights broadcast over gloo): an engine's server is
SIGKILLed in the middle of the run. The run finishes every step; the engine is restarted,
gets the current policy (a broadcast group of its own) before the router sends it traffic,
and the next push reaches every engine, each over its own group. Two training ranks: rank 0
alone sends, rank 1 takes part in the gathers. The same run holds the staleness bound
(algo.max_staleness=1) at every step."""

import os
import signal
import threading

import pytest

from conftest import chaos_module, run_main

pytestmark = pytest.mark.slow

ASYNC = ["cluster.colocate=false", "algo.max_staleness=1", "algo.rollout_correction=token_tis",
         "rollout.num_engines=2",
         "train.ranks_per_node=2", "warmup.steps=0", "eval.before_and_after=false",
         "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4"]


def test_async_run_restarts_a_killed_engine_on_the_current_policy_within_the_staleness_bound(
        tmp_path, ray_address):
    chaos = chaos_module()
    run_dir = tmp_path / "out" / "run"
    killed: list[int] = []
    errors: list[BaseException] = []

    def kill_one_engine_after_step_2() -> None:
        try:
            chaos.wait_until(lambda: chaos.steps_logged(run_dir) >= 2, 400, "step 2")
            me = os.getpid()
            servers = chaos.wait_until(lambda: chaos.engine_servers(me, run_dir), 30,
                                       "the engine servers")
            servers[0].send_signal(signal.SIGKILL)
            killed.append(servers[0].pid)
        except BaseException as err:  # reported by the test, not lost in the thread
            errors.append(err)

    killer = threading.Thread(target=kill_one_engine_after_step_2, daemon=True)
    killer.start()
    run = run_main(tmp_path, *ASYNC, "train.num_steps=6", timeout_s=500, ray_address=ray_address)
    killer.join(10)
    assert not errors, errors
    assert killed, "no engine was killed"
    rows = [r for r in run.metrics if "perf/train_time" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert max(r.get("rollout/engine_restarts", 0) for r in rows) == 1
    # In-flight requests of the dead engine went to the other: nothing failed, and no
    # sample came from an engine on no pushed policy (a restarted one before its push).
    assert all(r.get("rollout/failed_samples", 0) == 0 for r in rows)
    assert all(r["async/unversioned_samples"] == 0 for r in rows)
    assert "is dead (server): restarting it" in run.output
    # The staleness bound (algo.max_staleness=1) holds where generation is scheduled, not
    # only where filter_stale would drop: no sample generated is staler than 1 (before
    # filtering), none was dropped, and every step trained on its whole batch.
    assert all(r["async/max_staleness"] <= 1 for r in rows)
    assert all(r["async/dropped_stale_samples"] == 0 for r in rows)
    assert all(r["async/stale_samples"] == 0 for r in rows)
    # Generation of step s+1 overlapped training of step s: its samples are one version old.
    assert any(r["async/max_staleness"] == 1 for r in rows)
    assert any(r.get("async/staleness_1", 0) > 0 for r in rows)
    # The trainer's side of it, every step (issue 34): policy versions between the weights
    # that train a batch and its samples'.
    assert all(0 <= r["mismatch/staleness_mean"] <= r["mismatch/staleness_max"] <= 1 for r in rows)
    assert any(r["mismatch/staleness_max"] == 1 for r in rows)
    for key in ("perf/trainer_wait_time", "perf/engine_idle_time", "perf/weight_sync_time",
                "perf/weight_sync_bytes"):
        assert all(key in r for r in rows), key
