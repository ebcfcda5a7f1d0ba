"""Hugging Face <-> Megatron-core for the Llama family (Llama, Qwen2, Qwen3) and Qwen3.5's
text model: config and weights.

Written once for the family instead of using ``mbridge`` (0.15.1 imports here, but it
hard-codes the Transformer Engine layer spec and CUDA devices in load/export, so it
cannot build or export a model without TE/GPU) or ``megatron-bridge`` (needs a newer
megatron-core than Python 3.11 can install).

Three layers, each pure and tested on its own:

- ``transformer_config_kwargs`` / ``model_kwargs``: the HF config as Megatron arguments;
- ``hf_to_megatron`` / ``megatron_to_hf``: one layer's (or the embedding's) FULL tensors,
  HF names <-> Megatron names (global layer numbers), e.g. q/k/v -> fused ``linear_qkv``;
- ``shard`` / ``unshard``: a full Megatron tensor <-> this tensor-parallel rank's slice.

Megatron's fused QKV weight is laid out per query group: for each of the ``num_kv_heads``
groups, the group's ``heads_per_group`` query heads, then its key head, then its value
head (rows of ``head_dim`` each). Splitting that along dim 0 into TP parts keeps whole
groups together, which is what Megatron's ColumnParallelLinear expects. The MLP's fused
``linear_fc1`` is [gate; up]; each TP rank holds [gate_shard; up_shard].

Layer norms: the local spec has ``input_layernorm`` / ``pre_mlp_layernorm`` modules; the
Transformer Engine spec fuses them into ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``. ``te_names=True`` selects the latter.

Qwen3.5 (``qwen3_5_text``, trainer/training/backends/megatron/hybrid.py): its gated
attention's HF ``q_proj`` holds per head [query; gate]; Megatron's ``linear_qkv`` with
``attention_output_gate`` holds per query group [queries, gates, key, value]. Its Gated
DeltaNet layers are HF-layout modules in ``self_attention`` (names as in transformers,
replicated over TP), and every (1 + w) RMSNorm keeps HF's stored w.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "qwen3_5_text")
# Gated DeltaNet tensors under ``self_attention.`` (Megatron) / ``linear_attn.`` (HF).
GDN_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
               "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def is_qwen3_5(hf) -> bool:
    return hf.model_type == "qwen3_5_text"


def layer_types(hf) -> list[str]:
    """Each layer's kind: ``full_attention`` or (Qwen3.5) ``linear_attention``."""
    return list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)


def _partial_rotary(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor")
                 or getattr(hf, "partial_rotary_factor", None) or 1.0)


def _rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(hf, "rope_theta", None) or 10000.0)


def _rope_scaling(hf) -> dict:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return {}
    if kind == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise NotImplementedError(f"rope type {kind!r} is not mapped to Megatron yet")


def head_dim(hf) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def check_supported(hf) -> None:
    if hf.model_type not in SUPPORTED:
        raise NotImplementedError(
            f"train.backend=megatron maps {', '.join(SUPPORTED)} checkpoints; "
            f"{hf.model_type!r} needs its own map in trainer/training/backends/megatron/hf_map.py")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={hf.hidden_act!r} (only silu is mapped)")
    if getattr(hf, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not mapped")


def transformer_config_kwargs(hf) -> dict:
    """TransformerConfig fields that describe the architecture (parallelism added by caller)."""
    check_supported(hf)
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf, "attention_bias", hf.model_type == "qwen2")),
        qk_layernorm=hf.model_type in ("qwen3", "qwen3_5_text"),
        attention_output_gate=is_qwen3_5(hf),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def model_kwargs(hf, padded_vocab_size: int) -> dict:
    """GPTModel keyword arguments (besides config/spec/pre/post_process)."""
    return dict(vocab_size=padded_vocab_size,
                max_sequence_length=hf.max_position_embeddings,
                position_embedding_type="rope",
                rotary_base=_rope_theta(hf),
                share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
                rotary_percent=_partial_rotary(hf),
                **_rope_scaling(hf))


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


# ------------------------------------------------------------------------------ names
def _layer_names(te_names: bool) -> dict[str, str]:
    """Megatron suffix (within decoder.layers.N.) -> HF suffix (within model.layers.N.)."""
    ln1 = "self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"
    ln2 = "mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight"
    return {
        ln1: "input_layernorm.weight",
        ln2: "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_names_of(mg_name: str, *, te_names: bool, tied: bool) -> list[str]:
    """HF tensors that make up one Megatron tensor (global layer numbers)."""
    if mg_name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if mg_name == "output_layer.weight":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    if mg_name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    m = _LAYER_RE.match(mg_name)
    if not m:
        raise KeyError(f"no HF name for Megatron tensor {mg_name!r}")
    layer, suffix = m.groups()
    hf = f"model.layers.{layer}."
    gdn = suffix.removeprefix("self_attention.")
    if gdn in GDN_TENSORS:
        return [hf + "linear_attn." + gdn]
    if suffix == "self_attention.linear_qkv.weight":
        return [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
    if suffix == "self_attention.linear_qkv.bias":
        return [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
    if suffix == "mlp.linear_fc1.weight":
        return [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
    names = _layer_names(te_names)
    if suffix in names:
        return [hf + names[suffix]]
    raise KeyError(f"no HF name for Megatron tensor {mg_name!r}")


# ------------------------------------------------------------------------------ tensors
def _qkv_groups(hf) -> tuple[int, int, int]:
    groups = hf.num_key_value_heads
    return groups, hf.num_attention_heads // groups, head_dim(hf)


def fuse_qkv(hf, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's per-group layout (with an
    output gate: HF's per-head [query; gate] rows -> per group [queries, gates, k, v])."""
    groups, per_group, d = _qkv_groups(hf)
    rest = q.shape[1:]
    if is_qwen3_5(hf):
        heads = q.reshape(groups, per_group, 2, d, *rest)
        q = torch.cat([heads[:, :, 0], heads[:, :, 1]], dim=1)  # [groups, 2 x per_group, d]
        q = q.reshape(groups, 2 * per_group * d, *rest)
    else:
        q = q.reshape(groups, per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(hf, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, d = _qkv_groups(hf)
    rest = qkv.shape[1:]
    width = 2 * per_group if is_qwen3_5(hf) else per_group
    grouped = qkv.reshape(groups, (width + 2) * d, *rest)
    q, k, v = torch.split(grouped, [width * d, d, d], dim=1)
    if is_qwen3_5(hf):  # [queries, gates] of a group -> per head [query; gate]
        q = q.reshape(groups, 2, per_group, d, *rest).transpose(1, 2)
    return (q.reshape(-1, *rest), k.reshape(groups * d, *rest), v.reshape(groups * d, *rest))


def to_megatron(hf, mg_name: str, tensors: list[torch.Tensor], padded_vocab: int) -> torch.Tensor:
    """Full Megatron tensor from the HF tensors ``hf_names_of(mg_name)`` (in that order)."""
    if mg_name.endswith("linear_qkv.weight") or mg_name.endswith("linear_qkv.bias"):
        return fuse_qkv(hf, *tensors)
    if mg_name.endswith("linear_fc1.weight"):
        return torch.cat(tensors, dim=0)
    (t,) = tensors
    if mg_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if t.shape[0] < padded_vocab:
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
    return t


def to_hf(hf, mg_name: str, full: torch.Tensor, *, te_names: bool,
          tied: bool) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs from one full Megatron tensor."""
    names = hf_names_of(mg_name, te_names=te_names, tied=tied)
    if mg_name.endswith("linear_qkv.weight") or mg_name.endswith("linear_qkv.bias"):
        return list(zip(names, split_qkv(hf, full)))
    if mg_name.endswith("linear_fc1.weight"):
        return list(zip(names, torch.chunk(full, 2, dim=0)))
    if mg_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = full[:hf.vocab_size]
    return [(names[0], full)]


# ------------------------------------------------------------------------------ TP
def tp_split_dim(mg_name: str) -> int | None:
    """Dimension along which TP shards the tensor (None: replicated)."""
    if mg_name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if mg_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if mg_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def shard(mg_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor."""
    dim = tp_split_dim(mg_name)
    if dim is None or tp_size == 1:
        return full
    if mg_name.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]])
    if full.shape[dim] % tp_size:
        raise ValueError(f"{mg_name}: dim {dim} of {tuple(full.shape)} is not divisible by "
                         f"tensor_model_parallel_size={tp_size}")
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]


def unshard(mg_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard`` over all TP ranks' slices (in rank order)."""
    dim = tp_split_dim(mg_name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if mg_name.endswith("linear_fc1.weight"):
        pairs = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs])
    return torch.cat(shards, dim=dim)


def global_name(local_name: str, layer_offset: int) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<local + offset>.x``."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}"


def megatron_names(hf, *, te_names: bool, layers: Iterable[int], pre_process: bool,
                   post_process: bool) -> list[str]:
    """The Megatron parameter names of a pipeline stage (global layer numbers), in HF order."""
    out = ["embedding.word_embeddings.weight"] if pre_process else []
    names = _layer_names(te_names)
    inv = {v: k for k, v in names.items()}
    kinds = layer_types(hf)
    for i in layers:
        p = f"decoder.layers.{i}."
        out.append(p + inv["input_layernorm.weight"])
        if kinds[i] == "linear_attention":
            out += [p + "self_attention." + n for n in GDN_TENSORS]
            out.append(p + inv["post_attention_layernorm.weight"])
            out += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
            continue
        out.append(p + "self_attention.linear_qkv.weight")
        if transformer_config_kwargs(hf)["add_qkv_bias"]:
            out.append(p + "self_attention.linear_qkv.bias")
        if hf.model_type in ("qwen3", "qwen3_5_text"):
            out += [p + "self_attention.q_layernorm.weight",
                    p + "self_attention.k_layernorm.weight"]
        out.append(p + "self_attention.linear_proj.weight")
        out.append(p + inv["post_attention_layernorm.weight"])
        out += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if post_process:
        out.append("decoder.final_layernorm.weight")
        if not hf.tie_word_embeddings:
            out.append("output_layer.weight")
    return out


def hf_layer_of(hf_name: str) -> int | None:
    m = _HF_LAYER_RE.match(hf_name)
    return int(m.group(1)) if m else None
