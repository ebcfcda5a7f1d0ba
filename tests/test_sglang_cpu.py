"""The real SGLang server (the pinned version's Python server, with its CPU kernels) behind
the real sglang-router, started by homegym's own SGLang engine actor: the launch code GPU
users run, with ``--device cpu``.

Needs a CPU with AVX-512 and AMX and the SGLang venv that scripts/install_sglang_cpu.sh
makes (``HOMEGYM_SGLANG_PYTHON`` names its interpreter; .ci/run sets it where the CPU
allows). SGLang's CPU kernels serve bfloat16 only, so the engines run bf16 beside an fp32
trainer: log-probs agree at bf16's level, not at the CPU engine's 1e-4.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal

import pytest
import requests
import torch

from conftest import compose_config, push_tensors, run_main
from rollout.engines.actor import SGLANG_CPU_LOADERS
from rollout.engines.sglang_serving import missing_cpu_flags
from trainer.driver import components

pytestmark = pytest.mark.slow

SGLANG_PYTHON = os.environ.get("HOMEGYM_SGLANG_PYTHON", "")


def _skip_reason() -> str | None:
    missing = missing_cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(missing)}: SGLang's CPU kernels need AVX-512 and AMX"
    if not SGLANG_PYTHON or not os.path.exists(SGLANG_PYTHON):
        return ("HOMEGYM_SGLANG_PYTHON is not set to the interpreter of an SGLang venv "
                "(bash scripts/install_sglang_cpu.sh .venv-sglang <kernel wheel or source>)")
    return None


if _skip_reason():
    pytest.skip(_skip_reason(), allow_module_level=True)


def sglang_config(*overrides):
    return compose_config("rollout.engine=sglang", "rollout.dtype=bfloat16",
                          f"rollout.sglang_python={SGLANG_PYTHON}", "rollout.num_engines=1",
                          *overrides)


@pytest.fixture(scope="module")
def group(ray_local, tiny_model_path, tmp_path_factory):
    g = components.engine_group(sglang_config(), model_path=tiny_model_path,
                                log_dir=str(tmp_path_factory.mktemp("sglang")))
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager").eval()


def greedy(url, ids, n=8):
    r = requests.post(url + "/generate", timeout=120, json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def forward_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_real_server_behind_the_router_reports_the_pinned_version(group):
    from rollout.engines import PINNED_SGLANG_VERSION

    client = group.clients[0]
    assert client.version() == PINNED_SGLANG_VERSION
    assert client.server_info()["device"] == "cpu"
    assert group.weight_versions() == ["default"]
    assert group.router.healthy_urls() == set(group.urls)
    r = requests.post(group.router_url + "/generate", timeout=120, json={
        "input_ids": [3, 4, 5], "return_logprob": True,
        # ignore_eos: the random tiny model samples its eos within 4 tokens ~0.8% of the time
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    meta = r.json()["meta_info"]
    entry = meta["output_token_logprobs"][0]  # SGLang's [logprob, token_id, text] triples
    assert len(entry) == 3 and isinstance(entry[0], float) and isinstance(entry[1], int)
    assert meta["weight_version"] == "default" and meta["finish_reason"]["type"] == "length"


def test_an_idle_server_leaves_the_cpu_to_training(group):
    """Between rollouts (a colocated run's training phase) the server's processes wait,
    and the flushes the loop makes there cost little: SGLang's scheduler polls its sockets
    in a busy loop unless told to sleep, and on CPU every flush runs a full garbage
    collection, which walks all of torch's and SGLang's objects unless they were frozen
    (homegym's launch asks for both)."""
    import time

    import psutil
    import ray

    greedy(group.router_url, [3, 4, 5], n=2)  # it served just now; the window starts idle
    server = psutil.Process(ray.get(group.engines[0].pid.remote()))
    procs = [server] + server.children(recursive=True)
    assert len(procs) >= 3  # the launcher, its scheduler and detokenizer

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    before, start = cpu_seconds(), time.monotonic()
    time.sleep(3.0)  # the measured window: the router's health checks are all it serves
    used = (cpu_seconds() - before) / (time.monotonic() - start)
    # Busy-polling: ~1.0 CPU-s a second; asleep: the health checks' few ms.
    assert used < 0.25, f"the idle server used {used:.2f} CPU-s a second"
    before = cpu_seconds()
    for _ in range(5):
        group.clients[0].flush_cache()
    used = cpu_seconds() - before
    # Unfrozen: ~0.36 CPU-s a flush (Intel Xeon); frozen: ~0.01. (SGLang's own freeze
    # lands in some starts: without homegym's this fails in the others; test_engine_hf
    # checks homegym's request on every start.)
    assert used < 0.6, f"5 flushes of the idle server took {used:.2f} CPU-s"


def test_a_hang_dump_reaches_the_servers_scheduler(group, tmp_path):
    """The watchdog's stack dumps (a hang's diagnosis) cover the processes SGLang spawns,
    the scheduler where a stuck generation waits among them, not only its launcher."""
    from trainer.driver.watchdog import dump_stacks, run_processes

    spawned = [(pid, t) for pid, t in run_processes(os.getpid()) if t.startswith("sglang::")]
    assert any(t.startswith("sglang::scheduler") for _, t in spawned), spawned
    written = dump_stacks(tmp_path, spawned, driver_pid=os.getpid())
    scheduler = [p.read_text() for p in written if p.name.startswith("sglang::scheduler")]
    assert scheduler and "scheduler.py" in scheduler[0], scheduler


def rollout_step(group, *overrides):
    """One step of the rollout manager (2 prompts x 2 games) against the group's router."""
    from rollout.http import close_session
    from rollout.manager import RolloutManagerCore

    cfg = sglang_config("rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                        "rollout.max_response_len=8", *overrides)

    async def step():
        try:
            return await RolloutManagerCore(router_url=group.router_url,
                                            **components.manager_args(cfg)).generate(1)
        finally:
            await close_session()

    return asyncio.run(step())


def test_guessing_game_through_the_rollout_manager(group, hf_model):
    """Multi-turn episodes on the real server: masks mark exactly the engine's tokens (their
    log-probs, recomputed by an fp32 forward over the sample's tokens, agree with SGLang's
    at bf16's level), and the per-token log-probs arrive in SGLang's format."""
    batch = rollout_step(group)
    assert len(batch) == 4
    gaps = []
    for tokens, n, mask, lps in zip(batch.tokens, batch.response_lengths, batch.loss_masks,
                                    batch.rollout_log_probs):
        assert len(mask) == len(lps) == n and sum(mask) > 0
        # Environment tokens (a later turn's observation) carry no log-prob; an untrained
        # model's episode may also end after its first turn (a format error).
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
        prompt = tokens[:len(tokens) - n]
        full = forward_logprobs(hf_model, prompt, tokens[len(prompt):])
        model_positions = [i for i, m in enumerate(mask) if m]
        gaps += [abs(full[i].item() - lps[i]) for i in model_positions]
    gaps = torch.tensor(gaps)
    print(f"\nSGLang bf16 vs trainer fp32 log-probs over {len(gaps)} model tokens: "
          f"mean |diff| {gaps.mean():.4f}, max {gaps.max():.4f}")
    assert gaps.mean() < 0.05 and gaps.max() < 0.5  # bf16 rounding, not misplaced tokens


def test_seed_custom_generate_function_unchanged(group):
    batch = rollout_step(group,
                         "rollout.custom_generate_function=examples.number_guess_seed:number_guess_generate",
                         "rollout.custom_rm_function=examples.number_guess_seed:number_guess_rm")
    assert len(batch) == 4 and "failed" not in batch.statuses
    assert all(sum(m) > 0 for m in batch.loss_masks)


def test_pause_abort_continue(group):
    """A request that is decoding (its first streamed chunk has arrived) is aborted by
    pause_generation(abort); after continue_generation the server generates again."""
    client = group.clients[0]
    with requests.post(group.router_url + "/generate", stream=True, timeout=300, json={
            "input_ids": [1, 2, 3], "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
        lines = (line for line in r.iter_lines() if line.startswith(b"data:") and b"[DONE]" not in line)
        first = json.loads(next(lines)[5:])
        assert "error" not in first, first  # decoding now
        try:
            client.pause_generation("abort")
            last = json.loads(list(lines)[-1][5:])
        finally:
            client.continue_generation()
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400
    ids, _ = greedy(group.router_url, [1, 2, 3], n=2)
    assert len(ids) == 2


def _perturbed(tiny_model_path):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    # Matrices, and a Gated DeltaNet layer's (out, 1, kernel) causal-conv weights (packed
    # apart from the matrices on SGLang's CPU backend); not norms or biases.
    return {n: (t + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
            if t.dim() == 2 or "conv1d" in n else t for n, t in sd.items()}


@pytest.mark.parametrize("path", ["disk", "tensor", "distributed"])
def test_weight_push_is_verified_by_the_next_generation(group, tiny_model_path, tmp_path, path):
    """After a push through each of SGLang's three routes the next greedy generation is the
    pushed model's (its log-probs equal an fp32 forward of those weights at bf16's level);
    pushing the original weights back restores the original output exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.weight_sync.push import PushPlan, join_broadcast_group, send_weights
    from rollout.engines import free_port

    client = group.clients[0]
    prompt = [5, 6, 7, 8]
    client.flush_cache()
    before_ids, _ = greedy(group.router_url, prompt)
    new = _perturbed(tiny_model_path)
    original = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    plan = PushPlan(mode=path, version=11, targets=tuple(group.targets()), bucket_bytes=1 << 16,
                    dtype="bfloat16", device="cpu", flush_cache=True, disk_dir=str(tmp_path),
                    group_names=(f"cpu-{path}",), loaders=SGLANG_CPU_LOADERS)
    weight_groups = []
    if path == "distributed":
        weight_groups = [join_broadcast_group(plan.targets[0], "127.0.0.1", free_port(),
                                              plan.group_names[0], "gloo")]
    send_weights([sorted(new.items())], plan, rank=0, world_size=1, weight_groups=weight_groups)
    assert client.weight_version() == "11"
    after_ids, after_lps = greedy(group.router_url, prompt)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager")
    model.load_state_dict({**model.state_dict(), **{n: t.float() for n, t in new.items()}})
    want = forward_logprobs(model.eval(), prompt, after_ids)
    gap = (want - torch.tensor(after_lps)).abs().max().item()
    print(f"\n{path} push: max |SGLang bf16 - fp32 forward| = {gap:.4f}")
    assert gap < 0.1, gap
    send_weights([sorted(original.items())], dataclasses.replace(plan, version=12),
                 rank=0, world_size=1, weight_groups=weight_groups)
    if weight_groups:
        client.destroy_weights_update_group(plan.group_names[0])
        torch.distributed.destroy_process_group(weight_groups[0])  # leave this process as it was
    client.flush_cache()
    assert greedy(group.router_url, prompt)[0] == before_ids


def test_in_place_update_without_repacking_is_the_known_fault(group, tiny_model_path):
    """Why homegym's loaders exist: the stock tensor route writes plain values into AMX-
    packed weights, so even pushing the model's own weights changes its output."""
    from safetensors.torch import load_file

    from trainer.weight_sync.push import PushPlan, send_weights

    client = group.clients[0]
    prompt = [9, 10, 11, 12]
    client.flush_cache()
    before, _ = greedy(group.router_url, prompt)
    original = sorted(load_file(os.path.join(tiny_model_path, "model.safetensors")).items())
    push_tensors(client, original, version="stock")  # load_format None: SGLang's own loader
    client.flush_cache()
    corrupted, _ = greedy(group.router_url, prompt)
    plan = PushPlan(mode="tensor", version=13, targets=tuple(group.targets()), bucket_bytes=1 << 30,
                    dtype="bfloat16", device="cpu", flush_cache=True, loaders=SGLANG_CPU_LOADERS)
    send_weights([original], plan, rank=0, world_size=1)
    client.flush_cache()
    assert corrupted != before
    assert greedy(group.router_url, prompt)[0] == before


def test_killed_engine_is_restarted_registered_and_given_the_weights(group, tiny_model_path):
    import ray

    from trainer.weight_sync.push import send_weights

    cfg = sglang_config()
    new = sorted(_perturbed(tiny_model_path).items())

    class Policy:  # one training rank in this process, sending the perturbed weights
        def send_weights(self, plan):
            return send_weights([new], plan, rank=0, world_size=1)

    sync = components.weight_sync(cfg, Policy(), group)
    sync.push(21)
    expected, _ = greedy(group.router_url, [2, 3, 4])
    os.kill(ray.get(group.engines[0].pid.remote()), signal.SIGKILL)
    metrics = group.recover(push_weights=lambda view: sync.push(21, engines=view))
    assert metrics["rollout/engines_restarted_now"] == 1.0
    assert group.health() == [True] and group.weight_versions() == ["21"]
    assert group.router.healthy_urls() == set(group.urls)
    assert greedy(group.router_url, [2, 3, 4])[0] == expected


def test_default_recipe_trains_colocated_on_real_sglang(tmp_path):
    # One engine: the claim (the colocated loop on the real server: release, resume, push,
    # generate) is the same with two, which took this test 104-113 s alone against 63 s
    # (Intel Xeon, 2 cores).
    out = run_main(tmp_path, "rollout.engine=sglang", "rollout.dtype=bfloat16",
                   f"rollout.sglang_python={SGLANG_PYTHON}", "rollout.num_engines=1",
                   "train.num_steps=3",
                   "warmup.steps=20", "warmup.lr=3e-3", "eval.before_and_after=false",
                   "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                   timeout_s=600)
    steps = [r for r in out.metrics if "rollout/raw_reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # A step whose groups all scored alike trains no sample (train.skip_zero_advantage),
    # so it has no gap to report; the others must show a small one. (The warm-up's lr is
    # test_loop's: at the default a warmed-up policy's groups often all score alike.)
    gaps = [r for r in steps if "mismatch/logprob_abs_diff" in r]
    assert gaps, "no step trained a sample"
    for r in gaps:
        print(f"step {r['step']}: rollout/trainer log-prob gap "
              f"{r['mismatch/logprob_abs_diff']:.4f}, sync {r['perf/weight_sync_time']:.2f}s")
        assert r["mismatch/logprob_abs_diff"] < 0.05


# ---- Qwen3.5 (hybrid: Gated DeltaNet + gated attention) --------------------------------

# SGLang 0.5.18's CPU path for Qwen3.5: its sgl_kernel ops for the GDN conv, chunked and
# recurrent rule, gated norm and fused input projection; the state pool with the radix
# cache in no_buffer mode (the launch disables the overlap scheduler on CPU); homegym's
# re-pack loaders for the conv and for a projection packed to another shape.
@pytest.fixture(scope="module")
def q35_group(ray_local, tiny_qwen3_5_path, tmp_path_factory):
    g = components.engine_group(sglang_config("model.path=tiny-qwen3_5"),
                                model_path=tiny_qwen3_5_path,
                                log_dir=str(tmp_path_factory.mktemp("sglang-q35")))
    yield g
    g.shutdown()


def test_qwen3_5_serves_text_only_with_its_state_pool_and_is_flushed_after_a_push(
        q35_group, tiny_qwen3_5_path):
    """tiny-qwen3_5 (the vision-language checkpoint layout) on the real server: started
    from the text-only view with the state pool homegym sized; greedy outputs are the
    model's at bf16's level; a second turn may reuse the radix cache; a push (tensors named
    as the checkpoint, through homegym's re-packing loaders) followed by the flush every
    hybrid push ends with serves the new weights and nothing cached under the old ones."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rollout.checkpoints import read_config
    from rollout.engines.sglang_serving import cpu_state_slots
    from trainer.weight_sync.push import PushPlan, send_weights

    client = q35_group.clients[0]
    info = client.server_info()
    assert "sglang-text-only" in info["model_path"]
    assert info["max_mamba_cache_size"] == cpu_state_slots(
        read_config(tiny_qwen3_5_path), 65536, "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path).eval()
    prompt = list(range(20, 60))
    ids, lps = greedy(q35_group.router_url, prompt, n=8)
    gap = (forward_logprobs(model, prompt, ids) - torch.tensor(lps)).abs().max().item()
    print(f"\nQwen3.5 on SGLang-CPU bf16 vs fp32 forward: max |diff| {gap:.4f}")
    assert gap < 0.1, gap
    turn2 = prompt + ids + [7, 8]

    def cached(ids_in):
        r = requests.post(q35_group.router_url + "/generate", timeout=120, json={
            "input_ids": ids_in, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        return r.json()["meta_info"]["cached_tokens"]

    print(f"second turn: {cached(turn2)} cached tokens")
    original = load_file(os.path.join(tiny_qwen3_5_path, "model.safetensors"))
    new = _perturbed(tiny_qwen3_5_path)
    plan = PushPlan(mode="tensor", version=31, targets=tuple(q35_group.targets()),
                    bucket_bytes=1 << 16, dtype="bfloat16", device="cpu", flush_cache=True,
                    loaders=SGLANG_CPU_LOADERS)
    send_weights([sorted(new.items())], plan, rank=0, world_size=1)
    assert client.weight_version() == "31"
    assert cached(turn2) == 0  # the flush dropped every state computed with the old weights
    after_ids, after_lps = greedy(q35_group.router_url, prompt, n=8)
    text = {k.replace("model.language_model.", "model."): v.float() for k, v in new.items()
            if k.startswith("model.language_model.")}
    text["lm_head.weight"] = text["model.embed_tokens.weight"]  # tied
    model.load_state_dict({**model.state_dict(), **text})
    gap = (forward_logprobs(model, prompt, after_ids) - torch.tensor(after_lps)).abs().max()
    assert gap < 0.1, gap
    send_weights([sorted(original.items())], dataclasses.replace(plan, version=32),
                 rank=0, world_size=1)
    assert greedy(q35_group.router_url, prompt, n=8)[0] == ids
