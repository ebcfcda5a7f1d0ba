"""The ecosystem adapters (envs/reasoning_gym_tasks.py, envs/textarena_games.py) with the
real reasoning-gym and textarena packages, played through homegym's own episode driver by
scripted players; and every adapter's start-up errors. OpenEnv, which needs a server:
tests/test_envs_openenv.py."""

import asyncio
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import compose_config
from env_players import Player, assert_token_layout, recording, source
from envs.reasoning_gym_tasks import ReasoningGymTask
from envs.textarena_games import TextArenaGame
from rollout.chat import ChatRenderer, load_tokenizer
from rollout.generate import Episode, run_episode

RG = dict(task="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1,
          train_size=40, eval_size=20)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return load_tokenizer(tiny_model_path)


# ---------------------------------------------------------------------- reasoning-gym
def test_reasoning_gym_scores_the_right_answer_1_and_a_wrong_one_below_1(tok):
    """Its own score_answer: the label's answer scores 1.0 (success), a wrong number or the
    answer buried in other text scores less; the episode is one turn with exact tokens."""
    renderer = ChatRenderer(tok)
    rows = ReasoningGymTask.dataset("train", **RG)
    data = source(rows, tok, "rg")

    async def play(i, reply):
        sample = data.make_group(i)[0]
        prompt = list(sample.tokens)
        env = recording(ReasoningGymTask(**RG))
        player = Player(tok, env, reply)
        out = await run_episode(Episode(sample, env), player, renderer, max_turns=1,
                                max_context_len=512, max_response_len=32)
        return out, prompt, player, env

    for i in range(5):
        answer = rows[i]["label"]["answer"]
        right, prompt, player, env = asyncio.run(play(i, lambda said: answer))
        assert right.reward == 1.0 and right.metadata["success"] is True
        assert env.said[0] in rows[i]["messages"][-1]["content"]
        assert_token_layout(right, prompt, player, env.said, renderer)
        wrong, *_ = asyncio.run(play(i, lambda said: str(int(answer) + 1)))
        assert wrong.reward < 1.0 and wrong.metadata["success"] is False
        buried, *_ = asyncio.run(play(i, lambda said: f"It is {answer}."))
        assert 0.0 < buried.reward < 1.0


def test_reasoning_gym_answer_tag_and_scripted_player():
    env = ReasoningGymTask(answer_tag="answer", **RG)
    label = ReasoningGymTask.dataset("train", **RG)[3]["label"]

    async def go():
        await env.reset(SimpleNamespace(label=label))
        demo = env.demo_action()
        return demo, await env.step(f"thinking... {demo}"), await env.step("no tag here")

    demo, tagged, untagged = asyncio.run(go())
    assert demo == f"<answer>{label['answer']}</answer>"
    assert tagged[1] == 1.0 and tagged[3]["format_error"] is False
    assert untagged[1] == 0.0 and untagged[3]["format_error"] is True


def test_reasoning_gym_splits_are_reproducible_and_eval_is_held_out():
    train = ReasoningGymTask.dataset("train", **RG)
    evals = ReasoningGymTask.dataset("eval", **RG)
    assert train == ReasoningGymTask.dataset("train", **RG)
    asked = {r["messages"][-1]["content"] for r in train}
    held_out = [r["messages"][-1]["content"] for r in evals]
    assert len(train) == 40 and len(evals) == 20
    assert not asked & set(held_out) and len(set(held_out)) == len(held_out)
    # Too many train questions for the task's space: nothing left to hold out.
    from envs.base import EnvSetupError

    with pytest.raises(EnvSetupError, match="env.kwargs.train_size"):
        ReasoningGymTask.dataset("eval", **dict(RG, train_size=5000))


# ---------------------------------------------------------------------- textarena
def binary_search(said):
    """The next bracketed guess over 1..20, replaying the game's hint to each earlier one."""
    lo, hi = 1, 20
    for hint in said[1:]:
        guess = (lo + hi) // 2
        if "higher" in hint:
            lo = guess + 1
        elif "lower" in hint:
            hi = guess - 1
    return f"I guess [{(lo + hi) // 2}]"


def test_textarena_guess_the_number_is_won_by_binary_search_within_5_turns(tok):
    """20 games (15 of the 20 targets) all won; rows carry no prompt, so the game's first
    observation is the prompt; exact tokens and masks."""
    renderer = ChatRenderer(tok)
    kwargs = dict(id="GuessTheNumber-v0", train_size=20)
    data = source(TextArenaGame.dataset("train", **kwargs), tok, "ta")

    async def play(i):
        sample = data.make_group(i)[0]
        assert sample.tokens == []
        env = recording(TextArenaGame(max_turns=10, **kwargs))
        player = Player(tok, env, binary_search)
        out = await run_episode(Episode(sample, env), player, renderer, max_turns=10,
                                max_context_len=2048, max_response_len=32)
        return out, env, player

    targets = set()
    for i in range(20):
        s, env, player = asyncio.run(play(i))
        targets.add(env.game.state.game_state["game_number"])
        assert s.reward == 1.0 and s.metadata["success"] is True, env.said
        assert s.metadata["num_turns"] <= 5 and s.metadata["format_error"] is False
        assert "Guess The Number" in env.said[0]
        prompt = renderer.prompt_ids([{"role": "user", "content": env.said[0]}])[1]
        assert_token_layout(s, prompt, player, env.said, renderer)
    assert len(targets) >= 10  # the seeds choose different targets (15 of 20 here)


def test_textarena_concurrent_games_draw_from_their_own_random_only():
    """Blackjack deals from the global ``random`` at every step. Eight games interleaved on
    one event loop see exactly the cards each sees when played alone, and the process's
    global random and numpy generators are left where they were."""
    actions = ["[hit]", "[stand]", "[stand]", "[hit]", "[stand]", "[stand]"]

    async def game(seed):
        env = TextArenaGame(max_turns=10, id="Blackjack-v0")
        seen = [await env.reset({"seed": seed})]
        for action in actions:
            await asyncio.sleep(0)  # the other games reset and deal in between
            obs, reward, done, _ = await env.step(action)
            seen.append(obs)
            if done:
                break
        await env.close()
        return seen

    alone = [asyncio.run(game(seed)) for seed in range(8)]
    random.seed(123)
    np.random.seed(123)
    before = random.getstate(), np.random.get_state()[1].copy()

    async def together():
        return await asyncio.gather(*(game(seed) for seed in range(8)))

    assert asyncio.run(together()) == alone
    assert random.getstate() == before[0]
    assert (np.random.get_state()[1] == before[1]).all()
    assert len({tuple(t) for t in alone}) == 8  # the seeds deal different cards


# ---------------------------------------------------------------------- start-up errors
def _preflight_error(*overrides):
    from config import ConfigError
    from trainer.driver.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(compose_config(*overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("overrides,module,extra", [
    (["env=reasoning_gym", "env.task=chain_sum"], "reasoning_gym", "reasoning_gym"),
    (["env=textarena", "env.id=GuessTheNumber-v0"], "textarena", "textarena"),
    (["env=openenv", "env.url=http://127.0.0.1:9"], "websockets", "openenv"),
])
def test_a_missing_package_names_the_extra(monkeypatch, overrides, module, extra):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for an absent package
    message = _preflight_error(*overrides)
    assert message.startswith("env.name: needs the ")
    assert f"pip install -e '.[{extra}]'" in message


@pytest.mark.parametrize("overrides,key,phrase", [
    (["env=reasoning_gym"], "env.task", "must name a reasoning-gym task"),
    (["env=reasoning_gym", "env.task=chian_sum"], "env.task", "did you mean chain_sum"),
    (["env=reasoning_gym", "env.task=chain_sum", "env.kwargs.min_term=2"], "env.kwargs",
     "unexpected keyword argument 'min_term'"),
    (["env=reasoning_gym", "env.task=chain_sum", "env.kwargs.size=5"], "env.kwargs.size",
     "train_size"),
    (["env=textarena", "env.id=GuessTheNumbr-v0"], "env.id", "did you mean GuessTheNumber-v0"),
    (["env=textarena", "env.id=Wordle-v0"], "env.id", "Resource 'words' not found"),
    (["env=textarena", "env.id=GuessTheNumber-v0", "env.kwargs.max_number=0",
      "env.kwargs.colour=1"], "env.kwargs", "unexpected keyword argument 'colour'"),
    (["env=openenv"], "env.url", "must be the OpenEnv server's address"),
    (["env=openenv", "env.url=http://127.0.0.1:9"], "env.url",
     "no OpenEnv server answers at http://127.0.0.1:9"),
])
def test_a_bad_task_game_or_server_is_one_line_naming_the_key(overrides, key, phrase):
    message = _preflight_error(*overrides, "logging.wandb_mode=disabled")
    assert message.startswith(f"{key}: "), message
    assert phrase in message, message


def test_adapter_keys_are_passed_as_keyword_arguments_and_name_the_run():
    config = compose_config("env=reasoning_gym", "env.task=chain_sum", "env.kwargs.max_terms=2")
    assert config.env.kwargs == {"max_terms": 2}  # as written
    assert config.env.init_kwargs == {"task": "chain_sum", "max_terms": 2}
    assert config.derived.label == "chain_sum-tiny-qwen3"
    assert compose_config("env=textarena", "env.id=GuessTheNumber-v0").derived.label == \
        "guessthenumber-v0-tiny-qwen3"
    from config import ConfigError

    with pytest.raises(ConfigError, match="env.task: 'a' disagrees with env.kwargs.task='b'"):
        compose_config("env=reasoning_gym", "env.task=a", "env.kwargs.task=b")


# ---------------------------------------------------------------------- the driver's close()
def test_the_driver_closes_the_environment_when_the_episode_ends_or_fails_not_when_aborted(tok):
    """An adapter's session or game is released once its episode is over (finished,
    truncated or failed by an exception), exactly once; an aborted episode, which the
    manager continues later, keeps it open."""
    from envs.base import Environment
    from rollout.sample import Sample

    class Counted(Environment):
        def __init__(self, fail_on_step=False):
            super().__init__(max_turns=2)
            self.fail_on_step, self.closed = fail_on_step, 0

        async def reset(self, sample):
            return "go"

        async def step(self, action_text):
            if self.fail_on_step:
                raise RuntimeError("environment crashed")
            return "again", 0.0, False, {}

        async def close(self):
            self.closed += 1

    class Fixed:
        weight_version = None

        def __init__(self, finish):
            self.finish = finish

        async def act(self, token_ids, max_new_tokens):
            return [5, tok.eos_token_id], [-0.1, -0.1], self.finish

    renderer = ChatRenderer(tok)

    def episode(env):
        return Episode(Sample(prompt="", tokens=[]), env)

    async def play(ep, finish):
        return await run_episode(ep, Fixed(finish), renderer, max_turns=2,
                                 max_context_len=256, max_response_len=8)

    truncated = Counted()
    assert asyncio.run(play(episode(truncated), "stop")).status == Sample.Status.TRUNCATED
    assert truncated.closed == 1
    crashed = Counted(fail_on_step=True)
    with pytest.raises(RuntimeError, match="environment crashed"):
        asyncio.run(play(episode(crashed), "stop"))
    assert crashed.closed == 1
    aborted = Counted()
    ep = episode(aborted)
    assert asyncio.run(play(ep, "abort")).status == Sample.Status.ABORTED
    assert aborted.closed == 0
    assert asyncio.run(play(ep, "stop")).status == Sample.Status.TRUNCATED  # continued
    assert aborted.closed == 1
