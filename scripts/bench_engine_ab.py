"""A/B the CPU engine of two code versions: a git ref against the working tree.

    .venv/bin/python scripts/bench_engine_ab.py --base REF [--model tiny-qwen3]
        [--pairs 12] [--multiturn] [--router]

Starts one engine server from a temporary git worktree of REF and one from this checkout,
warms both up, then sends bench_engine.py's workload to them in interleaved pairs
(A B, B A, ...), so that drift in the machine's speed (other tenants, frequency) hits both
alike. Prints each side's median and best wall time, the median CPU seconds its engine
process spent per run (steadier than wall time on a loaded box: waiting for a core is not
counted) and its median page faults per run, and the ratios of medians. The workload is
bench_engine.py's single burst (64 prompts of 10-160 tokens x 32 new tokens) or, with
--multiturn, its multi-turn RL shape (64 episodes x 8 turns), sent to each server
directly or, with --router, through an sglang-router of its own (the serving path
bench_engine.py and the rollout manager use: each request crosses one more process). One
thread per server. Not a test: on a 2-core box give it a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_engine import make_prompts, run_engine, run_multiturn  # noqa: E402
from profile_engine import cpu_seconds, page_faults  # noqa: E402


def start_server(tree: str, model_path: str, port_file: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree)
    return subprocess.Popen(
        [sys.executable, "-m", "rollout.engines.hf.server", "--model-path", model_path,
         "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
         "--torch-threads", "1", "--max-context-len", "4096"],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_url(proc: subprocess.Popen, port_file: str, timeout: float = 300.0) -> str:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine server exited with {proc.returncode}")
        if os.path.exists(port_file):
            url = f"http://127.0.0.1:{open(port_file).read().strip()}"
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except requests.RequestException:
                pass
        time.sleep(0.2)
    raise TimeoutError("engine server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git ref of the A side (B = working tree)")
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--multiturn", action="store_true")
    ap.add_argument("--router", action="store_true",
                    help="each server behind an sglang-router of its own")
    args = ap.parse_args()

    from transformers import AutoConfig

    from rollout.models import resolve_model_path

    path = resolve_model_path(args.model)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(64, vocab, 8, 160)
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", base_tree,
                        args.base], check=True)
        procs, routers = [], []
        try:
            trees = {"A " + args.base: base_tree, "B working tree": ROOT}
            urls = {}
            for name, tree in trees.items():
                port_file = os.path.join(tmp, f"port{len(procs)}")
                procs.append(start_server(tree, path, port_file))
                urls[name] = wait_url(procs[-1], port_file)
                if args.router:
                    from rollout.engines import Router

                    routers.append(Router(tokenizer_path=path))
                    routers[-1].start([urls[name]])
                    urls[name] = routers[-1].url

            def once(url: str) -> float:
                if args.multiturn:
                    return asyncio.run(run_multiturn(url, 64, 8, vocab))[0]
                return asyncio.run(run_engine(url, prompts, 32))[0]

            for url in urls.values():
                once(url)  # warm-up
            pids = dict(zip(urls, (p.pid for p in procs)))
            times = {name: [] for name in urls}
            cpu = {name: [] for name in urls}
            faults = {name: [] for name in urls}
            names = list(urls)
            for i in range(args.pairs):
                for name in (names if i % 2 == 0 else names[::-1]):
                    c0, f0 = cpu_seconds(pids[name]), page_faults(pids[name])
                    times[name].append(once(urls[name]))
                    cpu[name].append(cpu_seconds(pids[name]) - c0)
                    faults[name].append(page_faults(pids[name]) - f0)
            workload = "multi-turn 64 x 8 turns" if args.multiturn else "burst 64 x 32 tokens"
            via = ", each through its own router" if args.router else ""
            print(f"{args.model}, {workload}{via}, {args.pairs} interleaved pairs:")
            for name in names:
                ts = times[name]
                print(f"  {name}: median {statistics.median(ts):.3f} s, best {min(ts):.3f} s; "
                      f"engine CPU median {statistics.median(cpu[name]):.3f} s, "
                      f"page faults median {statistics.median(faults[name]):.0f}")
            a, b = (statistics.median(times[n]) for n in names)
            ca, cb = (statistics.median(cpu[n]) for n in names)
            print(f"  ratio of medians B/A: wall {b / a:.3f}, engine CPU {cb / ca:.3f}")
        finally:
            for router in routers:
                router.shutdown()
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_tree],
                           check=False)


if __name__ == "__main__":
    main()
