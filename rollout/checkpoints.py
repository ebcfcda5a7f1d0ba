"""What a local Hugging Face checkpoint is, read from its config.json alone (no torch):
whether it is a vision-language checkpoint (Qwen3.5 ships as one), which of its layers keep
a recurrent state instead of a KV cache (hybrid models), and how large that state is.
"""

from __future__ import annotations

import json
import os
from typing import Optional

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The hybrid models homegym's CPU engine keeps recurrent state for
# (rollout/engines/hf/hybrid.py): text model types and the layer types it runs.
CPU_ENGINE_HYBRID_TYPES = ("qwen3_5_text",)
CPU_ENGINE_LAYER_TYPES = ("linear_attention", "full_attention")


def read_config(path: str) -> dict:
    """``config.json`` of the checkpoint directory ``path`` ({} when there is none)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def is_vlm(config: dict) -> bool:
    """A vision-language checkpoint: its text model sits under ``text_config``."""
    return isinstance(config.get("text_config"), dict)


def text_config(config: dict) -> dict:
    return config["text_config"] if is_vlm(config) else config


def recurrent_layers(config: dict) -> int:
    """Layers that keep a per-sequence recurrent state (Gated DeltaNet, Mamba, ...)."""
    return sum(t != "full_attention" for t in text_config(config).get("layer_types") or ())


def is_hybrid(config: dict) -> bool:
    return recurrent_layers(config) > 0


def gdn_head_dims(config: dict) -> Optional[tuple[int, int]]:
    """A Gated DeltaNet model's (key head dim, value head dim); None for other models."""
    text = text_config(config)
    if "linear_key_head_dim" not in text:
        return None
    return int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])


def state_bytes_per_sequence(config: dict, dtype: str) -> int:
    """One sequence's recurrent state over all Gated DeltaNet layers: the conv state (the
    last kernel - 1 inputs, in the serving ``dtype``) and the recurrent state (float32)."""
    text = text_config(config)
    key_dim = text["linear_key_head_dim"] * text["linear_num_key_heads"]
    conv_dim = 2 * key_dim + text["linear_value_head_dim"] * text["linear_num_value_heads"]
    conv = conv_dim * (text.get("linear_conv_kernel_dim", 4) - 1) * DTYPE_BYTES[dtype]
    recurrent = (text["linear_num_value_heads"] * text["linear_key_head_dim"]
                 * text["linear_value_head_dim"] * 4)
    return recurrent_layers(config) * (conv + recurrent)


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """K and V of one token over the full-attention layers."""
    text = text_config(config)
    types = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_layer = 2 * text.get("num_key_value_heads", text["num_attention_heads"]) * head_dim
    return sum(t == "full_attention" for t in types) * per_layer * DTYPE_BYTES[dtype]


def cpu_engine_refusal(config: dict) -> Optional[str]:
    """The one-line start-up error for a hybrid model homegym's CPU engine (rollout.engine
    hf) keeps no recurrent state for; None when it can serve the model."""
    if not is_hybrid(config):
        return None
    text = text_config(config)
    kind, types = text.get("model_type"), sorted(set(text.get("layer_types") or ()))
    if kind in CPU_ENGINE_HYBRID_TYPES and set(types) <= set(CPU_ENGINE_LAYER_TYPES):
        return None
    return (f"rollout.engine: hf keeps no recurrent state for {kind} (a hybrid model with "
            f"{', '.join(types)} layers; it does for {', '.join(CPU_ENGINE_HYBRID_TYPES)}): "
            "serve it with rollout.engine=sglang")
