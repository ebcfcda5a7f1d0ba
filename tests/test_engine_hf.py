"""The CPU engine (rollout/engines/hf) against its HTTP contract, on a real server process."""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from conftest import (fresh_logprobs, push_tensors, run_group, running_engine, starts_processes,
                      wait_for)
from rollout.models import cache_kwarg
from rollout.engines import (PINNED_SGLANG_VERSION, EngineError, EngineServer, HFLaunch,
                             MultiprocessingSerializer)
from rollout.engines.weights_io import init_custom_process_group

# The tiny model's whole context: the tests that pause, abort or update an engine while a
# request decodes send one this long, ~1.3 ms a token on 2 cores, so that it is still
# decoding when the call lands on a loaded machine (at 256 the margin was ~0.3 s).
CTX = 1024


@pytest.fixture(scope="module")
@starts_processes
def engine(tiny_model_path, tmp_path_factory):
    with running_engine(HFLaunch(model_path=tiny_model_path, max_context_len=CTX), "hf-test",
                        tmp_path_factory.mktemp("hf-engine")) as eng:
        yield eng


@pytest.fixture(scope="module")
def ref_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager").eval()


def gen(engine, payload, status=200):
    r = requests.post(engine.url + "/generate", json=payload, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def prompts(n, lo=3, hi=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(5, 400, (length,), generator=g).tolist())
    return out


def test_a_started_engine_keeps_what_it_loaded_out_of_the_collectors_reach(engine):
    """EngineServer.start asks every engine to freeze its GC once ready (SGLang's own
    request races its HTTP server's start), so a collection, a weight release's, walks
    only what serving made since: not torch's, transformers' and the model's objects."""
    assert engine.client.server_info()["gc_frozen_objects"] > 50_000


def test_generate_shape_and_eos_semantics(engine, tiny_model_path):
    out = gen(engine, {"text": "Hello, world!", "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["prompt_tokens"] > 0 and meta["weight_version"] == "default"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 and txt is None for lp, _, txt in meta["output_token_logprobs"])
    # A stop token ends generation and stays in output_ids, as in SGLang.
    first = out["output_ids"][0]
    stopped = gen(engine, {"text": "Hello, world!", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first]}})
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    # A stop string ends generation and is trimmed from the text.
    text = out["text"]
    if len(text) >= 3:
        s = gen(engine, {"text": "Hello, world!", "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "stop": [text[1:3]]}})
        assert s["meta_info"]["finish_reason"]["type"] == "stop"
        assert text[1:3] not in s["text"]
    # input_ids and text give the same result for the same tokens.
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(tiny_model_path).encode("Hello, world!")
    same = gen(engine, {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert same["output_ids"] == out["output_ids"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_fresh_forward_under_continuous_batching(engine, ref_model, temperature):
    """Mixed-length requests joining a running batch at different times still get the
    log-probs of a plain forward pass of their own sequence."""
    ps = prompts(12, seed=int(temperature * 10))
    # One long request first, so the others join a running batch mid-decode.
    first = {"input_ids": ps[0], "return_logprob": True,
             "sampling_params": {"max_new_tokens": 48, "temperature": temperature, "ignore_eos": True}}
    with ThreadPoolExecutor(12) as pool:
        steps = engine.client.server_info()["decode_steps"]
        futs = [pool.submit(gen, engine, first)]
        wait_for(lambda: engine.client.server_info()["decode_steps"] > steps, timeout_s=30,
                 what="the first request to decode")
        for i, p in enumerate(ps[1:]):
            futs.append(pool.submit(gen, engine, {
                "input_ids": p, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4 + 3 * i, "temperature": temperature,
                                    "ignore_eos": True}}))
        outs = [f.result() for f in futs]
    for p, out in zip(ps, outs):
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        want = fresh_logprobs(ref_model, p, out["output_ids"], temperature)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        if temperature == 0:  # greedy tokens are the fresh forward's argmax
            ids = torch.tensor([p + out["output_ids"]])
            with torch.no_grad():
                argmax = ref_model(ids).logits[0, len(p) - 1:-1].argmax(-1).tolist()
            assert argmax == out["output_ids"]


def test_logprobs_with_top_k_top_p_are_the_unfiltered_temperature_scaled_ones(engine, ref_model):
    """README: log-probs follow SGLang's default, the temperature-scaled distribution
    before top-k/top-p filtering (a filtered one would renormalise over the kept tokens)."""
    for i, p in enumerate(prompts(3, seed=5)):
        out = gen(engine, {"input_ids": p, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0.7, "top_k": 3, "top_p": 0.8, "seed": i,
            "ignore_eos": True}})
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        want = fresh_logprobs(ref_model, p, out["output_ids"], 0.7)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        # Every sampled token was inside the top 3 of its step.
        ids = torch.tensor([p + out["output_ids"]])
        with torch.no_grad():
            top3 = ref_model(ids).logits[0, len(p) - 1:-1].topk(3, dim=-1).indices
        assert all(t in row.tolist() for t, row in zip(out["output_ids"], top3))


def test_native_kernels_off_computes_the_same(engine, tiny_model_path, tmp_path, monkeypatch):
    """README: with HOMEGYM_NATIVE_KERNELS=0 the engine computes the same in plain torch:
    same greedy tokens, same log-probs, as the engine with its C kernels and packed
    matmuls."""
    monkeypatch.setenv("HOMEGYM_NATIVE_KERNELS", "0")
    with running_engine(HFLaunch(model_path=tiny_model_path, max_context_len=CTX), "hf-plain",
                        tmp_path) as plain:
        for p in prompts(4, seed=9):
            payload = {"input_ids": p, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
            a, b = gen(engine, payload), gen(plain, payload)
            assert a["output_ids"] == b["output_ids"]
            la, lb = (torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
                      for o in (a, b))
            assert torch.allclose(la, lb, atol=1e-4), (la - lb).abs().max()


def test_seed_is_reproducible_and_n(engine):
    payload = {"input_ids": [10, 20, 30], "sampling_params": {"max_new_tokens": 12, "seed": 7,
                                                              "temperature": 1.0}}
    a, b = gen(engine, payload), gen(engine, payload)
    assert a["output_ids"] == b["output_ids"]
    payload["sampling_params"]["seed"] = 8
    c = gen(engine, payload)
    assert c["output_ids"] != a["output_ids"]
    many = gen(engine, {"input_ids": [10, 20, 30], "sampling_params": {"max_new_tokens": 3, "n": 3}})
    assert isinstance(many, list) and len(many) == 3
    batch = gen(engine, {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 2}})
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [2, 3]
    texts = gen(engine, {"text": ["a", "hello hello"], "sampling_params": {"max_new_tokens": 2}})
    assert len(texts) == 2 and texts[0]["meta_info"]["prompt_tokens"] < texts[1]["meta_info"]["prompt_tokens"]
    topk = gen(engine, {"input_ids": [10, 20, 30], "sampling_params": {
        "max_new_tokens": 5, "top_k": 1, "top_p": 0.5, "temperature": 1.0}})
    greedy = gen(engine, {"input_ids": [10, 20, 30], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0}})
    assert topk["output_ids"] == greedy["output_ids"]


def test_abort_returns_partial_tokens(engine):
    long = {"input_ids": [5, 6, 7], "rid": "long-1",
            "sampling_params": {"max_new_tokens": CTX - 10, "ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(gen, engine, long)
        wait_for(lambda: engine.client.server_info()["num_running_reqs"], timeout_s=30,
                 what="the request to reach the engine")
        requests.post(engine.url + "/abort_request", json={"rid": "long-1"}, timeout=10)
        out = fut.result()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < CTX - 10
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(gen, engine, dict(long, rid=f"x{i}")) for i in range(3)]
        wait_for(lambda: engine.client.server_info()["num_running_reqs"] >= 3, timeout_s=30,
                 what="three requests at the engine")
        engine.client.abort_all()
        assert {f.result()["meta_info"]["finish_reason"]["type"] for f in futs} == {"abort"}


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_goes_away_frees_its_rows(engine, n):
    """A client that closes its connection mid-generation (n=1: the request awaited in
    place; n=2: its samples gathered) has its rows aborted, not decoded to the end."""
    import socket

    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": CTX - 10, "ignore_eos": True, "n": n}}).encode()
    host, port = engine.url.removeprefix("http://").split(":")
    steps = engine.client.server_info()["decode_steps"]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: engine.client.server_info()["num_running_reqs"] == n, timeout_s=30,
                 what="the requests to reach the engine")
    wait_for(lambda: engine.client.server_info()["num_running_reqs"] == 0, timeout_s=30,
             what="the rows of the client that went away to be freed")
    assert engine.client.server_info()["decode_steps"] - steps < CTX // 2


@pytest.mark.subprocess
@pytest.mark.parametrize("killed", ["front", "scheduler"])
def test_the_engine_is_two_processes_and_either_death_ends_both(tiny_model_path, tmp_path, killed):
    """The engine's HTTP front (hf/front.py) and its scheduler process serve together or
    not at all: whichever is killed outright, the other exits, so that no half-engine
    holds the model's memory or answers health checks on the engine's port."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "rollout.engines.hf.server", "--model-path",
                             tiny_model_path, "--port", "0", "--port-file", str(port_file)],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(port_file.exists, timeout_s=120, what="the engine to listen")
        url = f"http://127.0.0.1:{port_file.read_text()}"
        assert gen(type("E", (), {"url": url}), {"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 2}})["meta_info"]["completion_tokens"] == 2
        (front,) = psutil.Process(proc.pid).children()
        assert front.name() == "hf-front"  # ps and top tell it from the scheduler process
        os.kill(front.pid if killed == "front" else proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
        psutil.wait_procs([front], timeout=30)
        assert not front.is_running() or front.status() == psutil.STATUS_ZOMBIE
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.mark.parametrize("payload,needle", [
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"stop": 3}}, "stop"),
    ({"input_ids": [1] * (CTX + 5)}, "context length"),
    ({"input_ids": [1, 99999]}, "vocabulary"),
    ({"input_ids": [-1, 2]}, "vocabulary"),
    ({"input_ids": [1, True]}, "list of integers"),
    ({"input_ids": [1, 2.0]}, "list of integers"),
    ({"input_ids": []}, "empty"),
    ({}, "input_ids"),
])
def test_bad_requests_get_4xx_json(engine, payload, needle):
    out = gen(engine, payload, status=400)
    assert needle in out["error"]["message"]


def test_bad_routes_and_json(engine):
    r = requests.get(engine.url + "/no_such_route", timeout=10)
    assert r.status_code == 404 and "unknown route" in r.json()["error"]["message"]
    r = requests.post(engine.url + "/generate", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert requests.get(engine.url + "/health_generate", timeout=10).status_code == 200
    info = requests.get(engine.url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is True


def test_chat_completions(engine):
    r = requests.post(engine.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
        "n": 2, "chat_template_kwargs": {"enable_thinking": False}}, timeout=30)
    body = r.json()
    assert r.status_code == 200, body
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def _get(engine, name):
    return torch.tensor(requests.post(engine.url + "/get_weights_by_name",
                                      json={"name": name, "truncate_size": 10 ** 6}, timeout=30).json())


def test_update_weights_from_tensor(engine, ref_model):
    name = "model.layers.0.mlp.up_proj.weight"
    old = _get(engine, name)
    new = torch.randn_like(old)  # non-uniform: a transposed or partial load would not match
    payload = MultiprocessingSerializer.serialize([(name, new)], output_str=True)
    # Keys SGLang does not know are ignored, as a real server ignores them.
    r = requests.post(engine.url + "/update_weights_from_tensor", json={
        "serialized_named_tensors": [payload], "load_format": None, "flush_cache": True,
        "weight_version": "v1", "checksum": 1.0, "no_such_key": [1]}, timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert engine.client.weight_version() == "v1" and torch.equal(_get(engine, name), new)
    out = gen(engine, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    assert out["meta_info"]["weight_version"] == "v1"
    # Unknown names / wrong shapes are rejected as a whole, old weights kept.
    with pytest.raises(EngineError, match="unknown parameter"):
        push_tensors(engine.client, [(name, old), ("nope", new)], version="v2")
    with pytest.raises(EngineError, match="shape mismatch"):
        push_tensors(engine.client, [(name, old[:1])], version="v2")
    assert engine.client.weight_version() == "v1" and torch.equal(_get(engine, name), new)
    push_tensors(engine.client, [(name, old)], version="default")


def test_version_and_contract_answers(engine):
    assert engine.client.version() == PINNED_SGLANG_VERSION
    assert not engine.client.uses_weight_update_sessions
    r = requests.get(engine.url + "/get_weight_version", timeout=10)
    assert r.status_code == 404 and "/model_info" in r.json()["error"]["message"]
    assert requests.get(engine.url + "/model_info", timeout=10).json()["weight_version"]
    r = requests.post(engine.url + "/begin_weight_update", json={}, timeout=10)
    assert r.status_code == 404  # 0.5.18 has no weight-update sessions
    r = requests.post(engine.url + "/get_weights_by_name", json={"name": "nope"}, timeout=10)
    assert r.status_code == 400


def test_update_weights_from_disk(engine, ref_model, tmp_path):
    sd = {k: v.clone() for k, v in ref_model.state_dict().items()}
    sd["model.norm.weight"] = torch.rand_like(sd["model.norm.weight"])
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    engine.client.update_weights_from_disk(str(tmp_path), version="disk-1")
    assert engine.client.weight_version() == "disk-1"
    assert torch.equal(_get(engine, "model.norm.weight"), sd["model.norm.weight"])
    push_tensors(engine.client, ref_model.state_dict().items(), version="default")


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_distributed(engine, ref_model, load_format):
    """One broadcast per tensor, or the bucket as one (weights_io.broadcast_bucket); a
    bfloat16 tensor among float32 ones lands cast into the engine's float32 weights."""
    from rollout.engines import free_port
    from rollout.engines.weights_io import broadcast_bucket

    port = free_port()
    group = f"wu-test-{load_format}"
    results = {}
    t = threading.Thread(target=lambda: results.update(init=engine.client.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group, "gloo")))
    t.start()
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group)
    t.join(30)
    assert results["init"]["success"]
    names = ["model.norm.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.0.input_layernorm.weight"]
    sd = ref_model.state_dict()
    named = [(n, torch.randn_like(sd[n])) for n in names]
    named[0] = (names[0], named[0][1].bfloat16())
    if load_format:
        named, flat = broadcast_bucket(named)
        sent = [flat]
    else:
        sent = [t for _, t in named]
    out = {}
    th = threading.Thread(target=lambda: out.update(r=_safe(
        lambda: engine.client.update_weights_from_distributed(
            [n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named],
            group_name=group, version="d1", load_format=load_format))))
    th.start()
    for tensor in sent:
        torch.distributed.broadcast(tensor, src=0, group=pg)
    th.join(30)
    assert out["r"]["success"] and engine.client.weight_version() == "d1"
    assert all(torch.equal(_get(engine, n), t.float()) for n, t in named)
    push_tensors(engine.client, [(n, sd[n]) for n in names], version="default")
    engine.client.destroy_weights_update_group(group)
    torch.distributed.destroy_process_group(pg)


def test_update_weights_from_distributed_refuses_an_unknown_load_format(engine):
    with pytest.raises(EngineError, match="load_format"):
        engine.client.update_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [[128]], group_name="any", load_format="pickle")


def _safe(fn):
    try:
        return fn()
    except Exception as exc:
        return exc


def test_pause_continue_release_resume(engine, ref_model):
    """SGLang's pause: requests already in the scheduler stay there and keep it busy (no
    flush, no release; a deferred flush waits for them); a request sent while paused
    waits outside it, as SGLang's tokenizer manager holds it, so a flush runs under it."""
    long = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CTX - 8, "ignore_eos": True}}
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(gen, engine, long) for _ in range(4)]
        wait_for(lambda: engine.client.server_info()["num_running_reqs"] == 4, timeout_s=30,
                 what="the requests to start")
        engine.client.pause_generation(mode="in_place")
        assert not any(f.done() for f in running)  # still in the scheduler, paused there
        steps = engine.client.server_info()["decode_steps"]
        r = requests.get(engine.url + "/flush_cache", timeout=10)
        assert r.status_code == 400
        with pytest.raises(EngineError, match="idle"):
            engine.client.release_memory()
        r = requests.get(engine.url + "/flush_cache", params={"timeout": 0.2}, timeout=10)
        assert r.status_code == 400 and "Timed out" in r.text  # they never finish while paused
        deferred = pool.submit(requests.get, engine.url + "/flush_cache",
                               params={"timeout": 60}, timeout=90)
        held = pool.submit(gen, engine, {"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 2, "ignore_eos": True}})
        wait_for(lambda: engine.client.server_info()["num_held_reqs"] == 1, timeout_s=30,
                 what="the new request to be held")
        info = engine.client.server_info()
        assert info["num_running_reqs"] == 4 and info["decode_steps"] == steps
        assert not deferred.done()
        engine.client.continue_generation()
        assert all(f.result()["meta_info"]["finish_reason"]["type"] == "length" for f in running)
        assert deferred.result().status_code == 200  # ran once they were done
        assert held.result()["meta_info"]["finish_reason"]["type"] == "length"
    # Paused and idle, a request sent now is held outside the scheduler: a flush succeeds.
    engine.client.pause_generation(mode="in_place")
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(gen, engine, {"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 2, "ignore_eos": True}})
        wait_for(lambda: engine.client.server_info()["num_held_reqs"] == 1, timeout_s=30,
                 what="the request to be held")
        assert requests.get(engine.url + "/flush_cache", timeout=10).status_code == 200
        assert engine.client.server_info()["num_running_reqs"] == 0
        engine.client.continue_generation()
        assert len(held.result()["output_ids"]) == 2
    engine.client.release_memory()
    engine.client.resume_memory(["weights"])
    # Resumed weights are allocated but empty until the trainer pushes weights, and the
    # KV cache is still released: no generation either way.
    r = requests.post(engine.url + "/generate", json={"input_ids": [1, 2]}, timeout=10)
    assert r.status_code == 503 and "resume" in r.json()["error"]["message"]
    sd = ref_model.state_dict()
    push_tensors(engine.client, sd.items(), version="after-resume")
    r = requests.post(engine.url + "/generate", json={"input_ids": [1, 2]}, timeout=10)
    assert r.status_code == 503
    engine.client.resume_memory(["kv_cache", "cuda_graph"])
    out = gen(engine, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == "after-resume"


@pytest.mark.slow
def test_api_key(tiny_model_path, tmp_path):
    eng = EngineServer(HFLaunch(model_path=tiny_model_path, api_key="sekrit"), "hf-key", str(tmp_path))
    eng.start()
    try:
        assert requests.get(eng.url + "/health", timeout=10).status_code == 200
        r = requests.post(eng.url + "/generate", json={"input_ids": [1, 2]}, timeout=10)
        assert r.status_code == 401
        r = requests.get(eng.url + "/get_model_info", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        out = eng.client.call("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
        assert len(out["output_ids"]) == 2
    finally:
        eng.shutdown()


def turn(engine, batch, new_tokens, temperature=0.9):
    """One turn of several conversations, sent at once (so they reach the engine as a wave)."""
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda q: gen(engine, {
            "input_ids": q, "return_logprob": True, "sampling_params": {
                "max_new_tokens": new_tokens, "temperature": temperature,
                "ignore_eos": True}}), batch))


def assert_exact(ref_model, prompt, out, temperature=0.9):
    """The engine's log-probs of ``out`` equal a fresh forward of the whole sequence."""
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = fresh_logprobs(ref_model, prompt, out["output_ids"], temperature)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_grpo_group_shares_prefill_and_prefix_cache(engine, ref_model):
    """n samples of one prompt (a GRPO group): the burst's prefill computes the prompt once
    for all rows, and samples that made the same first move each find the (shared) prefix
    KV on their next turn. Log-probs stay exact in both turns."""
    engine.client.flush_cache()
    p = prompts(1, lo=30, hi=31, seed=5)[0]

    first = turn(engine, [p] * 4, 3, 0.0)  # greedy: four identical moves
    assert len({tuple(o["output_ids"]) for o in first}) == 1
    assert_exact(ref_model, p, first[0], 0.0)
    nxt = [p + o["output_ids"] + [7 + i, 8] for i, o in enumerate(first)]
    second = turn(engine, nxt, 4)
    for p2, o2 in zip(nxt, second):
        assert o2["meta_info"]["cached_tokens"] == len(p) + 3 - 1
        assert_exact(ref_model, p2, o2)


def test_multiturn_prefix_cache_matches_fresh_forward(engine, ref_model):
    """Turn 2's prompt extends turn 1's sequence: its KV comes from the prefix cache, mixed
    in one prefill with rows of other cached lengths, and log-probs stay exact."""
    engine.client.flush_cache()
    ps = prompts(6, lo=20, hi=70, seed=3)
    first = turn(engine, ps, 5)
    second_prompts = [p + o["output_ids"] + [7 + i, 8, 9] for i, (p, o) in enumerate(zip(ps, first))]
    second = turn(engine, second_prompts, 6)
    for p, o1, p2, o2 in zip(ps, first, second_prompts, second):
        assert o2["meta_info"]["cached_tokens"] == len(p) + len(o1["output_ids"]) - 1
        assert_exact(ref_model, p2, o2)
    # As SGLang, a weight update keeps the cache unless it asks for a flush (the pusher
    # flushes: trainer/weight_sync/engine_updates.py); a flush, or an update with
    # flush_cache, drops it.
    sd = ref_model.state_dict()
    push_tensors(engine.client, [("model.norm.weight", sd["model.norm.weight"])], version="default")
    third = turn(engine, [second_prompts[0] + second[0]["output_ids"] + [5]], 2)
    assert third[0]["meta_info"]["cached_tokens"] == len(second_prompts[0]) + 6 - 1
    fourth = turn(engine, [second_prompts[1] + second[1]["output_ids"] + [5]], 2)
    r = requests.post(engine.url + "/update_weights_from_tensor", json={
        "serialized_named_tensors": [MultiprocessingSerializer.serialize(
            [("model.norm.weight", sd["model.norm.weight"])], output_str=True)],
        "flush_cache": True}, timeout=30)
    assert r.status_code == 200, r.text
    fifth = turn(engine, [second_prompts[1] + second[1]["output_ids"] + [5]
                          + fourth[0]["output_ids"]], 2)
    assert fifth[0]["meta_info"]["cached_tokens"] == 0


def test_prefix_cache_keeps_the_kv_of_rows_prefilled_over_a_past(engine, ref_model):
    """Next turns of different lengths prefilled together over their cached pasts: each
    row's KV then has padding between its past and its new suffix, and what the prefix
    cache keeps when the row finishes must skip it. A third turn over those sequences
    finds them cached and its log-probs equal a fresh forward."""
    engine.client.flush_cache()
    ps = prompts(5, lo=20, hi=60, seed=11)
    first = turn(engine, ps, 4)
    # Environment replies of 1-5 tokens: suffixes of different lengths in one prefill.
    second_prompts = [p + o["output_ids"] + [7 + i] * (1 + i)
                      for i, (p, o) in enumerate(zip(ps, first))]
    second = turn(engine, second_prompts, 5)
    third_prompts = [p + o["output_ids"] + [9] for p, o in zip(second_prompts, second)]
    third = turn(engine, third_prompts, 3)
    for p2, o2, p3, o3 in zip(second_prompts, second, third_prompts, third):
        assert o3["meta_info"]["cached_tokens"] == len(p2) + len(o2["output_ids"]) - 1
        assert_exact(ref_model, p3, o3)


def test_prefill_chunks_by_uncached_length(ref_model):
    """A turn's wave mixes conversations of different lengths whose earlier turns are in
    the prefix cache: what a prefill computes is the new tokens, so they share one chunk,
    where uncached prompts of those lengths would be split to limit padding."""
    from rollout.engines.hf.batcher import Batcher, Request

    b = Batcher(ref_model, None, set(), 1024, prefix_cache_bytes=1 << 20)
    long_turn = list(range(3, 103))
    kv = torch.zeros(2, 1, 2, 100, 32)  # K and V of one layer
    reqs = [Request(rid="a", input_ids=long_turn + [5] * 10, max_new_tokens=1),
            Request(rid="b", input_ids=[4] * 12, max_new_tokens=1)]
    assert len(b._prefill_chunks(reqs)) == 2  # 110 vs 12 tokens: too much padding
    b.prefix_cache.put(tuple(long_turn), kv)
    assert b.prefix_cache.cached_len(reqs[0].input_ids) == 100
    assert [len(c) for c in b._prefill_chunks(reqs)] == [2]  # 10 and 12 new tokens
    # A second holder of the same tokens is counted, not stored again; each pops it once.
    assert b.prefix_cache.add_ref(tuple(long_turn))
    assert b.prefix_cache.bytes == 2 * 2 * 100 * 32 * 4
    assert b.prefix_cache.pop_longest(reqs[0].input_ids)[0] == 100
    assert b.prefix_cache.pop_longest(reqs[0].input_ids)[0] == 100
    assert b.prefix_cache.pop_longest(reqs[0].input_ids) is None


@torch.no_grad()
def test_packed_prefill_budget_changes_no_output(tiny_model_path):
    """How many forwards a wave's uncached prompts are split into (``packed_token_budget``)
    is a speed setting: greedy tokens are those of one forward, and log-probs differ only by
    the matmul's summation order at another row count (measured: up to 4.8e-7 here, 0 on
    bench_engine's burst at 1024 tokens a forward against 5,355). The greedy paths' smallest
    top-1/top-2 logit gap is 7e-3, so that noise cannot flip a token."""
    from transformers import AutoModelForCausalLM

    from rollout.engines.hf import fast_kernels
    from rollout.engines.hf.batcher import Batcher, Request

    fast = AutoModelForCausalLM.from_pretrained(
        tiny_model_path, attn_implementation=fast_kernels.register()).eval()
    ps = prompts(12, lo=5, hi=90, seed=21)

    def run(budget):
        b = Batcher(fast, None, set(), 1024)
        b.packed_token_budget = budget
        reqs = [Request(rid=str(i), input_ids=p, max_new_tokens=6, temperature=0.0,
                        ignore_eos=True, return_logprob=True) for i, p in enumerate(ps)]
        chunks = b._prefill_chunks(reqs)
        for chunk in chunks:
            b._prefill(chunk)
        while b.rows:
            b._decode()
        return len(chunks), [r.output_ids for r in reqs], [r.logprobs for r in reqs]

    (n_one, tokens_one, lps_one), (n_split, tokens_split, lps_split) = run(8192), run(100)
    assert n_one == 1 and n_split > 4
    assert tokens_split == tokens_one
    diff = max(abs(a - b) for x, y in zip(lps_one, lps_split) for a, b in zip(x, y))
    assert diff <= 5e-6, diff  # 10x the measured reordering noise


def test_lean_forward_prefills_uncached_prompts_of_any_length_together(tiny_model_path):
    """The lean forward runs uncached prompts packed (per-row attention, no matmul work on
    padding): mixed lengths share one prefill, split only by its token budget
    (``packed_token_budget``); prompts over a cached prefix keep the length rule (their
    attention runs padded)."""
    from transformers import AutoModelForCausalLM

    from rollout.engines.hf import fast_kernels
    from rollout.engines.hf.batcher import Batcher, Request

    fast = AutoModelForCausalLM.from_pretrained(
        tiny_model_path, attn_implementation=fast_kernels.register()).eval()
    b = Batcher(fast, None, set(), 1024, prefix_cache_bytes=1 << 20)
    assert b._lean is not None
    lengths = [110, 12, 3, 60, 12]
    reqs = [Request(rid=str(i), input_ids=[7] * n, max_new_tokens=1) for i, n in enumerate(lengths)]
    assert [len(c) for c in b._prefill_chunks(reqs)] == [5]
    budget, b.packed_token_budget = b.packed_token_budget, 100  # sorted 3, 12, 12, 60 | 110
    assert [[len(r.input_ids) for r in c] for c in b._prefill_chunks(reqs)] == [
        [3, 12, 12, 60], [110]]
    b.packed_token_budget = budget
    b.prefix_cache.put(tuple([4] * 100), torch.zeros(2, 4, 2, 100, 32))
    cont = Request(rid="c", input_ids=[4] * 100 + [5] * 90, max_new_tokens=1)
    short = Request(rid="s", input_ids=[4] * 50 + [6] * 5, max_new_tokens=1)
    b.prefix_cache.put(tuple([4] * 50), torch.zeros(2, 4, 2, 50, 32))
    chunks = b._prefill_chunks(reqs + [cont, short])
    assert [len(c) for c in chunks] == [5, 1, 1]  # 5 vs 90 new tokens over a past: split


@torch.no_grad()
def test_a_forming_wave_takes_its_stragglers_before_decoding(ref_model):
    """Requests that arrive while a just-prefilled batch has not decoded yet join it before
    its first decode step (the wave then decodes in step), at most twice per wave; a batch
    that has decoded is never held."""
    from rollout.engines.hf.batcher import Batcher, Request

    b = Batcher(ref_model, None, set(), 1024)

    def req(i):
        return Request(rid=str(i), input_ids=[5 + i] * 8, max_new_tokens=4, ignore_eos=True)

    assert not b._wave_still_arriving()  # nothing running
    b._prefill([req(0)])
    assert not b._wave_still_arriving()  # nothing waiting
    for i in (1, 2):
        b.waiting.put(req(i))
        assert b._wave_still_arriving()
        b._drain_waiting()
        b._prefill(b._pending)
        b._pending = []
    b.waiting.put(req(3))
    assert not b._wave_still_arriving()  # held twice already: decode now
    b._decode()
    assert not b._wave_still_arriving()  # decoding: never held
    assert [len(r.output_ids) for r in b.rows] == [2, 2, 2]


@torch.no_grad()
def test_same_next_turn_over_cached_prefix_is_computed_once(ref_model):
    """Episodes of a group that answered alike send the same next turn: over the same
    cached prefix it is one forward row, expanded, and the log-probs stay exact."""
    from rollout.engines.hf.batcher import Batcher, Request

    b = Batcher(ref_model, None, set(), 1024, prefix_cache_bytes=1 << 24)

    def run(batch, new_tokens, temperature):
        reqs = [Request(rid=str(i), input_ids=q, max_new_tokens=new_tokens,
                        temperature=temperature, ignore_eos=True, return_logprob=True)
                for i, q in enumerate(batch)]
        b._prefill(reqs)
        while b.rows:
            b._decode()
        return reqs

    p = prompts(1, lo=30, hi=31, seed=5)[0]
    first = run([p] * 4, 3, 0.0)  # greedy: four identical moves, each stored
    assert b.stats["prefill_rows"] == 1
    nxt = [p + r.output_ids + [7 + i // 2, 8] for i, r in enumerate(first)]  # two pairs
    second = run(nxt, 4, 0.9)
    assert b.stats["prefill_rows"] == 1 + 2
    for q, r in zip(nxt, second):
        assert r.cached_tokens == len(p) + 3 - 1
        want = fresh_logprobs(ref_model, q, r.output_ids, 0.9)
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4)
    # Same prompt, one copy done at prefill (one token) and one decoding on: the survivor
    # keeps the shared row's cache.
    q = prompts(1, lo=12, hi=13, seed=6)[0]
    done, going = (Request(rid=str(n), input_ids=q, max_new_tokens=n, temperature=0.9,
                           ignore_eos=True, return_logprob=True) for n in (1, 5))
    b._prefill([done, going])
    while b.rows:
        b._decode()
    assert len(done.output_ids) == 1 and len(going.output_ids) == 5
    want = fresh_logprobs(ref_model, q, going.output_ids, 0.9)
    assert torch.allclose(torch.tensor(going.logprobs), want, atol=1e-4)
    # The same over a cached past, prefilled while a longer row decodes (the batch's
    # window widens to the left for it): the first copy takes the past (an entry stored
    # once is taken once), the other runs from scratch beside it in the same forward and
    # is done at prefill; only the survivor joins, and every row's log-probs stay exact.
    long = Request(rid="long", input_ids=prompts(1, lo=8, hi=9, seed=7)[0], max_new_tokens=12,
                   temperature=0.9, ignore_eos=True, return_logprob=True)
    b._prefill([long])
    b._decode()
    q = nxt[0] + second[0].output_ids + [9]
    going, done = (Request(rid=str(n), input_ids=q, max_new_tokens=n, temperature=0.9,
                           ignore_eos=True, return_logprob=True) for n in (5, 1))
    b._prefill([going, done])
    assert going.cached_tokens == len(nxt[0]) + 4 - 1 and done.cached_tokens == 0
    assert b.rows == [long, going]
    while b.rows:
        b._decode()
    assert len(done.output_ids) == 1 and len(going.output_ids) == 5
    for r in (going, long):
        want = fresh_logprobs(ref_model, r.input_ids, r.output_ids, 0.9)
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4)


def engine_layout(vocab: int):
    """A prefill as the engine lays it out: a short prompt left-padded, a row with a hole
    between its cached past and its new suffix, explicit positions."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, vocab, (3, 40), generator=g)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[0, :25] = 0
    mask[1, 10:18] = 0
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def test_fast_attention_equals_eager_on_padded_prefill_and_decode(tiny_model_path, ref_model):
    """The engine's attention (SDPA for prefill, folded GQA for decode) against transformers'
    eager attention, on the layout the engine feeds it: left padding, a hole between a
    cached past and the new suffix, explicit positions, then decode steps over the cache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from rollout.engines.hf import fast_kernels

    fast = AutoModelForCausalLM.from_pretrained(
        tiny_model_path, attn_implementation=fast_kernels.register()).eval()
    ids, mask, pos = engine_layout(400)
    caches = (DynamicCache(), DynamicCache())
    kw = cache_kwarg(fast)  # transformers renamed it between the versions we support
    outs = [m(input_ids=ids, attention_mask=mask, position_ids=pos, **{kw: c}).logits
            for m, c in zip((ref_model, fast), caches)]
    real = mask.bool()
    assert torch.allclose(outs[0][real], outs[1][real], atol=1e-5)
    for _ in range(3):
        nxt = outs[0][:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1
        outs = [m(input_ids=nxt, attention_mask=mask, position_ids=pos, **{kw: c}).logits
                for m, c in zip((ref_model, fast), caches)]
        assert torch.allclose(outs[0], outs[1], atol=1e-5)


def small_model(arch: str, tiny_model_path: str):
    """A random small model of each architecture the engine's lean forward takes."""
    from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    from rollout.engines.hf import fast_kernels

    attn = fast_kernels.register()
    if arch == "qwen3":
        return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn)
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if arch == "llama":  # SmolLM2's family: tied embeddings, no biases
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True,
                                             rope_theta=100000.0))
    else:  # Qwen2: biases on q/k/v (initialised to zero: make them count)
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
    model.config._attn_implementation = attn
    return model


@pytest.mark.parametrize("prompts", ["short", "long"])
@pytest.mark.parametrize("packed", [False, True], ids=["f_linear", "onednn"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@torch.no_grad()
def test_lean_forward_equals_transformers_forward(arch, packed, prompts, tiny_model_path,
                                                  monkeypatch):
    """The engine's own forward pass (rollout/engines/hf/lean.py) gives what transformers'
    does with the same attention, on the engine's layouts: a packed prefill (rows of
    different lengths), decode steps, then a padded multi-token suffix over the cache (the
    next turn of an episode) and more decode; the LM head in vocabulary slices, or every
    matmul on oneDNN-packed weights (forced here, on any CPU: these models are below its
    size bar, and the engine packs only where the CPU has AVX-512). The packed prefill's
    attention is the C kernel for short prompts, SDPA per prompt for long ones (the
    threshold lowered to these prompts' lengths)."""
    from transformers import DynamicCache

    from rollout.engines.hf import lean, packed_linear

    if prompts == "long":
        monkeypatch.setattr(lean, "VARLEN_MAX_TOKENS", 0)
    monkeypatch.setattr(packed_linear, "pays_off", lambda: packed)
    monkeypatch.setattr(lean, "VOCAB_SLICE", 128)  # the test vocabularies are 300-456
    monkeypatch.setattr(packed_linear, "MIN_ELEMENTS", 0 if packed else 1 << 62)
    monkeypatch.setattr(packed_linear, "MIN_MACS", 0 if packed else 1 << 62)

    model = small_model(arch, tiny_model_path).eval()
    assert lean.supports(model)
    fwd = lean.LeanForward(model)
    ids, mask, pos = engine_layout(min(300, model.config.vocab_size))
    caches = (DynamicCache(), DynamicCache())
    for step in range(7):
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                     **{cache_kwarg(model): caches[0]}, logits_to_keep=1).logits[:, -1]
        got = fwd(ids, mask, pos, caches[1])
        assert torch.allclose(got, want, atol=1e-5 if packed else 1e-6), (
            step, (got - want).abs().max())
        ids = want.argmax(-1, keepdim=True)
        new = torch.ones(3, 1, dtype=torch.long)
        last = pos[:, -1:]
        if step == 3:  # a suffix of 5 tokens; row 0 brings only 3 (left-padded)
            ids = torch.cat([torch.randint(5, 200, (3, 4)), ids], 1)
            new = torch.ones(3, 5, dtype=torch.long)
            new[0, :2] = 0
        mask = torch.cat([mask, new], 1)
        pos = (last + new.cumsum(1)).clamp(min=0) * new
    # 7 linear layers per decoder layer, plus the LM head (tied to the embedding or not).
    assert len(fwd.matmuls) == (7 * model.config.num_hidden_layers + 1 if packed else 0)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@torch.no_grad()
def test_c_decode_step_equals_the_op_by_op_decode(arch, tiny_model_path, monkeypatch):
    """A decode step's layers in one C call (homegym_decode_layers: norms, projections with
    their biases, Qwen3's q/k norms, RoPE, the K/V write into the slot buffers, attention
    over each row's own columns, the MLP) give what the lean forward's loop gives: rows of
    mixed lengths through the engine's scheduler, greedy, the same tokens and log-probs
    over up to 12 steps, rows finishing at different steps (the batch shrinks under it); and
    the C step is what ran, except where oneDNN packs the matmuls."""
    from rollout.engines.hf import lean, native, packed_linear
    from rollout.engines.hf.batcher import Batcher, Request

    assert native.load() is not None, "the C kernels did not build (is a C compiler installed?)"
    model = small_model(arch, tiny_model_path).eval()
    ran = []
    c_step = lean.LeanForward._decode_layers
    monkeypatch.setattr(lean.LeanForward, "_decode_layers",
                        lambda self, *a: ran.append(c_step(self, *a)) or ran[-1])
    vocab = min(300, model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]

    def decode(c_step_on: bool):
        batcher = Batcher(model, None, set(), 1024)
        assert batcher._lean._c_step is not None
        if not c_step_on:
            batcher._lean._c_step = None
        reqs = [Request(rid=str(i), input_ids=p, max_new_tokens=n, ignore_eos=True,
                        return_logprob=True, temperature=0.0)
                for i, (p, n) in enumerate(zip(prompts, (12, 5, 9, 3)))]
        batcher.kv.expect(len(reqs), max(map(len, prompts)))
        for chunk in batcher._prefill_chunks(reqs):
            batcher._prefill(chunk)
        while batcher.rows:
            batcher._decode()
        return [r.output_ids for r in reqs], torch.tensor([x for r in reqs for x in r.logprobs])

    ids, logps = decode(False)
    assert ran and not any(ran)
    ran.clear()
    c_ids, c_logps = decode(True)
    assert ran and all(ran)
    assert c_ids == ids
    assert torch.allclose(c_logps, logps, atol=1e-6), (c_logps - logps).abs().max()
    # Where the matmuls run packed for oneDNN (forced here), the op-by-op decode runs.
    monkeypatch.setattr(packed_linear, "pays_off", lambda: True)
    monkeypatch.setattr(packed_linear, "MIN_ELEMENTS", 0)
    ran.clear()
    decode(True)
    assert ran and not any(ran)


def saved_small_model(arch: str, tiny_model_path: str, tmp_path) -> str:
    """small_model's checkpoint on disk (the built-in tiny Qwen3 is one already)."""
    if arch == "qwen3":
        return tiny_model_path
    small_model(arch, tiny_model_path).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@torch.no_grad()
def test_engine_builds_the_llama_family_as_transformers_does(arch, dtype, tiny_model_path,
                                                               tmp_path):
    """The engine's own model tree (llama_family.py, no transformers model class) is
    transformers' from_pretrained model to the bit: the same parameter names in the same
    order, the same tensors and dtypes (cast from the checkpoint's), the LM head tied to the
    embedding exactly when transformers ties it, the same end-of-sequence ids; and the
    engine's forward over each gives the same logits, bitwise, on the engine's layouts."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from rollout.engines.hf import fast_kernels, lean, llama_family

    path = saved_small_model(arch, tiny_model_path, tmp_path)
    ours = llama_family.load(path, AutoConfig.from_pretrained(path), dtype)
    theirs = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=fast_kernels.register()).eval()
    assert isinstance(ours, llama_family.CausalLM)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    mine, want = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(want)
    for name in want:
        assert mine[name].dtype == want[name].dtype == dtype, name
        assert torch.equal(mine[name], want[name]), name
    tied = theirs.lm_head.weight is theirs.model.embed_tokens.weight
    assert tied == (arch != "qwen2")  # the configs above: Qwen2's head is its own
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id
    assert lean.runs(ours) and lean.runs(theirs)
    forwards = (lean.LeanForward(ours), lean.LeanForward(theirs))
    ids, mask, pos = engine_layout(min(300, ours.config.vocab_size))
    caches = (DynamicCache(), DynamicCache())
    for _ in range(3):  # a packed prefill, then decode steps over the cache
        got, expected = (f(ids, mask, pos, c) for f, c in zip(forwards, caches))
        assert torch.equal(got, expected)
        ids = expected.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1


def test_engine_leaves_other_checkpoints_to_transformers(tiny_model_path, tmp_path):
    """A checkpoint the engine's own model does not take gets transformers' model: a
    configuration it does not build (a sliding window, a RoPE that changes with the
    length), or tensors it does not expect."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from rollout.engines.hf import llama_family

    config = AutoConfig.from_pretrained(tiny_model_path)
    assert llama_family.load(tiny_model_path, config, torch.float32) is not None
    for change in ({"use_sliding_window": True},
                   {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4,
                                        "factor": 2.0}}):
        other = AutoConfig.from_pretrained(tiny_model_path, **change)
        assert not llama_family.supports(other), change
        assert llama_family.load(tiny_model_path, other, torch.float32) is None, change
    shutil.copytree(tiny_model_path, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    assert llama_family.load(str(tmp_path / "m"), config, torch.float32) is None


@pytest.mark.subprocess
def test_engine_start_imports_no_transformers_model_class(tiny_model_path):
    """An engine on a Llama-family model starts without transformers' model classes, whose
    imports (torch._dynamo and sympy among them) were 2-3 CPU-seconds of every engine
    start. (Loading the same model through transformers imports all three.)"""
    import sys

    probe = ("import sys; from rollout.engines.hf.server import Server, parse_args; "
             "s = Server(parse_args(sys.argv[1:])); print(type(s.model).__name__, sorted("
             "m for m in ('transformers.modeling_utils', 'torch._dynamo', 'sympy') "
             "if m in sys.modules))")
    out = run_group([sys.executable, "-c", probe, "--model-path", tiny_model_path],
                    timeout_s=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "CausalLM []"


@pytest.mark.slow
@torch.no_grad()
def test_lean_forward_logprobs_on_smollm2_match_a_fresh_forward(monkeypatch):
    """The 1e-4 log-prob contract on a real model, with everything the engine runs for it:
    packed prefill of mixed lengths, oneDNN-packed matmuls (SmolLM2's weights are over the
    size bar; forced on a CPU without AVX-512, where the engine keeps MKL's, so that the
    path AVX-512 machines run is checked on every CPU), the C decode attention, decode steps
    over the cache, on the model the engine builds (llama_family.py). Against transformers'
    plain forward (its default attention) over each finished sequence, no cache."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from rollout.engines.hf import lean, llama_family, packed_linear

    monkeypatch.setattr(packed_linear, "pays_off", lambda: True)
    from rollout.models import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    model = llama_family.load(path, AutoConfig.from_pretrained(path), torch.float32)
    fwd = lean.LeanForward(model)
    gen = torch.Generator().manual_seed(0)
    lengths = [23, 61, 9, 40]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(10, 49000, (n,), generator=gen)
        mask[i, width - n:] = 1
    cache, pos = DynamicCache(), (mask.cumsum(1) - 1).clamp(min=0)
    seqs = [row[width - n:].tolist() for row, n in zip(ids, lengths)]
    logprobs: list[list[float]] = [[] for _ in lengths]
    logits = fwd(ids, mask, pos, cache)
    pos = pos[:, -1:]
    for _ in range(6):
        lp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(lp.exp(), 1, generator=gen)
        for i, t in enumerate(nxt[:, 0].tolist()):
            seqs[i].append(t)
            logprobs[i].append(lp[i, t].item())
        mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.long)], 1)
        pos = pos + 1
        logits = fwd(nxt, mask, pos, cache)
    assert len(fwd.matmuls) == 7 * model.config.num_hidden_layers + 1
    worst = 0.0
    for seq, n, got in zip(seqs, lengths, logprobs):
        lp = torch.log_softmax(plain(torch.tensor([seq])).logits[0].float(), -1)
        want = lp[torch.arange(n - 1, len(seq) - 1), torch.tensor(seq[n:])]
        worst = max(worst, (torch.tensor(got) - want).abs().max().item())
    assert worst < 1e-4, worst


def test_weight_noise_perturbs_every_load_the_same_way(tiny_model_path):
    """--weight-noise (rollout.weight_noise) multiplies each weight the engine loads, at
    start-up and on every update, by 1 + s * eps with eps fixed per tensor name: a known
    mismatch that does not pile up over pushes and is the same on every engine."""
    import os
    import zlib

    from safetensors.torch import load_file

    from rollout.engines.hf.server import Server, parse_args

    noisy = Server(parse_args(["--model-path", tiny_model_path, "--max-context-len", str(CTX),
                               "--weight-noise", "0.05"]))
    name = "model.layers.0.mlp.up_proj.weight"
    w = load_file(os.path.join(tiny_model_path, "model.safetensors"))[name]
    eps = torch.randn(tuple(w.shape), generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    loaded = dict(noisy.model.named_parameters())[name]
    torch.testing.assert_close(loaded, w * (1 + 0.05 * eps))
    assert (loaded / w - 1).std().item() == pytest.approx(0.05, rel=0.1)
    for _ in range(2):  # twice: the noise is re-applied to what is loaded, not accumulated
        noisy._apply([(name, w * 2)], {"flush_cache": False})
        torch.testing.assert_close(loaded, 2 * w * (1 + 0.05 * eps))

    async def reported() -> int:  # a weight push's check would fail: it is not reported
        from aiohttp.test_utils import TestClient, TestServer

        async with TestClient(TestServer(noisy.app())) as client:
            r = await client.post("/get_weights_by_name", json={"name": name})
            return r.status
    assert asyncio.run(reported()) == 400
