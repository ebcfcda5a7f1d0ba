"""Qwen3.5's text model in megatron-core: a decoder whose layers differ.

Written against megatron-core 0.16.1 (models/gpt/gpt_layer_specs.py's local spec,
transformer/attention.py's ``attention_output_gate``) and, for the Gated DeltaNet, the way
slime runs it (slime_plugins/models/qwen3_5.py: an HF-layout module swapped into the
layer's ``self_attention``, replicated over tensor parallelism):

- every 4th layer is megatron's ``SelfAttention`` with ``attention_output_gate`` (the
  output multiplied by sigmoid of a per-head gate that ``linear_qkv`` also produces),
  q/k norms, and rotary embeddings on the first quarter of each head (``rotary_percent``);
- the others hold ``HFGatedDeltaNet``: transformers' Gated DeltaNet parameters under their
  HF names, run by ``rollout.modeling.gated_deltanet`` (homegym's, the same math the FSDP
  trainer and the CPU engine run; flash-linear-attention's kernels on CUDA when installed)
  with each padded row, or each packed sequence (THD ``cu_seqlens``), as one sequence.
  Every TP rank holds it whole and computes the same output (no collective): its
  parameters carry no ``tensor_model_parallel`` mark, so gradient norms count them once;
- every norm but the GDN's gated one is Qwen3.5's (1 + w) RMSNorm (``OnePlusRMSNorm``),
  megatron-core's local norm being torch's (which refuses ``zero_centered_gamma``).

megatron-core's own ``gated_delta_net`` attention variant needs Transformer Engine, fla and
CUDA and raises on packed sequences (ssm/gated_delta_net.py); it is not used here.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.module import MegatronModule


class OnePlusRMSNorm(torch.nn.Module):
    """Qwen3.5's RMSNorm: ``x / rms(x) * (1 + w)`` in fp32, ``w`` stored (and initialised)
    as transformers' ``Qwen3_5RMSNorm`` holds it."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class HFGatedDeltaNet(MegatronModule):
    """A Gated DeltaNet with transformers' parameters (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``,
    ``out_proj``) as a megatron ``self_attention``: [s, b, h] in, ([s, b, h], None) out."""

    def __init__(self, config, submodules=None, layer_number: int = 1, hf_config=None,
                 **kwargs):
        super().__init__(config=config)
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        hf = Qwen3_5GatedDeltaNet(hf_config, layer_number - 1)
        for name, module in hf.named_children():
            self.add_module(name, module)
        for name, param in hf.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name in ("key_dim", "value_dim", "head_k_dim", "head_v_dim", "num_k_heads",
                     "num_v_heads", "conv_dim", "activation"):
            setattr(self, name, getattr(hf, name))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None,
                **kwargs):
        from rollout.modeling.gated_deltanet import gated_deltanet

        # Padded rows (local spec): padding only follows a row's tokens, so its outputs at
        # real positions are exact. THD: one packed row, each sequence from a fresh state.
        cu = packed_seq_params.cu_seqlens_q.long() if packed_seq_params is not None else None
        out, _ = gated_deltanet(self, hidden_states.transpose(0, 1), cu_seqlens=cu)
        return out.transpose(0, 1).contiguous(), None


def layer_specs(config, hf_text, *, layer_types: list[str], offset: int, num_layers: int):
    """The block spec of this pipeline stage (local spec; global layers ``offset`` ..
    ``offset + num_layers``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    attention = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    parts = attention.submodules
    parts.input_layernorm = parts.pre_mlp_layernorm = OnePlusRMSNorm
    parts.self_attention.submodules.q_layernorm = OnePlusRMSNorm
    parts.self_attention.submodules.k_layernorm = OnePlusRMSNorm
    linear = copy.deepcopy(attention)
    linear.submodules.self_attention = ModuleSpec(module=HFGatedDeltaNet,
                                                  params={"hf_config": hf_text})
    specs = [linear if layer_types[offset + i] == "linear_attention" else attention
             for i in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=OnePlusRMSNorm)


@torch.no_grad()
def restore_fp32(gpt, ckpt, layer_offset: int) -> None:
    """After Float16Module has cast the model: each Gated DeltaNet's A_log back in fp32 from
    the checkpoint (engines and checkpoints hold it in fp32; its parameter then trains in
    fp32, the optimizer keeping fp32 parameters as they are)."""
    from rollout.modeling.hybrid import FP32_PARAMS
    from trainer.training.backends.megatron import hf_map

    for name, param in gpt.named_parameters():
        if name.rsplit(".", 1)[-1] in FP32_PARAMS and param.dtype != torch.float32:
            (source,) = hf_map.hf_names_of(hf_map.global_name(name, layer_offset),
                                           te_names=False, tied=False)
            param.data = ckpt.get(source).to(param.device, torch.float32)
