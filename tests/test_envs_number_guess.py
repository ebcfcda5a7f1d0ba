"""The guessing game on the Environment protocol (rules and rewards as in the seed)."""

import asyncio
import json

import pytest

from envs.base import Environment, get_env_class
from envs.number_guess import EVAL_TARGETS, NumberGuessEnv, TRAIN_TARGETS, trajectory_reward
from rollout import Sample


def play(env, target, actions):
    async def go():
        await env.reset(Sample(label=json.dumps({"answer": target})))
        return [await env.step(a) for a in actions]
    return asyncio.run(go())


def test_success_reward_decreases_with_turns():
    steps = play(NumberGuessEnv(), 7, ["<answer>10</answer>", "<answer>5</answer>",
                                       "<answer>7</answer>"])
    assert [s[0] for s in steps[:2]] == ["<feedback>lower</feedback>",
                                         "<feedback>higher</feedback>"]
    assert [s[2] for s in steps] == [False, False, True]
    obs, reward, done, info = steps[-1]
    assert reward == pytest.approx(1.8)
    assert info == {"success": True, "format_error": False, "turns_taken": 3, "target": 7}


def test_malformed_ends_with_minus_two_and_budget_with_minus_one():
    (_, reward, done, info), = play(NumberGuessEnv(), 3, ["I think 3"])
    assert (reward, done, info["format_error"]) == (-2.0, True, True)
    steps = play(NumberGuessEnv(max_turns=2), 3, ["<answer>1</answer>", "<answer>2</answer>"])
    assert steps[-1][1:3] == (-1.0, True)
    assert sum(s[1] for s in steps) == -1.0  # the episode reward is the sum of steps


def test_reward_matches_seed_formula():
    assert trajectory_reward(True, False, 1) == 2.0
    assert trajectory_reward(True, False, 6) == pytest.approx(1.5)
    assert trajectory_reward(False, True, 1) == -2.0
    assert trajectory_reward(False, False, 6) == -1.0


def test_dataset_splits_odd_train_even_eval():
    train, ev = NumberGuessEnv.dataset("train"), NumberGuessEnv.dataset("eval")
    assert [json.loads(r["label"])["answer"] for r in train] == TRAIN_TARGETS
    assert [json.loads(r["label"])["answer"] for r in ev] == EVAL_TARGETS
    assert all(t % 2 == 1 for t in TRAIN_TARGETS) and all(t % 2 == 0 for t in EVAL_TARGETS)
    assert train[0]["messages"][0]["role"] == "user"
    with pytest.raises(ValueError):
        NumberGuessEnv.dataset("test")


@pytest.mark.parametrize("player", ["binary", "random"])
def test_scripted_players_always_win_within_budget(player):
    for target in range(1, 21):
        env = NumberGuessEnv(players=[player], seed=target)

        async def go():
            await env.reset(Sample(label={"answer": target}))
            while True:
                _, reward, done, info = await env.step(env.demo_action())
                if done:
                    return reward, info
        reward, info = asyncio.run(go())
        if player == "binary":  # log2(20) < 5: binary search never runs out of turns
            assert info["success"], (target, info)
        assert info["format_error"] is False


def test_bad_label_is_a_clear_error():
    with pytest.raises(ValueError, match="integer answer"):
        play(NumberGuessEnv(), 0, [])


def test_registry_and_dotted_path():
    assert get_env_class("number_guess") is NumberGuessEnv
    assert get_env_class("envs.number_guess.NumberGuessEnv") is NumberGuessEnv
    assert issubclass(get_env_class("arithmetic"), Environment)
    with pytest.raises(ValueError, match="unknown environment"):
        get_env_class("nope")
    with pytest.raises(ValueError, match="not an envs.base.Environment"):
        get_env_class("envs.number_guess.extract_answer")
