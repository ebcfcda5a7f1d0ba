"""homegym's CPU engine: a transformers model behind SGLang's HTTP routes (server.py),
continuous batching over a KV cache (batcher.py), exact decode-time kernels (fast_kernels.py)."""
