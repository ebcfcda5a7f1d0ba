"""The FSDP backend on a hybrid model (tiny-qwen3_5: Gated DeltaNet + gated attention):
its log-probs and gradients, in the shared-prefix layout (each group's prefix runs once and
its GDN states seed the packed suffixes) and in the padded layout, equal transformers'
own forward of each sample alone.

The backend runs one rank in a child process (its gloo process group stays out of the
pytest process). Tolerances: log-probs 1e-5 (fp32) against transformers in fp32, which
itself is within ~1e-6 of the same forward in fp64 (asserted below); a dropped state or a
conv leak moves log-probs by 1e-2 .. 1e-1. Gradients, against the fp64 forward: 1e-3 of each
tensor's largest entry, which transformers' own fp32 gradients meet too (their error reaches
2.4e-4 of it for the small gradients of the decay parameters A_log and dt_bias).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from train_batches import make_batch, make_config

TESTS = Path(__file__).resolve().parent


def _batch():
    # Groups whose samples share a first turn (common_start) and responses long enough
    # to cross the GDN's 64-token chunks; a budget that splits a group across micro-batches.
    return make_batch(num_groups=2, group_size=3, prompt_len=(10, 20), response_len=(5, 80),
                      vocab=450, seed=3, common_start=4)


def _weights(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r, generator=g) for r in batch.response_lengths]


def _backend_child(out: str) -> None:
    """Child: per layout, log-probs (eval) and the gradient of sum(w * log-probs) (train)."""
    import torch.distributed as dist

    from rollout.modeling.hybrid import HomegymGatedDeltaNet
    from rollout.models import resolve_model_path
    from trainer.driver import components
    from trainer.training.backends.fsdp import FSDPBackend
    from trainer.driver.checkpoint import export_hf

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    batch, weights = _batch(), _weights(_batch())
    res = {}
    for share in (True, False):
        b = FSDPBackend()
        b.init(rank=0, world_size=1, **components.backend_args(make_config(
            model={"path": "tiny-qwen3_5"},
            train={"share_prompts": share, "max_tokens_per_micro_batch": 300})))
        plan = b._plan(batch, None)[0]
        mbs = [b._micro_batch(batch, ids) for ids in plan]
        res[share] = {"hybrid": b.hybrid, "log_probs": b.log_probs(batch),
                      "layouts": [mb.shared is not None for mb in mbs],
                      "split": max(len(mb.sample_ids) for mb in mbs) < len(batch.tokens)}
        b.model.train()
        for mb in mbs:
            logp, _ = b._forward(b.model, mb, with_entropy=False)
            w = torch.cat([weights[i] for i in mb.sample_ids])
            (logp * w).sum().backward()
        res[share]["grads"] = {n: p.grad.full_tensor().clone() for n, p in b.model.named_parameters()}
    # bf16 compute: the GDN's A_log stays fp32 (its own FSDP unit), the projections go bf16.
    seen = []
    b16 = FSDPBackend()
    b16.init(rank=0, world_size=1, **components.backend_args(make_config(
        model={"path": "tiny-qwen3_5", "dtype": "bfloat16"},
        train={"max_tokens_per_micro_batch": 300})))
    gdn = next(m for m in b16.model.modules() if isinstance(m, HomegymGatedDeltaNet))
    # Each FSDP unit casts its parameters in its own pre-forward: the GDN unit's (A_log,
    # dt_bias) as the layer starts, a projection's as the projection starts.
    gdn.register_forward_pre_hook(lambda m, args: seen.append((m.A_log.dtype, m.dt_bias.dtype)))
    gdn.in_proj_qkv.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    res["bf16_log_probs"] = b16.log_probs(batch)
    res["bf16_dtypes"] = (*seen[0], seen[1])
    # The policy after one optimizer step (differs from the base), exported and pushed.
    b._optimizer_step()
    buckets = list(b.named_weight_buckets(1 << 16))
    export_hf(buckets, resolve_model_path("tiny-qwen3_5"), Path(out).parent / "hf")
    res["trained"] = {n: t for bucket in buckets for n, t in bucket}
    res["bf16"] = {n: t for bucket in b.named_weight_buckets(1 << 16, dtype=torch.bfloat16)
                   for n, t in bucket}
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def backend_results(tmp_path_factory, tiny_qwen3_5_path):
    out = tmp_path_factory.mktemp("q35") / "res.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]),
               OMP_NUM_THREADS="1")
    code = f"import test_fsdp_qwen3_5 as t; t._backend_child({str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {**torch.load(out, weights_only=False), "hf_dir": out.parent / "hf"}


def _reference(path, dtype):
    """Per-sample log-probs and gradients from transformers' own model (its torch GDN); in
    fp64 with homegym's GDN, which stays in fp64 where transformers' computes in fp32 (the
    float-noise yardstick)."""
    from transformers import AutoModelForCausalLM

    from rollout.modeling.hybrid import use_homegym_gdn

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if dtype == torch.float64:
        use_homegym_gdn(model)
    model.train()
    batch = _batch()
    log_probs = []
    for toks, r, w in zip(batch.tokens, batch.response_lengths, _weights(batch)):
        ids = torch.tensor([toks])
        logits = model(input_ids=ids).logits[0, -r - 1:-1]
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, -r:, None])[:, 0]
        (lp * w.to(dtype)).sum().backward()
        log_probs.append(lp.detach())
    return log_probs, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
def test_hybrid_log_probs_and_gradients_equal_transformers_per_sample(backend_results,
                                                                      tiny_qwen3_5_path):
    ref_lp, ref_grads = _reference(tiny_qwen3_5_path, torch.float32)
    lp64, grads64 = _reference(tiny_qwen3_5_path, torch.float64)
    noise = max(float((a.double() - b).abs().max()) for a, b in zip(ref_lp, lp64))
    assert noise < 1e-5  # the bound below is above float noise
    for share in (True, False):
        res = backend_results[share]
        assert res["hybrid"] and all(s == share for s in res["layouts"])
        assert res["split"]  # several micro-batches: a group's samples do not all share one
        for got, want in zip(res["log_probs"], ref_lp):
            assert (got - want).abs().max() <= 1e-5, share
        assert set(res["grads"]) == set(ref_grads)
        for name, exact in grads64.items():
            bound = 1e-3 * float(exact.abs().max())
            # transformers' own fp32 gradient is within the bound (float noise: up to 2.4e-4
            # of the largest entry here, for the small decay-parameter gradients) ...
            assert (ref_grads[name].double() - exact).abs().max() <= bound, name
            # ... and so is the backend's.
            assert (res["grads"][name].double() - exact).abs().max() <= bound, (share, name)


@pytest.mark.slow
def test_export_is_a_full_qwen3_5_checkpoint_and_pushes_keep_a_log_fp32(
        backend_results, tiny_qwen3_5_path):
    """The trained text model comes out under model.language_model. next to the base's
    vision tower and MTP layer (verbatim), loads as Qwen3_5ForConditionalGeneration with
    nothing missing or unexpected, embeddings still tied; a bf16 push keeps A_log fp32."""
    from safetensors import safe_open
    from transformers import Qwen3_5ForConditionalGeneration

    from trainer.driver.hf_export import base_tensor_files

    trained = backend_results["trained"]
    out = backend_results["hf_dir"]
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    state = model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state["model.language_model." + name[len("model."):]], tensor), name
    base = base_tensor_files(tiny_qwen3_5_path)
    with safe_open(str(out / "model.safetensors"), "pt") as exported, safe_open(
            str(Path(tiny_qwen3_5_path) / "model.safetensors"), "pt") as src:
        assert set(exported.keys()) == set(base)
        changed = [n for n in base if not torch.equal(exported.get_tensor(n), src.get_tensor(n))]
        copied = [n for n in base if n.startswith(("model.visual.", "mtp."))]
        assert copied and not set(changed) & set(copied)
        assert len(changed) > len(trained) // 2  # the trained ones did change
    bf16 = backend_results["bf16"]
    assert set(bf16) == set(trained)
    for name, tensor in bf16.items():
        keep = name.endswith(".A_log")
        assert tensor.dtype == (torch.float32 if keep else torch.bfloat16), name
        assert torch.equal(tensor, trained[name] if keep else trained[name].bfloat16()), name


@pytest.mark.slow
def test_bf16_training_keeps_the_decay_rate_fp32(backend_results, tiny_qwen3_5_path):
    """model.dtype=bfloat16: the projections compute in bf16, A_log in fp32 (as engines
    and checkpoints hold it); log-probs stay within bf16 rounding of the fp32 ones."""
    a_log, dt_bias, proj = backend_results["bf16_dtypes"]
    assert (a_log, proj) == (torch.float32, torch.bfloat16)
    for got, want in zip(backend_results["bf16_log_probs"], backend_results[True]["log_probs"]):
        assert (got - want).abs().max() < 0.1  # bf16 noise here; a broken GDN is off by ~1
