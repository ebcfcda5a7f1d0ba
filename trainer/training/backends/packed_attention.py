"""Attention for shared-prefix micro-batches (``batching.build_shared_prefix_micro_batch``).

The model runs the packed suffixes as one row [1, N], so its linear layers, norms and LM
head see no padding. Only attention needs rows: this attention function scatters the
packed queries/keys/values into [rows, width], prepends each row's prefix KV (computed
once per prefix, with grad, by an earlier forward), runs SDPA under the re-padded mask and
gathers the outputs back into the packed row.

The rows are re-padded in a few buckets of similar suffix length (``row_buckets``), one
SDPA call each: SDPA computes every padded query and key, and one width for all rows made
half of a multi-turn batch's attention work padding.

transformers hands extra forward kwargs down to the attention function, so the layout and
prefix KV travel as the ``packed_prefix`` kwarg; a forward without it is plain SDPA (the
prefix pass, and any other use of the model).

On CUDA in fp16/bf16 with flash-attn installed, the suffix attention runs flash-attn's
``flash_attn_varlen_func`` instead, with no re-padding at all: the queries are the packed
suffix tokens as they are (cu_seqlens_q = each row's suffix length), and row b's keys are
its prefix's real tokens followed by its own suffix (cu_seqlens_k). flash-attn >= 2.1
aligns the causal mask to the bottom-right corner when seqlen_k > seqlen_q (query i of a
row sees keys j <= i + seqlen_k - seqlen_q), which is exactly "the whole prefix, then the
suffix causally". GQA is native (fewer K/V heads than query heads). Anything else (CPU,
fp32, no flash-attn, ``use_flash = False``) takes the SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from trainer.training.backends.batching import SharedPrefix

ATTN_NAME = "homegym_packed_sdpa"


@dataclass
class PackedPrefix:
    """What the suffix forward's attention needs from the micro-batch and the prefix pass."""

    keys: list[torch.Tensor]  # per layer [U, H_kv, L, D]: the prefixes' keys (post-RoPE)
    values: list[torch.Tensor]
    layout: SharedPrefix  # rows, width, each row's prefix, each packed token's slot
    # The varlen layout (flash path) or the row buckets (SDPA path), built by the first
    # layer and shared by the others.
    varlen: Optional["VarlenLayout"] = field(default=None, repr=False)
    buckets: Optional["RowBuckets"] = field(default=None, repr=False)


# flash-attn's varlen kernel, or None without flash-attn; preferred where it applies.
try:
    from flash_attn import flash_attn_varlen_func as _flash_varlen
    flash_import_error = None
except Exception as _e:  # not installed, or built for another torch/CUDA
    _flash_varlen = None
    flash_import_error = f"{type(_e).__name__}: {_e}"
use_flash = True  # False forces SDPA (the GPU smoke compares the two)


def flash_available() -> bool:
    return _flash_varlen is not None


def _flash_applies(query: torch.Tensor, *tensors: torch.Tensor) -> bool:
    return (use_flash and _flash_varlen is not None and query.is_cuda
            and query.dtype in (torch.float16, torch.bfloat16)
            and all(t.dtype == query.dtype for t in tensors) and query.shape[-1] <= 256)


@dataclass
class VarlenLayout:
    """The micro-batch as flash-attn's varlen batch: per row, queries = its packed suffix,
    keys = its prefix's real tokens then its suffix."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    # Row-major key index into cat(prefix keys [U * L], packed suffix keys [N]).
    kv_index: torch.Tensor


def varlen_layout(layout: SharedPrefix) -> VarlenLayout:
    u, length = layout.prefix_mask.shape  # distinct prefixes, padded prefix length
    device = layout.slot.device
    prefix_len = layout.prefix_mask.sum(1)[layout.prefix_index]  # [B]
    suffix_len = torch.bincount(layout.slot // layout.width, minlength=layout.rows)  # [B]
    key_len = prefix_len + suffix_len

    def cumulative(lengths):
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths, 0)
        return cu

    cu_q, cu_k = cumulative(suffix_len), cumulative(key_len)
    row = torch.repeat_interleave(torch.arange(layout.rows, device=device), key_len)
    pos = torch.arange(row.numel(), device=device) - cu_k[:-1].long()[row]
    from_prefix = layout.prefix_index[row] * length + pos
    from_suffix = u * length + cu_q[:-1].long()[row] + pos - prefix_len[row]
    kv_index = torch.where(pos < prefix_len[row], from_prefix, from_suffix)
    lengths = torch.stack([suffix_len.max(), key_len.max()]).tolist()  # one host sync
    return VarlenLayout(cu_q, cu_k, int(lengths[0]), int(lengths[1]), kv_index)


def _varlen_kv(prefix: torch.Tensor, packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[U, H, L, D] prefixes + [1, H, N, D] packed suffixes -> [total_k, H, D] per the index."""
    u, h, l, d = prefix.shape
    flat = torch.cat([prefix.transpose(1, 2).reshape(u * l, h, d), packed[0].transpose(0, 1)])
    return flat.index_select(0, index)


def _flash_prefix_attention(query, key, value, packed_prefix: PackedPrefix, layer: int,
                            scaling, dropout) -> torch.Tensor:
    if packed_prefix.varlen is None:
        packed_prefix.varlen = varlen_layout(packed_prefix.layout)
    v = packed_prefix.varlen
    out = _flash_varlen(
        query[0].transpose(0, 1).contiguous(),  # [N, H, D]: the packed order is row-major
        _varlen_kv(packed_prefix.keys[layer], key, v.kv_index),
        _varlen_kv(packed_prefix.values[layer], value, v.kv_index),
        v.cu_seqlens_q, v.cu_seqlens_k, v.max_seqlen_q, v.max_seqlen_k,
        dropout_p=dropout, softmax_scale=scaling, causal=True)
    return out[None]  # [1, N, H, D]


@dataclass
class RowBucket:
    """Rows of similar suffix length, re-padded to the longest of them for one SDPA call."""

    size: int  # b: rows
    prefix_index: torch.Tensor  # [b] each row's prefix
    tokens: Optional[torch.Tensor]  # [n] packed positions of the rows' tokens; None: all
    slot: torch.Tensor  # [n] each of those tokens' place in the bucket's [b * width]
    width: int
    mask: torch.Tensor  # [b, 1, width, L + width] the layout's mask, cut to the bucket


@dataclass
class RowBuckets:
    buckets: list[RowBucket]
    # Packed position of each token in the buckets' outputs concatenated; None: in order.
    inverse: Optional[torch.Tensor]


MAX_BUCKETS = 4
# A further bucket must save this share of the one-bucket area: each costs a few more ops.
MIN_BUCKET_SAVING = 0.02


def bucket_bounds(lengths: list[int], prefix_width: int) -> list[int]:
    """Where to cut ``lengths`` (ascending suffix lengths) into at most ``MAX_BUCKETS``
    runs, minimising the padded attention area sum(rows * width * (prefix_width + width)),
    width being a run's last length, plus ``MIN_BUCKET_SAVING`` of the one-run area per
    further run. Returns the runs' ends. Cuts are taken at up to 16 quantiles, so the
    search stays small for any number of rows."""
    n = len(lengths)
    pos = [0] + sorted({round(n * q / 16) for q in range(1, 17)} - {0})  # ends with n
    m = len(pos) - 1

    def area(a: int, b: int) -> int:  # rows [pos[a], pos[b])
        width = lengths[pos[b] - 1]
        return (pos[b] - pos[a]) * width * (prefix_width + width)

    # cost[b]: least area of rows [0, pos[b]) in k + 1 runs; back[k][b]: where its last
    # run starts.
    cost = [area(0, b) if b else 0 for b in range(m + 1)]
    penalty = MIN_BUCKET_SAVING * cost[m]
    best, best_k, back = cost[m], 0, []
    for k in range(1, min(MAX_BUCKETS, m)):
        new, starts = [float("inf")] * (m + 1), [0] * (m + 1)
        for b in range(k + 1, m + 1):
            new[b], starts[b] = min((cost[a] + area(a, b), a) for a in range(k, b))
        cost = new
        back.append(starts)
        if cost[m] + k * penalty < best:
            best, best_k = cost[m] + k * penalty, k
    ends, b = [n], m
    for k in range(best_k, 0, -1):
        b = back[k - 1][b]
        ends.insert(0, pos[b])
    return ends


def row_buckets(layout: SharedPrefix, mask: torch.Tensor) -> RowBuckets:
    """The layout's rows in buckets of similar suffix length (``bucket_bounds``)."""
    row, col = layout.slot // layout.width, layout.slot % layout.width
    lengths = torch.bincount(row, minlength=layout.rows)
    prefix_width = layout.prefix_mask.shape[1]
    order = torch.argsort(lengths, stable=True)
    sorted_lengths = lengths[order].tolist()  # the one host sync
    ends = bucket_bounds(sorted_lengths, prefix_width)
    if len(ends) == 1:
        return RowBuckets([RowBucket(layout.rows, layout.prefix_index, None, layout.slot,
                                     layout.width, mask)], None)
    device = row.device
    starts = [0] + ends[:-1]
    widths = [sorted_lengths[e - 1] for e in ends]
    # Each row's place in the sorted order, its bucket and its place in that bucket.
    place = torch.empty_like(order)
    place[order] = torch.arange(len(order), device=device)
    bucket = torch.searchsorted(torch.tensor(ends, device=device), place, right=True)
    local = place - torch.tensor(starts, device=device)[bucket]
    # Tokens grouped by bucket (packed order within one), each at its bucket's slot.
    token_bucket = bucket[row]
    grouped = torch.argsort(token_bucket, stable=True)
    slot = local[row] * torch.tensor(widths, device=device)[token_bucket] + col
    counts = [sum(sorted_lengths[a:e]) for a, e in zip(starts, ends)]
    out = []
    for rows, tokens, width in zip(order.split([e - a for a, e in zip(starts, ends)]),
                                   grouped.split(counts), widths):
        # The prefix's columns, then the suffix's first ``width``.
        cut = mask.index_select(0, rows)[:, :, :width, :prefix_width + width]
        out.append(RowBucket(len(rows), layout.prefix_index.index_select(0, rows), tokens,
                             slot.index_select(0, tokens), width, cut))
    inverse = torch.empty_like(grouped)
    inverse[grouped] = torch.arange(len(grouped), device=device)
    return RowBuckets(out, inverse)


def _repad(x: torch.Tensor, bucket: RowBucket) -> torch.Tensor:
    """[1, H, N, D] packed -> the bucket's rows [b, H, width, D], zeros past each row."""
    _, h, _, d = x.shape
    tokens = x[0].transpose(0, 1)  # [N, H, D]
    if bucket.tokens is not None:
        tokens = tokens.index_select(0, bucket.tokens)
    flat = x.new_zeros(bucket.size * bucket.width, h, d).index_copy(0, bucket.slot, tokens)
    return flat.view(bucket.size, bucket.width, h, d).transpose(1, 2)


def _sdpa_prefix_attention(query, key, value, attention_mask, packed_prefix: PackedPrefix,
                           layer: int, scaling, dropout) -> torch.Tensor:
    if packed_prefix.buckets is None:
        packed_prefix.buckets = row_buckets(packed_prefix.layout, attention_mask)
    plan = packed_prefix.buckets
    prefix_k, prefix_v = packed_prefix.keys[layer], packed_prefix.values[layer]
    outs = []
    for bucket in plan.buckets:
        keys = torch.cat([prefix_k.index_select(0, bucket.prefix_index), _repad(key, bucket)], 2)
        values = torch.cat([prefix_v.index_select(0, bucket.prefix_index),
                            _repad(value, bucket)], 2)
        # GQA in the kernel: no K/V copies per query head (docs/performance.md).
        out = F.scaled_dot_product_attention(
            _repad(query, bucket), keys, values, attn_mask=bucket.mask, dropout_p=dropout,
            scale=scaling, enable_gqa=keys.shape[1] != query.shape[1])  # [b, H, width, D]
        b, h, w, d = out.shape
        outs.append(out.transpose(1, 2).reshape(b * w, h, d).index_select(0, bucket.slot))
    packed = outs[0] if plan.inverse is None else torch.cat(outs).index_select(0, plan.inverse)
    return packed[None]  # [1, N, H, D]


def packed_prefix_attention(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, packed_prefix: PackedPrefix | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    layer = module.layer_idx
    if _flash_applies(query, key, value, packed_prefix.keys[layer], packed_prefix.values[layer]):
        return _flash_prefix_attention(query, key, value, packed_prefix, layer, scaling,
                                       dropout), None
    return _sdpa_prefix_attention(query, key, value, attention_mask, packed_prefix, layer,
                                  scaling, dropout), None


def register() -> str:
    """Make the attention function known to transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, packed_prefix_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME
