"""The engine's Llama-family model: transformers' module tree for Llama, Qwen2 and Qwen3,
built from config.json and the safetensors files without transformers' model classes.

Importing those classes is most of an engine's start: ``transformers.modeling_utils``
pulls in its fp8 integration (and with it ``torch._dynamo``), DTensor and sympy, 2-3
CPU-seconds on this project's 2-core boxes (docs/testing.md, "What bounds it now"), paid
again by every engine a run, a restart or a test starts. The engine needs none of it:
lean.py's forward reads the modules' weights and does its own math. So this module builds
the same tree, with the same parameter names, shapes, dtypes and weight tying, so that
everything that addresses weights by name (pushes, release and resume,
get_weights_by_name, weight noise) cannot tell the difference, and lean.py runs on it
unchanged (tests/test_engine_hf.py: the state dicts and the logits equal transformers'
bitwise). A checkpoint it does not take (another architecture, a RoPE that changes with
the sequence length, tensors it does not expect) makes :func:`load` return None, and the
engine loads transformers' model as before.
"""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# RoPE types whose frequencies are fixed at load; "dynamic" and "longrope" change them with
# the sequence length (transformers' dynamic_rope_update), which lean.py does not do.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def full_attention(config) -> bool:
    """Every layer attends to the whole sequence and no matmul is split for tensor-parallel
    pretraining: what lean.py's forward computes, on this module's model or transformers'."""
    return (not getattr(config, "use_sliding_window", False)
            and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ()))
            and getattr(config, "pretraining_tp", 1) == 1)


def supports(config) -> bool:
    """Whether :func:`load` builds this configuration (transformers' PretrainedConfig)."""
    archs = getattr(config, "architectures", None) or ()
    rope = getattr(config, "rope_parameters", None) or {}
    return (len(archs) == 1 and archs[0] in ARCHITECTURES
            and config.model_type in ("llama", "qwen2", "qwen3")
            and full_attention(config)
            and rope.get("rope_type", "default") in STATIC_ROPE
            and getattr(config, "partial_rotary_factor", 1.0) == 1.0)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """Left uninitialised: :func:`load` assigns the checkpoint's tensors, so an
        initialisation would be wasted work (and on the meta device torch's initialisers
        import torch._dynamo, a second of CPU)."""


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """As Linear's."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm, operation for operation (lean.py calls it for dtypes
        # its C kernel does not take).
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        rope = config.rope_parameters
        if rope.get("rope_type", "default") == "default":
            dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                        // config.num_attention_heads)
            base = rope["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device,
                                                                   dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """transformers' RoPE for these architectures (lean.py's fallback without the C kernel)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                              // config.num_attention_heads)
        self.scaling = self.head_dim ** -0.5
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        qkv_bias = True if config.model_type == "qwen2" else config.attention_bias
        o_bias = False if config.model_type == "qwen2" else config.attention_bias
        self.q_proj = Linear(config.hidden_size, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(heads * self.head_dim, config.hidden_size, bias=o_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False) if config.model_type == "llama" else False
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.hidden_act = config.hidden_act

    def act_fn(self, x: torch.Tensor) -> torch.Tensor:  # lean.py runs silu itself
        from transformers.activations import ACT2FN

        return ACT2FN[self.hidden_act](x)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """``model`` and ``lm_head`` named as transformers names them; ``config`` is the
    checkpoint's PretrainedConfig; ``generation_config.eos_token_id`` what transformers'
    from_pretrained would give."""

    def __init__(self, config, generation_config):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def _generation_config(path: str, config) -> SimpleNamespace:
    # from_pretrained takes generation_config.json when there is one, else a generation
    # config made from the model's config.
    file = os.path.join(path, "generation_config.json")
    if os.path.exists(file):
        with open(file) as f:
            return SimpleNamespace(eos_token_id=json.load(f).get("eos_token_id"))
    return SimpleNamespace(eos_token_id=getattr(config, "eos_token_id", None))


def load(path: str, config, dtype: torch.dtype) -> Optional[CausalLM]:
    """The model at ``path`` in ``dtype``, or None where this module does not take it (the
    caller then loads transformers' model)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not supports(config) or not files:
        return None
    # Uninitialised (torch.empty): the checkpoint's tensors replace them below.
    model = CausalLM(config, _generation_config(path, config))
    expected = {n for n, _ in model.named_parameters()}
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    if set(weights) != expected:
        return None
    # assign=True keeps the loaded tensors (cast where the dtype differs, as
    # from_pretrained does) instead of copying them into freshly allocated ones.
    model.load_state_dict({n: t.to(dtype) for n, t in weights.items()}, strict=False,
                          assign=True)
    if config.tie_word_embeddings:  # assign replaced the embedding's Parameter object
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()
