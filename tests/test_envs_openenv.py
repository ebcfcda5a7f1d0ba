"""The OpenEnv adapter (envs/openenv_client.py) against a real openenv-core server: a small
text environment written for the tests (tests/openenv_echo_server.py), served with uvicorn
on 127.0.0.1 in its own process (conftest's ``openenv_echo_server``). Its 2-step training
run: tests/test_envs_train.py."""

import asyncio
import difflib

import pytest

from env_players import Player, assert_token_layout, recording, source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from rollout.chat import load_tokenizer

    return load_tokenizer(tiny_model_path)


def test_four_concurrent_episodes_keep_isolated_state(openenv_echo_server, tok):
    """Four episodes with different seeds, interleaved turn by turn on one event loop
    through homegym's driver, each say exactly what they say when played alone: their own
    word and their own step count; each is won on its second turn, its session closed, and
    its tokens are the exact layout of a prompt-less row (the reset observation is the
    prompt)."""
    from envs.openenv_client import OpenEnvSession
    from rollout.chat import ChatRenderer
    from rollout.generate import Episode, run_episode

    renderer = ChatRenderer(tok)
    data = source(OpenEnvSession.dataset("train", train_size=4), tok, "openenv")

    def wrong_then_right(said):
        return "banana" if len(said) == 1 else said[-1].rsplit(": ", 1)[1]

    class Yielding(Player):
        async def act(self, token_ids, max_new_tokens):
            await asyncio.sleep(0.05)  # every episode's turn waits for the others'
            return await super().act(token_ids, max_new_tokens)

    async def play(i):
        sample = data.make_group(i)[0]
        env = recording(OpenEnvSession(max_turns=3, url=openenv_echo_server))
        player = Yielding(tok, env, wrong_then_right)
        out = await run_episode(Episode(sample, env), player, renderer, max_turns=3,
                                max_context_len=1024, max_response_len=32)
        return out, env, player

    async def together():
        return await asyncio.gather(*(play(i) for i in range(4)))

    alone = [asyncio.run(play(i))[1].said for i in range(4)]
    for i, (s, env, player) in enumerate(asyncio.run(together())):
        assert env.said == alone[i]
        word = env.said[0].rsplit(": ", 1)[1]
        assert env.said == [f"Say the word: {word}", f"No. Say the word: {word}", "Correct."]
        assert s.metadata["success"] is True and s.metadata["turn"] == 2  # its own count
        assert s.reward == pytest.approx(1.0 + difflib.SequenceMatcher(None, "banana", word)
                                         .ratio())
        assert env.ws is None  # the session was closed at the end of the episode
        prompt = renderer.prompt_ids([{"role": "user", "content": env.said[0]}])[1]
        assert_token_layout(s, prompt, player, env.said, renderer)
    assert len({said[0] for said in alone}) > 1  # the seeds chose different words


def test_a_wrong_action_field_is_named(openenv_echo_server):
    from envs.base import EnvSetupError
    from envs.openenv_client import OpenEnvSession

    OpenEnvSession.check_setup(url=openenv_echo_server)  # the one string field is found
    with pytest.raises(EnvSetupError, match=r"env.kwargs.action_field: 'text' is not a field "
                                            r"of the server's action \(fields: message"):
        OpenEnvSession.check_setup(url=openenv_echo_server, action_field="text")
