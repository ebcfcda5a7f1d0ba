"""Megatron-core training backend: ``train.backend=megatron``.

- ``backend.MegatronBackend``: the TrainBackend protocol over megatron-core;
- ``hf_map``: HF <-> Megatron config and weights for Llama / Qwen2 / Qwen3 checkpoints;
- ``model``: parallel state, GPTModel construction, weight loading, vocab-parallel log-probs;
- ``cpu_shim``: the torch.cuda patches that let megatron-core run on CPU (tests/debugging
  only; applied by the backend when no CUDA device is present).

Importing this package does not import megatron-core (it is an optional dependency).
"""

from trainer.backends.megatron.backend import MegatronBackend

__all__ = ["MegatronBackend"]
