"""The CPU engine's own kernels against the torch math they replace: the C decode attention
(on the slot cache's layouts: strided K/V windows, left padding, holes), the C rotary
embedding, the oneDNN-packed matmuls, and the token draws."""

import os
import platform
import subprocess
import sys
import time

import pytest
import torch

from rollout.engines.hf import fast_kernels, native, packed_linear
from rollout.engines.hf.batcher import draw, sample_plain

MASKED = torch.finfo(torch.float32).min


def slot_layout(b, hkv, g, t, d, seed=0):
    """q [b, hkv*g, 1, d]; K/V as views of a window [c0, c0 + t) of larger slot buffers;
    an additive mask [b, 1, 1, t + 3] whose rows start at different columns and have holes."""
    gen = torch.Generator().manual_seed(seed)
    kbuf = torch.randn(b + 2, hkv, t + 9, d, generator=gen)
    vbuf = torch.randn(b + 2, hkv, t + 9, d, generator=gen)
    k, v = kbuf[:b, :, 4:4 + t], vbuf[:b, :, 4:4 + t]
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    allow = torch.rand(b, t, generator=gen) > 0.25
    starts = torch.randint(0, t, (b,), generator=gen)
    allow &= torch.arange(t)[None, :] >= starts[:, None]  # left padding
    allow[:, -1] = True  # every row attends at least to its newest token
    mask = torch.zeros(b, 1, 1, t + 3).masked_fill_(
        ~torch.nn.functional.pad(allow, (0, 3), value=True)[:, None, None], MASKED)
    return q, k, v, mask


@pytest.mark.parametrize("b,hkv,g,t,d", [(64, 2, 2, 150, 32), (7, 3, 3, 33, 64),
                                         (3, 1, 4, 9, 128), (5, 2, 1, 1, 16), (4, 2, 3, 20, 12)])
def test_native_decode_attention_equals_folded_torch_attention(b, hkv, g, t, d):
    assert native.load() is not None, "the C kernels did not build (is a C compiler installed?)"
    q, k, v, mask = slot_layout(b, hkv, g, t, d)
    got, _ = fast_kernels.gqa_attention_forward(None, q, k, v, mask, scaling=d ** -0.5)
    want = fast_kernels.folded_attention(q, k, v, mask, d ** -0.5)
    assert got.shape == want.shape == (b, 1, hkv * g, d)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()
    # Masked columns are not read: poisoning them changes nothing.
    k2, v2 = k.clone(), v.clone()
    hidden = (mask[:, 0, 0, :t] == MASKED)[:, None, :, None].expand_as(k2)
    k2[hidden], v2[hidden] = float("nan"), float("nan")
    again, _ = fast_kernels.gqa_attention_forward(None, q, k2, v2, mask, scaling=d ** -0.5)
    assert torch.equal(again, got)


@pytest.mark.parametrize("lengths,hkv,g,d", [([1, 37, 8, 160, 2], 2, 2, 32), ([64, 3, 90], 3, 3, 64),
                                              ([5, 1, 40], 1, 4, 128), ([9, 17], 2, 3, 12)])
def test_native_varlen_causal_attention_equals_sdpa_per_sequence(lengths, hkv, g, d):
    """Fresh prompts packed end to end, each causally to itself only (a prefill's packed
    layout), against one causal SDPA call per prompt."""
    assert native.load() is not None, "the C kernels did not build (is a C compiler installed?)"
    gen = torch.Generator().manual_seed(1)
    n = sum(lengths)
    q, k, v = (torch.randn(n, heads, d, generator=gen) for heads in (hkv * g, hkv, hkv))
    bounds = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    got = fast_kernels.varlen_causal_attention(q, k, v, bounds, d ** -0.5)
    assert got is not None and got.shape == q.shape
    for s, e in zip(bounds.tolist(), bounds.tolist()[1:]):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
            scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
        # Float32 softmax-weighted sums in another order: measured within 1.3e-6.
        assert torch.allclose(got[s:e], want, atol=5e-6, rtol=1e-5), (got[s:e] - want).abs().max()
    assert fast_kernels.varlen_causal_attention(q.double(), k.double(), v.double(), bounds,
                                                d ** -0.5) is None


def test_native_silu_mul_equals_silu_times_up():
    """gate = silu(gate) * up in place, against float64, over the range where exp saturates."""
    gen = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.tensor([-200.0, -88.5, -87.0, -20.0, 0.0, 20.0, 87.0, 88.5, 200.0]),
                      torch.randn(64 * 384 - 9, generator=gen) * 6])
    up = torch.randn_like(gate)
    want = torch.nn.functional.silu(gate.double()) * up.double()
    got = gate.clone()
    assert fast_kernels.silu_mul_(got, up)
    # The polynomial exp is within ~2 ulp; torch's own float32 silu * up is within ~2e-7.
    err = (got.double() - want).abs().max()
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-30), err
    assert not fast_kernels.silu_mul_(gate.double(), up.double())


@pytest.mark.parametrize("b,t,h,hkv,d", [(1, 300, 9, 3, 64), (64, 1, 4, 2, 32), (2, 3, 2, 1, 6)])
def test_native_rope_is_transformers_rope_bitwise(b, t, h, hkv, d):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(b, t, h, d, generator=gen), torch.randn(b, t, hkv, d, generator=gen)
    angles = torch.randn(b, t, d, generator=gen) * 10
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert fast_kernels.rope_(q, k, cos, sin)  # in place
    assert torch.equal(q.transpose(1, 2), want_q) and torch.equal(k.transpose(1, 2), want_k)
    assert not fast_kernels.rope_(q.double(), k.double(), cos.double(), sin.double())


@pytest.mark.parametrize("shape", [(64, 1, 4, 32), (1, 300, 576), (3, 7)])
def test_native_rms_norm_equals_the_llama_familys_norm(shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
        x = torch.randn(shape, generator=gen) * 3
        want = norm(x)
        got = fast_kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
        assert got is not None and got.shape == x.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
        same = x.clone()
        assert fast_kernels.rms_norm(same, norm.weight, 1e-6, out=same) is same
        assert torch.equal(same, got)
        assert fast_kernels.rms_norm(x.double(), norm.weight.double(), 1e-6) is None


@pytest.mark.subprocess
def test_native_kernels_can_be_switched_off(tmp_path):
    """HOMEGYM_NATIVE_KERNELS=0 keeps the torch path (and builds nothing)."""
    code = ("from rollout.engines.hf import native, packed_linear; import sys; "
            "sys.exit(0 if native.load() is None and not packed_linear.available() else 1)")
    env = {"HOMEGYM_NATIVE_KERNELS": "0", "HOMEGYM_CACHE": str(tmp_path), "PATH": "/usr/bin"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=native.SOURCE.parents[4])
    assert not (tmp_path / "kernels").exists()


def _build_in_subprocess(cache, march=None) -> tuple[str, float]:
    """Build (or find) the kernels in a fresh process with ``HOMEGYM_NATIVE_MARCH=march``:
    the library's path ('' when load() gave None) and the C RMSNorm's largest difference
    from torch's on a random batch (nan without the kernels)."""
    code = ("import sys, torch; from rollout.engines.hf import native, fast_kernels; "
            "lib = native.load(); x, w = torch.randn(64, 576), torch.randn(576); "
            "got = fast_kernels.rms_norm(x, w, 1e-6); "
            "want = torch.nn.functional.rms_norm(x, (576,), w, 1e-6); "
            "print(lib._name if lib else '', "
            "float('nan') if got is None else float((got - want).abs().max()))")
    env = dict(os.environ, HOMEGYM_CACHE=str(cache))
    env.pop("HOMEGYM_NATIVE_MARCH", None)
    if march:
        env["HOMEGYM_NATIVE_MARCH"] = march
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, text=True,
                         capture_output=True, cwd=native.SOURCE.parents[4]).stdout.split()
    return (out[0], float(out[1])) if len(out) == 2 else ("", float(out[0]))


@pytest.mark.subprocess
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 target")
def test_the_kernels_build_for_another_target_when_asked(tmp_path):
    """HOMEGYM_NATIVE_MARCH=haswell builds AVX2 kernels (256-bit vectors, no AVX-512 zmm
    register anywhere in the library) into a cache entry of their own beside this CPU's
    build, and they compute what torch does; a target the compiler does not know leaves
    the engine on its torch path."""
    avx2, avx2_err = _build_in_subprocess(tmp_path, "haswell")
    here, here_err = _build_in_subprocess(tmp_path)
    assert avx2 and here and os.path.dirname(avx2) != os.path.dirname(here)
    assert avx2_err < 1e-5 and here_err < 1e-5, (avx2_err, here_err)

    def disassembly(lib: str) -> str:
        return subprocess.run(["objdump", "-d", lib], check=True, text=True,
                              capture_output=True).stdout

    assert "%ymm" in disassembly(avx2) and "%zmm" not in disassembly(avx2)
    with open("/proc/cpuinfo") as f:
        if " avx512f" in f.read():  # this CPU's own build uses them
            assert "%zmm" in disassembly(here)
    lib, err = _build_in_subprocess(tmp_path, "no-such-cpu")
    assert lib == "" and err != err  # no kernels: the torch path (rms_norm gives None)


@pytest.mark.subprocess
def test_a_build_clears_what_killed_builds_left_and_keeps_a_concurrent_ones(tmp_path):
    """A build killed outright leaves its temporary library beside the target; the next
    build removes such leftovers, but not a file young enough to be another build's."""
    out = tmp_path / "kernels" / "key" / "libhomegym_kernels.so"
    out.parent.mkdir(parents=True)
    killed, running = out.parent / "tmpkilled.so", out.parent / "tmprunning.so"
    for f in (killed, running):
        f.write_bytes(b"partial")
    old = time.time() - 3 * native.BUILD_TIMEOUT_S
    os.utime(killed, (old, old))
    native._build(native.compiler(), out)
    assert out.stat().st_size > 0
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, running.name]


def test_packed_linear_matches_f_linear_and_follows_weight_updates():
    assert packed_linear.available(), "torch was built without oneDNN (mkldnn)"
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(576, 1536)
    mm = packed_linear.PackedLinears(enabled=True)  # on any CPU, whether or not it pays off
    x = torch.randn(64, 576, generator=gen)
    with torch.no_grad():
        got = mm(x, layer.weight, layer.bias)
        assert len(mm) == 1
        assert torch.allclose(got, layer(x), atol=1e-5), (got - layer(x)).abs().max()
        # 3-D input (a packed prefill's [1, N, hidden]), and the same packed copy reused.
        x3 = torch.randn(1, 300, 576, generator=gen)
        assert torch.allclose(mm(x3, layer.weight, layer.bias), layer(x3), atol=1e-5)
        assert len(mm) == 1
        # An in-place update (what the engine's weight updates do) is picked up.
        layer.state_dict()["weight"].copy_(torch.randn(1536, 576, generator=gen))
        assert torch.allclose(mm(x, layer.weight, layer.bias), layer(x), atol=1e-4)
        # Small matmuls stay F.linear, exactly; so do weights that need grad under autograd.
        small = torch.nn.Linear(64, 32)
        assert torch.equal(mm(x[:4, :64], small.weight, small.bias), small(x[:4, :64]))
        mm.clear()
        assert len(mm) == 0
    assert torch.equal(mm(x, layer.weight, layer.bias), layer(x)) and len(mm) == 0


def test_draw_samples_the_distribution_and_never_a_zero_probability_token():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, generator=gen), -1)
    p[[0, 7, 39]] = 0  # e.g. removed by top-k / top-p (the first and last entries too)
    p /= p.sum()
    n = 200_000
    tokens = draw(p.expand(n, -1), gen)
    counts = torch.bincount(tokens, minlength=40).double()
    assert counts[[0, 7, 39]].sum() == 0
    sigma = (n * p.double() * (1 - p.double())).sqrt()
    assert ((counts - n * p.double()).abs() <= 5 * sigma + 1).all()
    # Seeded generators reproduce their draws (requests with a seed rely on it).
    a = draw(p.expand(8, -1), torch.Generator().manual_seed(5))
    b = draw(p.expand(8, -1), torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_plain_sampling_gives_log_softmax_and_samples_the_distribution():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=gen) * 4
    tokens, logps = sample_plain(logits, gen)
    want = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logps, want, atol=1e-6), (logps - want).abs().max()
    n = 100_000
    row = torch.randn(1, 30, generator=gen)
    row[0, 11] = float("-inf")  # a masked token is never drawn
    tokens, lps = sample_plain(row.expand(n, -1), gen, want_lp=False)
    assert lps is None
    p = torch.softmax(row[0].double(), -1)
    counts = torch.bincount(tokens, minlength=30).double()
    assert counts[11] == 0
    assert ((counts - n * p).abs() <= 5 * (n * p * (1 - p)).sqrt() + 1).all()
