"""Hang diagnosis, for real: a user generate function blocks the rollout manager's event
loop in step 2. After train.hang_timeout_s the run fails with a message naming the stuck
actor call, and <run dir>/hang/ holds the stacks of the driver, the actors and the engine
servers (py-spy), the manager's showing the blocking line."""

import time

import pytest

from conftest import REPO, chaos_module

pytestmark = pytest.mark.slow

CALLS = {"n": 0}


async def hang_in_step_2(args, sample, sampling_params):
    """The default generate for step 1's four samples, then a call that never returns and
    blocks the event loop (a sleep standing for a stuck library call)."""
    from rollout.generate import generate

    CALLS["n"] += 1
    if CALLS["n"] > 4:
        time.sleep(3600)  # the injected hang: this line must show in the dump
    return await generate(args, sample, sampling_params)


async def constant_rm(args, sample, **kwargs):
    return 1.0


def test_a_stuck_step_fails_the_run_naming_the_call_and_dumps_every_stack(tmp_path):
    chaos = chaos_module()
    run = chaos.launch(tmp_path, "hang", [
        "train.ranks_per_node=1", "rollout.num_engines=1", "warmup.steps=0",
        "eval.before_and_after=false", "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2", "train.num_steps=4", "train.hang_timeout_s=20",
        "rollout.sample_timeout_s=900",
        "rollout.custom_generate_function=test_faults_hang:hang_in_step_2",
        "rollout.custom_rm_function=test_faults_hang:constant_rm"],
        pythonpath=str(REPO / "tests"))
    code = run.wait(timeout_s=400)
    output = run.tail(20000)
    assert code != 0, output
    assert "HangError: no progress for" in output and "after step 1" in output, output
    assert "RolloutManagerCore.generate" in output, output
    hang_dir = tmp_path / "hang" / "hang"
    report = (hang_dir / "report.txt").read_text()
    assert "RolloutManagerCore.generate" in report and "in colocated_steps" in report
    dumps = {p.name: p.read_text() for p in hang_dir.glob("*.txt")}
    manager = [t for n, t in dumps.items() if n.startswith("RolloutManagerCore")]
    assert manager and "hang_in_step_2 (test_faults_hang.py" in manager[0], sorted(dumps)
    assert any(n.startswith("TrainActor") for n in dumps), sorted(dumps)
    assert any(n.startswith("engine_server") for n in dumps), sorted(dumps)
    driver = [t for n, t in dumps.items() if n.startswith("driver_") and "traceback" not in n]
    assert driver and "colocated_steps" in driver[0]
