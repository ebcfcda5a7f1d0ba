"""Where the CPU engine's time goes on bench_engine.py's workloads, through the real router.

    .venv/bin/python scripts/profile_engine.py [--model tiny-qwen3] [--runs 5] [--rate 250]
        [--in-process] [--parts]

Starts one engine server and the router as bench_engine.py does, warms up, then runs its
burst (64 prompts x 32 new tokens) and its multi-turn RL shape (64 episodes x 8 turns)
``--runs`` times each (a burst run is ``run_engine``'s, one request alone and then the
burst). For each workload it prints the wall time per run, the CPU seconds
per run of the engine process, the router process and this client, the engine's own
prefill/decode seconds (``/server_info``), the CPU seconds and context switches of its
scheduler process's two threads (the scheduler; the main thread, which takes the HTTP
front's requests off its channel) and the front's CPU seconds, and a breakdown of the
engine's samples from py-spy (``pip install py-spy``, the ``bench`` extra; ``--rate 0``
skips it): the forward pass by part, the scheduler's work outside it, the main thread's
and the HTTP front's. py-spy counts samples of running (non-idle) threads, so the shares
are of the engine's CPU work, both processes together. ``--in-process`` runs both
workloads straight into the engine's scheduler (the Batcher) in this process instead, with
no HTTP, router or client, and profiles that: the scheduler's share outside the forward
pass without the serving path around it. ``--parts`` times each part of the burst's
prefill and decode steps (linear layers, attention, norms, ...) by the scheduler's code
called in this thread. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench_engine import (make_prompts, next_prompt, opening_prompt, prefill_wave,  # noqa: E402
                          run_engine, run_multiturn, turn_new_tokens)

# First match wins, in this order: (substring of a frame, part). Forward parts are looked
# for only under the engine's forward call, the rest under the scheduler thread's loop.
FORWARD = (("_logits (", "LM head"), ("_decode_layers", "decode: decoder layers in one C call"),
           ("causal_attention", "prefill attention, per row"),
           ("gqa_attention_forward", "attention"), ("_linear (", "linear layers"),
           ("_norm (", "RMSNorm"), ("rope_", "RoPE"), ("rotary_emb", "rotary cos/sin"),
           ("update (", "KV write"), ("kv_layer", "KV write"), ("_unpack", "unpacking K/V"),
           ("_mask (", "mask"),
           ("embed", "embedding"))
SCHEDULER = (("_sample", "sampling"), ("_append_tokens", "token bookkeeping, finishing"),
             ("_store_prefix", "prefix cache: store"), ("pop_longest", "prefix cache: lookup"),
             ("cached_len", "prefix cache: lookup"), ("_prefill_chunks", "prefill chunking"),
             ("_merge", "merging rows into the batch KV"), ("_keep_rows", "dropping rows"),
             ("_prefill (", "prefill inputs and cached pasts"), ("_decode (", "decode step glue"),
             ("_run_controls", "control commands"))
HTTP = (("_text (", "detokenize"), ("_format (", "format response"),
        ("_prompt_ids", "validate input_ids"), ("sampling (", "sampling params"),
        ("read_body (", "read + parse JSON"), ("json_response (", "write JSON"),
        ("on_message (", "channel frames"), ("generate (", "generate handler, other"))
MAIN = (("on_message (", "admit the front's requests"), ("_admit_remote", "admit the front's requests"),
        ("_settle_finished", "answer finished requests"))


def part(stack: str) -> str:
    if "._loop (rollout/engines/hf/batcher.py" in stack:  # the scheduler thread
        if "._forward (rollout/engines/hf/batcher.py" in stack:
            return "forward: " + next((name for key, name in FORWARD if key in stack),
                                      "other ops and glue")
        return "scheduler: " + next((name for key, name in SCHEDULER if key in stack), "loop")
    if "rollout/engines/hf/front.py" in stack:
        return "HTTP front process: " + next((name for key, name in HTTP if key in stack),
                                             "aiohttp + asyncio")
    return "scheduler process, main thread: " + next(
        (name for key, name in MAIN if key in stack), "asyncio (or another thread)")


def breakdown(raw_path: str) -> list[tuple[str, float]]:
    counts: collections.Counter = collections.Counter()
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if stack and n.isdigit():
                counts[part(stack)] += int(n)
    total = sum(counts.values()) or 1
    return [(k, 100.0 * v / total) for k, v in counts.most_common()]


def _tree(pid: int) -> list[int]:
    """A process and its descendants that are still running."""
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            for child in f.read().split():
                pids += _tree(int(child))
    except OSError:
        pass
    return pids


def _stat(path: str) -> list[str]:
    """A /proc stat file's fields from the state on (field 3 is index 0)."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its descendants that are still running."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(f[11]) + int(f[12])) / tick
               for f in (_stat(f"/proc/{p}/stat") for p in _tree(pid)))


def page_faults(pid: int) -> int:
    """Minor page faults of a process and its descendants that are still running: pages
    the kernel mapped (and zeroed) on first touch."""
    return sum(int(_stat(f"/proc/{p}/stat")[7]) for p in _tree(pid))


def thread_stats(pid: int) -> dict[int, tuple[float, int, int]]:
    """Per thread of a process: (CPU seconds, voluntary and involuntary context switches).
    A thread waiting for the GIL sleeps on a futex, a voluntary switch; one preempted for
    another process's turn on the core counts an involuntary one."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = _stat(f"/proc/{pid}/task/{tid}/stat")
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / tick,
                         int(status["voluntary_ctxt_switches"]),
                         int(status["nonvoluntary_ctxt_switches"]))
    return out


def thread_report(pid: int, before: dict, after: dict, runs: int) -> str:
    """The scheduler process's main thread (the front's channel, the control routes) and
    its busiest other (the scheduler)."""
    diff = {t: tuple((b - a) / runs for a, b in zip(before.get(t, (0, 0, 0)), after[t]))
            for t in after}
    sched = max((t for t in diff if t != pid), key=lambda t: diff[t][0])
    return "; ".join(f"{name} {diff[t][0]:.3f} CPU s, {diff[t][1]:.0f} voluntary and "
                     f"{diff[t][2]:.0f} involuntary switches"
                     for name, t in (("scheduler thread", sched), ("main thread", pid)))


def spy(spy_bin: str, pid: int, rate: int, raw: str) -> subprocess.Popen:
    proc = subprocess.Popen([spy_bin, "record", "-p", str(pid), "-r", str(rate), "-f", "raw",
                             "-o", raw, "--threads", "--nonblocking", "--subprocesses"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    return proc


def report(proc: subprocess.Popen, raw: str) -> None:
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    for label, share in breakdown(raw):
        print(f"  {share:5.1f}%  {label}")


def in_process(path: str, prompts, runs: int, spy_bin: str, rate: int, tmp: str) -> None:
    """Both workloads submitted straight to a Batcher in this process, profiled: the burst,
    and the multi-turn shape (run_multiturn's episodes, each next turn submitted from the
    scheduler thread as the previous one finishes: no HTTP, router or client latency)."""
    import random
    import threading

    from transformers import AutoModelForCausalLM

    from rollout.engines.hf import fast_kernels
    from rollout.engines.hf.batcher import Batcher, Request

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=fast_kernels.register()).eval()
    vocab = model.config.vocab_size
    batcher = Batcher(model, None, set(), 4096)
    batcher.start()

    def burst() -> None:
        left = threading.Semaphore(0)
        for i, p in enumerate(prompts):
            batcher.submit(Request(rid=str(i), input_ids=p, max_new_tokens=32, ignore_eos=True,
                                   return_logprob=True, on_done=lambda r: left.release()))
        for _ in prompts:
            left.acquire()

    def multiturn(episodes: int = 64, turns: int = 8) -> None:
        rng, left = random.Random(0), threading.Semaphore(0)

        def play(k: int, ids: list[int], turn: int) -> None:
            def done(r: Request) -> None:
                if turn + 1 == turns:
                    left.release()
                else:
                    play(k, next_prompt(rng, vocab, ids, r.output_ids), turn + 1)

            batcher.submit(Request(rid=f"{k}-{turn}", input_ids=ids, ignore_eos=True,
                                   max_new_tokens=turn_new_tokens(rng), return_logprob=True,
                                   on_done=done))

        for k in range(episodes):
            play(k, opening_prompt(rng, vocab), 0)
        for _ in range(episodes):
            left.acquire()

    for name, job in (("burst", burst), ("multi-turn", multiturn)):
        job()  # warm-up
        raw = os.path.join(tmp, "raw.txt")
        proc = spy(spy_bin, os.getpid(), rate, raw) if rate else None
        walls, c0 = [], time.process_time()
        stats0 = dict(batcher.stats, decode_steps=batcher.steps)
        for _ in range(runs):
            t0 = time.perf_counter()
            job()
            walls.append(time.perf_counter() - t0)
        print(f"{name} in process, no HTTP: wall per run min {min(walls):.3f} s, median "
              f"{statistics.median(walls):.3f} s; CPU s per run "
              f"{(time.process_time() - c0) / runs:.3f}")
        stats1 = dict(batcher.stats, decode_steps=batcher.steps)
        print("  engine's own: " + ", ".join(
            f"{k} {(stats1[k] - stats0[k]) / runs:.3f}"
            for k in ("prefills", "prefill_s", "decode_steps", "decode_s")) + " per run")
        if proc is not None:
            report(proc, raw)
    batcher.stop()
    batcher.thread.join(5)


def parts(path: str, prompts, runs: int) -> None:
    """The burst's prefill and decode steps by the engine's scheduler code in this thread,
    each part of the forward pass timed (time.perf_counter around the calls): where a step's
    time goes, in milliseconds, with no sampler thread beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.engines.hf import fast_kernels, lean
    from rollout.engines.hf.batcher import Batcher, Request

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=fast_kernels.register()).eval()
    batcher = Batcher(model, None, set(), 4096)
    spent: collections.Counter = collections.Counter()

    def timed(name: str, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return run

    forward = batcher._lean
    forward._linear = timed("linear layers", forward._linear)
    forward._logits = timed("LM head", forward._logits)
    forward._decode_layers = timed("decoder layers in one C call", forward._decode_layers)
    for name, module, attr in (("attention", lean, "gqa_attention_forward"),
                               ("attention", lean, "varlen_causal_attention"),
                               ("RMSNorm", lean, "_norm"), ("RoPE", lean, "rope_"),
                               ("MLP activation", lean, "silu_mul_")):
        setattr(module, attr, timed(name, getattr(module, attr)))
    batcher._sample = timed("sampling", batcher._sample)
    batcher._forward = timed("forward pass", batcher._forward)

    def burst() -> tuple[dict, dict, int]:
        reqs = [Request(rid=str(i), input_ids=p, max_new_tokens=32, ignore_eos=True,
                        return_logprob=True) for i, p in enumerate(prompts)]
        spent.clear()
        t0 = time.perf_counter()
        prefill_wave(batcher, reqs)
        prefill = dict(spent, total=time.perf_counter() - t0)
        spent.clear()
        t0, steps = time.perf_counter(), 0
        while batcher.rows:
            batcher._decode()
            steps += 1
        return prefill, dict(spent, total=time.perf_counter() - t0), steps

    with torch.no_grad():
        burst()  # warm-up
        best = min((burst() for _ in range(runs)), key=lambda r: r[0]["total"] + r[1]["total"])
    prefill, decode, steps = best
    tokens = sum(map(len, prompts))
    print(f"burst's prefill ({tokens} tokens), ms: " + ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in sorted(prefill.items(), key=lambda kv: -kv[1])))
    print(f"a decode step at batch {len(prompts)} (mean of {steps}), ms: " + ", ".join(
        f"{k} {v * 1e3 / steps:.2f}" for k, v in sorted(decode.items(), key=lambda kv: -kv[1])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples/s (0 = no py-spy)")
    ap.add_argument("--in-process", action="store_true",
                    help="both workloads straight into the scheduler, no server (see above)")
    ap.add_argument("--parts", action="store_true",
                    help="time each part of the burst's prefill and decode steps, in process")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig

    from rollout.engines import EngineServer, HFLaunch, Router
    from rollout.models import resolve_model_path

    torch.set_num_threads(1)
    path = resolve_model_path(args.model)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(64, vocab, 8, 160)
    if args.parts:  # no py-spy: it times the parts itself
        parts(path, prompts, args.runs)
        return
    spy_bin = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if args.rate and not os.path.exists(spy_bin):
        sys.exit("py-spy not found: pip install py-spy (or --rate 0)")
    if args.in_process:
        with tempfile.TemporaryDirectory() as tmp:
            in_process(path, prompts, args.runs, spy_bin, args.rate, tmp)
        return
    workloads = {"burst, 64 x 32 tokens": lambda url: run_engine(url, prompts, 32),
                 "multi-turn, 64 episodes x 8 turns": lambda url: run_multiturn(url, 64, 8, vocab)}
    engine = EngineServer(HFLaunch(model_path=path, max_context_len=4096), "profile0")
    router = Router(tokenizer_path=path)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            router.start([engine.start()])
            epid, rpid = engine.pid(), router.proc.pid
            with open(f"/proc/{epid}/task/{epid}/children") as f:
                (fpid,) = map(int, f.read().split())  # the HTTP front (hf/front.py)
            asyncio.run(run_engine(router.url, prompts, 32))  # warm-up
            for name, job in workloads.items():
                raw = os.path.join(tmp, "raw.txt")
                proc = spy(spy_bin, epid, args.rate, raw) if args.rate else None
                info0 = engine.client.server_info()
                cpu0 = (cpu_seconds(epid), cpu_seconds(rpid), time.process_time(),
                        cpu_seconds(fpid))
                threads0 = thread_stats(epid)
                walls = []
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    asyncio.run(job(router.url))
                    walls.append(time.perf_counter() - t0)
                cpu1 = (cpu_seconds(epid), cpu_seconds(rpid), time.process_time(),
                        cpu_seconds(fpid))
                threads1 = thread_stats(epid)
                info1 = engine.client.server_info()
                n = args.runs
                e, r, c, _ = ((b - a) / n for a, b in zip(cpu0, cpu1))
                print(f"{name}: wall per run min {min(walls):.3f} s, median "
                      f"{statistics.median(walls):.3f} s; CPU s per run: engine {e:.3f}, "
                      f"router {r:.3f}, client {c:.3f}")
                print("  engine's own: " + ", ".join(
                    f"{k} {(info1[k] - info0[k]) / n:.3f}"
                    for k in ("prefills", "prefill_s", "decode_steps", "decode_s")) + " per run")
                front = (cpu1[3] - cpu0[3]) / n
                print("  per run: " + thread_report(epid, threads0, threads1, n) +
                      f"; HTTP front process {front:.3f} CPU s")
                if proc is not None:
                    report(proc, raw)
        finally:
            router.shutdown()
            engine.shutdown()


if __name__ == "__main__":
    main()
