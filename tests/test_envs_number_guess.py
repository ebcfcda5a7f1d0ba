"""The guessing game on the Environment protocol (rules and rewards as in the seed)."""

import asyncio
import json

import pytest

from envs.base import Environment
from rollout.plugins import get_env_class
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


@pytest.mark.parametrize("player", ["binary", "random", "careless"])
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


def careless_guesses(target, repeat_prob, seed=0):
    env = NumberGuessEnv(players=["careless"], repeat_prob=repeat_prob, seed=seed)

    async def go():
        await env.reset(Sample(label={"answer": target}))
        guesses = []
        while True:
            action = env.demo_action()
            guesses.append(int(action.removeprefix("<answer>").removesuffix("</answer>")))
            _, _, done, info = await env.step(action)
            if done:
                return guesses, info
    return asyncio.run(go())


def test_careless_player_wastes_turns_by_repeating():
    guesses, info = careless_guesses(3, repeat_prob=1.0)
    assert guesses == [10] * 6 and not info["success"]  # never moves past its first guess
    guesses, info = careless_guesses(3, repeat_prob=0.0)
    assert guesses == [10, 5, 2, 3] and info["success"]  # plain binary search
    # in between: some games repeat a guess (a wasted turn), and every new guess is the
    # midpoint of what the feedback still allows
    repeats = 0
    for seed in range(20):
        guesses, _ = careless_guesses(17, repeat_prob=0.5, seed=seed)
        repeats += sum(a == b for a, b in zip(guesses, guesses[1:]))
        assert [g for i, g in enumerate(guesses) if i == 0 or g != guesses[i - 1]] == \
            [10, 15, 18, 16, 17][:len(set(guesses))]
    assert repeats > 0
    with pytest.raises(ValueError, match="repeat_prob"):
        NumberGuessEnv(repeat_prob=1.5)


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
