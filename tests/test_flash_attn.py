"""The flash-attn varlen path of the shared-prefix attention
(trainer/training/backends/packed_attention).

On any machine: the varlen layout (cu_seqlens, the key gather, bottom-right causal) run
through a pure-torch stand-in for ``flash_attn_varlen_func`` gives the SDPA path's outputs
and gradients. With CUDA and flash-attn: the real kernel against SDPA in bf16.
"""

import pytest
import torch

from train_batches import make_batch
from trainer.training.backends import packed_attention as pa
from trainer.training.backends.batching import build_shared_prefix_micro_batch


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_varlen_func's maths (flash-attn >= 2.1): GQA by head groups; causal
    aligned to the bottom-right corner (query i of a row sees keys j <= i + Sk - Sq)."""
    assert dropout_p == 0.0
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    lq, lk = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    assert int(lq.max()) == max_seqlen_q and int(lk.max()) == max_seqlen_k
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs = []
    for b in range(len(lq)):
        qb = q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]].transpose(0, 1).float()  # [H, Sq, D]
        kb = k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]].transpose(0, 1).float()
        vb = v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]].transpose(0, 1).float()
        rep = qb.shape[0] // kb.shape[0]
        kb, vb = kb.repeat_interleave(rep, 0), vb.repeat_interleave(rep, 0)
        scores = qb @ kb.transpose(1, 2) * scale
        if causal:
            sq, sk = qb.shape[1], kb.shape[1]
            i = torch.arange(sq)[:, None]
            j = torch.arange(sk)[None, :]
            scores = scores.masked_fill(j > i + sk - sq, float("-inf"))
        outs.append((scores.softmax(-1) @ vb).transpose(0, 1).to(q.dtype))
    return torch.cat(outs)


class _Layer(torch.nn.Module):
    layer_idx = 0


def _inputs(device="cpu", dtype=torch.float32, heads=4, kv_heads=2, dim=16, seed=0):
    """Random q/k/v and prefix KV laid out as a real shared-prefix micro-batch: groups with
    a common first turn (prefixes longer than the prompt) and ragged suffixes."""
    batch = make_batch(num_groups=3, group_size=3, prompt_len=(4, 9), response_len=(3, 12),
                       common_start=3, seed=seed)
    mb = build_shared_prefix_micro_batch(batch, list(range(len(batch.tokens))), pad_token_id=0)
    s = mb.shared.to(device)
    g = torch.Generator().manual_seed(seed)
    n = mb.input_ids.shape[1]
    u, length = s.prefix_ids.shape

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    q, k, v = rand(1, heads, n, dim), rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim)
    pk, pv = rand(u, kv_heads, length, dim), rand(u, kv_heads, length, dim)
    return q, k, v, pk, pv, s, mb.attention_mask.to(device)


def _run(q, k, v, pk, pv, layout, mask, *, flash: bool, monkeypatch=None):
    prefix = pa.PackedPrefix(keys=[pk], values=[pv], layout=layout)
    if monkeypatch is not None:
        monkeypatch.setattr(pa, "use_flash", flash)
    out, _ = pa.packed_prefix_attention(_Layer(), q, k, v, mask, scaling=0.3,
                                        packed_prefix=prefix)
    grads = torch.autograd.grad(out.float().square().sum(), [q, k, v, pk, pv])
    return out, grads, prefix


def test_varlen_layout_matches_sdpa(monkeypatch):
    q, k, v, pk, pv, layout, mask = _inputs()
    assert bool((layout.prefix_mask.sum(1) > layout.prefix_keep.sum(1)).all())
    monkeypatch.setattr(pa, "use_flash", False)
    sdpa, sdpa_grads, _ = _run(q, k, v, pk, pv, layout, mask, flash=False)
    # The flash branch with the reference kernel (the branch's gate forced open on CPU).
    monkeypatch.setattr(pa, "_flash_varlen", reference_varlen)
    monkeypatch.setattr(pa, "_flash_applies", lambda *a: True)
    flash, flash_grads, prefix = _run(q, k, v, pk, pv, layout, mask, flash=True)
    assert prefix.varlen is not None  # the varlen branch ran
    assert flash.shape == sdpa.shape == (1, q.shape[2], q.shape[1], q.shape[3])
    torch.testing.assert_close(flash, sdpa, atol=1e-5, rtol=1e-5)
    for a, b in zip(flash_grads, sdpa_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Padding positions of the prefixes never reach a key (their grads are exactly zero).
    pad = ~layout.prefix_mask.bool()
    assert bool((flash_grads[3].transpose(1, 2)[pad] == 0).all())


def test_gate_keeps_sdpa_off_cuda():
    q = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    assert not pa._flash_applies(q, q)  # CPU tensors: SDPA whatever flash-attn says


def _flash_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not pa.flash_available():
        return f"flash_attn is not importable ({pa.flash_import_error})"
    return None


@pytest.mark.skipif(_flash_skip_reason() is not None, reason=str(_flash_skip_reason()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_kernel_matches_sdpa_on_cuda(monkeypatch, dtype):
    q, k, v, pk, pv, layout, mask = _inputs(device="cuda", dtype=dtype, heads=8, kv_heads=2,
                                            dim=64)
    monkeypatch.setattr(pa, "use_flash", True)
    assert pa._flash_applies(q, k, v, pk, pv)
    flash, flash_grads, prefix = _run(q, k, v, pk, pv, layout, mask, flash=True)
    assert prefix.varlen is not None
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v, pk, pv)]
    ref, ref_grads, _ = _run(*fp32, layout, mask, flash=False, monkeypatch=monkeypatch)
    torch.testing.assert_close(flash.float(), ref, atol=2e-2, rtol=2e-2)
    for a, b in zip(flash_grads, ref_grads):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


def test_row_buckets_cut_where_the_padded_area_is_least():
    """``bucket_bounds`` against every way of cutting a few sorted lengths into at most
    MAX_BUCKETS runs (below 16 rows every position is a candidate cut)."""
    import itertools

    def area(lengths, ends, prefix):
        return sum((e - s) * lengths[e - 1] * (prefix + lengths[e - 1])
                   for s, e in zip([0] + ends[:-1], ends))

    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 9):
        lengths = sorted(torch.randint(1, 90, (n,), generator=gen).tolist())
        ends = pa.bucket_bounds(lengths, 40)
        assert ends[-1] == n and ends == sorted(set(ends)) and len(ends) <= pa.MAX_BUCKETS
        single = area(lengths, [n], 40)
        penalty = pa.MIN_BUCKET_SAVING * single
        best = min(area(lengths, list(cut) + [n], 40) + len(cut) * penalty
                   for k in range(pa.MAX_BUCKETS) for cut in itertools.combinations(range(1, n), k))
        assert area(lengths, ends, 40) + (len(ends) - 1) * penalty == best, (lengths, ends)


def test_bucketed_rows_give_the_one_width_attention(monkeypatch):
    """The SDPA path's rows in buckets of similar length (each padded to its own longest)
    compute what all rows padded to the longest do: outputs and gradients, in float64, so
    anything beyond rounding (a token put in the wrong row, slot or order) shows."""
    q, k, v, pk, pv, layout, mask = _inputs(dtype=torch.float64, seed=2)
    monkeypatch.setattr(pa, "use_flash", False)
    bucketed, bucketed_grads, prefix = _run(q, k, v, pk, pv, layout, mask, flash=False)
    assert len(prefix.buckets.buckets) > 1 and prefix.buckets.inverse is not None
    monkeypatch.setattr(pa, "MAX_BUCKETS", 1)
    one, one_grads, prefix = _run(q, k, v, pk, pv, layout, mask, flash=False)
    assert len(prefix.buckets.buckets) == 1
    torch.testing.assert_close(bucketed, one, atol=1e-12, rtol=0)
    for a, b in zip(bucketed_grads, one_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
