"""An exported policy in its base checkpoint's layout.

Training holds the text model (``AutoModelForCausalLM``). A vision-language base such as
Qwen3.5 (``Qwen3_5ForConditionalGeneration``) stores that model under
``model.language_model.`` next to tensors training never touches: the vision tower
(``model.visual.*``) and the multi-token-prediction layer (``mtp.*``). The export renames
the trained tensors into the base's layout and copies the base's other tensors verbatim, in
their stored dtype, so the exported directory loads as the base's own class (transformers,
SGLang) with the base's config. A text-only base comes out as it went in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT_PREFIX = "model."
VLM_TEXT_PREFIX = "model.language_model."


def base_tensor_files(source_dir: str) -> dict[str, str]:
    """{tensor name: safetensors file} of the base checkpoint (sharded or single file)."""
    src = Path(source_dir)
    index = src / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = src / "model.safetensors"
    if not single.exists():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: single.name for name in f.keys()}


def in_base_layout(tensors: dict[str, torch.Tensor], source_dir: str) -> dict[str, torch.Tensor]:
    """``tensors`` (the text model's HF names) renamed into the base checkpoint's layout,
    plus the base's tensors outside the text model (vision tower, MTP layer) verbatim."""
    files = base_tensor_files(source_dir)
    if not any(name.startswith(VLM_TEXT_PREFIX) for name in files):
        return tensors
    out = {(VLM_TEXT_PREFIX + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name): t
           for name, t in tensors.items()}
    # The LM head belongs to the text model: trained when untied, absent when tied (the
    # base's copy, if it has one, would be stale).
    extra = [n for n in files if not n.startswith(VLM_TEXT_PREFIX) and n != "lm_head.weight"
             and n not in out]
    from safetensors import safe_open

    for file in sorted({files[n] for n in extra}):
        with safe_open(str(Path(source_dir) / file), "pt") as f:
            for name in extra:
                if files[name] == file:
                    out[name] = f.get_tensor(name)
    return out
