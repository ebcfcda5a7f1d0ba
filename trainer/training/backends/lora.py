"""LoRA adapters through peft, for a backend that shards the model afterwards.

``apply_lora`` injects peft's LoRA layers into the plain transformers model (peft's
``inject_adapter_in_model``: no ``PeftModel`` wrapper, so the model keeps its HF module
tree, and FSDP wraps the same decoder layers as without LoRA). Only the adapter
parameters require grad.

Weights leave the trainer in one of two forms, both computed from gathered full tensors
without touching the training model:
- merged (``merged_tensors``): ``W + scaling * B @ A`` under the base model's HF names, so
  an engine loads a LoRA policy exactly as it loads a full-model update;
- adapter (``adapter_tensors``): the A/B matrices under peft's saved names
  (``base_model.model.<module>.lora_A.weight``), ``save_adapter`` writes them with an
  ``adapter_config.json`` that ``PeftModel.from_pretrained`` and SGLang's
  ``/load_lora_adapter`` read.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator

import torch

ADAPTER = "default"  # peft's adapter name; one adapter per model here
_BASE = ".base_layer."
_LORA_A = f".lora_A.{ADAPTER}.weight"
_LORA_B = f".lora_B.{ADAPTER}.weight"


def peft_config(lora, base_model_path: str = ""):
    """peft's ``LoraConfig`` for homegym's ``train.lora`` (config.schema.LoraConfig)."""
    import peft

    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.target_modules), bias="none",
                           base_model_name_or_path=base_model_path or None,
                           task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, lora) -> dict[str, float]:
    """Inject LoRA layers into ``model`` in place (B = 0, so the forward is unchanged) and
    freeze everything else; returns {module name: scaling} of the adapted layers."""
    import peft
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        peft.inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
    except ValueError as err:  # peft's message says which target modules it did not find
        raise ValueError(f"train.lora.target_modules={list(lora.target_modules)}: {err}") from err
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            # The merge below is a Linear's; embeddings / convolutions merge differently.
            if not isinstance(module, LoraLinear):
                raise ValueError(f"train.lora.target_modules: {name} is a "
                                 f"{type(module.get_base_layer()).__name__}; only Linear "
                                 "layers are supported")
            layers[name] = float(module.scaling[ADAPTER])
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return layers


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward (the KL reference of a LoRA policy) without a second
    copy of the weights. peft's switch also flips requires_grad; the flags come back."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    flags = {p: p.requires_grad for p in model.parameters()}
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags.items():
            p.requires_grad_(flag)


def merged_tensors(items: Iterable[tuple[str, torch.Tensor]],
                   layers: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` (the model's state in state_dict order, full tensors the caller hands
    over: fp32 base weights are merged in place) with each adapted Linear's weight merged
    (in fp32, then the base's dtype) under its HF name; adapter matrices themselves are
    not yielded."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in items:
        if _BASE in name:
            module, _, leaf = name.partition(_BASE)
            if leaf != "weight":  # a bias is the base layer's, unchanged
                yield f"{module}.{leaf}", value
                continue
            key = "W"
        elif name.endswith(_LORA_A):
            module, key = name[:-len(_LORA_A)], "A"
        elif name.endswith(_LORA_B):
            module, key = name[:-len(_LORA_B)], "B"
        else:
            yield name, value
            continue
        parts = pending.setdefault(module, {})
        parts[key] = value
        if len(parts) == 3:
            del pending[module]
            w, a, b = parts["W"], parts["A"], parts["B"]
            # In place on the gathered copy: no second weight-sized tensor per layer.
            merged = w if w.dtype == torch.float32 else w.float()
            merged.addmm_(b.float(), a.float(), alpha=layers[module])
            yield f"{module}.weight", merged.to(w.dtype)
    if pending:
        raise RuntimeError(f"LoRA layers without all of base/A/B weights: {sorted(pending)}")


def adapter_tensors(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter matrices of ``items`` under the names peft saves them with."""
    for name, value in items:
        if name.endswith(_LORA_A) or name.endswith(_LORA_B):
            yield "base_model.model." + name.replace(f".{ADAPTER}.", "."), value


def save_adapter(tensors: dict[str, torch.Tensor], lora, base_model_path: str, out_dir) -> None:
    """Write a peft adapter directory: adapter_model.safetensors + adapter_config.json."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config(lora, base_model_path).save_pretrained(str(out_dir))

