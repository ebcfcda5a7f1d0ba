"""SGLang 0.5.18's receiving side of ``/update_weights_from_tensor``, vendored for
scripts/gpu_smoke.py (the GPU machine has no SGLang): the torch-reductions patch that
rebuilds CUDA tensors from a device UUID (patch_torch.py), the serializer with its
SafeUnpickler (serializer.py, from utils/common.py) and the flattened tensor bucket
(tensor_bucket.py). tests/test_gpu_smoke.py checks each definition against the wheel.
Apache License 2.0, Copyright 2023-2024 SGLang Team (headers in each file)."""
