"""Megatron-core pieces of the backend: parallel state, the GPT model from an HF config,
HF weight loading, TP gathering for export, and vocab-parallel log-probs/entropy.

Kept apart from ``backend.py`` so tests can build a model in one process without Ray.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from trainer.training.backends.megatron import hf_map

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def have_transformer_engine() -> bool:
    """Transformer Engine importable (its layer spec then also needs a CUDA device)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def have_apex_fused_softmax() -> bool:
    """Apex's fused softmax kernels, which ``masked_softmax_fusion`` needs on the local spec:
    ``megatron/core/fusions/fused_softmax.py`` imports ``scaled_masked_softmax_cuda``
    (``get_batch_per_block``), ``scaled_upper_triang_masked_softmax_cuda`` (causal) and
    ``scaled_softmax_cuda`` at call time, so a missing one fails at the first forward."""
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
        import scaled_softmax_cuda  # noqa: F401
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class KernelPlan:
    """Which layer spec and which fused kernels a rank uses (``kernel_plan``)."""

    use_te: bool  # Transformer Engine layer spec; else megatron-core's local spec
    fusions: dict  # TransformerConfig fusion flags
    note: Optional[str] = None  # one line to log when a CUDA run falls back to the local spec

    @property
    def packed(self) -> bool:
        """THD packing of a micro-batch's samples needs TE's attention (cu_seqlens)."""
        return self.use_te


def kernel_plan(*, device: str, te_available: bool, fused_softmax_available: bool,
                sequence_parallel: bool) -> KernelPlan:
    """Layer spec and TransformerConfig fusion flags for (device, what is installed, config).

    Read off megatron-core 0.16's source, for the Llama-family models mapped here
    (RMSNorm, no linear biases, no dropout, SwiGLU, RoPE):

    - local spec (``models/gpt/gpt_layer_specs.py::get_gpt_layer_local_spec`` with RMSNorm):
      norms are ``transformer/torch_norm.py::WrappedTorchNorm`` (torch RMSNorm), which
      asserts ``not persist_layer_norm``, ``not sequence_parallel`` and
      ``not memory_efficient_layer_norm``; attention is ``DotProductAttention`` whose
      ``masked_softmax_fusion`` calls apex's softmax kernels (``have_apex_fused_softmax``);
    - ``gradient_accumulation_fusion``: the local linears need apex's
      ``fused_weight_gradient_mlp_cuda`` (``tensor_parallel/layers.py``): off;
    - ``apply_rope_fusion``: TE's fused RoPE (``models/common/embeddings/rope_utils.py``
      asserts it is importable): off (the local spec cannot use it; not enabled on TE);
    - ``bias_dropout_fusion``: ``fusions/fused_bias_dropout.py`` under ``jit.py``'s
      ``torch.compile``; with no bias and dropout 0 it is a plain residual add, so the
      compiled version buys nothing and costs a compile (triton, a C compiler) per new
      micro-batch shape: off;
    - ``bias_activation_fusion``: there is no FC1 bias to fuse: off.

    ``train.sequence_parallel`` without TE is refused here, naming the key, instead of
    megatron's assertion deep inside model construction.
    """
    cuda = device == "cuda"
    use_te = cuda and te_available
    if sequence_parallel and not use_te:
        why = "this run has no CUDA device" if not cuda else "transformer_engine is not installed"
        raise ValueError(
            "train.sequence_parallel=true needs Transformer Engine's layer spec "
            f"({why}): megatron-core's local spec normalises with torch RMSNorm "
            "(megatron/core/transformer/torch_norm.py), which does not support sequence "
            "parallelism. Install transformer-engine or set train.sequence_parallel=false.")
    softmax = cuda and not use_te and fused_softmax_available
    fusions = dict(masked_softmax_fusion=softmax, bias_dropout_fusion=False,
                   apply_rope_fusion=False, gradient_accumulation_fusion=False,
                   bias_activation_fusion=False, persist_layer_norm=False,
                   memory_efficient_layer_norm=False)
    note = None
    if cuda and not use_te:
        note = ("megatron: transformer_engine is not installed: using megatron-core's local "
                "layer spec (torch RMSNorm, padded micro-batches instead of THD packing, "
                + ("apex fused softmax" if softmax else "unfused softmax: no apex kernels")
                + "; no sequence parallelism)")
    return KernelPlan(use_te=use_te, fusions=fusions, note=note)


def initialize_parallel(train, *, seed: int) -> None:
    """Megatron's process groups over the already-initialised default group (all ranks)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=train.tensor_model_parallel_size,
        pipeline_model_parallel_size=train.pipeline_model_parallel_size,
        context_parallel_size=train.context_parallel_size,
        expert_model_parallel_size=train.expert_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(hf, train, *, dtype: str, cpu: bool, fusions: dict):
    from megatron.core.transformer import TransformerConfig

    params_dtype = _DTYPES[dtype]
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None)
    if num_experts:
        raise NotImplementedError("mixture-of-experts checkpoints are not mapped yet "
                                  "(expert parallel groups are initialised, the map is not)")
    return TransformerConfig(
        **hf_map.transformer_config_kwargs(hf),
        tensor_model_parallel_size=train.tensor_model_parallel_size,
        pipeline_model_parallel_size=train.pipeline_model_parallel_size,
        context_parallel_size=train.context_parallel_size,
        expert_model_parallel_size=train.expert_model_parallel_size,
        sequence_parallel=train.sequence_parallel,
        params_dtype=torch.float32,  # master weights; Float16Module casts for compute
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        variable_seq_lengths=True,  # micro-batches differ in shape: send shapes first
        moe_token_dispatcher_type="alltoall",  # the only one variable_seq_lengths allows
        use_cpu_initialization=cpu,
        # Every weight is then overwritten from the HF checkpoint, but initialisation is
        # also what marks weights `tensor_model_parallel` (without it, grad-norm and
        # clipping count TP-sharded weights on TP rank 0 only).
        perform_initialization=True,
        **fusions,  # kernel_plan: what the layer spec and the installed kernels allow
        recompute_granularity="full" if train.gradient_checkpointing else None,
        recompute_method="uniform" if train.gradient_checkpointing else None,
        recompute_num_layers=1 if train.gradient_checkpointing else None,
    )


def layer_spec(config, *, use_te: bool, num_layers: int):
    """The decoder spec. TE: its layer spec. Local: a whole-block spec that names the final
    norm too, because for a bare layer spec ``transformer/transformer_block.py`` picks the
    final norm from what is importable (``LayerNormImpl``: TENorm if TE, else apex's
    FusedLayerNorm, which asserts ``normalization == "LayerNorm"`` and so breaks RMSNorm
    models on a CUDA box with apex but no TE)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=WrappedTorchNorm)


def vocab_multiple(tp: int, cpu: bool) -> int:
    return tp if cpu else 128 * tp


def build_gpt(hf, config, *, use_te: bool, padded_vocab: int):
    """This pipeline stage's GPTModel (float32 parameters, uninitialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if hf_map.is_qwen3_5(hf):  # layers differ: gated attention or an HF-layout Gated DeltaNet
        from trainer.training.backends.megatron.hybrid import layer_specs

        spec = layer_specs(config, hf, layer_types=hf_map.layer_types(hf),
                           offset=get_transformer_layer_offset(config),
                           num_layers=get_num_layers_to_build(config))
    else:
        spec = layer_spec(config, use_te=use_te, num_layers=get_num_layers_to_build(config))
    return GPTModel(config=config, transformer_layer_spec=spec,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    parallel_output=True, **hf_map.model_kwargs(hf, padded_vocab))


def freeze_padding_embedding(gpt, pad_token_id: Optional[int]) -> None:
    """HF's Llama/Qwen embeddings are ``nn.Embedding(padding_idx=pad_token_id)``: the pad
    row gets no gradient from the input side. Do the same (forward values unchanged):
    positions holding the pad token pass no gradient back to the embedding table."""
    if pad_token_id is None or not getattr(gpt, "pre_process", False):
        return
    embedding = gpt.embedding.word_embeddings

    def hook(module, args, output):
        input_ids = args[0]
        keep = (input_ids != pad_token_id).unsqueeze(-1)
        if keep.shape[:2] != output.shape[:2]:  # [s, b, h] (sequence parallel: s / tp)
            keep = keep.transpose(0, 1)
            if keep.shape[0] != output.shape[0]:
                from megatron.core import parallel_state

                keep = keep.chunk(parallel_state.get_tensor_model_parallel_world_size())[
                    parallel_state.get_tensor_model_parallel_rank()]
        return torch.where(keep, output, output.detach())

    embedding.register_forward_hook(hook)


def layer_offset(gpt) -> int:
    layers = gpt.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"{path}: no model.safetensors(.index.json)")
            with safe_open(single, "pt") as f:
                files = {k: "model.safetensors" for k in f.keys()}
        self.path, self.files = path, files
        self._handles: dict = {}
        self._open = safe_open

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files and name.startswith("model."):
            # A vision-language checkpoint (Qwen3.5) keeps its text model one level down.
            name = "model.language_model." + name[len("model."):]
        fname = self.files[name]
        if fname not in self._handles:
            self._handles[fname] = self._open(os.path.join(self.path, fname), "pt")
        return self._handles[fname].get_tensor(name)


@torch.no_grad()
def load_hf_weights(gpt, hf, ckpt: HFCheckpoint, *, te_names: bool, padded_vocab: int) -> None:
    """Fill this rank's GPTModel shard from the HF checkpoint (each rank reads what it needs)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    offset = layer_offset(gpt)
    tied = bool(hf.tie_word_embeddings)
    state = gpt.state_dict(keep_vars=True)
    for local, param in state.items():
        if "_extra_state" in local or not isinstance(param, torch.Tensor):
            continue
        name = hf_map.global_name(local, offset)
        sources = [ckpt.get(n) for n in hf_map.hf_names_of(name, te_names=te_names, tied=tied)]
        full = hf_map.to_megatron(hf, name, sources, padded_vocab)
        part = hf_map.shard(name, full, tp_rank, tp_size)
        if part.shape != param.shape:
            raise ValueError(f"{name}: checkpoint gives {tuple(part.shape)}, model has "
                             f"{tuple(param.shape)}")
        param.data.copy_(part.to(param.dtype))


def gather_tp(name: str, local: torch.Tensor) -> torch.Tensor:
    """The full tensor from every TP rank's shard (a collective over the TP group)."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1 or hf_map.tp_split_dim(name) is None:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(),
                    group=parallel_state.get_tensor_model_parallel_group())
    return hf_map.unshard(name, parts)


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                             with_entropy: bool, entropy_grad: bool = False,
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(target) (and entropy) from this TP rank's vocab slice of the logits.

    ``logits`` [N, V/tp]; columns beyond the real ``vocab_size`` (padding) are dropped.
    All-reduces use Megatron's reduce-from-TP-region (backward: identity), which is the
    right gradient because every TP rank computes the same loss from the reduced values
    AND every reduced term depends on this rank's logits only (no reduced value feeds a
    local term; e.g. entropy is written as lse - sum(e*x)/sum(e), not with p = e/sum).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    start = tp_rank * part
    valid = max(min(vocab_size - start, part), 0)
    logits = logits[..., :valid].float()
    local_max = logits.max(dim=-1).values.detach()
    if tp_size > 1:
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX,
                        group=parallel_state.get_tensor_model_parallel_group())
        reduce = reduce_from_tensor_model_parallel_region
    else:
        global_max = local_max
        reduce = lambda x: x  # noqa: E731
    shifted = logits - global_max[:, None]
    exp = shifted.exp()
    sum_exp = reduce(exp.sum(dim=-1))
    lse = sum_exp.log()
    in_range = (targets >= start) & (targets < start + valid)
    local_idx = (targets - start).clamp(0, max(valid - 1, 0))
    target_logit = shifted.gather(-1, local_idx[:, None]).squeeze(-1) * in_range
    logp = reduce(target_logit) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # H = lse - E_p[shifted]; the local sums must not use a reduced value (lse),
            # or the identity backward of the reduce would drop other ranks' gradients.
            entropy = lse - reduce((exp * shifted).sum(dim=-1)) / sum_exp
    return logp, entropy
