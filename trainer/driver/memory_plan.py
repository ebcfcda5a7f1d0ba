"""Per-GPU memory plan of a GPU layout, checked at start-up before Ray starts.

    from trainer.driver.memory_plan import plan_memory, check_memory
    plan = plan_memory(config)          # a MemoryPlan: phases x components, in bytes
    print(plan.table())
    plan.check()                        # MemoryPlanError (a ConfigError) if it cannot fit
    check_memory(config)                # the start-up hook: no-op on CPU, else plan + check

Everything is arithmetic on the config and the model's architecture (``model.path``'s
config.json, or the built-in table of the recipes' public architectures when that
directory is not on this machine), so a plan prints anywhere, without the model or a GPU:
``python scripts/memory_plan.py +recipe=qwen_4b``.

What is counted, per GPU (B = bytes per parameter, P = this GPU's parameters):

Training, Megatron (``train.backend=megatron``, as trainer/training/backends/megatron builds it):
  P = parameters of one TP x PP shard: matrices and the vocab-parallel embedding / LM
  head (vocabulary padded to a multiple of 128 x TP) divided by TP, norms replicated,
  ceil(layers / PP) layers; a pipeline stage holds the embedding (first) or final norm
  and LM head (last; a copy of tied embeddings when PP > 1): the larger stage is planned.
  weights    2 B (bf16/fp16 model parameters; 4 B with model.dtype=float32)
  grads      4 B (DDP grad buffer, grad_reduce_in_fp32; full size even with the
               distributed optimizer, which reduce-scatters into it)
  optimizer  fp32 main parameters 4 B (not with float32 weights) + Adam moments 8 B,
               divided by DP x CP with train.use_distributed_optimizer
  reference  2 B more when algo.kl_coef > 0 (a frozen copy)
  Colocated, between training phases ``offload`` moves every storage to the host
  (trainer/training/backends/megatron/offload.py; MEGATRON_KEPT_WHEN_OFFLOADED names what stays).
  start-up peak: the largest of three moments of a rank's start-up: the model built in
  fp32 (4 B, plus the KL reference, plus one checkpoint tensor), DDP's buffers allocated
  while the cast parameters are alive (B + B for param_data with the distributed
  optimizer + 4 B grad_data: 8 B in bf16, megatron-core 0.16.1
  distributed/param_and_grad_buffer.py:795-835), the optimizer built (B + 4 B + fp32
  main shards 4 B / (DP x CP)). Adam moments appear at the first step.
  attention scores: without Transformer Engine the local spec's attention materialises
  each layer's [rows, heads / TP, s, s] score matrix: 16 B per element while a layer
  runs (bf16 scores, fp32 copy, masked copy, fp32 softmax, bf16 probabilities), 6 B per
  element kept per layer for backward without checkpointing; elements <= micro-batch
  tokens x min(model.max_context_len, tokens) x heads / TP. The start-up check takes
  Transformer Engine as present when it imports in the driver's process.

Training, FSDP (``train.backend=fsdp``): fp32 master parameters, fp32 grads and Adam
  moments, all sharded over the train world size (4 + 4 + 8 B per parameter / W), plus
  the bf16 parameters FSDP gathers at once (the root module's: embedding, final norm, LM
  head; and two decoder layers, the running one and the prefetched one). Colocated,
  ``offload`` moves all of it to the host while the engines generate. start-up peak:
  the fp32 shards (the model is loaded on the host and sharded before it moves).

Weight push: the sending rank's bucket on its GPU (train.weight_bucket_mb of gathered
  tensors in the engines' dtype, or the largest tensor alone when larger).

Activations: tokens per micro-batch x hidden x layers x factor (bytes), with
  tokens = train.max_tokens_per_micro_batch, or fewer when the samples a rank gets per
  optimizer step cannot fill it: whole samples are packed, at most model.max_context_len
  tokens each (and one sample longer than the budget gets a micro-batch of its own), so
  tokens = max_context_len if that is >= the budget, else min(budget, samples per rank x
  max_context_len), samples per rank = ceil(global_batch_size / DP).
  factor = (8h + 6 (n_heads + n_kv_heads) head_dim + 8 I) / h: the bf16 tensors a Qwen3 /
  Llama layer keeps for backward per token, with fused (flash) attention, no dropout:
  norm inputs and outputs 8h, q/k before their norms, q/k/v after RoPE and the attention
  output 6 (n_heads + n_kv_heads) head_dim, SwiGLU gate+up, silu(gate) and the down
  projection's input 8 I (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", counted for this block; their GPT block gives 34).
  Qwen3-4B: 50.4, Qwen3-8B: 39.5. Divided by TP with sequence parallel; without it the
  8h of norm tensors are replicated on every TP rank. The Hugging Face model (FSDP) keeps
  more: its RMSNorm saves an fp32 copy of its input besides the bf16 output (6 B per
  element for each of the 2 layer norms and the q/k norms), and attention's output is
  kept twice (by SDPA and by o_proj): factor (12h + 12 (n_heads + n_kv_heads) head_dim
  + 8 I) / h, 66.4 for Qwen3-4B. With activation checkpointing
  (train.gradient_checkpointing: Megatron full recompute of every layer, HF's
  per-layer checkpointing) each layer keeps only its input (factor 2) plus one layer
  recomputed at full size. PP > 1: the first stage holds PP micro-batches in flight
  (1F1B). Context parallel divides the tokens.
  Logits: vocabulary / TP x (6 B x tokens + 12 B x response tokens): Megatron's bf16
  output and its fp32 copy at every position, and three fp32 working copies (selected
  rows, shifted, exp; their gradients in backward) of the rows that predict a response
  token. FSDP computes the LM head at those rows only: vocabulary x 18 B x response
  tokens. Response tokens = min(tokens, samples per rank x max_turns x
  rollout.max_response_len), max_turns the larger of env.max_turns and
  rollout.extra_config.max_turns (what custom generate functions read).
  Both are upper bounds on what one micro-batch can need.

Engines (SGLang, rollout.num_gpus_per_engine = engine TP):
  static     mem_fraction_static x GPU memory: SGLang sizes weights + KV cache pool to
               that fraction of the GPU; weights = model in model.dtype / engine TP, the
               KV pool is the rest. Shown next to it: what rollout.max_concurrency
               requests (spread over the engines) of model.max_context_len tokens need.
  runtime    CUDA context and attention-backend workspace (1 GiB), NCCL (TP/8 GiB, as
               SGLang reserves), CUDA graphs (2 MiB per decode batch size up to 256, 512
               with TP >= 4: SGLang's own estimate) and, while generating, one prefill
               chunk's activations (8192 tokens on >= 60 GiB GPUs). rollout.dtype,
               rollout.sglang_max_total_tokens and the --mem-fraction-static,
               --max-total-tokens, --kv-cache-dtype, --chunked-prefill-size,
               --cuda-graph-max-bs and --disable-cuda-graph of rollout.sglang_args count.
  Colocated (SGLang's memory saver, on whenever cluster.colocate): release frees the
  weights and the KV pool, and the decode CUDA graphs where the engine's launch sets
  SGLANG_MEMORY_SAVER_CUDA_GRAPH (rollout/engines/actor.py does for colocated engines;
  otherwise they are counted as kept); the context, workspace and NCCL buffers are
  counted as kept.

Layouts and phases (each must fit):
  colocated      every GPU holds one training rank and an engine (shard), which take
                 turns (trainer.driver.runtime, trainer.weight_sync.engine_updates):
                 engine start-up (the engine alone: static + runtime + graphs); trainer
                 start-up (the engines
                 released: the rank's start-up peak + what a released engine keeps);
                 weight push (the ranks offloaded, the engines' weights back: the first
                 push, before the base evaluation and rollout 1, and every step's);
                 rollout (engine static + runtime + what the offloaded trainer keeps);
                 training (trainer state + activations + logits + what the released
                 engine keeps).
  disaggregated  engine GPUs (rollout.num_gpus) hold the engines alone; training GPUs
                 (the train world) hold the trainer alone: its start-up, a push (the
                 trainer's state between steps + the bucket) and training.
Each training process also has a CUDA context (0.5 GiB) and, in a multi-GPU group, NCCL
buffers (0.5 GiB). Fragmentation is not modelled: a plan with under 5% headroom says so.

GPU memory: ``cluster.gpu_memory_gib`` if the config has that key and it is set, else the
table below keyed by ``cluster.gpu_type`` (default H100, the recipes' cluster). Totals are
what CUDA reports, a little under the nominal size.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from config import ConfigError
from rollout.engines.sglang_serving import SGLANG_MAMBA_FULL_MEMORY_RATIO, SLOTS_PER_REQUEST

GiB = 2**30
MiB = 2**20

# Per-GPU memory (GiB) as CUDA reports it (torch.cuda.mem_get_info's total).
GPU_MEMORY_GIB: dict[str, float] = {
    "H100": 79.1,       # H100 80 GB (SXM / PCIe)
    "H200": 139.8,      # H200 141 GB
    "A100": 79.1,       # A100 80 GB
    "A100-40GB": 39.4,  # A100 40 GB
}
DEFAULT_GPU = "H100"

# Fixed overheads (GiB), documented in the module docstring.
TRAIN_CONTEXT_GIB = 0.5      # CUDA context, cuBLAS workspace of a training process
TRAIN_NCCL_GIB = 0.5         # NCCL communicator buffers, when the train world is > 1
ENGINE_CONTEXT_GIB = 1.0     # CUDA context + attention-backend workspace of an engine
ENGINE_CUDA_GRAPH_MIB_PER_BS = 2.0  # SGLang's reserve per captured decode batch size
# Activation bytes per token per layer: (8h + 6(nh + nkv)hd + 8I), see the docstring.
CKPT_FACTOR = 2              # activation checkpointing: a layer's bf16 input per token
# A Gated DeltaNet layer's mixer, bytes kept per token per channel (module docstring): the
# conv's bf16 input and output plus q/k/v in fp32 for the kernel (8 per conv channel); the
# kernel's fp32 output, z and the gated norm's bf16 output (10 per value channel).
GDN_CONV_BYTES = 8
GDN_VALUE_BYTES = 10
# Logits, bytes per vocabulary entry: bf16 output + its fp32 copy of every position of
# the micro-batch (Megatron computes all), and three fp32 working copies of the response
# rows (the selected rows, shifted, exp; or their gradients in backward).
LOGITS_BYTES_PER_TOKEN = 6
LOGITS_BYTES_PER_RESPONSE_TOKEN = 12
TIGHT_FRACTION = 0.05        # headroom under 5% of the GPU is reported as tight
# Colocated, what the Megatron backend's offload() leaves on the GPU while the engines
# generate: nothing since it offloads every storage (trainer/training/backends/megatron/offload.py);
# before that it moved only the Adam moments, i.e. ("weights", "grads",
# "optimizer: fp32 main params", "reference model").
MEGATRON_KEPT_WHEN_OFFLOADED: tuple[str, ...] = ()
# Megatron's local attention (no Transformer Engine) per element of one layer's score
# matrix [b, heads / TP, s, s] (megatron-core 0.16.1 transformer/dot_product_attention.py
# 188-212 and fusions/fused_softmax.py 299-340, softmax in fp32): the bf16 scores (a
# global buffer), their fp32 copy, the masked copy, the fp32 softmax and its bf16 cast
# alive at once; kept for backward: the fp32 softmax and the bf16 probabilities.
SCORE_BYTES_TRANSIENT = 16
SCORE_BYTES_KEPT = 6


# Table rows, trainer first, then the engine.
ROW_ORDER = ("start-up peak", "weights", "grads", "optimizer: fp32 main params",
             "optimizer: Adam moments", "reference model", "gathered params", "push bucket",
             "activations", "attention scores", "logits", "trainer runtime",
             "engine weights", "engine KV cache pool", "engine recurrent states", "engine runtime",
             "engine CUDA graphs",
             "engine prefill activations")


class MemoryPlanError(ConfigError):
    """A layout that cannot fit the GPU: lists the components and what to change."""


# ====================================================================== architecture
@dataclass(frozen=True)
class ModelArch:
    """The numbers of a dense decoder (Qwen3 / Qwen2 / Llama) that memory depends on; a
    hybrid one (Qwen3.5) also has Gated DeltaNet layers (``linear_layers`` of the
    ``num_layers``: no KV cache, a recurrent state per sequence) and gated attention."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = True          # Qwen3: RMSNorm on q and k (head_dim weights each)
    attention_bias: bool = False  # Qwen2: q/k/v biases
    attn_output_gate: bool = False  # Qwen3.5: q_proj also yields a per-head output gate
    linear_layers: int = 0        # Gated DeltaNet layers (Qwen3.5: 3 of every 4)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 4

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "ModelArch":
        parent = cfg
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        if cfg.get("num_experts") or cfg.get("n_routed_experts"):
            raise ConfigError(f"model.path: {name or 'the model'} is a mixture-of-experts "
                              "model; the memory plan covers dense models only")
        heads = int(cfg["num_attention_heads"])
        model_type = cfg.get("model_type", "")
        layers = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or (
            ["full_attention" if (i + 1) % int(cfg["full_attention_interval"]) == 0
             else "linear_attention" for i in range(layers)]
            if cfg.get("full_attention_interval") else [])
        qwen3_5 = model_type.startswith("qwen3_5")
        return cls(
            name=name or cfg.get("_name_or_path") or model_type or "model",
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            # A vision-language config's text part may leave the flag to its parent.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             parent.get("tie_word_embeddings", False))),
            qk_norm=model_type == "qwen3" or qwen3_5,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            attn_output_gate=qwen3_5,
            linear_layers=sum(t == "linear_attention" for t in types),
            linear_key_heads=int(cfg.get("linear_num_key_heads") or 0),
            linear_value_heads=int(cfg.get("linear_num_value_heads") or 0),
            linear_key_dim=int(cfg.get("linear_key_head_dim") or 0),
            linear_value_dim=int(cfg.get("linear_value_head_dim") or 0),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
        )

    # -------------------------------------------------------------- layer kinds
    @property
    def attention_layers(self) -> int:
        return self.num_layers - self.linear_layers

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet's conv: q, k (key heads) and v (value heads)."""
        return (2 * self.linear_key_heads * self.linear_key_dim
                + self.linear_value_heads * self.linear_value_dim)

    def _attention_matrix(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        q = self.num_heads * hd * (2 if self.attn_output_gate else 1)
        bias = (self.num_heads + 2 * self.num_kv_heads) * hd if self.attention_bias else 0
        return h * (q + 2 * self.num_kv_heads * hd) + bias + self.num_heads * hd * h

    def _gdn_matrix(self) -> int:
        """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj of one GDN layer."""
        h, value = self.hidden_size, self.linear_value_heads * self.linear_value_dim
        return h * (self.conv_dim + value + 2 * self.linear_value_heads) + value * h

    def _gdn_small(self) -> int:
        """The conv weights, A_log, dt_bias and the gated norm of one GDN layer."""
        return self.conv_dim * self.conv_kernel + 2 * self.linear_value_heads + self.linear_value_dim

    # -------------------------------------------------------------- parameter counts
    def layer_matrix_params(self, gdn_split: bool = True) -> float:
        """Parameters of one layer that tensor parallelism splits (projections); a
        hybrid model's layers differ, so this is their mean. ``gdn_split=False``: the
        Gated DeltaNet is replicated over TP (homegym's Megatron model), not split."""
        mixer = self.attention_layers * self._attention_matrix() + (
            self.linear_layers * self._gdn_matrix() if gdn_split else 0)
        return mixer / self.num_layers + 3 * self.hidden_size * self.intermediate_size

    def layer_norm_params(self, gdn_split: bool = True) -> float:
        """Parameters of one layer that every TP rank holds whole (norms; the mean over a
        hybrid model's layers, a replicated Gated DeltaNet included)."""
        qk = 2 * self.head_dim * self.attention_layers if self.qk_norm else 0
        gdn = self.linear_layers * (self._gdn_small() + (0 if gdn_split else self._gdn_matrix()))
        return 2 * self.hidden_size + (qk + gdn) / self.num_layers

    def layer_params(self) -> int:
        return self.layer_matrix_params() + self.layer_norm_params()

    def lora_params(self, rank: int, target_modules) -> int:
        """Parameters of rank-``rank`` LoRA adapters (A: r x in, B: out x r) on the named
        projections of every layer."""
        h, hd, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        gate = 2 if self.attn_output_gate else 1
        value = self.linear_value_heads * self.linear_value_dim
        layers = {"q_proj": (self.attention_layers, h, gate * q),
                  "k_proj": (self.attention_layers, h, kv), "v_proj": (self.attention_layers, h, kv),
                  "o_proj": (self.attention_layers, q, h),
                  "in_proj_qkv": (self.linear_layers, h, self.conv_dim),
                  "in_proj_z": (self.linear_layers, h, value),
                  "out_proj": (self.linear_layers, value, h)}
        layers.update({m: (self.num_layers, *d) for m, d in
                       {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}.items()})
        return sum(n * rank * (a + b) for m, (n, a, b) in layers.items() if m in target_modules)

    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_layers * self.layer_params() + self.hidden_size

    def activation_factor(self, hf: bool = False) -> float:
        """Activation bytes per token per layer, divided by the hidden size."""
        return self.activation_bytes_per_token_layer(hf=hf) / self.hidden_size

    def activation_bytes_per_token_layer(self, tp: int = 1, sequence_parallel: bool = True,
                                         hf: bool = False) -> float:
        """bf16 bytes one layer keeps for backward per token (module docstring):
        Megatron + Transformer Engine, or the Hugging Face model (``hf``, FSDP)."""
        h = self.hidden_size
        norm = (12 if hf else 8) * h
        attention = (12 if hf else 6) * (self.num_heads + self.num_kv_heads) * self.head_dim
        if self.attn_output_gate:  # the gate and the gated output
            attention += (8 if hf else 4) * self.num_heads * self.head_dim
        if self.linear_layers:  # the mean over the layers (module docstring)
            value = self.linear_value_heads * self.linear_value_dim
            gdn = GDN_CONV_BYTES * self.conv_dim + GDN_VALUE_BYTES * value
            attention = (self.attention_layers * attention + self.linear_layers * gdn) / self.num_layers
        rest = attention + 8 * self.intermediate_size
        if sequence_parallel:
            return (norm + rest) / tp
        return norm + rest / tp

    def kv_bytes_per_token(self, tp: int = 1, dtype_bytes: int = 2) -> int:
        """KV cache bytes per token on one engine GPU (KV heads split over TP, replicated
        when there are fewer KV heads than TP ranks)."""
        heads = max(1, self.num_kv_heads // tp)
        return 2 * self.attention_layers * heads * self.head_dim * dtype_bytes

    def state_bytes_per_sequence(self, tp: int = 1) -> int:
        """A sequence's Gated DeltaNet state on one engine GPU, as SGLang keeps it: the
        fp32 recurrent state (value heads x key dim x value dim) and the conv's last
        kernel - 1 inputs (bf16) of every linear-attention layer; 0 for a dense model."""
        heads = max(1, self.linear_value_heads // tp)
        recurrent = heads * self.linear_key_dim * self.linear_value_dim * 4
        conv = self.conv_dim // tp * (self.conv_kernel - 1) * 2
        return self.linear_layers * (recurrent + conv)


# Public configs of the recipes' models (Hugging Face Qwen/Qwen3-*/config.json).
BUILTIN_ARCHS: dict[str, ModelArch] = {
    "qwen3-0.6b": ModelArch("Qwen3-0.6B", hidden_size=1024, num_layers=28, num_heads=16,
                            num_kv_heads=8, head_dim=128, intermediate_size=3072,
                            vocab_size=151936, tie_word_embeddings=True),
    "qwen3-4b": ModelArch("Qwen3-4B", hidden_size=2560, num_layers=36, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=9728,
                          vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": ModelArch("Qwen3-8B", hidden_size=4096, num_layers=36, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=12288,
                          vocab_size=151936, tie_word_embeddings=False),
    # Qwen3.5-4B as slime's model script gives it (FACTS.md); intermediate_size and the tie
    # flag are Qwen's config.json as recalled here, not read on this machine (no hub).
    "qwen3.5-4b": ModelArch("Qwen3.5-4B", hidden_size=2560, num_layers=32, num_heads=16,
                            num_kv_heads=4, head_dim=256, intermediate_size=9216,
                            vocab_size=248320, tie_word_embeddings=True, attn_output_gate=True,
                            linear_layers=24, linear_key_heads=16, linear_value_heads=32,
                            linear_key_dim=128, linear_value_dim=128),
}
_BUILTIN_RE = re.compile(r"qwen3(\.5|_5)?[-_]?(0\.6|4|8)b", re.IGNORECASE)


def model_arch(config) -> tuple[ModelArch, str]:
    """(architecture, where it came from) for ``model.path``: its config.json when the
    directory exists here (built-in offline models: from the cache, built on first use),
    else the built-in table when the path names a recipe model (Qwen3-0.6B/4B/8B)."""
    path = config.model.path
    cfg_file = Path(path) / "config.json"
    from rollout.models import BUILTIN_MODELS, default_cache_dir, resolve_model_path

    if path in BUILTIN_MODELS and not cfg_file.is_file():  # homegym's offline models
        cached = Path(config.model.cache_dir or default_cache_dir()) / path / "config.json"
        cfg_file = cached if cached.is_file() else \
            Path(resolve_model_path(path, config.model.cache_dir)) / "config.json"
    if cfg_file.is_file():
        with open(cfg_file) as f:
            return (ModelArch.from_hf_config(json.load(f), name=Path(path).name or path),
                    str(cfg_file))
    match = _BUILTIN_RE.search(os.path.basename(str(path).rstrip("/")))
    key = match and f"qwen3{'.5' if match.group(1) else ''}-{match.group(2)}b"
    if key in BUILTIN_ARCHS:
        arch = BUILTIN_ARCHS[key]
        return arch, f"built-in {arch.name} architecture ({path} is not on this machine)"
    raise ConfigError(
        f"model.path: {path!r} has no config.json here and is not one of the built-in "
        f"architectures ({', '.join(a.name for a in BUILTIN_ARCHS.values())}); the memory "
        "plan needs the model's config.json")


# ====================================================================== GPU memory
def gpu_capacity(config, gpu: Optional[str] = None,
                 memory_gib: Optional[float] = None) -> tuple[str, float]:
    """(GPU name, GiB per GPU): explicit arguments, else ``cluster.gpu_memory_gib`` /
    ``cluster.gpu_type`` when the config has them, else the H100 row."""
    cluster = config.cluster
    memory_gib = memory_gib if memory_gib is not None else getattr(cluster, "gpu_memory_gib", None)
    name = gpu or getattr(cluster, "gpu_type", None) or DEFAULT_GPU
    if memory_gib is not None:
        if memory_gib <= 0:
            raise ConfigError("cluster.gpu_memory_gib: must be > 0")
        return str(name), float(memory_gib)
    key = _gpu_key(str(name))
    if key is None:
        raise ConfigError(f"cluster.gpu_type: unknown GPU {name!r}; known: "
                          f"{', '.join(GPU_MEMORY_GIB)} (or set cluster.gpu_memory_gib)")
    return key, GPU_MEMORY_GIB[key]


def _gpu_key(name: str) -> Optional[str]:
    norm = re.sub(r"[^A-Z0-9]", "", name.upper().replace("NVIDIA", ""))
    for key in GPU_MEMORY_GIB:
        if norm == re.sub(r"[^A-Z0-9]", "", key.upper()):
            return key
    if norm.startswith("A100"):
        return "A100-40GB" if "40G" in norm else "A100"
    for key in ("H200", "H100"):
        if norm.startswith(key):
            return key
    return None


# ====================================================================== the plan
@dataclass(frozen=True)
class Item:
    """One component of a phase: ``nbytes`` per GPU; ``note`` says how it was counted."""

    name: str
    nbytes: float
    note: str = ""


@dataclass(frozen=True)
class Phase:
    """What one GPU holds at one moment (e.g. the colocated training peak)."""

    name: str
    gpus: int
    items: tuple[Item, ...]

    @property
    def total(self) -> float:
        return sum(i.nbytes for i in self.items)

    def get(self, name: str) -> float:
        return sum(i.nbytes for i in self.items if i.name == name)

    def largest(self) -> Item:
        return max(self.items, key=lambda i: i.nbytes)


@dataclass(frozen=True)
class MemoryPlan:
    recipe: str
    arch: ModelArch
    arch_source: str
    gpu: str
    capacity: float  # bytes per GPU
    layout: str      # "colocated" | "disaggregated"
    phases: tuple[Phase, ...]
    summary: tuple[str, ...]  # lines describing the layout
    notes: tuple[str, ...] = ()
    suggestions: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return all(p.total <= self.capacity for p in self.phases)

    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(name)

    def table(self) -> str:
        names: list[str] = []
        notes: dict[str, str] = {}
        for p in self.phases:
            for i in p.items:
                if i.name not in names:
                    names.append(i.name)
                notes.setdefault(i.name, i.note)
        names.sort(key=lambda n: ROW_ORDER.index(n) if n in ROW_ORDER else len(ROW_ORDER))
        width = max(len(n) for n in names + ["total", "GPU memory"]) + 2
        cols = [f"{p.name} ({p.gpus} GPU{'s' if p.gpus != 1 else ''})" for p in self.phases]
        cw = max(12, *(len(c) + 2 for c in cols))
        lines = [f"memory plan: {self.recipe}, {self.arch.name} "
                 f"({self.arch.num_params() / 1e9:.2f} B parameters; {self.arch_source})"]
        lines += [f"  {s}" for s in self.summary]
        lines.append("")
        lines.append("per GPU, GiB".ljust(width) + "".join(c.rjust(cw) for c in cols))
        for n in names:
            row = n.ljust(width)
            for p in self.phases:
                has = any(i.name == n for i in p.items)
                row += (f"{p.get(n) / GiB:.2f}" if has else "-").rjust(cw)
            if notes.get(n):
                row += f"   {notes[n]}"
            lines.append(row)
        lines.append("total".ljust(width) + "".join(f"{p.total / GiB:.2f}".rjust(cw)
                                                    for p in self.phases))
        lines.append("GPU memory".ljust(width) + "".join(
            f"{self.capacity / GiB:.2f}".rjust(cw) for _ in self.phases) + f"   {self.gpu}")
        lines.append("headroom".ljust(width) + "".join(
            f"{(self.capacity - p.total) / GiB:.2f}".rjust(cw) for p in self.phases))
        verdict = "fits" if self.fits else "DOES NOT FIT"
        peak = self.peak
        lines.append("")
        lines.append(f"{verdict}: peak {peak.total / GiB:.1f} of {self.capacity / GiB:.1f} GiB "
                     f"per GPU ({peak.name})")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def error_message(self) -> Optional[str]:
        over = [p for p in self.phases if p.total > self.capacity]
        if not over:
            return None
        parts = []
        for p in over:
            big = p.largest()
            comps = ", ".join(f"{i.name} {i.nbytes / GiB:.1f}" for i in
                              sorted(p.items, key=lambda i: -i.nbytes))
            parts.append(
                f"{p.name}: {p.total / GiB:.1f} GiB per GPU, more than the {self.gpu}'s "
                f"{self.capacity / GiB:.1f} GiB (largest: {big.name} {big.nbytes / GiB:.1f} "
                f"GiB; in GiB: {comps})")
            changes = self.suggestions.get(p.name, ())
            if changes:
                parts.append("  change: " + "; ".join(changes))
        return ("memory plan: this layout cannot fit (" + self.layout + ", " + self.recipe
                + "):\n  " + "\n  ".join(parts)
                + "\n  (the whole plan: python scripts/memory_plan.py <the same overrides>)")

    def check(self) -> "MemoryPlan":
        message = self.error_message()
        if message:
            raise MemoryPlanError(message)
        return self


def max_turns(config) -> int:
    """Engine calls per sample: env.max_turns, or rollout.extra_config.max_turns (what
    custom generate functions read) when that is larger."""
    extra = config.rollout.extra_config.get("max_turns")
    return max(config.env.max_turns, int(extra) if isinstance(extra, (int, float)) else 0)


def micro_batch_tokens(config, dp: int) -> tuple[int, int, str]:
    """(tokens, response tokens) one rank's micro-batch can hold, and how that follows
    from the config (see the module docstring)."""
    r, train = config.rollout, config.train
    cap, context = train.max_tokens_per_micro_batch, config.model.max_context_len
    minibatch = train.global_batch_size or r.rollout_batch_size * r.n_samples_per_prompt
    per_rank = math.ceil(minibatch / dp)
    if train.backend == "fsdp" and config.derived.share_prompts:
        groups = math.ceil(minibatch / r.n_samples_per_prompt)
        if groups >= dp:  # shared-prefix training deals whole groups to ranks
            per_rank = math.ceil(groups / dp) * r.n_samples_per_prompt
    if context >= cap:
        tokens = context
        why = (f"model.max_context_len={context} >= train.max_tokens_per_micro_batch={cap}: "
               "a sample that long gets a micro-batch of its own")
    else:
        tokens = min(cap, per_rank * context)
        why = (f"train.max_tokens_per_micro_batch={cap}" if tokens == cap else
               f"{per_rank} sample{'s' if per_rank != 1 else ''} per rank x "
               f"model.max_context_len={context} < train.max_tokens_per_micro_batch={cap}")
    turns = max_turns(config)
    response = min(tokens, per_rank * turns * r.max_response_len)
    why += (f"; <= {response} response tokens ({per_rank} x {turns} turns x "
            f"rollout.max_response_len={r.max_response_len})")
    return tokens, response, why


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M" if n >= 1e5 else f"{int(n)}"


def _activations(arch: ModelArch, tokens: float, layers: int, *, tp: int = 1,
                 sequence_parallel: bool = True, checkpointing: bool = False) -> float:
    """Bytes of activations kept for backward: ``tokens`` x ``layers`` (see docstring)."""
    per_layer = arch.activation_bytes_per_token_layer(tp, sequence_parallel)
    if not checkpointing:
        return tokens * layers * per_layer
    kept = CKPT_FACTOR * arch.hidden_size / (tp if sequence_parallel else 1)
    return tokens * layers * kept + tokens * per_layer  # + one layer recomputed


def _fsdp_activations(arch: ModelArch, tokens: float, checkpointing: bool) -> float:
    per_layer = arch.activation_bytes_per_token_layer(hf=True)
    if not checkpointing:
        return tokens * arch.num_layers * per_layer
    return tokens * arch.num_layers * CKPT_FACTOR * arch.hidden_size + tokens * per_layer


@dataclass
class _Trainer:
    items: list[Item]          # one training GPU at the training peak
    resident: list[Item]       # what stays on it while colocated engines generate
    startup: list[Item]        # at the peak of a rank's start-up (runtime included)
    at_rest: list[Item]        # between steps, not offloaded (runtime included)
    summary: list[str]
    tokens: int                # micro-batch tokens
    token_slope: float         # training-peak bytes per micro-batch token
    ckpt_activations: Optional[float]  # activations with checkpointing (if it is off)
    tp: int
    sequence_parallel: bool


def _megatron_startup(params: float, *, wbytes: int, kl: bool, dist_opt: bool, shard: int,
                      largest: float) -> Item:
    """The peak of a Megatron rank's start-up, as trainer/training/backends/megatron/backend.py
    builds it: the model in fp32 (TransformerConfig params_dtype, master weights) with one
    checkpoint tensor in flight, the KL reference likewise then cast; Float16Module casts
    the policy to model.dtype one parameter at a time; DDP then allocates its contiguous
    param_data (model.dtype, distributed optimizer only) and fp32 grad_data while the
    parameters are still alive, copies them in and frees them (megatron-core 0.16.1
    distributed/param_and_grad_buffer.py:795-835); the distributed optimizer clones its
    fp32 main-parameter shards (optimizer/distrib_optimizer.py:399). Adam moments come
    with the first step."""
    ref = wbytes * params if kl else 0.0
    moments = {
        "model build in fp32": 4 * params + 4 * largest + (4 * params if kl else 0.0),
        "DDP buffers allocated": ref + wbytes * params + (wbytes * params if dist_opt else 0.0)
        + 4 * params,
        "optimizer built": ref + wbytes * params + 4 * params
        + (4 * params / shard if wbytes < 4 else 0.0),
    }
    when = max(moments, key=moments.get)
    return Item("start-up peak", moments[when], f"{when} ({_count(params)} params/GPU); "
                + ", ".join(f"{k} {v / GiB:.1f}" for k, v in moments.items()) + " GiB")


def _attention_scores(arch: ModelArch, tokens: int, context: int, *, tp: int, layers: int,
                      checkpointing: bool) -> tuple[float, str]:
    """Megatron's local attention materialises every layer's score matrix; a micro-batch
    of ``tokens`` in padded rows of at most ``context`` has at most tokens x min(context,
    tokens) x heads / TP elements per layer. Checkpointed, one layer's at a time; else
    each layer keeps SCORE_BYTES_KEPT per element for backward."""
    elems = tokens * min(context, tokens) * arch.num_heads / tp
    if checkpointing:
        return SCORE_BYTES_TRANSIENT * elems, (
            f"{elems / 1e9:.2f} G elements x {SCORE_BYTES_TRANSIENT} B in one layer")
    nbytes = SCORE_BYTES_KEPT * elems * layers + (SCORE_BYTES_TRANSIENT - SCORE_BYTES_KEPT) * elems
    return nbytes, (f"{elems / 1e9:.2f} G elements x ({SCORE_BYTES_KEPT} B kept x {layers} "
                    f"layers + {SCORE_BYTES_TRANSIENT - SCORE_BYTES_KEPT} B)")


def _trainer(config, arch: ModelArch, *, transformer_engine: bool = True) -> _Trainer:
    train, model = config.train, config.model
    world = train.world_size
    half = model.dtype in ("bfloat16", "float16")
    wbytes = 2 if half else 4
    kl = config.algo.kl_coef > 0
    ckpt = train.gradient_checkpointing
    h, L, V = arch.hidden_size, arch.num_layers, arch.vocab_size
    items: list[Item] = []
    if train.backend == "megatron":
        tp, pp, cp = (train.tensor_model_parallel_size, train.pipeline_model_parallel_size,
                      train.context_parallel_size)
        dp = world // (tp * pp * cp)
        sp = train.sequence_parallel
        vp = math.ceil(V / (128 * tp)) * 128 * tp  # Megatron pads the vocabulary
        per_stage = math.ceil(L / pp)
        # Gated DeltaNet layers are replicated over TP (trainer/backends/megatron).
        layers = per_stage * (arch.layer_matrix_params(gdn_split=False) / tp
                              + arch.layer_norm_params(gdn_split=False))
        embed = vp * h / tp
        if pp == 1:
            params = layers + embed + h + (0 if arch.tie_word_embeddings else embed)
        else:  # first stage: embedding; last: final norm + LM head (a copy when tied)
            params = max(layers + embed, layers + h + embed)
        shard = dp * cp if train.use_distributed_optimizer else 1
        how = (f"/ {shard} (distributed optimizer over DP x CP)" if shard > 1
               else "not sharded" + ("" if train.use_distributed_optimizer else
                                     " (no distributed optimizer)"))
        items.append(Item("weights", wbytes * params,
                          f"{model.dtype}, {_count(params)} params/GPU (TP {tp}, PP {pp})"))
        items.append(Item("grads", 4 * params, "fp32 DDP grad buffer, full size"))
        if half:
            items.append(Item("optimizer: fp32 main params", 4 * params / shard, f"4 B/param {how}"))
        items.append(Item("optimizer: Adam moments", 8 * params / shard, f"8 B/param {how}"))
        if kl:
            items.append(Item("reference model", wbytes * params, "frozen copy (algo.kl_coef > 0)"))
        # What offload() leaves on the GPU between colocated training phases.
        resident = [i for i in items if i.name in MEGATRON_KEPT_WHEN_OFFLOADED]
        tokens, response, why = micro_batch_tokens(config, dp)
        t_rank, r_rank = tokens / cp, response / cp
        in_flight = pp  # 1F1B: the first stage holds PP micro-batches' activations
        act = _activations(arch, t_rank, per_stage * in_flight, tp=tp, sequence_parallel=sp,
                           checkpointing=ckpt)
        factor = f"{CKPT_FACTOR} (checkpointed) + one layer x " if ckpt else ""
        note = (f"{tokens} tok x {h} x {per_stage * in_flight} layers x {factor}"
                f"{arch.activation_factor():.1f}")
        if tp > 1:
            note += f", / TP {tp}" + (" (sequence parallel)" if sp else ", norms replicated (no SP)")
        if cp > 1:
            note += f", / CP {cp}"
        items.append(Item("activations", act, note))
        at_rest = [i for i in items if i.name != "activations"]
        largest = max(embed, arch.layer_matrix_params() / tp / 3)  # one checkpoint tensor
        startup = [_megatron_startup(params, wbytes=wbytes, kl=kl,
                                     dist_opt=train.use_distributed_optimizer, shard=shard,
                                     largest=largest)]
        if not transformer_engine:
            scores, how = _attention_scores(arch, t_rank, model.max_context_len, tp=tp,
                                            layers=per_stage * in_flight, checkpointing=ckpt)
            items.append(Item("attention scores", scores, how + " (no Transformer Engine: "
                              "local attention, fp32 softmax)"))
        logits = vp / tp * (LOGITS_BYTES_PER_TOKEN * t_rank + LOGITS_BYTES_PER_RESPONSE_TOKEN * r_rank)
        items.append(Item("logits", logits, f"{vp} vocab / TP {tp} x ({LOGITS_BYTES_PER_TOKEN} B x "
                          f"{tokens} tok + {LOGITS_BYTES_PER_RESPONSE_TOKEN} B x {response} "
                          "response tok)"))
        slope = (act + vp / tp * LOGITS_BYTES_PER_TOKEN * t_rank) / tokens
        ckpt_act = None if ckpt else _activations(arch, t_rank, per_stage * in_flight, tp=tp,
                                                   sequence_parallel=sp, checkpointing=True)
        summary = [
            f"training: megatron, {world} ranks = TP {tp} x PP {pp} x CP {cp} x DP {dp}"
            + (" (sequence parallel)" if sp else "") + "; "
            + ("distributed optimizer" if train.use_distributed_optimizer else
               "no distributed optimizer") + f"; {model.dtype}; activation checkpointing "
            + ("on" if ckpt else "off") + "; attention: "
            + ("fused (Transformer Engine)" if transformer_engine else
               "local, full score matrix (no Transformer Engine)"),
            f"micro-batch: {tokens} tokens ({why})"]
    else:  # fsdp: everything sharded over the train world
        tp, sp = 1, True
        params = arch.num_params()
        items.append(Item("weights", 4 * params / world,
                          f"fp32 master, {_count(params)} params / {world} ranks (FSDP)"))
        lora = train.lora
        # LoRA: gradients and Adam moments of the adapters only; the KL reference is the
        # policy with its adapters off, no second copy.
        trained = arch.lora_params(lora.rank, lora.target_modules) if lora.enabled else params
        what = f"LoRA r{lora.rank}: {_count(trained)} params, " if lora.enabled else ""
        items.append(Item("grads", 4 * trained / world, f"{what}fp32 / {world}"))
        items.append(Item("optimizer: Adam moments", 8 * trained / world, f"{what}fp32 / {world}"))
        if kl and not lora.enabled:
            items.append(Item("reference model", wbytes * params / world, f"{model.dtype} / {world}"))
        at_rest = list(items)
        # Loaded on the host, sharded, then moved: only the shards reach the GPU.
        startup = [Item("start-up peak", 4 * params / world + (wbytes * params / world
                                                              if kl and not lora.enabled else 0),
                        f"fp32 shards of {_count(params)} params / {world} ranks")]
        root = V * h * (1 if arch.tie_word_embeddings else 2) + h
        items.append(Item("gathered params", wbytes * (root + 2 * arch.layer_params()),
                          f"{model.dtype}: embedding, LM head and 2 layers unsharded at once"))
        resident = []  # offload() moves parameters, grads and optimizer state to the host
        tokens, response, why = micro_batch_tokens(config, world)
        act = _fsdp_activations(arch, tokens, ckpt)
        factor = f"{CKPT_FACTOR} (checkpointed) + one layer x " if ckpt else ""
        items.append(Item("activations", act, f"{tokens} tok x {h} x {L} layers x {factor}"
                          f"{arch.activation_factor(hf=True):.1f} (HF model)"))
        fsdp_bytes = LOGITS_BYTES_PER_TOKEN + LOGITS_BYTES_PER_RESPONSE_TOKEN
        items.append(Item("logits", V * fsdp_bytes * response,
                          f"{V} vocab x {fsdp_bytes} B x {response} response tok "
                          "(LM head at response rows only)"))
        slope = act / tokens
        ckpt_act = None if ckpt else _fsdp_activations(arch, tokens, True)
        summary = [f"training: fsdp, {world} ranks; parameters, grads and optimizer sharded over "
                   f"{world}; {model.dtype} compute; activation checkpointing "
                   + ("on" if ckpt else "off"),
                   f"micro-batch: {tokens} tokens ({why})"]
    runtime = Item("trainer runtime", (TRAIN_CONTEXT_GIB + (TRAIN_NCCL_GIB if world > 1 else 0)) * GiB,
                   "CUDA context" + (" + NCCL" if world > 1 else ""))
    return _Trainer(items=items + [runtime], resident=resident + [runtime],
                    startup=startup + [runtime], at_rest=at_rest + [runtime], summary=summary,
                    tokens=tokens, token_slope=slope, ckpt_activations=ckpt_act, tp=tp,
                    sequence_parallel=sp)


@dataclass
class _Engine:
    active: list[Item]   # one engine GPU while generating
    kept: list[Item]     # what a released engine keeps (colocated training)
    kv_pool: float
    kv_token: int        # KV bytes per token per GPU
    requests: int        # requests in flight per engine
    summary: list[str]
    notes: list[str]


def _sglang_arg(args, flag: str) -> Optional[str]:
    """The value of ``flag`` in rollout.sglang_args (``--flag V`` or ``--flag=V``)."""
    args = [str(a) for a in args]
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _engine(config, arch: ModelArch, capacity: float) -> _Engine:
    r, model = config.rollout, config.model
    tp, engines = r.num_gpus_per_engine, config.derived.num_engines
    extra = list(getattr(r, "sglang_args", None) or [])
    dtype = getattr(r, "dtype", None) or model.dtype  # rollout.dtype: the engines' own
    wbytes = 2 if dtype in ("bfloat16", "float16") else 4
    kv_dtype = _sglang_arg(extra, "--kv-cache-dtype") or "auto"
    kv_bytes = 1 if kv_dtype.startswith("fp8") else wbytes
    h, hd = arch.hidden_size, arch.head_dim
    embeds = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    params = arch.num_layers * (arch.layer_matrix_params() / tp + arch.layer_norm_params()) \
        + embeds / tp + h
    weights = wbytes * params
    fraction = float(_sglang_arg(extra, "--mem-fraction-static") or r.mem_fraction_static)
    kv_token = arch.kv_bytes_per_token(tp, kv_bytes)
    kv_pool = fraction * capacity - weights
    pool_note = f"mem_fraction_static {fraction:g} x GPU - engine weights"
    slot = arch.state_bytes_per_sequence(tp)
    states = 0.0
    if slot:  # a hybrid model: SGLang gives the recurrent states ratio x the KV memory
        ratio = float(getattr(r, "sglang_mamba_full_memory_ratio", None)
                      or _sglang_arg(extra, "--mamba-full-memory-ratio")
                      or SGLANG_MAMBA_FULL_MEMORY_RATIO)
        states = max(kv_pool, 0.0) * ratio / (1 + ratio)
        cap_slots = (getattr(r, "sglang_max_mamba_cache_size", None)
                     or _sglang_arg(extra, "--max-mamba-cache-size"))
        if cap_slots:
            states = min(states, int(cap_slots) * slot)
        kv_pool = kv_pool - states
        pool_note += f" - recurrent states (--mamba-full-memory-ratio {ratio:g})"
    max_tokens = _sglang_arg(extra, "--max-total-tokens") or getattr(r, "sglang_max_total_tokens", None)
    if max_tokens and int(max_tokens) * kv_token < kv_pool:
        kv_pool = int(max_tokens) * kv_token
        pool_note = f"--max-total-tokens {int(max_tokens)} x {kv_token} B"
    requests = math.ceil(r.max_concurrency / engines)
    context = model.max_context_len
    kv_need = requests * context * kv_token
    cap_gib = capacity / GiB
    chunk = int(_sglang_arg(extra, "--chunked-prefill-size")  # SGLang's defaults by GPU size
                or (8192 if cap_gib >= 60 else 4096 if cap_gib >= 35 else 2048))
    max_bs = int(_sglang_arg(extra, "--cuda-graph-max-bs") or (512 if tp >= 4 else 256))
    graphs = 0.0 if "--disable-cuda-graph" in extra else max_bs * ENGINE_CUDA_GRAPH_MIB_PER_BS * MiB
    nccl = tp / 8 * GiB if tp > 1 else 0.0
    # One layer's bf16 working set per prefill token: residual, norm out, attention out
    # (3h), q/k/v + q/k after RoPE, gate/up/product (3 I); nothing is kept across layers.
    prefill = chunk * 2 * (3 * h + 2 * (arch.num_heads + arch.num_kv_heads) * hd / tp
                           + 3 * arch.intermediate_size / tp)
    kept = [Item("engine runtime", ENGINE_CONTEXT_GIB * GiB + nccl,
                 f"CUDA context + attention workspace {ENGINE_CONTEXT_GIB:g} GiB"
                 + (f" + NCCL {tp}/8 GiB" if nccl else ""))]
    graph_item = Item("engine CUDA graphs", graphs, f"decode batch sizes <= {max_bs}, "
                      f"{ENGINE_CUDA_GRAPH_MIB_PER_BS:g} MiB each")
    if not (config.cluster.colocate and engine_releases_cuda_graphs(config)):
        kept.append(graph_item)
    active = [Item("engine weights", weights, f"{dtype}, {_count(params)} params/GPU (TP {tp})"),
              Item("engine KV cache pool", max(kv_pool, 0.0), pool_note),
              *([Item("engine recurrent states", states,
                      f"{int(states // slot)} slots x {slot / MiB:.1f} MiB (fp32 state + conv "
                      f"tail of {arch.linear_layers} GDN layers per sequence)")] if slot else []),
              kept[0], graph_item,
              Item("engine prefill activations", prefill, f"one {chunk}-token prefill chunk")]
    pool_tokens = max(kv_pool, 0.0) / kv_token
    summary = [f"KV cache: pool {max(kv_pool, 0) / GiB:.1f} GiB per GPU = {pool_tokens / 1e3:.0f}k "
               f"tokens per engine; rollout.max_concurrency={r.max_concurrency} over {engines} "
               f"engines = {requests} requests x model.max_context_len={context} need "
               f"{kv_need / GiB:.1f} GiB ({requests * context / 1e3:.0f}k tokens)"]
    notes = []
    if slot:
        slots = int(states // slot)
        need = requests * SLOTS_PER_REQUEST
        summary.append(
            f"recurrent states: {slots} slots of {slot / MiB:.1f} MiB per engine; {requests} "
            f"requests in flight hold {SLOTS_PER_REQUEST} each ({need}); KV only for the "
            f"{arch.attention_layers} full-attention layers of {arch.num_layers}")
        if slots < need:
            notes.append(f"the engines' recurrent-state pool holds {slots} slots, fewer than the "
                         f"{need} that {requests} running requests per engine hold: SGLang queues "
                         "the rest (raise rollout.sglang_mamba_full_memory_ratio or "
                         "rollout.mem_fraction_static)")
    if pool_tokens < context:
        notes.append(f"the engines' KV pool ({max(kv_pool, 0) / GiB:.2f} GiB per GPU) cannot hold "
                     f"one model.max_context_len={context} request: SGLang would refuse to start "
                     "(raise rollout.mem_fraction_static or rollout.num_gpus_per_engine)")
    elif pool_tokens < requests * context:
        notes.append(f"the KV pool holds {pool_tokens / context:.1f} full-context requests per "
                     f"engine, fewer than the {requests} in flight: SGLang queues the rest "
                     "(fine for short episodes; else lower rollout.max_concurrency or raise "
                     "rollout.mem_fraction_static / rollout.num_gpus_per_engine)")
    return _Engine(active=active, kept=kept, kv_pool=kv_pool, kv_token=kv_token,
                   requests=requests, summary=summary, notes=notes)


def _push_bucket(config, arch: ModelArch) -> Item:
    """A push's bucket on the sending rank's GPU: train.weight_bucket_mb of full (TP
    gathered) tensors in the engines' dtype, or one tensor alone when it is larger."""
    dtype = getattr(config.rollout, "dtype", None) or config.model.dtype
    nbytes = 2 if dtype in ("bfloat16", "float16") else 4
    largest = max(arch.vocab_size * arch.hidden_size, arch.hidden_size * arch.intermediate_size)
    size = max(config.train.weight_bucket_mb * MiB, nbytes * largest)
    return Item("push bucket", size, f"train.weight_bucket_mb={config.train.weight_bucket_mb} "
                f"or the largest tensor ({_count(largest)} x {nbytes} B), gathered whole")


def engine_releases_cuda_graphs(config) -> bool:
    """Whether the engines' decode CUDA graphs go with their memory when they release it:
    the memory saver's region holds them only when the launch sets
    SGLANG_MEMORY_SAVER_CUDA_GRAPH (rollout.engines.actor.releases_cuda_graphs)."""
    from rollout.engines.actor import releases_cuda_graphs
    from trainer.driver.components import engine_spec

    if config.rollout.engine != "sglang":
        return False
    return releases_cuda_graphs(engine_spec(config, config.model.path))


def transformer_engine_available() -> bool:
    """Transformer Engine importable in this process (the driver's environment stands for
    the ranks'): without it Megatron runs its local attention."""
    from trainer.training.backends.megatron.model import have_transformer_engine

    return have_transformer_engine()


TE_FIX = ("install Transformer Engine (fused attention: pip install --no-build-isolation "
          "-c constraints.txt -e '.[te]')")


def _training_changes(config, trainer: _Trainer, phase: Phase, capacity: float,
                      colocate: bool) -> list[str]:
    """What would bring the training peak under ``capacity``, with the numbers."""
    train = config.train
    over = phase.total - capacity
    out = []
    if phase.get("attention scores"):
        out.append(f"{TE_FIX}: the {phase.get('attention scores') / GiB:.1f} GiB of attention "
                   "scores go; or lower model.max_context_len (the padded row length)")
    if trainer.ckpt_activations is not None:
        after = phase.total - phase.get("activations") + trainer.ckpt_activations
        out.append(f"train.gradient_checkpointing=true (activations "
                   f"{phase.get('activations') / GiB:.1f} -> {trainer.ckpt_activations / GiB:.1f} "
                   f"GiB, peak {after / GiB:.1f} GiB)"
                   + (" with train.share_prompts=false" if train.backend == "fsdp" else ""))
    fit = int((trainer.tokens - over / trainer.token_slope) // 512 * 512) if trainer.token_slope else 0
    if fit >= 512:
        change = f"train.max_tokens_per_micro_batch<={fit} (now {train.max_tokens_per_micro_batch}"
        change += f", micro-batch {trainer.tokens} tokens)"
        if config.model.max_context_len > fit:
            change += f" and model.max_context_len<={fit} (a longer sample is a micro-batch alone)"
        out.append(change)
    if train.backend == "megatron":
        if not train.use_distributed_optimizer and train.world_size > 1:
            out.append("train.use_distributed_optimizer=true")
        more = f"more tensor parallelism (train.tensor_model_parallel_size, now {trainer.tp})"
        if not trainer.sequence_parallel:
            more += " with train.sequence_parallel=true"
        out.append(more)
    else:
        out.append("more training ranks, or train.backend=megatron with tensor parallelism")
    if colocate:
        out.append("cluster.colocate=false (the trainer gets GPUs of its own)")
    return out


def plan_memory(config, *, arch: Optional[ModelArch] = None, gpu: Optional[str] = None,
                gpu_memory_gib: Optional[float] = None,
                transformer_engine: Optional[bool] = None) -> MemoryPlan:
    """The per-GPU memory plan of a GPU config (``cluster.device=cuda``). ``arch``,
    ``gpu``, ``gpu_memory_gib`` override what the config says (model.path's config.json
    or the built-in table; cluster.gpu_type / cluster.gpu_memory_gib or H100).
    ``transformer_engine``: whether the Megatron ranks have it; None: whether it imports
    here."""
    if config.cluster.device != "cuda":
        raise ConfigError("memory plan: cluster.device=cpu has no GPU memory to plan")
    source = "given"
    if arch is None:
        arch, source = model_arch(config)
    gpu_name, cap_gib = gpu_capacity(config, gpu, gpu_memory_gib)
    capacity = cap_gib * GiB
    colocate = config.cluster.colocate
    r = config.rollout
    if transformer_engine is None:
        transformer_engine = (config.train.backend != "megatron"
                              or transformer_engine_available())
    trainer = _trainer(config, arch, transformer_engine=transformer_engine)
    engine = _engine(config, arch, capacity)
    bucket = _push_bucket(config, arch)
    engine_changes = [f"a lower rollout.mem_fraction_static (now {r.mem_fraction_static:g})"]
    train = config.train
    startup_changes = ("more tensor/pipeline parallelism for training (smaller shards)",
                       "train.use_distributed_optimizer=false (no second parameter buffer "
                       "at start-up; the optimizer state is then not sharded)"
                       if train.backend == "megatron" and train.use_distributed_optimizer
                       else "more training ranks")
    smaller_bucket = f"a lower train.weight_bucket_mb (now {train.weight_bucket_mb})"
    if colocate:
        # Rows keep their names across phases: "-" is not on the GPU at that moment. In
        # order: the engines start alone; they release their memory and the ranks build
        # (trainer.driver.runtime); the ranks offload and the engines get their weights back for
        # the push (the first one, and every step's); they generate; they release for
        # training.
        weights_back = [i for i in engine.active if i.name == "engine weights"] + engine.kept
        phases = (
            Phase("engine start-up", r.num_gpus, tuple(
                i for i in engine.active if i.name != "engine prefill activations")),
            Phase("trainer start-up", r.num_gpus, tuple(trainer.startup + engine.kept)),
            Phase("weight push", r.num_gpus, tuple(trainer.resident + [bucket] + weights_back)),
            Phase("rollout", r.num_gpus, tuple(trainer.resident + engine.active)),
            Phase("training", r.num_gpus, tuple(trainer.items + engine.kept)))
        kept = sum(i.nbytes for i in trainer.resident) / GiB
        suggestions = {
            "engine start-up": tuple(engine_changes),
            "trainer start-up": startup_changes + ("cluster.colocate=false",),
            "weight push": (smaller_bucket, engine_changes[0]),
            "rollout": (engine_changes[0] + f": the trainer keeps {kept:.1f} GiB on each GPU "
                        "while the engines generate",
                        "cluster.colocate=false",
                        "more tensor/pipeline parallelism for training (smaller resident shards)"),
            "training": tuple(_training_changes(config, trainer, phases[-1], capacity, True)),
        }
        layout = (f"colocated: {r.num_gpus} GPUs, each with a training rank and an engine "
                  "(shard) taking turns")
    else:
        world = config.train.world_size
        phases = (Phase("engine GPUs", r.num_gpus, tuple(engine.active)),
                  Phase("trainer start-up", world, tuple(trainer.startup)),
                  Phase("weight push", world, tuple(trainer.at_rest + [bucket])),
                  Phase("training GPUs", world, tuple(trainer.items)))
        suggestions = {
            "engine GPUs": tuple(engine_changes) + (
                f"rollout.num_gpus_per_engine > {r.num_gpus_per_engine} (engine TP)",),
            "trainer start-up": startup_changes,
            "weight push": (smaller_bucket,),
            "training GPUs": tuple(_training_changes(config, trainer, phases[-1], capacity, False)),
        }
        layout = (f"disaggregated: {r.num_gpus} engine GPUs + {config.train.world_size} "
                  "training GPUs")
    summary = [f"GPUs: {config.cluster.num_nodes} x {config.cluster.gpus_per_node} {gpu_name} "
               f"({cap_gib:g} GiB each); {layout}",
               f"engines: {config.derived.num_engines} x SGLang TP {r.num_gpus_per_engine}, "
               f"mem_fraction_static {r.mem_fraction_static:g}"
               + (("; memory saver: weights, KV cache" + (" and decode CUDA graphs"
                   if engine_releases_cuda_graphs(config) else "") + " released while training")
                  if colocate else ""),
               *trainer.summary, *engine.summary]
    notes = list(engine.notes)
    scores = phases[-1].get("attention scores")
    if scores:
        notes.append(f"Megatron without Transformer Engine: its local attention materialises "
                     f"every score matrix in fp32 ({scores / GiB:.1f} GiB at the training peak); "
                     f"{TE_FIX}")
    tight = [p.name for p in phases if 0 <= capacity - p.total < TIGHT_FRACTION * capacity]
    if tight:
        notes.append(f"under {TIGHT_FRACTION:.0%} headroom at {', '.join(tight)}: allocator "
                     "fragmentation may still run out of memory")
    return MemoryPlan(recipe=config.derived.label, arch=arch, arch_source=source, gpu=gpu_name,
                      capacity=capacity, layout="colocated" if colocate else "disaggregated",
                      phases=phases, summary=tuple(summary), notes=tuple(notes),
                      suggestions=suggestions)


def check_memory(config, *, print_fn: Callable[[str], Any] = print,
                 transformer_engine: Optional[bool] = None) -> Optional[MemoryPlan]:
    """The start-up check: on a GPU config, plan the layout and refuse one that cannot
    fit (MemoryPlanError, a ConfigError, listing each component in GiB and what to
    change); print one line otherwise. CPU configs: nothing to check, returns None.
    ``cluster.memory_check=false`` (where the config has that key) prints the whole plan
    and goes ahead whatever it says. ``transformer_engine`` as in ``plan_memory``."""
    if config.cluster.device != "cuda":
        return None
    plan = plan_memory(config, transformer_engine=transformer_engine)
    if not getattr(config.cluster, "memory_check", True):
        print_fn(plan.table())
        if not plan.fits:
            print_fn("homegym: memory plan does not fit; going ahead (cluster.memory_check=false)")
        return plan
    plan.check()
    peak = plan.peak
    print_fn(f"homegym: memory plan ({plan.layout}): peak {peak.total / GiB:.1f} of "
             f"{plan.capacity / GiB:.1f} GiB per {plan.gpu} GPU ({peak.name}); the table: "
             "python scripts/memory_plan.py with the same overrides")
    for note in plan.notes:
        if note.startswith("Megatron without Transformer Engine"):
            print_fn(f"homegym: warning: {note}")
    return plan
