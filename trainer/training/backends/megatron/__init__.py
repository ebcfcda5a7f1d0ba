"""Megatron-core training backend: ``train.backend=megatron``.

- ``backend.MegatronBackend``: the TrainBackend protocol over megatron-core;
- ``hf_map``: HF <-> Megatron config and weights for Llama / Qwen2 / Qwen3 checkpoints;
- ``model``: parallel state, the layer spec / fused-kernel plan, GPTModel construction,
  weight loading, vocab-parallel log-probs;
- ``offload``: moving everything a rank holds on its device to host memory and back,
  storage by storage (Megatron's parameters and main params are views into buffers);
- ``cpu_shim``: the torch.cuda patches that let megatron-core run on CPU (tests/debugging
  only; applied by the backend when no CUDA device is present).

Importing this package imports none of them (megatron-core is an optional dependency, and
the modules import each other, never this package's namespace).
"""
