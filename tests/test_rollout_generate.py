"""The env driver and the HTTP client against real CPU engines behind the real router."""

import asyncio

import pytest

from rollout.args import RolloutArgs
from rollout.engines.client import EngineError
from rollout.generate import EnginePolicy, Episode, GenerateState, generate, run_episode
from rollout.http import close_session, generate_together, post
from rollout.sample import Sample
from rollout_engines import config, start_decoding
from rollout_plugins import EndlessEnv
from trainer.driver import components

pytestmark = pytest.mark.slow


@pytest.fixture()
def router(shared_router):
    return shared_router


@pytest.fixture()
def state(router):
    return GenerateState(RolloutArgs(router, **components.rollout_sections(config())))


class Recorder:
    """The real engine policy, remembering what the engine returned per turn."""

    def __init__(self, policy):
        self.policy, self.turns = policy, []
        self.weight_version = None

    async def act(self, token_ids, max_new_tokens):
        out = await self.policy.act(list(token_ids), max_new_tokens)
        self.turns.append(out)
        return out


def prompt_sample(state):
    text, ids = state.renderer.prompt_ids([{"role": "user", "content": "Say anything."}])
    return Sample(prompt=text, tokens=ids, index=0, group_index=0)


def test_multi_turn_masks_are_exact_token_by_token(state):
    tok, r = state.tokenizer, state.renderer
    eos = tok.eos_token_id
    # Many stop tokens: turns end after a few tokens, on eos or on another stop token
    # (then the renderer must close the turn itself). Seeded, so the test does not depend
    # on the luck of a draw; a turn may still run to the 16-token limit, which ends the
    # episode as TRUNCATED on length.
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16,
              "stop_token_ids": list(range(0, len(tok), 3))}

    async def go():
        results = []
        for k in range(6):
            s = prompt_sample(state)
            rec = Recorder(EnginePolicy(state, dict(params, sampling_seed=100 + k)))
            out = await run_episode(Episode(s, EndlessEnv(max_turns=4)), rec, r, max_turns=4,
                                    max_context_len=1024, max_response_len=16)
            results.append((s.tokens[:out.prompt_length], out, rec.turns))
        await close_session()
        return results

    closed_by_renderer = full_episodes = 0
    for prompt, s, turns in asyncio.run(go()):
        exp_tokens, exp_mask, exp_lp = list(prompt), [], []
        for i, (ids, lps, finish) in enumerate(turns):
            assert len(ids) == len(lps) >= 1
            assert finish == "stop" or (finish == "length" and len(ids) == 16
                                        and i == len(turns) - 1)
            exp_tokens += ids
            exp_mask += [1] * len(ids)
            exp_lp += lps
            if i < len(turns) - 1:
                closed = ids[-1] == eos
                closed_by_renderer += not closed
                obs = r.observation_ids("<feedback>higher</feedback>", closed)
                exp_tokens += obs
                exp_mask += [0] * len(obs)
                exp_lp += [0.0] * len(obs)
        assert s.tokens == exp_tokens
        assert s.loss_mask == exp_mask
        assert s.rollout_log_probs == exp_lp
        assert all(lp < 0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m)
        assert s.status == Sample.Status.TRUNCATED  # turn budget or a length stop
        n = len(turns)
        assert s.metadata["num_turns"] == n and s.reward == pytest.approx(n / 4)
        assert tok.decode(s.response_tokens).count("<|im_start|>user\n<feedback>higher") == n - 1
        full_episodes += n == 4
    assert full_episodes > 0  # the turn budget ended some episode
    assert closed_by_renderer > 0  # the close-the-turn path ran too


def test_length_stop_truncates_and_still_scores(state):
    params = dict(state.sampling_params, max_new_tokens=2, ignore_eos=True)

    async def go():
        s = prompt_sample(state)
        env = EndlessEnv(max_turns=4)
        out = await run_episode(Episode(s, env), EnginePolicy(state, params), state.renderer,
                                max_turns=4, max_context_len=1024, max_response_len=2)
        await close_session()
        return out
    s = asyncio.run(go())
    assert s.status == Sample.Status.TRUNCATED and s.response_length == 2
    assert s.metadata["turns_taken"] == 1 and s.loss_mask == [1, 1]


def test_abort_mid_turn_then_resume_keeps_partial_tokens(state, router):
    params = dict(state.sampling_params, ignore_eos=True)

    async def go():
        s = prompt_sample(state)
        ep = Episode(s)
        policy = EnginePolicy(state, params)
        # Abort once the turn is decoding, far from its 300 tokens (a fixed sleep raced:
        # a fast engine finishes 300 tiny-model tokens in ~0.4 s).
        task, urls = await start_decoding(router, run_episode(
            ep, policy, state.renderer, max_turns=1, max_context_len=1024, max_response_len=300))
        for url in urls:
            await post(f"{url}/abort_request", {"abort_all": True})
        first = await task
        partial = (first.status, first.response_length, list(first.tokens))
        again = await run_episode(ep, policy, state.renderer, max_turns=1,
                                  max_context_len=1024, max_response_len=300)
        await close_session()
        return partial, again
    (status, k, tokens), s = asyncio.run(go())
    assert status == Sample.Status.ABORTED and k < 300
    assert s.tokens[:len(tokens)] == tokens  # kept verbatim, continued after
    assert s.response_length == 300 and s.status == Sample.Status.TRUNCATED
    assert s.loss_mask == [1] * 300 and len(s.rollout_log_probs) == 300


def test_default_generate_is_token_in_token_out(state):
    args = state.args

    async def go():
        s = Sample(prompt=state.renderer.prompt_ids([{"role": "user", "content": "hi"}])[0])
        out = await generate(args, s, dict(state.sampling_params))
        await close_session()
        return out
    s = asyncio.run(go())
    assert 1 <= s.response_length <= 8 and s.loss_mask == [1] * s.response_length
    assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    assert GenerateState(args) is state  # cached per process


def test_post_errors_are_clear(router):
    async def go():
        with pytest.raises(EngineError, match="HTTP 4"):
            await post(f"{router}/generate", {"input_ids": "nope"})
        with pytest.raises(EngineError, match="unreachable after 2 attempts"):
            await post("http://127.0.0.1:9/generate", {}, max_retries=1)
        await close_session()
    asyncio.run(go())


class RecordingProxy:
    """A pass-through HTTP server in front of the router that keeps each /generate body it
    forwards (the engines behind it answer; errors pass through with their status)."""

    def __init__(self, target: str):
        self.target, self.bodies = target, []

    async def __aenter__(self):
        from aiohttp import web

        async def forward(request):
            body = await request.json()
            self.bodies.append(body)
            try:
                return web.json_response(await post(f"{self.target}/generate", body))
            except EngineError as err:
                return web.Response(status=err.status or 502, text=str(err))

        app = web.Application()
        app.router.add_post("/generate", forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def policies_behind(proxy, state, params, n):
    """``n`` engine policies whose requests go through ``proxy``."""
    args = RolloutArgs(proxy.url, **components.rollout_sections(config()))
    proxied = GenerateState(args)
    proxied.batch_turns_up_to = state.batch_turns_up_to
    return proxied, [EnginePolicy(proxied, dict(params)) for _ in range(n)]


def test_short_turns_ready_together_go_as_one_request_each_answer_to_its_caller(state, router):
    """Eight short turns started together reach the engines as one batched /generate (one
    request each with rollout.batch_turns_up_to=0), and each caller gets its own prompt's
    answer: every prompt has another length, and each answer reports its caller's
    (``meta_info.prompt_tokens``; a mix-up of the batch's order would swap them). Token
    equality with the one-request runs is not asserted: other batch-mates reorder float
    sums, and a near-tie between two tokens could then flip a greedy pick."""
    params = dict(state.sampling_params, max_new_tokens=6, ignore_eos=True)
    prompts = [prompt_sample(state).tokens + [10 + k] * (k + 1) for k in range(8)]

    async def turns(up_to):
        async with RecordingProxy(router) as proxy:
            proxied, policies = policies_behind(proxy, state, params, len(prompts))
            proxied.batch_turns_up_to = up_to
            out = await asyncio.gather(*[p.act(ids, 6) for p, ids in zip(policies, prompts)])
            payload = {"sampling_params": params, "return_logprob": True}
            answers = await asyncio.gather(*[generate_together(
                proxied.generate_url, dict(payload, input_ids=ids)) for ids in prompts])
        await close_session()
        return out, answers, proxy.bodies

    out, answers, bodies = asyncio.run(turns(16))
    assert [b["input_ids"] for b in bodies] == [prompts, prompts]  # acts, then the direct calls
    for ids, lps, finish in out:
        assert len(ids) == len(lps) == 6 and finish == "length"
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [len(p) for p in prompts]
    _, _, bodies = asyncio.run(turns(0))
    alone = [b["input_ids"] for b in bodies[:len(prompts)]]  # the acts, one request each
    assert sorted(alone) == sorted(prompts) and bodies[-1]["input_ids"] == prompts


def test_a_turn_the_engine_refuses_fails_alone_and_long_turns_go_alone(state, router):
    """A batch the engines answer with a 4xx is sent again prompt by prompt, so only the
    turn it is about fails; turns over rollout.batch_turns_up_to new tokens are never
    batched."""
    params = dict(state.sampling_params, max_new_tokens=4, ignore_eos=True)
    good = prompt_sample(state).tokens
    too_long = good + [11] * state.max_context_len

    async def go():
        async with RecordingProxy(router) as proxy:
            _, policies = policies_behind(proxy, state, params, 3)
            out = await asyncio.gather(policies[0].act(good, 4), policies[1].act(too_long, 4),
                                       policies[2].act(good, 4), return_exceptions=True)
            long_turns = await asyncio.gather(*[p.act(good, 17) for p in policies])
        await close_session()
        return out, long_turns, proxy.bodies

    out, long_turns, bodies = asyncio.run(go())
    assert isinstance(out[1], EngineError) and "HTTP 4" in str(out[1])
    assert [len(o[0]) for o in (out[0], out[2])] == [4, 4]
    assert isinstance(bodies[0]["input_ids"][0], list) and len(bodies[0]["input_ids"]) == 3
    assert all(len(o[0]) == 17 for o in long_turns)
    assert [isinstance(b["input_ids"][0], list) for b in bodies[-3:]] == [False] * 3
