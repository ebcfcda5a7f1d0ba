"""What the real SGLang server needs to serve a model: the checkpoint directory it is given,
a hybrid model's state pool, and on CPU what its kernels require of the machine and model.

Qwen3.5 ships as a vision-language checkpoint (``Qwen3_5ForConditionalGeneration``) that
homegym trains and serves text-only. SGLang 0.5.18 skips the vision tower (never built,
never loaded, no multimodal processor) when the checkpoint's own config.json says
``"language_model_only": true`` (srt/configs/model_config.py reads it; so do
srt/models/qwen3_vl.py and srt/utils/hf_transformers/processor.py); its
``--language-model-only`` flag is refused for this architecture (server_args.py,
``LANGUAGE_MODEL_ONLY_ARCHITECTURES``). The user's checkpoint is never edited: the server
gets a view of it, a directory of links to its files with that one key added to
config.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from filelock import FileLock

from rollout.checkpoints import (gdn_head_dims, is_hybrid, is_vlm, kv_bytes_per_token,
                                 read_config, state_bytes_per_sequence)

LANGUAGE_MODEL_ONLY = "language_model_only"
# SGLang's default ratio of state memory to KV-cache memory (server_args.py,
# mamba_full_memory_ratio), used to size the state pool where homegym sizes the KV cache.
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9
# SGLang's CPU backend: instructions its kernels are built for (-march=x86-64-v4, AMX
# tiles), and the Gated DeltaNet head dims its kernels dispatch on (sgl-kernel
# csrc/cpu/mamba/fla.cpp: DISPATCH_HEAD_DIM 64 / 128, key dim == value dim).
CPU_FLAGS = ("avx512f", "amx_tile")
CPU_GDN_HEAD_DIMS = (64, 128)
# State slots a running request holds with the radix cache on (SGLang 0.5.18,
# mem_cache/kv_cache_configurator.py MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO).
SLOTS_PER_REQUEST = 3


def served_path(path: str, root: Optional[str] = None) -> str:
    """``path`` itself, or for a vision-language checkpoint without ``language_model_only``
    a text-only view of it under ``root`` (default: homegym's cache), made once."""
    config = read_config(path)
    if not is_vlm(config) or config.get(LANGUAGE_MODEL_ONLY):
        return path
    if root is None:
        from rollout.models import cache_root

        root = str(cache_root() / "sglang-text-only")
    source = os.path.realpath(path)
    key = hashlib.sha256((source + json.dumps(config, sort_keys=True)).encode()).hexdigest()[:16]
    target = Path(root) / f"{Path(source).name}-{key}"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            for entry in os.listdir(source):
                if entry != "config.json":
                    os.symlink(os.path.join(source, entry), tmp / entry)
            (tmp / "config.json").write_text(json.dumps({**config, LANGUAGE_MODEL_ONLY: True},
                                                        indent=2))
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def cpu_state_slots(config: dict, max_total_tokens: int, dtype: str,
                    ratio: Optional[float] = None) -> int:
    """State slots for a hybrid model on SGLang's CPU backend. There SGLang sizes both pools
    from free RAM unless told otherwise; homegym fixes the KV cache (max_total_tokens), so
    the state pool gets SGLang's own share of it: ``ratio`` (default SGLang's 0.9) times
    the KV cache's bytes, and never fewer slots than one request needs."""
    ratio = SGLANG_MAMBA_FULL_MEMORY_RATIO if ratio is None else ratio
    budget = ratio * max_total_tokens * kv_bytes_per_token(config, dtype)
    return max(SLOTS_PER_REQUEST, int(budget // state_bytes_per_sequence(config, dtype)))


def missing_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU flags SGLang's CPU kernels need that this machine lacks. ``cpuinfo``: the
    file to read (SGLANG_CPU_CPUINFO overrides it, as in scripts/install_sglang_cpu.sh)."""
    cpuinfo = os.environ.get("SGLANG_CPU_CPUINFO") or cpuinfo
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        flags = set()
    return [f for f in CPU_FLAGS if f not in flags]


def cpu_model_problem(config: dict) -> Optional[str]:
    """Why SGLang's CPU kernels cannot run this model (None if they can)."""
    dims = gdn_head_dims(config) if is_hybrid(config) else None
    if dims is not None and (dims[0] != dims[1] or dims[0] not in CPU_GDN_HEAD_DIMS):
        return (f"its Gated DeltaNet head dims are {dims[0]} (key) / {dims[1]} (value); "
                "SGLang's CPU kernels take 64 or 128, equal for keys and values")
    return None
