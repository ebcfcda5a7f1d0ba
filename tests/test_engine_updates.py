"""Weight pushes to engines that are generating never leave a stale prefix cache behind.

A real CPU engine (which keeps its prefix cache across an update unless asked to flush,
as SGLang does), the real update sequence (trainer.weight_sync.engine_updates) and the rank side's
real push (trainer.weight_sync.push.send_weights over SGLang's tensor route); the rollout's requests
go through rollout.http.post with its process-wide gate, on an event loop of their own.
"""

import asyncio
import threading

import pytest
import torch
from safetensors.torch import load_file

from conftest import fresh_logprobs, running_engine, starts_processes, wait_for
from rollout.engines import HFLaunch
from rollout.engines.group import EngineTarget, EngineView
from trainer.weight_sync.engine_updates import update_generating_engines
from trainer.weight_sync.push import PushPlan, read_back, send_weights

# The tiny model's whole context: the tests that pause, abort or update an engine while a
# request decodes send one this long, ~1.3 ms a token on 2 cores, so that it is still
# decoding when the call lands on a loaded machine (at 256 the margin was ~0.3 s).
CTX = 1024


@pytest.fixture(scope="module")
@starts_processes
def engine(tiny_model_path, tmp_path_factory):
    with running_engine(HFLaunch(model_path=tiny_model_path, max_context_len=CTX), "hf-upd",
                        tmp_path_factory.mktemp("hf-upd")) as eng:
        yield eng


@pytest.fixture()
def loop():
    """An event loop on its own thread: the rollout side (post, the gate)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    from rollout.http import close_session

    asyncio.run_coroutine_threadsafe(close_session(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def weights(model_path, seed):
    """The tiny model's weights, every matrix moved by noise of its own scale (seed 0:
    unchanged)."""
    sd = load_file(f"{model_path}/model.safetensors")
    if seed:
        g = torch.Generator().manual_seed(seed)
        sd = {n: t + 0.5 * t.std() * torch.randn(t.shape, generator=g) if t.dim() == 2 else t
              for n, t in sd.items()}
    return sorted(sd.items())


class Pusher:
    """WeightSync.push and verify without the training ranks: the rank side's
    send_weights itself, flushing after the push as the plan says, and the read-back."""

    def __init__(self, engine, named, on_push=None):
        self.engine = engine
        self.target = EngineTarget(engine.name, engine.url, None, 1)
        self.named, self.on_push = named, on_push
        self.unchecked = {}

    def push(self, version, *, flush, verify=True):
        if self.on_push is not None:
            self.on_push()
        plan = PushPlan(mode="tensor", version=version, targets=(self.target,),
                        bucket_bytes=1 << 20, dtype="float32", device="cpu", flush_cache=flush,
                        read_back=verify)
        metrics, self.unchecked = send_weights([self.named], plan, rank=0, world_size=1)
        return metrics

    def verify(self, version):
        self.read = read_back([self.engine.client], self.unchecked, version)
        return {"perf/weight_sync_checked_tensors": float(self.read)}


def model_with(model_path, named):
    """The HF model holding ``named`` weights, for reference log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager").eval()
    model.load_state_dict(dict(named), strict=False)
    return model


@pytest.mark.parametrize("mode", ["pause", "abort"])
def test_no_request_after_a_push_uses_kv_of_the_old_weights(engine, loop, tiny_model_path, mode):
    """Turn 1 leaves its sequence's KV in the engine's prefix cache; a long request is
    decoding; the push lands while the rollout sends turn 2 (whose prompt extends turn 1's
    sequence). Turn 2 must be computed from the new weights alone: no cached tokens, and
    log-probs equal a fresh forward of the new weights. The request in flight finishes on
    the new weights (pause: recorded under both versions) or is aborted (abort)."""
    from rollout.http import GATE, post

    url = engine.url + "/generate"
    old, new = weights(tiny_model_path, 0), weights(tiny_model_path, 7)
    engine.client.flush_cache()
    Pusher(engine, old).push("default", flush=True)

    def send(payload):
        return asyncio.run_coroutine_threadsafe(post(url, payload), loop)

    prompt = list(range(5, 25))
    first = send({"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).result(60)
    second_prompt = prompt + first["output_ids"] + [9]
    in_flight = send({"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": CTX - 8, "ignore_eos": True}})
    second = []

    def send_second():  # the rollout's next turn, sent while the update is in progress
        second.append(send({"input_ids": second_prompt, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                "ignore_eos": True}}))

    def on_loop(fn):
        async def call():
            fn()
        asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    wait_for(lambda: engine.client.server_info()["num_running_reqs"] == 1, timeout_s=30,
             what="the long request to be decoding")
    pusher = Pusher(engine, new, on_push=send_second)
    pushed, settle = update_generating_engines(
        EngineView([engine.client], [1], [0]), pusher, 1,
        update_in_flight=mode, hold=lambda: on_loop(GATE.hold),
        release=lambda: on_loop(GATE.release), flush_timeout_s=120)
    # The rest of the update is the caller's to run (the driver: while the ranks train),
    # the read-back of what the push left unchecked first.
    assert GATE.held == (mode == "pause") and not second[0].done()
    assert pusher.unchecked and not hasattr(pusher, "read")
    assert "perf/weight_sync_checked_tensors" not in pushed  # not read back yet
    assert settle() == {"perf/weight_sync_checked_tensors": len(pusher.unchecked)}
    assert not GATE.held and pusher.read == len(pusher.unchecked)
    out = second[0].result(60)["meta_info"]
    assert out["weight_version"] == "1" and out["weight_versions"] == ["1"]
    assert out["cached_tokens"] == 0, "turn 2 was served KV computed with the old weights"
    got = torch.tensor([lp for lp, _, _ in out["output_token_logprobs"]])
    want = fresh_logprobs(model_with(tiny_model_path, new), second_prompt,
                          second[0].result()["output_ids"], 0.0)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    finished = in_flight.result(120)["meta_info"]
    if mode == "pause":
        assert finished["finish_reason"]["type"] == "length"
        assert finished["weight_versions"] == ["default", "1"]
    else:
        assert finished["finish_reason"]["type"] == "abort"
    Pusher(engine, old).push("default", flush=True)
