"""OpenAI-API agents as rollouts (rollout/agent): the real ``openai`` client against the
session server, token-exact traces, tool calls, errors; then real engines and the router."""

import asyncio
import functools
import json
import random
import re

import anthropic
import dialect_agents
import openai
import pytest

from envs import calculator
from rollout.agent import (Call, HistoryRewriteError, ScriptedChatPolicy, SessionServer,
                           ToolCall, Trace, build_samples, format_tool_calls,
                           parse_tool_calls, run_agent)
from rollout.agent.toolcalls import UNPARSED_NAME
from rollout.args import RolloutArgs
from rollout.generate import EnginePolicy, GenerateState
from rollout.http import ABORT, close_session
from rollout.sample import Sample
from rollout_engines import engines
from trainer.driver import components


@pytest.fixture(scope="module")
def tools_model_path():
    from rollout.models import resolve_model_path

    return resolve_model_path("tiny-qwen3-tools")


@pytest.fixture(scope="module")
def tok(tools_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_model_path)


def agent_config(**rollout):
    from config import build_config

    base = {"num_engines": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
            "max_response_len": 40}
    base.update(rollout)
    return build_config({"rollout": base, "model": {"path": "tiny-qwen3-tools"},
                         "env": {"name": "calculator", "max_turns": 3}})


def task_sample(k=0):
    row = calculator.CalculatorEnv.dataset("eval", size=k + 1)[k]
    return Sample(prompt="", tokens=[1], label=row["label"], index=k, group_index=0)


def render(tok, messages, tools, *, generation_prompt=True):
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


def run(coro):
    async def go():
        try:
            return await coro
        finally:
            server = SessionServer._servers.get(id(asyncio.get_running_loop()))
            if server is not None:
                await server.close()
            await close_session()
    return asyncio.run(go())


def scripted(tok, sample, direct_prob):
    reply = functools.partial(calculator.demo_reply, direct_prob=direct_prob)
    return ScriptedChatPolicy(reply, sample, tok, random.Random(0))


class Recorder:
    """A policy wrapper remembering every request's input ids and the policy's answer."""

    def __init__(self, policy):
        self.policy, self.inputs, self.outputs = policy, [], []

    @property
    def weight_version(self):
        return getattr(self.policy, "weight_version", None)

    def observe_request(self, messages, tools):
        if hasattr(self.policy, "observe_request"):
            self.policy.observe_request(messages, tools)

    async def act(self, token_ids, max_new_tokens):
        out = await self.policy.act(token_ids, max_new_tokens)
        self.inputs.append(list(token_ids))
        self.outputs.append(out)
        return out


def check_layout(samples, rec):
    """Each sample is its calls' tokens verbatim: mask 1 and the engine's log-probs exactly
    on output ids, mask 0 on everything between; a call that does not extend the previous
    call's context starts the next sample."""
    calls = list(zip(rec.inputs, rec.outputs))
    k = 0
    for s in samples:
        prompt, (out, lps, _) = calls[k]
        tokens, mask, logp = list(prompt) + out, [1] * len(out), list(lps)
        k += 1
        while k < len(calls) and calls[k][0][:len(tokens)] == tokens:
            nxt, (out, lps, _) = calls[k]
            delta = nxt[len(tokens):]
            tokens += delta + out
            mask += [0] * len(delta) + [1] * len(out)
            logp += [0.0] * len(delta) + list(lps)
            k += 1
        assert s.tokens == tokens and s.prompt_length == len(prompt)
        assert s.loss_mask == mask and s.rollout_log_probs == logp
        s.check()
    assert k == len(calls)


# ---- tool-call parsing --------------------------------------------------------------

def test_tool_call_parse_round_trip_keeps_the_models_json_verbatim(tok):
    canonical = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 38"}}'
                 '\n</tool_call>')
    p = parse_tool_calls(canonical)
    assert p.content is None and not p.malformed
    assert [(c.name, c.arguments) for c in p.tool_calls] == [
        ("calculator", '{"expression": "47 * 38"}')]
    assert format_tool_calls(p.tool_calls) == canonical
    # Compact JSON as a model may write it: the arguments string stays the model's text.
    compact = 'Let me compute.\n<tool_call>{"name":"calc","arguments":{"x":1,"y":[2]}}</tool_call>'
    p = parse_tool_calls(compact)
    assert p.content == "Let me compute." and p.tool_calls[0].arguments == '{"x":1,"y":[2]}'
    two = format_tool_calls([ToolCall("a", '{"v": 1}'), ToolCall("b", "{}")], "hi")
    p = parse_tool_calls(two)
    assert p.content == "hi" and [c.name for c in p.tool_calls] == ["a", "b"]
    # The template renders the parsed message back to exactly the model's text.
    msg = {"role": "assistant", "content": p.content,
           "tool_calls": [c.to_openai() for c in p.tool_calls]}
    rendered = tok.apply_chat_template([{"role": "user", "content": "q"}, msg],
                                       tools=[calculator.CALCULATOR_TOOL], tokenize=False)
    assert "<|im_start|>assistant\n" + two + "<|im_end|>" in rendered
    # Malformed calls are not repaired: each is a call with an error, its arguments the
    # model's raw text (what an agent's json.loads rejects), so the agent can answer it.
    for bad, name, arguments in (
            ('<tool_call>\nnot json\n</tool_call>', UNPARSED_NAME, "not json"),
            ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', UNPARSED_NAME,
             '{"name": 3, "arguments": {}}'),
            ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', "f", '"x"'),
            ('ok <tool_call>{"name": "f", "arguments": {"a": ', "f",  # cut off
             '{"name": "f", "arguments": {"a":')):
        p = parse_tool_calls(bad)
        assert p.malformed == 1 and len(p.tool_calls) == 1, bad
        call = p.tool_calls[0]
        assert (call.name, call.arguments) == (name, arguments) and call.error, bad
        assert p.content == ("ok " if bad.startswith("ok") else None)
    p = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call> and more')
    assert p.malformed == 1 and [(c.name, c.error) for c in p.tool_calls] == [("f", None)]
    assert not parse_tool_calls("<answer>3</answer>").malformed


# ---- traces -> samples ----------------------------------------------------------------

def test_trace_merges_extending_calls_and_applies_the_history_policy():
    def call(prompt, out):
        return Call(prompt_ids=prompt, output_ids=out, log_probs=[-0.5] * len(out),
                    finish="stop", weight_version=3)

    c1 = call([1, 2, 3], [10, 11])
    c2 = call([1, 2, 3, 10, 11, 4, 5], [12])       # extends c1: same sample
    c3 = call([1, 2, 9], [13, 14])                  # rewrote history: new sample
    s = Sample(tokens=[7], index=5, group_index=2, label="L", metadata={"k": 1})
    out = build_samples(Trace([c1, c2, c3]), s)
    assert len(out) == 2 and out[0] is s
    a, b = out
    assert a.tokens == [1, 2, 3, 10, 11, 4, 5, 12] and a.prompt_length == 3
    assert a.loss_mask == [1, 1, 0, 0, 1] and a.rollout_log_probs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert b.tokens == [1, 2, 9, 13, 14] and b.loss_mask == [1, 1]
    assert (b.index, b.group_index, b.label, b.metadata["k"]) == (5, 2, "L", 1)
    assert a.metadata["agent"]["history_rewrites"] == b.metadata["agent"]["history_rewrites"] == 1
    assert Trace([c1, c2, c3]).history_rewrites() == 1
    with pytest.raises(HistoryRewriteError):
        build_samples(Trace([c1, c2, c3]), Sample(), policy="drop")
    assert len(build_samples(Trace([c1, c2]), Sample(), policy="drop")) == 1
    with pytest.raises(ValueError, match="no chat completion call"):
        build_samples(Trace([]), Sample())


# ---- the session through the real openai client (scripted player) ----------------------

def test_tool_episode_is_one_token_exact_sample(tok):
    sample = task_sample()
    task = calculator.task_of(sample)
    rec = Recorder(scripted(tok, sample, direct_prob=0.0))
    args = RolloutArgs("http://127.0.0.1:1", **components.rollout_sections(agent_config()))
    samples = run(run_agent(calculator.agent, args,
                            sample, rec, tokenizer=tok, max_new_tokens=40, max_context_len=512))
    assert len(samples) == 1 and len(rec.inputs) == 2
    s = samples[0]
    assert s.reward == 1.0 and s.metadata["used_tool"] and s.metadata["success"]
    assert s.metadata["agent"] == {"calls": 2, "samples": 1, "history_rewrites": 0,
                                   "tool_calls": 1, "malformed_tool_calls": 0}
    question = [{"role": "user", "content": task["question"]}]
    assert rec.inputs[0] == render(tok, question, [calculator.CALCULATOR_TOOL])
    check_layout(samples, rec)
    # The whole sample is the template's render of the finished conversation (up to the
    # final eos): tool call, tool result and answer all rendered back token for token.
    call = ToolCall("calculator", json.dumps({"expression": task["expression"]}), id="c")
    convo = question + [
        {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
        {"role": "tool", "tool_call_id": "c", "content": str(task["answer"])},
        {"role": "assistant", "content": f"<answer>{task['answer']}</answer>"}]
    full = render(tok, convo, [calculator.CALCULATOR_TOOL], generation_prompt=False)
    assert s.tokens == full[:len(s.tokens)] and len(full) - len(s.tokens) == 1
    assert tok.decode(s.tokens[s.prompt_length:][-1:]) == tok.eos_token


async def _openai_errors(tok):
    server = await SessionServer.get()
    sample = task_sample()
    session = server.open(policy=scripted(tok, sample, 0.0), tokenizer=tok, max_new_tokens=40,
                          max_context_len=256)
    client = server.client(session, timeout=30)
    msgs = [{"role": "user", "content": "What is 1 + 2?"}]
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    errors = {}
    for name, kwargs in {"n": {"n": 2}, "tool_choice": {"tool_choice": "required"},
                         "long": {"messages": [{"role": "user", "content": "9 " * 300}]},
                         "bad_max_tokens": {"max_tokens": 0}}.items():
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(**{"model": "policy", "messages": msgs,
                                                    **kwargs})
        errors[name] = e.value
    assert errors["long"].code == "context_length_exceeded"
    # The other dialects' mistakes reach their own clients' exceptions.
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.create(model="policy", input="hi", previous_response_id="r")
    claude = anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="role must be"):
        await claude.messages.create(model="policy", max_tokens=4,
                                     messages=[{"role": "system", "content": "hi"}])
    gone = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/nope/v1", api_key="x",
                              max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await gone.chat.completions.create(model="policy", messages=msgs)
    await gone.close()
    server.close_session(session)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="policy", messages=msgs)
    with pytest.raises(anthropic.NotFoundError):
        await claude.messages.create(model="policy", max_tokens=4, messages=msgs)
    await claude.close()
    assert len(session.trace.calls) == 1  # only the one answered call was recorded


def test_session_http_errors_reach_the_agent_as_openai_exceptions(tok):
    run(_openai_errors(tok))


def test_aborted_request_is_a_503_and_the_episode_aborted(tok):
    cfg = agent_config()
    # never reached: the switch answers
    args = RolloutArgs("http://127.0.0.1:1", **components.rollout_sections(cfg))
    seen = []

    async def agent(client, sample, args):
        try:
            await client.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": "hi"}])
        except openai.InternalServerError as e:
            seen.append(e.status_code)
            raise

    async def go():
        policy = EnginePolicy(GenerateState(args), {"max_new_tokens": 8})
        ABORT.on = True
        try:
            return await run_agent(agent, args, task_sample(), policy, tokenizer=tok,
                                   max_new_tokens=8, max_context_len=512)
        finally:
            ABORT.on = False

    samples = run(go())
    assert seen == [503]
    assert len(samples) == 1 and samples[0].status == Sample.Status.ABORTED


# ---- the other dialects: chat streaming, Responses, Anthropic Messages ------------------

QUESTION = re.compile(r"What is (\d+ [-+*] \d+)\?")


def fumbling_reply(sample, messages, tools, rng, fumble=True):
    """The scripted model: a malformed call first (a brace short), then, answered with the
    tool's error, a well-formed call in compact JSON (which Anthropic's parsed ``input``
    does not keep), then the tool's result as the answer. Without ``fumble``: the call in
    the template's own JSON straight away."""
    question = next(m["content"] for m in messages if m["role"] == "user")
    arguments = {"expression": QUESTION.search(question).group(1)}
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if results and not results[-1].startswith("error"):
        return f"<answer>{results[-1]}</answer>"
    if not fumble:
        return format_tool_calls([ToolCall("calculator", json.dumps(arguments))])
    if not results:
        return ('<tool_call>\n{"name": "calculator", "arguments": '
                + json.dumps(arguments) + '\n</tool_call>')
    return format_tool_calls([ToolCall("calculator", json.dumps(arguments, separators=(",", ":")))])


def scored(sample, text):
    return float(calculator.extract_answer(text) == calculator.task_of(sample)["answer"])


def dialect_agent(loop):
    """A homegym agent running ``loop`` (tests/dialect_agents.py) on the episode's session."""
    async def agent(client, sample, args):
        question = calculator.task_of(sample)["question"]
        return scored(sample, await loop(str(client.base_url), "unused", "policy", question))
    return agent


def same_episode_in_every_dialect(tok, reply, max_new_tokens=64, max_context_len=512,
                                  **run_kwargs):
    """The calculator episode ``reply`` scripts (a malformed call, a corrected call, the
    answer), driven by the real openai (chat, streamed chat, Responses) and anthropic
    clients: each must be one token-exact sample, reward 1, the malformed call counted,
    and all the same tokens. Returns the chat client's sample."""
    args = RolloutArgs("http://127.0.0.1:1", **components.rollout_sections(agent_config()))
    agents = {"chat": calculator.agent,
              **{name: dialect_agent(loop) for name, loop in dialect_agents.LOOPS.items()}}
    out = {}
    for name, agent in agents.items():
        sample = task_sample()
        rec = Recorder(ScriptedChatPolicy(reply, sample, tok, random.Random(0)))
        samples = run(run_agent(agent, args, sample, rec, tokenizer=tok,
                                max_new_tokens=max_new_tokens, max_context_len=max_context_len,
                                **run_kwargs))
        assert len(samples) == 1 and samples[0].reward == 1.0, name
        assert samples[0].metadata["agent"] == {"calls": 3, "samples": 1, "history_rewrites": 0,
                                                "tool_calls": 1, "malformed_tool_calls": 1}, name
        check_layout(samples, rec)
        out[name] = samples[0]
    first = out["chat"]
    for name, s in out.items():
        assert (s.tokens, s.loss_mask, s.prompt_length) == \
            (first.tokens, first.loss_mask, first.prompt_length), name
    return first


def test_every_dialect_records_the_same_token_exact_sample_malformed_call_included(tok):
    """The real openai (chat, streamed chat, Responses) and anthropic clients drive the same
    episode: a malformed call the agent answers with the tool's error, a corrected call,
    the answer. Each is one token-exact sample with the malformed call counted, and all
    four are the same tokens: the session renders each answered turn as the model wrote
    it, whatever the dialect sent back."""
    first = same_episode_in_every_dialect(tok, fumbling_reply)
    text = tok.decode(first.tokens)
    expression = calculator.task_of(first)["expression"]
    assert f'{{"expression": "{expression}"}}\n</tool_call>' in text  # the malformed call
    assert f'{{"expression":"{expression}"}}}}\n</tool_call>' in text  # compact, verbatim
    assert "<tool_response>\nerror: " in text  # the tool error the agent answered with


class PromptReadingPolicy(ScriptedChatPolicy):
    """The scripted player on the token route, which carries no messages: it reads the
    question and the tool results from the decoded prompt."""

    async def act(self, token_ids, max_new_tokens):
        text = self.tokenizer.decode(token_ids)
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
        self.observe_request([{"role": "user", "content": text}]
                             + [{"role": "tool", "content": r} for r in results], None)
        return await super().act(token_ids, max_new_tokens)


def test_verifiers_taskset_runs_through_the_session(tok):
    """A verifiers environment written with verifiers' own classes (tests/vf_calculator.py:
    Taskset, Task with a @vf.reward, a Harness) is the rollout through
    rollout.agent.verifiers_env: its harness's streamed chat (usage asked for), Responses
    and Anthropic Messages calls relayed by verifiers' interception server and eval client
    to the session, and verifiers' token-level train client posting token ids to the
    session's /inference/v1/generate. Each episode is one token-exact sample with the
    taskset's reward; the relayed dialects record the same tokens."""
    from rollout.agent import verifiers_env

    renderer = {"name": "default", "tool_parser": "qwen3"}  # tiny-qwen3-tools' format
    runs = {**{d: {"harness": {"id": "vf_calculator", "dialect": d}}
               for d in dialect_agents.LOOPS},
            "train": {"client": "train", "renderer": renderer}}
    out = {}
    for name, options in runs.items():
        cfg = agent_config(extra_config={"verifiers": {"taskset": "vf_calculator", **options}})
        args = RolloutArgs("http://127.0.0.1:1", **components.rollout_sections(cfg))
        sample = Sample(prompt="", tokens=[1], label=json.dumps({"idx": 2}), index=0,
                        group_index=0)
        # verifiers' renderer parses tool calls itself, and its bridge to the next turn
        # re-renders them in the template's JSON: it gets the template's call only.
        player = PromptReadingPolicy if name == "train" else ScriptedChatPolicy
        reply = functools.partial(fumbling_reply, fumble=name != "train")
        rec = Recorder(player(reply, sample, tok, random.Random(0)))
        samples = run(run_agent(verifiers_env.agent, args, sample, rec, tokenizer=tok,
                                max_new_tokens=64, max_context_len=512))
        assert len(samples) == 1 and samples[0].reward == 1.0, name
        check_layout(samples, rec)
        info = samples[0].metadata["agent"]
        assert info["samples"] == 1 and info["calls"] == (2 if name == "train" else 3), name
        out[name] = samples[0]
    task = json.loads(calculator.CalculatorEnv.dataset("eval", size=3)[2]["label"])
    assert task["question"] in tok.decode(out["train"].tokens)  # the label's task was played
    for name in dialect_agents.LOOPS:
        assert out[name].metadata["agent"]["malformed_tool_calls"] == 1
        assert out[name].tokens == out["chat_stream"].tokens, name


# ---- real engines behind the real router -----------------------------------------------

@pytest.fixture(scope="module")
def router(ray_local, tools_model_path):
    with engines(tools_model_path, num_engines=1) as url:
        yield url


async def echo_agent(client, sample, args):
    """Three calls, each sending the model's reply back verbatim plus a new user turn."""
    messages = [{"role": "user", "content": "Say something."}]
    for _ in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[calculator.CALCULATOR_TOOL])
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Again."})
    return 0.0


@pytest.mark.slow
def test_real_engine_traces_are_token_exact_and_rewrites_counted(router, tok):
    cfg = agent_config()
    args = RolloutArgs(router, **components.rollout_sections(cfg))

    async def go():
        state = GenerateState(args)
        results = []
        for k in range(4):
            params = dict(state.sampling_params, max_new_tokens=12, sampling_seed=10 + k)
            rec = Recorder(EnginePolicy(state, params))
            for policy in ("split", "drop"):
                rec.inputs, rec.outputs = [], []
                try:
                    out = await run_agent(echo_agent, args, task_sample(k), rec, tokenizer=tok,
                                          max_new_tokens=12, max_context_len=512,
                                          history_policy=policy)
                except HistoryRewriteError:
                    out = None
                results.append((policy, out, list(rec.inputs), list(rec.outputs)))
        return results

    results = run(go())
    splits = 0
    for policy, samples, inputs, outputs in results:
        rec = Recorder(None)
        rec.inputs, rec.outputs = inputs, outputs
        assert len(inputs) == 3
        assert inputs[0] == render(tok, [{"role": "user", "content": "Say something."}],
                                   [calculator.CALCULATOR_TOOL])
        rewrites = sum(inputs[k][:len(inputs[k - 1]) + len(outputs[k - 1][0])]
                       != inputs[k - 1] + outputs[k - 1][0] for k in (1, 2))
        if policy == "drop":
            assert (samples is None) == (rewrites > 0)
        else:
            assert len(samples) == 1 + rewrites
            splits += rewrites
            check_layout(samples, rec)
            assert all(s.metadata["agent"]["history_rewrites"] == rewrites for s in samples)
    print(f"history rewrites of the untrained model's replies: {splits}")


async def agent_failing_on_group_0(client, sample, args):
    if sample.group_index == 0:
        raise RuntimeError("the agent's tool crashed")
    r = await client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": "hi"}])
    return float(len(r.choices[0].message.content or "") % 2)


async def agent_with_bad_sampling(client, sample, args):
    try:
        await client.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "hi"}])
    except openai.APIStatusError as e:
        sample.metadata["status"] = e.status_code
        raise


@pytest.mark.slow
def test_manager_runs_agents_and_fails_the_ones_that_raise(router):
    from rollout.manager import RolloutManagerCore

    # More episodes than request permits (max_concurrency): must not deadlock.
    cfg = agent_config(rollout_batch_size=2, n_samples_per_prompt=2, max_concurrency=1,
                       sample_timeout_s=30.0,
                       agent={"function": "test_rollout_agent:agent_failing_on_group_0"})
    m = RolloutManagerCore(router_url=router, **components.manager_args(cfg))
    batch = run(m.generate(0))
    assert len(batch) == 4 and 0 not in batch.group_ids
    assert batch.metrics["rollout/failed_samples"] == 2.0
    assert batch.metrics["rollout/agent/calls"] == 1.0
    assert set(batch.statuses) <= {"completed", "truncated"}
    # An engine error (here: sampling params the engine rejects) reaches the agent as an
    # openai exception with the session's 502, and the sample fails like any other.
    cfg = agent_config(rollout_batch_size=1, n_samples_per_prompt=1,
                       agent={"function": "test_rollout_agent:agent_with_bad_sampling"})
    m = RolloutManagerCore(router_url=router, **components.manager_args(cfg))
    m.state.sampling_params["top_k"] = -5
    item = m._new_items(m.train_data.next_group())[0]
    from rollout.manager import _StepStats

    stats = _StepStats()
    run(m._run_item(item, dict(m.state.sampling_params), stats))
    s = item.result[0]
    assert s.status == Sample.Status.FAILED and s.metadata["status"] == 502
    assert "InternalServerError" in s.metadata["error"]


@pytest.mark.slow
def test_calculator_agent_trains_end_to_end(tmp_path, ray_address):
    """The recipe's whole path for a few steps: warm-up transcripts played by the agent
    against the scripted player, then GRPO steps whose rollouts are the agent's sessions
    on the real engine and router."""
    from conftest import run_main

    # A short warm-up: the claim is the path (transcripts, then agent sessions trained on),
    # not that the warm-up taught the model (docs/agents.md measures that).
    run = run_main(tmp_path, "+recipe=calculator_agent_cpu", "warmup.steps=4",
                   "warmup.batch_size=16", "train.num_steps=2", "rollout.rollout_batch_size=2",
                   "rollout.n_samples_per_prompt=4", "rollout.num_engines=1",
                   "+env.kwargs.size=64", "eval.before_and_after=false", timeout_s=400,
                   ray_address=ray_address)
    assert "warm-up: 64 scripted transcripts" in run.output
    steps = [r for r in run.metrics if "rollout/agent/calls" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/failed_samples"] == 0.0 and r["rollout/num_samples"] >= 8
        assert r["rollout/agent/calls"] >= 1.0 and "rollout/used_tool" in r
    assert any("train/pg_loss" in r for r in run.metrics)
    assert "HTTP Request:" not in run.output  # httpx's per-request INFO lines stay quiet


def odd(group: int) -> bool:
    return group % 2 == 1


class Hold:
    busy = staticmethod(odd)  # which groups stay in flight until the step ends


async def agent_busy_on_odd_groups(client, sample, args):
    """Groups chosen by ``Hold.busy`` keep calling the model: in flight when the step ends."""
    msgs = [{"role": "user", "content": "hi"}]
    calls = 0
    while Hold.busy(sample.group_index):
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=1)
        calls += 1
    await client.chat.completions.create(model="policy", messages=msgs)
    sample.metadata["busy_calls"] = calls
    return 1.0


@pytest.mark.slow
def test_agents_aborted_at_the_end_of_a_step_restart_next_step(router):
    from rollout.manager import RolloutManagerCore

    cfg = agent_config(rollout_batch_size=2, over_sampling_batch_size=4, n_samples_per_prompt=2,
                       partial_rollout=True,
                       agent={"function": "test_rollout_agent:agent_busy_on_odd_groups"})
    m = RolloutManagerCore(router_url=router, **components.manager_args(cfg))
    b0 = run(m.generate(0))
    assert sorted(set(b0.group_ids)) == [0, 2]
    assert b0.metrics["rollout/aborted_groups"] == 2 and len(m.buffer) == 2
    for items in m.buffer:  # restarted from the prompt, as a custom generate function is
        for it in items:
            assert it.result is None and it.episode.sample.tokens == it.prompt_ids
    # Step 1 over-samples new groups next to the two resumed ones; holding the new ones
    # makes the resumed groups the first to finish, whatever the machine's load.
    Hold.busy = staticmethod(lambda group: group >= 4)
    try:
        b1 = run(m.generate(1))
    finally:
        Hold.busy = staticmethod(odd)
    assert sorted(set(b1.group_ids)) == [1, 3] and b1.metrics["rollout/resumed_groups"] == 2
    # The restarted episodes' samples hold only their new session's single call.
    assert b1.metrics["rollout/agent/calls"] == 1.0 and b1.metrics["rollout/busy_calls"] == 0.0
