"""homegym vs TRL's GRPOTrainer on the guessing game, same model / batch / optimiser / steps.

    .venv/bin/python scripts/bench_vs_trl.py [--model tiny-qwen3|smollm2-135m|DIR]
        [--tasks multi,single] [--systems homegym,homegym_async,trl] [--steps 20]
        [--repeats 1] [--threads 1] [--prompts 4] [--samples 8] [--max-new-tokens 8]
        [--warmup-steps 400] [--out outputs/bench_vs_trl] [--engines 1 --ranks 1]
        [--trl-attn eager|sdpa]

TRL (`pip install -c constraints.txt -e '.[bench]'`) is an optional benchmark dependency.

1. Warm-up, once (cached in --out): a short SFT of the model on homegym's scripted
   transcripts (``rollout.demos``, the same data as homegym's own ``warmup`` stage), saved as
   an HF dir. Both systems start from it, so success rates mean something.
2. Per task (``multi``: the game, up to 6 turns; ``single``: one guess, same reward function
   = the environment with ``max_turns=1``), each system runs ``--steps`` GRPO steps of
   prompts x samples episodes, in its own subprocess (so thread settings and imports cannot
   leak), one after the other in this invocation:
   - homegym through its public path, ``trainer.driver.loop.train(compose_config(overrides))``:
     real Ray, HF engine(s) behind sglang-router, FSDP rank(s), weight sync; timings from
     its metrics.jsonl (perf/step_time, rollout_time, train_time, weight_sync_time).
     ``homegym`` is colocated and synchronous (engine and rank take turns);
     ``homegym_async`` is disaggregated with algo.max_staleness=1 (one thread per process).
   - TRL: ``GRPOTrainer(use_cpu=True)``, --threads torch threads; multi-turn through the
     experimental ``rollout_func`` returning ``env_mask`` (the games are played with batched
     ``model.generate`` per turn: all live episodes advance together); single-turn through
     TRL's own generation path with a reward function wrapping the same environment.
   Same optimiser (AdamW, lr, betas, no decay, clip 1.0, constant LR), loss (PPO-clip 0.2,
   token-mean, group-normalised advantages, no KL), sampling (T=1, no top-k/p).
3. The limit: the same tokens in one process, no serving layer -- the step's generation
   forwards (batched KV-cache decode) plus one forward/backward/AdamW over the batch.

Threads: --threads applies to TRL, colocated homegym and the limit. On this 2-core box,
quiet, 2 threads run a matmul ~1.9x faster than 1; under load (other processes running)
2 threads collapse (spinning OpenMP workers), so compare both settings.

Writes --out/results.json, --out/results.md and --out/reward_vs_time_<task>.png, and prints
the table. Timings depend on the machine and its load (reported alongside); TRL's step time
varied by ~20% between runs here, so ``--repeats N`` runs every system N times, interleaved,
and reports each system's median run with the spread of all of them.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MULTI_TURNS = 6


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def base_overrides(args, model_path: str, task: str) -> list[str]:
    """homegym config overrides shared by the warm-up data and the RL run."""
    return [f"model.path={model_path}",
            f"rollout.rollout_batch_size={args.prompts}",
            f"rollout.n_samples_per_prompt={args.samples}",
            f"rollout.max_response_len={args.max_new_tokens}",
            f"env.max_turns={MULTI_TURNS if task == 'multi' else 1}",
            f"train.lr={args.lr}"]


# ====================================================================== warm-up (SFT)
def warm_model(args) -> str:
    """SFT on rollout.demos transcripts, saved once as an HF dir; returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.demos import make_demos
    from config import compose_config
    from rollout.models import resolve_model_path
    from trainer.driver.components import rollout_sections

    torch.set_num_threads(1)
    src = resolve_model_path(args.model, None)
    name = Path(src).name
    out = Path(args.out).resolve() / f"warm-{name}-{args.warmup_steps}x{args.warmup_batch}"
    if (out / "config.json").exists():
        return str(out)
    config = compose_config(base_overrides(args, src, "multi"))
    tok = AutoTokenizer.from_pretrained(src)
    t0 = time.perf_counter()
    demos = make_demos(tok, args.warmup_steps * args.warmup_batch, seed=0, **rollout_sections(config))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, betas=(0.9, 0.98),
                            weight_decay=0.0)
    pad = tok.pad_token_id or 0
    for i in range(args.warmup_steps):
        chunk = demos[i * args.warmup_batch:(i + 1) * args.warmup_batch]
        width = max(len(s.tokens) for s in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        lm = torch.zeros(len(chunk), width)
        for r, s in enumerate(chunk):
            n, p = len(s.tokens), s.prompt_length
            ids[r, :n] = torch.tensor(s.tokens)
            att[r, :n] = 1
            lm[r, p:n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                ids[:, 1:].reshape(-1), reduction="none")
        mask = lm[:, 1:].reshape(-1)
        loss = (nll * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (i + 1) % max(1, args.warmup_steps // 5) == 0:
            print(f"warm-up {i + 1}/{args.warmup_steps}: nll {loss.item():.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)


# ====================================================================== homegym
def run_homegym(args, model_path: str, task: str, out: Path, *, overlap: bool = False) -> dict:
    """``overlap``: homegym's disaggregated async mode -- the engine generates step k+1 on
    one core while the rank trains step k on the other (algo.max_staleness=1), one thread
    per process whatever --threads says (two processes already fill the two cores)."""
    import torch

    threads = 1 if overlap else args.threads
    torch.set_num_threads(threads)
    from config import compose_config
    from trainer.driver.loop import train

    run_name = f"homegym{'_async' if overlap else ''}-{task}"
    # A fresh run every time: an earlier run's checkpoints would otherwise be resumed.
    shutil.rmtree(out / run_name, ignore_errors=True)
    overrides = base_overrides(args, model_path, task) + [
        "warmup.steps=0", "eval.before_and_after=false", f"train.num_steps={args.steps}",
        f"rollout.num_engines={args.engines}", f"train.ranks_per_node={args.ranks}",
        "train.save_interval=null", "logging.wandb_mode=disabled",
        f"cluster.torch_threads={threads}",
        f"logging.output_dir={out}", f"logging.run_name={run_name}",
        f"train.seed={args.seed}"] + (["cluster.colocate=false", "algo.max_staleness=1",
                                        "algo.rollout_correction=token_tis"]
                                      if overlap else []) + list(args.homegym_override)
    config = compose_config(overrides)
    # A Ray instance of our own: a bare ray.init() would join any other cluster on the box.
    import ray

    from trainer.driver.runtime import worker_env
    ray.init(address="local",
             num_cpus=max(os.cpu_count() or 1,
                          config.derived.num_engines + config.train.world_size + 2),
             include_dashboard=False, runtime_env={"env_vars": worker_env(config)},
             log_to_driver=True)
    t0 = time.time()
    result = train(config)
    rows = [json.loads(line) for line in open(result.run_dir / "metrics.jsonl")]
    rows = [r for r in rows if "perf/step_time" in r]
    steps = []
    for r in rows:
        steps.append({
            "step": r["step"], "end_time": r["time"], "step_time": r["perf/step_time"],
            "gen_time": r.get("perf/rollout_time", 0.0), "train_time": r.get("perf/train_time", 0.0),
            "sync_time": r.get("perf/weight_sync_time", 0.0),
            "reward": r.get("rollout/raw_reward"), "success": r.get("rollout/success_rate"),
            "gen_tokens": r.get("perf/tokens_per_s", 0.0) * r.get("perf/rollout_time", 0.0),
            "episodes": r.get("rollout/num_samples", args.prompts * args.samples),
            "turns": r.get("rollout/mean_turns")})
    start = steps[0]["end_time"] - steps[0]["step_time"] if steps else t0
    return {"steps": steps, "start_time": start, "setup_s": start - t0,
            "overrides": overrides}


# ====================================================================== TRL
def _sample_turn(model, seqs: list[list[int]], max_new: int, pad: int, eos: int):
    """One batched, sampled turn for every live episode: (new ids, their log-probs)."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for r, s in enumerate(seqs):  # left padding, as generate() wants
        ids[r, width - len(s):] = torch.tensor(s)
        att[r, width - len(s):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                             pad_token_id=pad, eos_token_id=eos, output_scores=True,
                             return_dict_in_generate=True, disable_compile=True)
    new = out.sequences[:, width:]
    logps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
    lp = logps.gather(2, new[:, :, None])[:, :, 0]
    res = []
    for r in range(len(seqs)):
        toks = new[r].tolist()
        n = len(toks)
        if eos in toks:
            n = toks.index(eos) + 1
        res.append((toks[:n], lp[r, :n].tolist()))
    return res


def run_trl(args, model_path: str, task: str, out: Path) -> dict:
    import asyncio

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.number_guess import PROMPT, TRAIN_TARGETS, NumberGuessEnv
    from rollout.chat import ChatRenderer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation=args.trl_attn)
    renderer = ChatRenderer(tok)
    eos, pad = tok.eos_token_id, (tok.pad_token_id if tok.pad_token_id is not None else 0)
    max_turns = MULTI_TURNS if task == "multi" else 1
    loop = asyncio.new_event_loop()
    stats = {"gen_time": 0.0, "gen_tokens": 0, "success": [], "reward": []}

    def env_step(env, text):
        return loop.run_until_complete(env.step(text))

    # One row per prompt; TRL's sampler repeats each num_generations times.
    rows = [{"prompt": PROMPT if task == "multi" else [{"role": "user", "content": PROMPT}],
             "target": t} for t in TRAIN_TARGETS] * 50

    def rollout_func(prompts, trainer):
        t0 = time.perf_counter()
        tgts = trainer._bench_targets
        n = len(prompts)
        if len(tgts) != n:
            raise RuntimeError(f"rollout_func got {n} prompts, {len(tgts)} targets")
        m = trainer.accelerator.unwrap_model(trainer.model)
        was_training = m.training
        m.eval()
        envs = []
        for k, t in enumerate(tgts):
            env = NumberGuessEnv(max_turns=max_turns, seed=1000 * trainer.state.global_step + k)
            loop.run_until_complete(env.reset(t))
            envs.append(env)
        _, pids = renderer.prompt_ids([{"role": "user", "content": PROMPT}])
        seqs = [list(pids) for _ in range(n)]
        comp = [[] for _ in range(n)]
        mask = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        reward = [0.0] * n
        info = [{} for _ in range(n)]
        live = list(range(n))
        for _turn in range(max_turns):
            if not live:
                break
            outs = _sample_turn(m, [seqs[i] for i in live], args.max_new_tokens, pad, eos)
            nxt = []
            for i, (ids, lp) in zip(live, outs):
                seqs[i] += ids
                comp[i] += ids
                mask[i] += [1] * len(ids)
                lps[i] += lp
                stats["gen_tokens"] += len(ids)
                obs, r, done, inf = env_step(envs[i], tok.decode(ids, skip_special_tokens=True))
                reward[i] += r
                info[i] = inf
                if done or not ids or ids[-1] != eos:
                    continue  # finished, or cut off at the token budget (truncated)
                o = renderer.observation_ids(obs, model_closed_turn=True)
                seqs[i] += o
                comp[i] += o
                mask[i] += [0] * len(o)
                lps[i] += [0.0] * len(o)
                nxt.append(i)
            live = nxt
        if was_training:
            m.train()
        stats["gen_time"] += time.perf_counter() - t0
        stats["success"] += [float(x.get("success", False)) for x in info]
        stats["reward"] += reward
        return {"prompt_ids": [list(pids) for _ in range(n)], "completion_ids": comp,
                "logprobs": lps, "env_mask": mask, "env_reward": reward}

    def reward_multi(prompts, completions, env_reward=None, **kw):
        return list(env_reward)

    def reward_single(prompts, completions, target=None, **kw):
        out_r = []
        for c, t in zip(completions, target):
            text = c[0]["content"] if isinstance(c, list) else c
            env = NumberGuessEnv(max_turns=1)
            loop.run_until_complete(env.reset(t))
            _, r, _, inf = env_step(env, text)
            out_r.append(r)
            stats["success"].append(float(inf.get("success", False)))
            stats["reward"].append(r)
        return out_r

    batch = args.prompts * args.samples
    cfg = GRPOConfig(
        output_dir=str(out / f"trl-{task}"), use_cpu=True, bf16=False, seed=args.seed,
        per_device_train_batch_size=batch, num_generations=args.samples,
        max_completion_length=(args.max_new_tokens if task == "single"
                               else MULTI_TURNS * (args.max_new_tokens + 16)),
        learning_rate=args.lr, lr_scheduler_type="constant", adam_beta1=0.9, adam_beta2=0.98,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0,
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False)

    step_log = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()
            self.g = stats["gen_time"]
            self.tok = stats["gen_tokens"]
            self.k = len(stats["success"])

        def on_step_end(self, a, state, control, **kw):
            succ = stats["success"][self.k:]
            rew = stats["reward"][self.k:]
            step_log.append({
                "step": state.global_step, "end_time": time.time(),
                "step_time": time.perf_counter() - self.t,
                "gen_time": stats["gen_time"] - self.g, "sync_time": 0.0,
                "gen_tokens": stats["gen_tokens"] - self.tok,
                "success": sum(succ) / len(succ) if succ else None,
                "reward": sum(rew) / len(rew) if rew else None, "episodes": len(succ),
                "torch_threads": torch.get_num_threads()})

    if task == "multi":
        # The trainer hands rollout_func the prompts only; pass the targets beside them by
        # wrapping the generation entry point (the rows carry them).
        trainer = GRPOTrainer(model=model, reward_funcs=[reward_multi], args=cfg,
                              train_dataset=Dataset.from_list(rows), processing_class=tok,
                              rollout_func=rollout_func, callbacks=[Timer()])
        orig = trainer._generate_and_score_completions

        def with_targets(inputs):
            trainer._bench_targets = [x["target"] for x in inputs]
            return orig(inputs)

        trainer._generate_and_score_completions = with_targets
    else:
        trainer = GRPOTrainer(model=model, reward_funcs=[reward_single], args=cfg,
                              train_dataset=Dataset.from_list(rows), processing_class=tok,
                              callbacks=[Timer()])
        # TRL's own generation: time it as the generation phase.
        orig_gen = trainer._generate

        def timed_gen(prompts):
            t0 = time.perf_counter()
            res = orig_gen(prompts)
            stats["gen_time"] += time.perf_counter() - t0
            stats["gen_tokens"] += sum(len(c) for c in res[1])
            return res

        trainer._generate = timed_gen
    t0 = time.time()
    trainer.train()
    for s in step_log:
        s["train_time"] = s["step_time"] - s["gen_time"]
    start = step_log[0]["end_time"] - step_log[0]["step_time"] if step_log else t0
    return {"steps": step_log, "start_time": start, "setup_s": start - t0}


# ====================================================================== the limit
def run_limit(args, model_path: str, task: str, out: Path, ref: dict) -> dict:
    """Raw compute of one step's tokens in one process, one thread: batched KV-cache
    generation of the same turns (prefill of each turn's new tokens, then decode steps at
    the live batch size) plus forward/backward/AdamW over the batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from rollout.demos import make_demos
    from config import compose_config
    from trainer.driver.components import rollout_sections

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="eager")
    config = compose_config(base_overrides(args, model_path, task))
    batch = args.prompts * args.samples
    demos = make_demos(tok, batch, seed=1, **rollout_sections(config))
    # Shape of a step, from the reference run: mean model tokens per episode and turns.
    steps = ref["steps"][1:] or ref["steps"]
    gen_tok = statistics.mean(s["gen_tokens"] for s in steps) / batch
    turns = statistics.mean(s.get("turns") or 1.0 for s in steps)
    n_turns = max(1, round(turns))
    per_turn = max(1, round(gen_tok / turns))
    prompt_len = demos[0].prompt_length
    obs_len = 10

    def gen_pass():
        model.eval()
        with torch.no_grad():
            cache = DynamicCache()
            ids = torch.randint(10, 100, (batch, prompt_len))
            o = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = o.past_key_values
            for t in range(n_turns):
                if t:
                    o = model(input_ids=torch.randint(10, 100, (batch, obs_len)),
                              past_key_values=cache, use_cache=True, logits_to_keep=1)
                    cache = o.past_key_values
                for _ in range(per_turn):
                    probs = torch.softmax(o.logits[:, -1].float(), -1)
                    nxt = torch.multinomial(probs, 1)
                    o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                    cache = o.past_key_values

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    width = max(len(d.tokens) for d in demos)
    ids = torch.zeros(batch, width, dtype=torch.long)
    for r, d in enumerate(demos):
        ids[r, :len(d.tokens)] = torch.tensor(d.tokens)

    def train_pass():
        model.train()
        logits = model(input_ids=ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])
        lp.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def best(fn, k=5):
        fn()
        ts = []
        for _ in range(k):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    g, t = best(gen_pass), best(train_pass)
    return {"gen_time": g, "train_time": t, "step_time": g + t, "turns": n_turns,
            "decode_steps": n_turns * per_turn, "batch": batch, "seq_len": width}


# ====================================================================== summary
def summarize(res: dict, batch: int) -> dict:
    steps = res["steps"]
    body = steps[1:] if len(steps) > 1 else steps
    med = statistics.median(s["step_time"] for s in body)
    tot = sum(s["step_time"] for s in body)
    share = {k: sum(s[k] for s in body) / tot for k in ("gen_time", "train_time", "sync_time")}
    share["overhead"] = 1.0 - sum(share.values())
    eps = sum(s["episodes"] or batch for s in body) / tot
    toks = sum(s["gen_tokens"] for s in body) / tot
    last = [s["success"] for s in steps[-max(1, len(steps) // 4):] if s["success"] is not None]
    first = [s["success"] for s in steps[:max(1, len(steps) // 4)] if s["success"] is not None]
    return {"median_step_s": med, "episodes_per_s": eps, "gen_tokens_per_s": toks,
            "share": share, "success_first_quarter": statistics.mean(first) if first else None,
            "success_last_quarter": statistics.mean(last) if last else None,
            "reward_last_quarter": statistics.mean(
                [s["reward"] for s in steps[-max(1, len(steps) // 4):] if s["reward"] is not None]
                or [float("nan")]),
            "setup_s": res.get("setup_s"), "num_steps": len(steps)}


def parse_systems(spec: str, threads: int) -> list[tuple[str, str, int]]:
    """``--systems``' entries as (label, system, torch threads): ``trl@2`` is TRL at 2."""
    out = []
    for label in spec.split(","):
        name, _, n = label.partition("@")
        if name not in ("homegym", "homegym_async", "trl"):
            raise SystemExit(f"--systems: unknown system {name!r}")
        out.append((label, name, int(n) if n else threads))
    return out


def _name(label: str) -> str:
    return label.partition("@")[0]


def write_report(args, results: dict, out: Path) -> str:
    lines = [f"model `{args.model}`, {args.prompts} prompts x {args.samples} samples = "
             f"{args.prompts * args.samples} episodes/step, {args.max_new_tokens} new tokens/turn, "
             f"{args.steps} steps, homegym {args.engines} engine(s) + {args.ranks} rank(s), "
             f"{args.threads} torch thread(s) per process unless a system says @N", "",
             "| task | system | s/step (median) | s/step, each repeat | episodes/s | gen tok/s "
             "| gen | train | sync | overhead | success first->last quarter | load (1m) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, per in results["tasks"].items():
        for system, r in per.items():
            if system.startswith("_"):
                continue
            s = r["summary"]
            sh = s["share"]
            f = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
            lines.append(
                f"| {task} | {system} | {s['median_step_s']:.3f} | "
                f"{' '.join(f'{x:.3f}' for x in r.get('repeat_step_s', []))} | "
                f"{s['episodes_per_s']:.1f} | "
                f"{s['gen_tokens_per_s']:.0f} | {sh['gen_time']:.0%} | {sh['train_time']:.0%} | "
                f"{sh['sync_time']:.0%} | {sh['overhead']:.0%} | {f(s['success_first_quarter'])}"
                f" -> {f(s['success_last_quarter'])} | {r['load_before'][0] if r['load_before'] else '-'} |")
        lim = per.get("_limit")
        if lim:
            lines.append(f"| {task} | limit (raw fwd/bwd, 1 process) | {lim['step_time']:.3f} | | "
                         f"{args.prompts * args.samples / lim['step_time']:.1f} | | "
                         f"{lim['gen_time'] / lim['step_time']:.0%} | "
                         f"{lim['train_time'] / lim['step_time']:.0%} | | | | |")
    lines.append("")
    for task, per in results["tasks"].items():
        eps = lambda k: per[k]["summary"]["episodes_per_s"]  # noqa: E731
        trls = [k for k in per if _name(k) == "trl"]
        trl = max(trls, key=eps) if trls else None  # TRL at its faster thread count
        for system in per:
            if trl is None or _name(system) not in ("homegym", "homegym_async"):
                continue
            paired = [a / b for a, b in zip(per[system].get("repeat_episodes_per_s", []),
                                            per[trl].get("repeat_episodes_per_s", []))]
            lines.append(f"- {task}: {system}/{trl} episodes/s = {eps(system) / eps(trl):.2f}x" + (
                " (run by run: " + ", ".join(f"{x:.2f}x" for x in paired) + ")"
                if len(paired) > 1 else ""))
        colocated = next((k for k in per if _name(k) == "homegym"), None)
        if colocated is not None and "_limit" in per:
            lines.append(f"- {task}: {colocated} median step / limit = "
                         f"{per[colocated]['summary']['median_step_s'] / per['_limit']['step_time']:.1f}x")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def plot(results: dict, out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    for task, per in results["tasks"].items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for system, r in per.items():
            if system.startswith("_"):
                continue
            xs = [s["end_time"] - r["start_time"] for s in r["steps"]]
            ys = [s["reward"] for s in r["steps"]]
            ax.plot(xs, ys, marker="o", ms=3, label=system)
        ax.set_xlabel("wall time since the first step began (s)")
        ax.set_ylabel("mean episode reward")
        ax.set_title(f"guessing game ({task}-turn), reward vs wall time")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"reward_vs_time_{task}.png", dpi=100)
        plt.close(fig)


def run_worker(cmd: list[str], *, log_path: Path, tail_lines: int = 80) -> None:
    """Run one worker subprocess, echoing its output and keeping all of it in ``log_path``;
    if it fails, the error carries the worker's last lines (the traceback), not only its
    exit code."""
    tail: collections.deque = collections.deque(maxlen=tail_lines)
    with open(log_path, "w") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            tail.append(line)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {' '.join(cmd[-8:])} exited {proc.returncode} "
                           f"(whole output: {log_path}); its last lines:\n{''.join(tail)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--tasks", default="multi,single")
    p.add_argument("--systems", default="homegym,homegym_async,trl",
                   help="any of homegym (colocated, synchronous), homegym_async "
                        "(disaggregated, max_staleness=1), trl; NAME@N runs it with N torch "
                        "threads instead of --threads (trl@1,trl@2: TRL at both counts, "
                        "each homegym system compared with TRL's faster one)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--trl-attn", default="eager",
                   help="attn_implementation of TRL's model; TRL's default, sdpa, measured "
                        "the same here (multi-turn, 2 threads: 0.80 s/step vs eager 0.79-0.90)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every system this many times (interleaved); the report shows "
                        "each system's median run and the range of its runs' s/step")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmup-steps", type=int, default=400)
    p.add_argument("--warmup-batch", type=int, default=32)
    p.add_argument("--warmup-lr", type=float, default=2e-3)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process, both systems (and the limit)")
    p.add_argument("--no-limit", action="store_true")
    p.add_argument("--homegym-override", action="append", default=[],
                   help="extra homegym override (repeatable)")
    p.add_argument("--out", default="outputs/bench_vs_trl")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_task", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_model-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    # Before anything imports torch (here and in the worker subprocesses, which inherit
    # it): OpenMP reads its thread count once.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    if args._worker:  # a subprocess: one system, one task
        fn = {"homegym": run_homegym, "trl": run_trl,
              "homegym_async": functools.partial(run_homegym, overlap=True)}[args._worker]
        res = fn(args, args._model_path, args._task, out)
        Path(args._result).write_text(json.dumps(res))
        return

    model_path = warm_model(args)
    print(f"warm model: {model_path}", flush=True)
    results = {"model": args.model, "warm_model": model_path, "args": vars(args),
               "cpu_count": os.cpu_count(), "tasks": {}}
    base = [sys.executable, str(Path(__file__).resolve())]
    passthrough = [a for a in sys.argv[1:]]
    for task in args.tasks.split(","):
        per = results["tasks"].setdefault(task, {})
        runs: dict[str, list] = {}
        # Repeats interleave the systems, so a slow spell of the machine hits all of them.
        for rep in range(args.repeats):
            for system, name, threads in parse_systems(args.systems, args.threads):
                tag = system.replace("@", "-t")
                res_file = out / f"raw-{tag}-{task}-{rep}.json"
                load = loadavg()
                print(f"== {task} / {system} run {rep + 1}/{args.repeats} (load {load}) ==",
                      flush=True)
                t0 = time.perf_counter()
                run_worker(base + passthrough + ["--threads", str(threads), "--_worker", name,
                                                 "--_task", task, "--_model-path", model_path,
                                                 "--_result", str(res_file)],
                           log_path=out / f"worker-{tag}-{task}-{rep}.log")
                r = json.loads(res_file.read_text())
                r["threads"] = threads
                r["load_before"], r["load_after"] = load, loadavg()
                r["wall_s"] = time.perf_counter() - t0
                r["summary"] = summarize(r, args.prompts * args.samples)
                runs.setdefault(system, []).append(r)
                s = r["summary"]
                print(f"   {system}: {s['median_step_s']:.3f} s/step, {s['episodes_per_s']:.1f} "
                      f"episodes/s, success {s['success_first_quarter']} -> "
                      f"{s['success_last_quarter']}", flush=True)
        for system, rs in runs.items():  # report each system's median run
            median = sorted(rs, key=lambda r: r["summary"]["episodes_per_s"])[len(rs) // 2]
            median["repeat_step_s"] = [r["summary"]["median_step_s"] for r in rs]
            median["repeat_episodes_per_s"] = [r["summary"]["episodes_per_s"] for r in rs]
            per[system] = median
        colocated = next((k for k in per if _name(k) == "homegym"), None)
        if not args.no_limit and colocated is not None:
            per["_limit"] = run_limit(args, model_path, task, out, per[colocated])
    results["load_end"] = loadavg()
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, out)
    print(write_report(args, results, out), flush=True)


if __name__ == "__main__":
    main()
