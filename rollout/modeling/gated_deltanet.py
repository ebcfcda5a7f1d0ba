"""Gated DeltaNet (Qwen3.5's linear-attention layers) in pure torch, for packed batches.

One implementation for the trainer and the CPU engine:

- ``causal_conv1d``: the short depthwise causal conv over packed sequences
  (``cu_seqlens``), each seeded by its own conv state (the last ``K - 1`` inputs before
  it; zeros for a fresh sequence) and returning the state after it. No sequence sees
  another's tokens: transformers' fallback takes no ``cu_seqlens``, and the CUDA kernels
  without ``seq_idx`` let a packed sequence see the previous one's last ``K - 1`` tokens.
- ``chunk_gated_delta_rule``: the chunked gated delta rule over packed sequences, each
  from its own initial recurrent state, returning the final states.
- ``causal_conv1d_step`` / ``recurrent_gated_delta_rule_step``: one token per sequence
  (decode); ``recurrent_gated_delta_rule_step_`` the same in place on the state.
- ``gated_deltanet`` / ``gated_deltanet_step`` (``_step_`` in place): a whole layer (projections, conv, rule,
  gated norm, output projection) over a module with transformers' ``Qwen3_5GatedDeltaNet``
  layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``,
  ``A_log``, ``dt_bias``, ``norm``, ``out_proj``).

Layouts follow flash-linear-attention: tokens ``[B, T, ...]``; with ``cu_seqlens``
(``[N + 1]``, int) ``B`` is 1 and the ``N`` sequences lie back to back. States are per
sequence: conv ``[N, C, K - 1]`` (the input dtype), recurrent ``[N, Hv, Dk, Dv]`` (fp32, or
fp64 for fp64 inputs).
Everything is differentiable, initial states included (a shared prefix's final state
seeds each of its suffixes, with gradients).

On CUDA, when flash-linear-attention is importable, its Triton kernels run instead
(``fla/ops/gated_delta_rule/chunk.py`` and ``fla/modules/causal_conv1d/ops.py`` of
fla-core 0.6.0: the same arguments, ``cu_seqlens`` and initial/final states; its conv
state holds ``K`` columns, the first never read). fla is imported only for a CUDA tensor:
it binds Triton at import time, which a CPU install must never do.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class GDNState(NamedTuple):
    """Per-sequence state of one Gated DeltaNet layer."""

    conv: torch.Tensor  # [N, C, K - 1]: the last K - 1 inputs of the conv (C = 2 Dk Hk + Dv Hv)
    recurrent: torch.Tensor  # [N, Hv, Dk, Dv], fp32 (fp64 for fp64 inputs)


# ----------------------------------------------------------------------------- layout


def _lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def uniform_cu_seqlens(batch: int, length: int, device) -> torch.Tensor:
    """``cu_seqlens`` of ``batch`` sequences of ``length`` tokens each."""
    return torch.arange(batch + 1, device=device, dtype=torch.long) * length


def _packed(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T, ...]`` -> ``([total, ...], cu_seqlens)``: rows as sequences unless packed."""
    if cu_seqlens is None:
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), uniform_cu_seqlens(
            x.shape[0], x.shape[1], x.device)
    if x.shape[0] != 1:
        raise ValueError(f"packed input (cu_seqlens) needs batch size 1, got {x.shape[0]}")
    if int(cu_seqlens[-1]) != x.shape[1]:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the input has "
                         f"{x.shape[1]} tokens")
    return x[0], cu_seqlens.long()


def _padded_index(cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """Each packed token's slot in ``[N * width]`` (sequence-major, right padding)."""
    lengths = _lengths(cu_seqlens)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    pos = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - cu_seqlens[:-1][seq]
    return seq * width + pos


def _pad(x: torch.Tensor, index: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """Packed ``[total, ...]`` -> ``[n, width, ...]``, zeros after each sequence."""
    out = x.new_zeros(n * width, *x.shape[1:]).index_copy(0, index, x)
    return out.view(n, width, *x.shape[1:])


# ----------------------------------------------------------------------------- conv


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  activation: Optional[str] = "silu", cu_seqlens: Optional[torch.Tensor] = None,
                  initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv, per sequence. ``x``: ``[B, T, C]``; ``weight``: ``[C, K]``;
    ``initial_state``: ``[N, C, K - 1]`` or None (zeros). Returns ``(y [B, T, C], final
    state [N, C, K - 1])``, the final state being each sequence's last ``K - 1`` inputs
    (reaching into its initial state when it is shorter)."""
    if x.is_cuda and _fla() is not None:
        return _fla_causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state)
    flat, cu = _packed(x, cu_seqlens)
    n, width = len(cu) - 1, weight.shape[1] - 1
    channels = flat.shape[1]
    if initial_state is None:
        initial_state = flat.new_zeros(n, channels, width)
    # Each sequence preceded by its own K - 1 state columns, in one [n * width + T, C] row:
    # a window then never spans two sequences, and the conv runs once over everything.
    lengths = _lengths(cu)
    seq = torch.repeat_interleave(torch.arange(n, device=flat.device), lengths)
    token_at = torch.arange(flat.shape[0], device=flat.device) + (seq + 1) * width
    state_at = (cu[:-1] + torch.arange(n, device=flat.device) * width)[:, None] + torch.arange(
        width, device=flat.device)
    rows = torch.empty(n * width + flat.shape[0], dtype=torch.long, device=flat.device)
    rows[state_at.flatten()] = torch.arange(n * width, device=flat.device)
    rows[token_at] = n * width + torch.arange(flat.shape[0], device=flat.device)
    states = initial_state.to(flat.dtype).transpose(1, 2).reshape(n * width, channels)
    seeded = torch.cat([states, flat]).index_select(0, rows)  # [n * width + T, C]
    out = F.conv1d(seeded.t()[None].to(weight.dtype), weight[:, None, :], bias,
                   groups=channels)[0].t()  # window ending at row r -> out[r - width]
    y = out.index_select(0, token_at - width)
    if activation is not None:
        y = _activation(activation)(y)
    ends = cu[1:] + torch.arange(1, n + 1, device=flat.device) * width  # one past each segment
    final = seeded.index_select(0, (ends[:, None] - width + torch.arange(
        width, device=flat.device)).flatten()).view(n, width, channels).transpose(1, 2)
    return y.to(x.dtype).reshape(x.shape), final


def causal_conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, *,
                       activation: Optional[str] = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``x`` ``[N, C]``, ``state`` ``[N, C, K - 1]`` -> ``(y [N, C],
    new state)``."""
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype)[:, :, None]], 2)  # [N, C, K]
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias
    if activation is not None:
        y = _activation(activation)(y)
    return y.to(x.dtype), window[:, :, 1:].to(state.dtype)


def _activation(name: str):
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported conv activation {name!r} (silu only)")


# ----------------------------------------------------------------------------- delta rule


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As flash-linear-attention (and transformers' fallback) normalise q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool, scale: Optional[float]):
    """At least fp32 (fp64 stays fp64: the reference the tests measure noise against), value
    heads expanded onto q/k (each q/k head serves Hv // Hk consecutive value heads)."""
    hk, hv = k.shape[-2], v.shape[-2]
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=-2)
        k = k.repeat_interleave(hv // hk, dim=-2)
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (scale if scale is not None else q.shape[-1] ** -0.5), k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, *, cu_seqlens: Optional[torch.Tensor] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           use_qk_l2norm: bool = True, scale: Optional[float] = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over each sequence, chunk by chunk.

    ``q``, ``k``: ``[B, T, Hk, Dk]``; ``v``: ``[B, T, Hv, Dv]``; ``g`` (log decay, <= 0),
    ``beta``: ``[B, T, Hv]``; ``initial_state``: ``[N, Hv, Dk, Dv]`` or None (zeros).
    Returns ``(o [B, T, Hv, Dv] in v's dtype, final state [N, Hv, Dk, Dv] fp32)``.
    """
    if q.is_cuda and _fla() is not None:
        return _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale)
    out_shape, out_dtype = v.shape, v.dtype
    packed = [_packed(t, cu_seqlens) for t in (q, k, v, g, beta)]
    cu = packed[0][1]
    q, k, v, g, beta = _prepare(*(p[0] for p in packed), use_qk_l2norm, scale)
    n, lengths = len(cu) - 1, _lengths(cu)
    num_chunks = max(1, -(-int(lengths.max()) // chunk_size))
    width = num_chunks * chunk_size
    index = _padded_index(cu, width)
    hv, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]

    # [n, H, chunks, C, D]: each sequence right-padded with zeros to whole chunks. A padded
    # token has k = v = beta = 0 and g = 0, so it neither writes nor decays the state: the
    # final state is the one after each sequence's last real token.
    def chunked(t):
        t = _pad(t, index, n, width)
        return t.view(n, num_chunks, chunk_size, hv, -1).permute(0, 3, 1, 2, 4)

    q, k, v = chunked(q), chunked(k), chunked(v)
    beta, g = chunked(beta[..., None])[..., 0], chunked(g[..., None])[..., 0]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(-1)  # [n, H, chunks, C]: log decay since the chunk's start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # WY form (UT transform): (I + strict_tril(beta K K^T decay)) [u, w] = [beta V, beta K e^decay]
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                      unitriangular=True)
    state = q.new_zeros(n, hv, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [n, H, chunks, 1, 1]
    outs = []
    for i in range(num_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state  # what the state does not predict yet
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(n * width, hv, dv)
    return o.index_select(0, index).to(out_dtype).reshape(out_shape), state


def recurrent_gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, *,
                                    use_qk_l2norm: bool = True, scale: Optional[float] = None
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``q``, ``k`` ``[N, Hk, Dk]``, ``v`` ``[N, Hv, Dv]``, ``g``,
    ``beta`` ``[N, Hv]``, ``state`` ``[N, Hv, Dk, Dv]`` -> ``(o [N, Hv, Dv], new state)``."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    state = state.to(q.dtype) * g.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2).to(out_dtype), state


def recurrent_gated_delta_rule_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, *,
                                     use_qk_l2norm: bool = True, scale: Optional[float] = None
                                     ) -> torch.Tensor:
    """``recurrent_gated_delta_rule_step`` advancing ``state`` (contiguous, fp32 or fp64)
    in place; returns ``o``. The same rule as batched matmuls over (sequence, head): the
    decay, ``k^T S``, the rank-one update and ``q^T S`` read the state four times where the
    functional form makes a new one per operation (the CPU engine's decode, where the state
    is most of the traffic)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    n, h, dk, dv = state.shape
    flat = state.view(n * h, dk, dv)
    flat.mul_(g.exp().reshape(n * h, 1, 1))
    k = k.reshape(n * h, 1, dk)
    delta = (v.reshape(n * h, 1, dv) - torch.bmm(k, flat)).mul_(beta.reshape(n * h, 1, 1))
    flat.baddbmm_(k.transpose(1, 2), delta)
    return torch.bmm(q.reshape(n * h, 1, dk), flat).view(n, h, dv).to(out_dtype)


# ----------------------------------------------------------------------------- a layer


def _projections(layer, hidden: torch.Tensor):
    mixed = layer.in_proj_qkv(hidden)
    z = layer.in_proj_z(hidden)
    beta = layer.in_proj_b(hidden).sigmoid()
    # At least fp32 decay (as transformers): in bf16, exp(A_log) and softplus lose small decays.
    # A_log is used as held (fp32 in checkpoints and SGLang); dt_bias in the compute dtype,
    # as a model loaded in that dtype (SGLang, transformers) holds it.
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    dt_bias = layer.dt_bias.to(hidden.dtype).to(dtype)
    g = -layer.A_log.to(dtype).exp() * F.softplus(layer.in_proj_a(hidden).to(dtype) + dt_bias)
    return mixed, z, beta, g


def _split_heads(layer, mixed: torch.Tensor):
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    lead = mixed.shape[:-1]
    return (q.reshape(*lead, -1, layer.head_k_dim), k.reshape(*lead, -1, layer.head_k_dim),
            v.reshape(*lead, -1, layer.head_v_dim))


def _output(layer, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    lead = core.shape[:-2]
    normed = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(normed.reshape(*lead, -1))


def gated_deltanet(layer, hidden: torch.Tensor, *, cu_seqlens: Optional[torch.Tensor] = None,
                   initial_state: Optional[GDNState] = None,
                   chunk_size: int = 64) -> tuple[torch.Tensor, GDNState]:
    """A Gated DeltaNet layer over ``hidden`` ``[B, T, D]`` (``B`` = 1 with ``cu_seqlens``,
    else each row one sequence), each sequence from its ``initial_state`` (None: fresh).
    Returns the layer's output and every sequence's final state. ``chunk_size``: the torch
    rule's (each sequence is padded to whole chunks: short sequences, e.g. a turn over a
    cached state, cost less with smaller chunks; the result differs by float rounding)."""
    mixed, z, beta, g = _projections(layer, hidden)
    conv_state = recurrent_state = None
    if initial_state is not None:
        conv_state, recurrent_state = initial_state
    # The conv weight in the projections' dtype: a trainer holding it in fp32 (FSDP keeps
    # it in the GDN's fp32 unit, since it is read here, not through conv1d's forward)
    # rounds it as an engine holding the model in that dtype has it.
    bias = layer.conv1d.bias
    mixed, conv_final = causal_conv1d(
        mixed, layer.conv1d.weight.squeeze(1).to(mixed.dtype),
        None if bias is None else bias.to(mixed.dtype), activation=layer.activation,
        cu_seqlens=cu_seqlens, initial_state=conv_state)
    q, k, v = _split_heads(layer, mixed)
    core, recurrent_final = chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=recurrent_state,
        chunk_size=chunk_size)
    return _output(layer, core, z), GDNState(conv_final, recurrent_final)


def gated_deltanet_step(layer, hidden: torch.Tensor, state: GDNState) -> tuple[torch.Tensor, GDNState]:
    """One token per sequence: ``hidden`` ``[N, D]`` -> ``(output [N, D], new state)``."""
    mixed, z, beta, g = _projections(layer, hidden)
    mixed, conv_state = causal_conv1d_step(mixed, state.conv, layer.conv1d.weight.squeeze(1),
                                           layer.conv1d.bias, activation=layer.activation)
    q, k, v = _split_heads(layer, mixed)
    core, recurrent = recurrent_gated_delta_rule_step(q, k, v, g, beta, state.recurrent)
    return _output(layer, core, z), GDNState(conv_state, recurrent)


def gated_deltanet_step_(layer, hidden: torch.Tensor, state: GDNState) -> torch.Tensor:
    """``gated_deltanet_step`` advancing ``state`` in place (its recurrent state contiguous);
    returns the output ``[N, D]``."""
    mixed, z, beta, g = _projections(layer, hidden)
    mixed, conv_state = causal_conv1d_step(mixed, state.conv, layer.conv1d.weight.squeeze(1),
                                           layer.conv1d.bias, activation=layer.activation)
    state.conv.copy_(conv_state)
    q, k, v = _split_heads(layer, mixed)
    core = recurrent_gated_delta_rule_step_(q, k, v, g, beta, state.recurrent)
    return _output(layer, core, z)


def empty_state(layer, batch: int, *, dtype: torch.dtype, device=None) -> GDNState:
    """Zero states for ``batch`` fresh sequences (``dtype``: the conv state's)."""
    width = layer.conv1d.weight.shape[-1] - 1
    return GDNState(
        torch.zeros(batch, layer.conv_dim, width, dtype=dtype, device=device),
        torch.zeros(batch, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                    dtype=torch.float32, device=device))


# ----------------------------------------------------------------------------- CUDA (fla)


@functools.lru_cache(maxsize=1)
def _fla():
    """flash-linear-attention's ops, or None. Only ever called for CUDA tensors."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
    except ImportError:
        return None
    return conv, chunk


def _fla_causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state):
    conv, _ = _fla()
    # fla's conv state has K columns, the first never read (fla/modules/causal_conv1d/ops.py).
    if initial_state is not None:
        initial_state = F.pad(initial_state, (1, 0))
    y, final = conv(x, weight, bias, initial_state=initial_state, output_final_state=True,
                    activation=activation, cu_seqlens=cu_seqlens)
    return y, final[..., 1:]


def _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale):
    _, chunk = _fla()
    o, final = chunk(q, k, v, g.float(), beta, scale=scale, initial_state=initial_state,
                     output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                     cu_seqlens=cu_seqlens)
    return o, final.float()
