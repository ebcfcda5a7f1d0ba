"""Adapter-only LoRA pushes (train.lora.push=adapter) to the real SGLang server on CPU
(its torch_native LoRA backend, with homegym's pin-memory shim), behind the real
sglang-router: the engine serves the pushed adapter to homegym's requests, and a run
trains with it.

Same requirements as tests/test_sglang_cpu.py (AVX-512 + AMX, HOMEGYM_SGLANG_PYTHON).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from conftest import compose_config, run_main
from test_sglang_cpu import SGLANG_PYTHON, _skip_reason, forward_logprobs

pytestmark = pytest.mark.slow

if _skip_reason():
    pytest.skip(_skip_reason(), allow_module_level=True)

RANK = 8


def lora_config(*overrides):
    return compose_config("rollout.engine=sglang", "rollout.dtype=bfloat16",
                          f"rollout.sglang_python={SGLANG_PYTHON}", "rollout.num_engines=1",
                          f"train.lora.rank={RANK}", *overrides)


class AdapterPolicy:
    """One training rank in this process: a peft model whose adapter it saves on demand."""

    def __init__(self, model):
        self.model = model

    def save_adapter(self, out_dir):
        self.model.save_pretrained(out_dir)


def trained_adapter(tiny_model_path, seed):
    """The tiny model with LoRA adapters whose B matrices are random (a trained policy)."""
    import peft
    from transformers import AutoModelForCausalLM

    from trainer.training.backends.lora import peft_config

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager")
    model = peft.get_peft_model(model, peft_config(lora_config().train.lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def rollout_generate(router_url, ids):
    """One greedy /generate the way the rollout side sends it (rollout.http.post)."""
    from rollout.http import close_session, post

    async def go():
        try:
            return await post(router_url + "/generate", {
                "input_ids": ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})
        finally:
            await close_session()

    out = asyncio.run(go())
    return (out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
            out["meta_info"]["weight_version"])


def test_adapter_push_serves_the_trained_policy(ray_local, engine_group, tiny_model_path, tmp_path):
    """After each push the engine's greedy log-probs are the pushed policy's (an fp32 peft
    forward, at bf16's level), requests carry the new version, and adapters older than the
    previous push are unloaded; without the adapter name the engine serves the base."""
    from rollout import http
    from trainer.weight_sync.adapter import AdapterSync, adapter_name

    cfg = lora_config()
    group = engine_group(cfg)
    prompt = [5, 6, 7, 8]
    policies = [trained_adapter(tiny_model_path, seed) for seed in (0, 1, 2)]
    sync = AdapterSync(cfg.train, None, group, disk_dir=str(tmp_path / "push"),
                       announce=lambda name: http.LORA_ADAPTER.__setitem__(0, name))
    try:
        for version, policy in enumerate(policies, start=1):
            sync.train_group = AdapterPolicy(policy)
            metrics = sync.push(version)
            assert 0 < metrics["perf/weight_sync_bytes"] < 2**20  # the adapter, not the model
            ids, lps, reported = rollout_generate(group.router_url, prompt)
            assert reported == str(version) and group.weight_versions() == [str(version)]
            gap = (forward_logprobs(policy, prompt, ids) - torch.tensor(lps)).abs().max().item()
            with policy.disable_adapter():
                base_gap = (forward_logprobs(policy, prompt, ids) - torch.tensor(lps)).abs().max().item()
            print(f"\nadapter v{version}: max |SGLang - peft fp32| {gap:.4f}, vs base {base_gap:.4f}")
            assert gap < 0.1 and base_gap > 0.3, (gap, base_gap)
        loaded = group.clients[0].call("/v1/models", method="GET")["data"]
        names = {m["id"] for m in loaded if m["id"].startswith("homegym-v")}
        assert names == {adapter_name(2), adapter_name(3)}  # v1 unloaded, v2 kept for stragglers
        assert sorted(os.listdir(tmp_path / "push")) == ["lora-v3"]
        http.LORA_ADAPTER[0] = None
        ids, lps, _ = rollout_generate(group.router_url, prompt)
        with policies[-1].disable_adapter():
            base = forward_logprobs(policies[-1], prompt, ids)
        assert (base - torch.tensor(lps)).abs().max().item() < 0.1
    finally:
        http.LORA_ADAPTER[0] = None


def test_lora_run_pushes_adapters_to_real_sglang(tmp_path):
    """A LoRA run on real SGLang pushes adapters (auto): the rollout log-probs match the
    trainer's recomputed ones after the policy has moved, at a fraction of the bytes."""
    out = run_main(tmp_path, "rollout.engine=sglang", "rollout.dtype=bfloat16",
                   f"rollout.sglang_python={SGLANG_PYTHON}", "train.num_steps=2",
                   "rollout.num_engines=1", "train.ranks_per_node=1",
                   "warmup.steps=20", "eval.before_and_after=false",
                   f"train.lora.rank={RANK}", "train.lora.alpha=16", "train.lr=2e-2",
                   "train.skip_zero_advantage=false", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                   timeout_s=600)
    steps = [r for r in out.metrics if "rollout/raw_reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # The adapter (two rank-8 matrices per projection), not the model's 1.8 MB.
        assert 0 < r["perf/weight_sync_bytes"] < 2**20, r["perf/weight_sync_bytes"]
        # Every sample trains (skip_zero_advantage off), so every step reports the gap
        # between the engine's log-probs and the trainer's: the warmed-up adapter serves
        # from step 1 on (the base model's would differ by far more).
        print(f"step {r['step']}: rollout/trainer log-prob gap "
              f"{r['mismatch/logprob_abs_diff']:.4f}, sync {r['perf/weight_sync_time']:.2f}s")
        assert r["mismatch/logprob_abs_diff"] < 0.05
