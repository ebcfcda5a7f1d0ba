"""The CPU engine on a hybrid model (tiny-qwen3_5: Gated DeltaNet layers with recurrent
state, gated full attention): its forward, the batch's per-row states as rows join and
leave, prefix reuse from state snapshots, and the server end to end, against transformers."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from conftest import fresh_logprobs, push_tensors, running_engine, starts_processes
from rollout.engines import HFLaunch

CTX = 256
ATOL = 1e-4  # the engine's log-prob contract (tests/test_engine_hf.py)


def load(path, attn=None):
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn is None else {"attn_implementation": attn}
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


@pytest.fixture(scope="module")
def ref_model(tiny_qwen3_5_path):
    return load(tiny_qwen3_5_path)


@pytest.fixture(scope="module")
def models(tiny_qwen3_5_path):
    """tiny-qwen3_5 as the engine loads it and as transformers does, both with their norm
    and decay weights moved off their initial values (zeros / ones), so every weight
    counts in the comparisons."""
    from rollout.engines.hf import fast_kernels

    engine_model, ref = load(tiny_qwen3_5_path, fast_kernels.register()), load(tiny_qwen3_5_path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (name, p), q in zip(engine_model.named_parameters(), ref.parameters()):
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
                q.copy_(p)
    return engine_model, ref


def prompts(lengths, seed, vocab=400):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def worst_gap(model, reqs, temperature):
    return max((torch.tensor(r.logprobs) - fresh_logprobs(model, r.input_ids, r.output_ids,
                                                          temperature)).abs().max().item()
               for r in reqs)


@torch.no_grad()
def test_hybrid_forward_equals_transformers_forward(models):
    """Packed prefill of rows of different lengths (one a single token), then decode steps
    that advance every row's states in place: logits equal transformers' forward of each
    row's whole sequence (no cache: its chunked delta rule, not the recurrent step)."""
    from transformers.cache_utils import DynamicLayer

    from rollout.engines.hf import hybrid
    from rollout.engines.hf.fast_kernels import GrowingLayer

    engine_model, ref_model = models
    fwd = hybrid.HybridForward(engine_model)
    seqs = prompts([5, 70, 1, 33], seed=0)
    width, b = max(map(len, seqs)), len(seqs)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = hybrid.new_cache(engine_model, b)
    assert all(isinstance(layer, DynamicLayer) for layer in cache.layers)
    logits = fwd(ids, mask, pos, cache)
    cache.layers = [GrowingLayer(layer.keys, layer.values) for layer in cache.layers]
    pos = pos[:, -1:]
    for step in range(5):
        want = torch.stack([ref_model(torch.tensor([s])).logits[0, -1] for s in seqs])
        assert torch.allclose(logits, want, atol=1e-5), (step, (logits - want).abs().max())
        nxt = want.argmax(-1)
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
        pos = pos + 1
        logits = fwd(nxt[:, None], mask, pos, cache)


def _batcher(model, **kwargs):
    from rollout.engines.hf.batcher import Batcher

    return Batcher(model, None, set(), 1024, **kwargs)


def _requests(batch, new_tokens, temperature, **kwargs):
    from rollout.engines.hf.batcher import Request

    news = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(batch)
    return [Request(rid=str(i), input_ids=list(q), max_new_tokens=n, temperature=temperature,
                    ignore_eos=True, return_logprob=True, **kwargs)
            for i, (q, n) in enumerate(zip(batch, news))]


def _drain(b):
    while b.rows:
        b._decode()


@torch.no_grad()
def test_rows_joining_and_leaving_keep_their_recurrent_states(models):
    """Rows join a decoding batch one at a time and leave at different steps (the last
    rows move into the freed slots, their states with them): every row's log-probs stay
    those of a fresh forward of its own sequence."""
    engine_model, ref_model = models
    b = _batcher(engine_model)
    reqs = _requests(prompts([5, 40, 17, 3, 60, 9], seed=1), [12, 3, 9, 1, 6, 10], 0.9)
    b._prefill(reqs[:2])
    for r in reqs[2:]:
        b._decode()
        b._prefill([r])
    _drain(b)
    assert [len(r.output_ids) for r in reqs] == [12, 3, 9, 1, 6, 10]
    assert worst_gap(ref_model, reqs, 0.9) < ATOL


@torch.no_grad()
def test_next_turn_resumes_from_the_state_at_the_end_of_the_previous_call(models):
    """Prefix reuse by state snapshots: a prompt that extends a finished sequence exactly
    starts from that sequence's states (and its attention KV) and computes only the new
    tokens; one that diverges inside a cached sequence reuses nothing. Log-probs stay
    exact either way, also when a group's samples share one cached entry."""
    engine_model, ref_model = models
    b = _batcher(engine_model, prefix_cache_bytes=1 << 24)
    ps = prompts([20, 45, 7, 31], seed=2)
    first = _requests(ps, 5, 0.9)
    b._prefill(first)
    _drain(b)
    nxt = [r.input_ids + r.output_ids + [7 + i, 8] for i, r in enumerate(first)]
    diverged = first[0].input_ids + first[0].output_ids[:2] + [9, 9]  # inside turn 1
    second = _requests(nxt + [diverged], 6, 0.9)
    b._prefill(second)
    _drain(b)
    assert [r.cached_tokens for r in second] == [len(r.input_ids) + 4 for r in first] + [0]
    assert worst_gap(ref_model, first + second, 0.9) < ATOL
    # A GRPO group: identical greedy first moves share one entry; each continuation reads
    # it (copies the states) and none is corrupted by another's decode.
    p = prompts([30], seed=3)[0]
    group = _requests([p] * 3, 3, 0.0)
    b._prefill(group)
    _drain(b)
    cont = _requests([p + r.output_ids + [11 + i] for i, r in enumerate(group)], 5, 0.9)
    b._prefill(cont)
    _drain(b)
    assert [r.cached_tokens for r in cont] == [len(p) + 2] * 3
    assert worst_gap(ref_model, group, 0.0) < ATOL
    assert worst_gap(ref_model, cont, 0.9) < ATOL


@pytest.fixture(scope="module")
@starts_processes
def engine(tiny_qwen3_5_path, tmp_path_factory):
    with running_engine(HFLaunch(model_path=tiny_qwen3_5_path, max_context_len=CTX), "hf-q35",
                        tmp_path_factory.mktemp("hf-q35")) as eng:
        yield eng


def gen(engine, payload):
    r = requests.post(engine.url + "/generate", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_greedy_equals_transformers_generate_and_logprobs_match(engine, ref_model):
    """Over HTTP, concurrent requests of mixed lengths: greedy tokens are transformers'
    own generate, log-probs those of a fresh forward; a multi-turn follow-up is served
    from the prefix cache with the same guarantees."""
    ps = prompts([6, 33, 12, 50], seed=4)
    payload = [{"input_ids": p, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}} for p in ps]
    with ThreadPoolExecutor(len(ps)) as pool:
        outs = list(pool.map(lambda body: gen(engine, body), payload))
    for p, out in zip(ps, outs):
        want = ref_model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10,
                                  do_sample=False)[0, len(p):].tolist()
        assert out["output_ids"] == want
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (got - fresh_logprobs(ref_model, p, want, 0.0)).abs().max() < ATOL
    turn2 = ps[1] + outs[1]["output_ids"] + [5, 6]
    out = gen(engine, {"input_ids": turn2, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True}})
    assert out["meta_info"]["cached_tokens"] == len(ps[1]) + 9
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert (got - fresh_logprobs(ref_model, turn2, out["output_ids"], 0.8)).abs().max() < ATOL


def test_server_takes_updates_named_as_in_the_checkpoint(engine, ref_model):
    """Updates may name tensors as the vision-language checkpoint does
    (model.language_model.*); the tower's tensors are accepted and left out (as SGLang's
    language_model_only loader does). An update keeps the cached states (SGLang's rule);
    the flush after it, which WeightSync sends after every push to a hybrid model, drops
    them."""
    name = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    old = ref_model.state_dict()["model.layers.0.linear_attn.in_proj_qkv.weight"]
    new = torch.randn_like(old)
    p = prompts([15], seed=5)[0]
    first = gen(engine, {"input_ids": p, "sampling_params": {"max_new_tokens": 3,
                                                             "temperature": 0}})
    push_tensors(engine.client, [(name, new), ("model.visual.blocks.0.norm1.weight",
                                               torch.ones(32))], version="v1")
    r = requests.post(engine.url + "/get_weights_by_name",
                      json={"name": name, "truncate_size": 10 ** 6}, timeout=30)
    assert torch.equal(torch.tensor(r.json()), new)
    engine.client.flush_cache()
    nxt = gen(engine, {"input_ids": p + first["output_ids"] + [5],
                       "sampling_params": {"max_new_tokens": 2}})
    assert nxt["meta_info"]["cached_tokens"] == 0 and nxt["meta_info"]["weight_version"] == "v1"
    push_tensors(engine.client, [(name, old)], version="default")


@pytest.mark.slow
def test_hybrid_model_without_state_support_is_refused_at_start(tmp_path, tiny_model_path):
    """A hybrid architecture the engine keeps no recurrent state for (Qwen3-Next) is
    refused at start-up with one line and exit status 2, never served without its state."""
    from transformers import AutoTokenizer, Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=500, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
                          num_experts_per_tok=1, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16)
    Qwen3NextForCausalLM(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "rollout.engines.hf.server", "--model-path",
                           str(tmp_path), "--port", "0"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("homegym: rollout.engine: hf keeps no recurrent state for "
                                "qwen3_next") and "rollout.engine=sglang" in lines[-1], lines[-3:]
    assert json.loads((tmp_path / "config.json").read_text())["layer_types"]
