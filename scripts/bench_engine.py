"""Benchmark the CPU engine (through the real router) against plain ``model.generate()``.

    .venv/bin/python scripts/bench_engine.py [--model tiny-qwen3|smollm2-135m|DIR]
        [--prompts 64] [--new-tokens 32] [--engines 1] [--hf-batch-size 64]
        [--sglang-python .venv-sglang/bin/python]

Workload: prompts of mixed lengths, each generating exactly --new-tokens tokens
(ignore_eos), sampled at temperature 1. Reports tokens/s for
- the engine: all prompts sent at once through sglang-router (continuous batching), a
  request each, and again as one batched request;
- the engine on the RL loop's multi-turn shape, twice: a request per turn, and short
  turns ready together batched into one request as the rollout manager sends them
  (``rollout.batch_turns_up_to``);
- transformers' model.generate(): the same prompts, left-padded, in batches of
  --hf-batch-size, one thread, the model loaded with from_pretrained's defaults (SDPA
  attention): what a user would naturally write. --hf-attn eager gives the slower eager
  attention that figures before 2026-11-29 were measured against;
- the raw forward-pass bound: the same prefill and decode work as bare forward passes in
  one process with the engine's kernels and a static schedule (no scheduler, no HTTP),
  i.e. what a perfect server with zero overhead could reach;
- the multi-turn shape's bound: its turns with a perfect schedule (each turn's requests
  one wave, prefilled together over the prefix cache and decoded to the end) by the
  engine's own scheduler code in one thread, with no serving path;
- with --sglang-python: both engine workloads on the real SGLang CPU server (bfloat16, its
  AMX kernels) in the same run, beside homegym's engine (float32).
Each server figure is the best of --repeat runs, each run starting with the servers'
prefix caches flushed (a first-time burst, whatever each server caches).
Not a test: timings depend on the machine (and on other processes sharing it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab - 1, (length,), generator=g).tolist() for length in lengths]


async def generate_call(session, url: str, payload: dict, together: bool) -> dict:
    """One /generate: a request of its own or, ``together``, batched with the calls ready
    at the same moment (``rollout.http.generate_together``)."""
    from rollout.http import generate_together

    if together:
        return await generate_together(url + "/generate", payload)
    async with session.post(url + "/generate", json=payload) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def run_engine(url: str, prompts, new_tokens: int,
                     together: bool = False) -> tuple[float, int]:
    """Every prompt at once, a request each or, ``together``, as one batched request (what
    ``rollout.http.generate_together`` makes of calls ready at the same moment)."""
    import aiohttp

    from rollout.http import close_session

    async with aiohttp.ClientSession() as session:
        async def one(p):
            payload = {"input_ids": p, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0,
                                           "ignore_eos": True}}
            return len((await generate_call(session, url, payload, together))["output_ids"])

        await one(prompts[0])  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*[one(p) for p in prompts])
        dt = time.perf_counter() - t0
    await close_session()
    return dt, sum(counts)


# The multi-turn shape's episodes, drawn from one random.Random in this order: an opening
# prompt, then per turn its new-token count and, after the answer, the next prompt.
def opening_prompt(rng, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 1) for _ in range(rng.randint(60, 100))]


def turn_new_tokens(rng) -> int:
    return rng.randint(5, 8)


def next_prompt(rng, vocab: int, ids: list[int], answer: list[int]) -> list[int]:
    """The conversation so far, the answer, then ~10 environment tokens."""
    return ids + answer + [rng.randrange(10, vocab - 1) for _ in range(10)]


def prefill_wave(batcher, reqs) -> None:
    """Prefill ``reqs`` in this thread as the scheduler admits a wave: room made for all of
    it at once, then its prefill chunks."""
    batcher.kv.expect(len(batcher.rows) + len(reqs), max(len(r.input_ids) for r in reqs))
    for chunk in batcher._prefill_chunks(reqs):
        batcher._prefill(chunk)


async def run_multiturn(url: str, episodes: int, turns: int, vocab: int, seed: int = 0,
                        together: bool = False):
    """The RL loop's shape: ``episodes`` concurrent games, each a chain of short turns
    (prompt ~60-150 tokens, 5-8 new tokens, then ~10 environment tokens appended), one
    request per turn or, ``together``, as the rollout manager sends short turns: those
    ready at the same moment with the same sampling params as one batched request
    (``rollout.http.generate_together``)."""
    import random

    import aiohttp

    from rollout.http import close_session

    rng = random.Random(seed)
    latencies: list[float] = []

    async def episode(session, k):
        ids = opening_prompt(rng, vocab)
        new = 0
        for _ in range(turns):
            t0 = time.perf_counter()
            payload = {"input_ids": ids, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": turn_new_tokens(rng),
                                           "temperature": 1.0, "ignore_eos": True}}
            body = await generate_call(session, url, payload, together)
            latencies.append(time.perf_counter() - t0)
            ids = next_prompt(rng, vocab, ids, body["output_ids"])
            new += len(body["output_ids"])
        return new

    conn = aiohttp.TCPConnector(limit=episodes)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*[episode(session, k) for k in range(episodes)])
        dt = time.perf_counter() - t0
    await close_session()
    latencies.sort()
    return dt, sum(tokens), len(latencies), latencies[len(latencies) // 2]


def left_pad(chunk: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), left-padded as generate() wants."""
    width = max(len(p) for p in chunk)
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, p in enumerate(chunk):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    return ids, mask


def run_hf_generate(model, prompts, new_tokens: int, batch_size: int, pad_id: int):
    total, t0 = 0, None
    for warm in (True, False):
        if not warm:
            t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size] if not warm else prompts[:2]
            ids, mask = left_pad(chunk, pad_id)
            width = ids.shape[1]
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     pad_token_id=pad_id)
            if not warm:
                total += (out.shape[1] - width) * len(chunk)
            if warm:
                break
    return time.perf_counter() - t0, total


def forward_bound(model, prompts: list[list[int]], new_tokens: int, pad_id: int,
                  repeat: int = 3) -> tuple[float, dict]:
    """The same work as raw forward passes in this process, no scheduler and no HTTP:
    prefill every prompt, then ``new_tokens`` decode steps of the whole batch over one KV
    cache, with the engine's own forward pass, kernels and sampler (rollout/engines/hf/lean.py
    where the architecture allows: packed prefill; the C decode attention; an in-place
    growing cache; the inverse-CDF draw).
    Three static schedules, the fastest counts: one left-padded prefill of all prompts,
    length-sorted prefill chunks of 16 prompts, or of up to 1024 tokens (the engine's
    ``packed_token_budget``), merged into one cache. Returns (seconds, details)."""
    from transformers import DynamicCache

    from rollout.engines.hf import lean
    from rollout.engines.hf.batcher import draw
    from rollout.engines.hf.fast_kernels import GrowingLayer
    from rollout.models import cache_kwarg

    b = len(prompts)
    kw = cache_kwarg(model)
    gen = torch.Generator().manual_seed(0)

    if lean.supports(model):  # the engine's own forward pass, as the engine runs it
        forward = lean.LeanForward(model)
    else:
        def forward(ids, mask, pos, cache):
            return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{kw: cache}).logits[:, -1]

    def prefill(chunk):
        ids, mask = left_pad(chunk, pad_id)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        return cache, mask, forward(ids, mask, pos, cache)

    def chunks(fits):
        out = [[]]
        for p in sorted(prompts, key=len):
            if out[-1] and not fits(out[-1] + [p]):
                out.append([])
            out[-1].append(p)
        return out

    def run(schedule):
        parts = [prefill(chunk) for chunk in schedule]
        width = max(m.shape[1] for _, m, _ in parts)
        layers = []
        for li in range(len(parts[0][0].layers)):
            ks, vs = [], []
            for cache, m, _ in parts:  # left-pad every chunk's KV to the common width
                k, v = cache.layers[li].keys, cache.layers[li].values
                pad = width - k.shape[2]
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layers.append(GrowingLayer(torch.cat(ks), torch.cat(vs), spare=new_tokens))
        cache = DynamicCache()
        cache.layers = layers
        mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for _, m, _ in parts])
        logits = torch.cat([lg for _, _, lg in parts])
        pos = mask.sum(1, keepdim=True)
        for _ in range(new_tokens):
            nxt = draw(torch.softmax(logits.float(), -1), gen)[:, None]
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], 1)
            logits = forward(nxt, mask, pos, cache)
            pos = pos + 1

    best = {}
    with torch.no_grad():
        schedules = {"one padded prefill": [prompts],
                     "prefill chunks of 16": chunks(lambda c: len(c) <= 16),
                     "of 1024 tokens": chunks(lambda c: sum(map(len, c)) <= 1024)}
        for name, schedule in schedules.items():
            run(schedule)  # warm-up
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                run(schedule)
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
    return min(best.values()), best


def multiturn_bound(model, episodes: int, turns: int, vocab: int, repeat: int = 3) -> float:
    """run_multiturn's work with a perfect schedule and no serving path: each turn's
    requests prefilled together as one wave (over the prefix cache, as the engine does) and
    decoded until all are done, by the engine's own scheduler code (the Batcher's prefill
    and decode steps) called in this thread: no HTTP, no router, no client, no request
    arriving late, every turn's past in the prefix cache. Returns the best seconds per run."""
    import random

    from rollout.engines.hf.batcher import Batcher, Request

    def run() -> float:
        # A prefix cache that holds every conversation: the engine's 256 MB would evict
        # SmolLM2's (46 KB of KV a token) in this wave order, store all, then look all up.
        batcher = Batcher(model, None, set(), 4096, prefix_cache_bytes=1 << 40)
        rng = random.Random(0)
        convs = [opening_prompt(rng, vocab) for _ in range(episodes)]
        t0 = time.perf_counter()
        for _ in range(turns):
            reqs = [Request(rid=str(k), input_ids=ids, max_new_tokens=turn_new_tokens(rng),
                            ignore_eos=True, return_logprob=True) for k, ids in enumerate(convs)]
            prefill_wave(batcher, reqs)
            while batcher.rows:
                batcher._decode()
            convs = [next_prompt(rng, vocab, ids, r.output_ids) for ids, r in zip(convs, reqs)]
        return time.perf_counter() - t0

    with torch.no_grad():
        run()  # warm-up
        return min(run() for _ in range(repeat))


def bench_server(label: str, make_spec, args, prompts, vocab: int, path: str):
    """Both workloads through the router on ``args.engines`` servers of one kind; returns
    (burst seconds, burst tokens, burst seconds batched, multi-turn turns/s: a request
    each, batched)."""
    from rollout.engines import EngineServer, Router

    engines = [EngineServer(make_spec(i), f"bench{i}") for i in range(args.engines)]
    router = Router(tokenizer_path=path)
    rates = {False: float("nan"), True: float("nan")}
    try:
        urls = [e.start() for e in engines]
        router.start(urls)

        def fresh(run):
            # Every timed run starts with empty prefix caches: the runs repeat the same
            # prompts, which SGLang's radix cache would otherwise serve from the previous
            # run (its whole prefill skipped), as homegym's engine does not (its cache
            # holds finished sequences for the prompts that extend them).
            for e in engines:
                e.client.flush_cache()
            return asyncio.run(run)

        # Best of --repeat: other processes on a small box add noise, never speed.
        dt, tokens = min(fresh(run_engine(router.url, prompts, args.new_tokens))
                         for _ in range(args.repeat))
        print(f"{label} via router ({args.engines} engine): {tokens} tokens in {dt:.2f}s = "
              f"{tokens / dt:,.0f} tok/s")
        batched_dt, _ = min(fresh(run_engine(router.url, prompts, args.new_tokens,
                                             together=True))
                            for _ in range(args.repeat))
        print(f"{label} via router, the burst as one batched request: {batched_dt:.2f}s = "
              f"{tokens / batched_dt:,.0f} tok/s")
        if args.multiturn_turns:
            for together in (False, True):
                m_dt, m_tok, m_req, p50 = fresh(run_multiturn(
                    router.url, args.episodes, args.multiturn_turns, vocab, together=together))
                how = ("turns ready together batched, as the rollout manager sends them"
                       if together else "a request per turn")
                print(f"{label} multi-turn RL shape ({how}): {args.episodes} episodes x "
                      f"{args.multiturn_turns} turns = {m_req} turns in {m_dt:.2f}s = "
                      f"{m_req / m_dt:,.0f} turns/s, {m_tok / m_dt:,.0f} new tok/s, p50 "
                      f"latency {p50 * 1000:.0f} ms")
                rates[together] = m_req / m_dt
        for e in engines:
            info = e.client.server_info()
            if "prefill_s" in info:
                print(f"  {e.name}: {info['prefills']} prefills {info['prefill_s']:.2f}s, "
                      f"{info['decode_steps']} decode steps {info['decode_s']:.2f}s (incl. warm-up)")
    finally:
        router.shutdown()
        for e in engines:
            e.shutdown()
    return dt, tokens, batched_dt, rates[False], rates[True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-attn", default=None,
                    help="attn_implementation for generate() (default: transformers' own, SDPA)")
    ap.add_argument("--multiturn-turns", type=int, default=8,
                    help="also run the RL loop's multi-turn shape (0 = skip)")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timed runs")
    ap.add_argument("--sglang-python", default=None,
                    help="also run both workloads on the real SGLang CPU server of this venv "
                         "(scripts/install_sglang_cpu.sh)")
    ap.add_argument("--homegym-bf16", action="store_true",
                    help="also run both workloads on homegym's engine in bfloat16 (SGLang-CPU's "
                         "dtype)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.engines import HFLaunch, SGLangLaunch
    from rollout.engines.hf import fast_kernels, lean
    from rollout.models import resolve_model_path

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    hf_kwargs = {"attn_implementation": args.hf_attn} if args.hf_attn else {}
    model = AutoModelForCausalLM.from_pretrained(path, **hf_kwargs).eval()
    fast_model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=fast_kernels.register()).eval()
    prompts = make_prompts(args.prompts, model.config.vocab_size, args.min_len, args.max_len)
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; "
          f"{len(prompts)} prompts, lengths {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"(mean {mean_len:.0f}), {args.new_tokens} new tokens each")

    servers = {"homegym CPU engine (fp32)": lambda i: HFLaunch(model_path=path, max_context_len=4096)}
    if args.homegym_bf16:
        servers["homegym CPU engine (bf16)"] = lambda i: HFLaunch(
            model_path=path, max_context_len=4096, dtype="bfloat16")
    if args.sglang_python:
        servers["SGLang 0.5.18 CPU (bf16)"] = lambda i: SGLangLaunch(
            model_path=path, device="cpu", dtype="bfloat16",
            python=args.sglang_python, random_seed=i)
    results = {}
    for label, spec in servers.items():
        results[label] = bench_server(label, spec, args, prompts, model.config.vocab_size, path)
    e_dt, e_tokens, e_batched_dt = results["homegym CPU engine (fp32)"][:3]
    e_tps = e_tokens / e_dt
    if len(results) > 1:
        print("\nside by side (same prompts, same run):")
        print(f"  {'server':<28} {'burst s':>8} {'tok/s':>8} {'multi-turn turns/s':>19} "
              f"{'batched':>8}")
        for label, (dt, tokens, _, req_s, batched_s) in results.items():
            print(f"  {label:<28} {dt:>8.2f} {tokens / dt:>8,.0f} {req_s:>19,.0f} "
                  f"{batched_s:>8,.0f}")

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    h_dt, h_tokens = min(run_hf_generate(model, prompts, args.new_tokens, args.hf_batch_size, pad)
                         for _ in range(args.repeat))
    h_tps = h_tokens / h_dt
    print(f"model.generate() batch {args.hf_batch_size}, {model.config._attn_implementation} "
          f"attention: {h_tokens} tokens in {h_dt:.2f}s = {h_tps:,.0f} tok/s")
    bound_dt, schedules = forward_bound(fast_model, prompts, args.new_tokens, pad, args.repeat)
    b_tps = h_tokens / bound_dt
    print("raw forward bound (same prefill + decode work, one process, engine kernels): "
          + ", ".join(f"{k} {v:.2f}s" for k, v in schedules.items())
          + f" -> {b_tps:,.0f} tok/s")
    print(f"ratio engine / generate(): {e_tps / h_tps:.2f}x a request per prompt, "
          f"{h_dt / e_batched_dt:.2f}x batched; engine / bound: {e_tps / b_tps:.2f} "
          f"(engine / bound time: {e_dt / bound_dt:.2f}x a request per prompt, "
          f"{e_batched_dt / bound_dt:.2f}x batched)")
    m_rates = results["homegym CPU engine (fp32)"][3:]
    if args.multiturn_turns and lean.supports(fast_model):
        m_bound = multiturn_bound(fast_model, args.episodes, args.multiturn_turns,
                                  model.config.vocab_size, args.repeat)
        each, batched = (args.episodes * args.multiturn_turns / r for r in m_rates)
        print(f"multi-turn bound (each turn one wave, prefilled together and decoded to the "
              f"end by the engine's scheduler code in one thread, no serving path): "
              f"{m_bound:.2f}s; engine / bound time: {each / m_bound:.2f}x a request per "
              f"turn, {batched / m_bound:.2f}x batched")


if __name__ == "__main__":
    main()
