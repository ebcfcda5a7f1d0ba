"""The ways in from the ecosystem train 2 steps on CPU through the real stack (the driver,
Ray, the CPU engine behind sglang-router, an FSDP rank, evaluation before and after):
a reasoning-gym task, a textarena game and an OpenEnv server mixed in one run
(examples/mixed_envs.py interleaves their rows, so every step plays all three), and an
agent of one's own on one's own data with no environment class. Both runs share one Ray
instance (they run in this process, as `trainer.main` runs them after composing its
config)."""

import math

import pytest

from conftest import compose_config, read_jsonl

pytestmark = pytest.mark.slow

# 1 engine, 1 rank, 2 steps, no warm-up; zero-advantage samples are trained too, so every
# step's samples reach the rank's loss whatever the tiny model's rewards; one sampled eval.
SHORT = ["warmup.steps=0", "train.num_steps=2", "rollout.n_samples_per_prompt=4",
         "rollout.num_engines=1", "train.ranks_per_node=1", "train.save_interval=null",
         "train.skip_zero_advantage=false", "eval.n_samples_per_prompt=1", "eval.greedy=false",
         "logging.wandb_mode=disabled"]


def two_steps(tmp_path, *overrides):
    """Run; the run directory and its two RL steps' metrics, checked for what every way in
    must give: all samples scored, none failed, a finite loss on all of them."""
    from trainer.main import run

    result = run(compose_config(*SHORT, f"logging.output_dir={tmp_path}", *overrides))
    steps = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "rollout/raw_reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/failed_samples"] == 0.0 and r["train/skipped_samples"] == 0.0
        assert math.isfinite(r["train/pg_loss"])
    return result, steps


def test_reasoning_gym_textarena_and_openenv_train_in_one_run(ray_local, tmp_path,
                                                             openenv_echo_server):
    parts = ("[{name: reasoning_gym, task: chain_sum, max_terms: 2, max_digits: 1, "
             "train_size: 50, eval_size: 2}, {name: textarena, id: GuessTheNumber-v0, "
             f"eval_size: 2}}, {{name: openenv, url: '{openenv_echo_server}', eval_size: 2}}]")
    result, steps = two_steps(tmp_path, "env=custom", "env.name=examples.mixed_envs:MixedEnvironments",
                              f"env.kwargs.parts={parts}", "env.max_turns=2",
                              "rollout.rollout_batch_size=3", "data.shuffle=false")
    for r in steps:
        assert r["rollout/num_samples"] == 12.0  # 3 prompts (one per part) x 4
        # Each part's own info keys: reasoning-gym's score, the OpenEnv server's step
        # count (a numeric observation field), textarena's and everyone's success.
        assert "rollout/score" in r and 1.0 <= r["rollout/turn"] <= 2.0
        assert "rollout/success_rate" in r and "rollout/turns_taken" in r
    assert result.run_dir.name.startswith("mixedenvironments-tiny-qwen3-")
    for name in ("base", "trained"):  # the held-out rows of every part, all scored
        rows = read_jsonl(result.run_dir / "eval" / f"{name}.jsonl")
        assert sorted(r["label"]["part"] for r in rows) == [0, 0, 1, 1, 2, 2]
        assert all(r["status"] != "failed" and r["reward"] is not None for r in rows)


def test_an_agent_of_ones_own_trains_without_an_environment_class(ray_local, tmp_path):
    """env=custom (no environment) + rollout.agent.function + data.path: the agent is the
    whole rollout; the run is named after it and, with no eval split, evaluates nothing."""
    from examples.guess_agent import write_rows

    rows = tmp_path / "guesses.jsonl"
    write_rows(str(rows), num_rows=16)
    result, steps = two_steps(tmp_path, "env=custom", "model=tiny_qwen3_tools",
                              "rollout.agent.function=examples.guess_agent:guess_agent",
                              f"data.path={rows}", "env.max_turns=2", "rollout.rollout_batch_size=2",
                              "rollout.max_response_len=24")
    assert result.run_dir.name.startswith("guess_agent-tiny-qwen3-tools-")
    for r in steps:
        assert r["rollout/num_samples"] >= 8.0 and r["rollout/agent/calls"] >= 1.0
        assert "rollout/guesses" in r and "rollout/success_rate" in r
    assert result.evals == {} and not (result.run_dir / "eval").exists()
