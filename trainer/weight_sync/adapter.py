"""Adapter-only weight sync for a LoRA policy on SGLang engines (``train.lora.push=adapter``).

Instead of the merged model, each push sends only the adapter: the training ranks write
it in peft format (rank 0, after gathering: ``backend.save_adapter``) to
``<disk_dir>/lora-v<version>``, and every engine loads it with SGLang's
``/load_lora_adapter`` under the name ``homegym-v<version>``. SGLang applies an adapter
only to requests that name it, so the rollout side is told the new name
(``announce``: the RolloutManager's ``set_lora_adapter``, which rollout.http's ``post``
adds as ``lora_path`` to every /generate, custom generate functions' included). The
engine's reported weight version is set with ``/update_weight_version`` so samples carry
policy versions as with merged pushes.

The previous adapter stays loaded for one more push: a request built with its name just
before the announcement may still be on its way; SGLang frees an unloaded adapter only
once its requests in flight finish. Older ones are unloaded and their directories
removed (an engine reads the files once, when it loads them).

The directory must be readable by every engine at the same path: on one machine the run
directory is; across nodes it must be on a filesystem every node mounts.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Callable, Optional

from rollout.engines.client import EngineError, fan_out
from trainer.weight_sync.push import WeightSyncError, check_reported_versions

PREFIX = "homegym-v"


def adapter_name(version: int) -> str:
    return f"{PREFIX}{version}"


def _version_of(name: str) -> Optional[int]:
    if not name.startswith(PREFIX):
        return None  # someone else's adapter (loaded by hand): not ours to unload
    try:
        return int(name[len(PREFIX):])
    except ValueError:
        return None


class AdapterSync:
    """Driver-side, in place of trainer.weight_sync.push.WeightSync: ``push(version)`` per
    update."""

    mode = "adapter"

    def __init__(self, train, train_group, engines, *, disk_dir: str,
                 announce: Callable[[str], None]) -> None:
        self.train_group = train_group
        self.engines = engines
        self.disk_dir = disk_dir
        self.announce = announce
        self.bucket_bytes = train.weight_bucket_mb * 2**20  # for HF exports

    def push(self, version: int, engines=None, *, flush: Optional[bool] = None,
             verify: bool = True) -> dict[str, float]:
        """Write the adapter, load it into every engine (or ``engines``, an EngineView)
        as ``homegym-v<version>``, report ``version``, route requests to it, then unload
        adapters older than the previous one. ``flush`` is not needed: SGLang keys its
        radix cache by adapter (0.5.18 managers/schedule_batch.py:923-926), so a new
        adapter's requests never find KV of another. ``verify=False``: the version check
        waits for the caller's ``verify(version)``."""
        start = time.perf_counter()
        engines = engines or self.engines
        name = adapter_name(version)
        path = os.path.join(self.disk_dir, f"lora-v{version}")
        try:
            self.train_group.save_adapter(path)
            saved = time.perf_counter()
            loaded = self._each(engines, lambda c: self._load(c, name, path))
            self._each(engines, lambda c: c.update_weight_version(version))
        except Exception as err:
            raise WeightSyncError(f"adapter push of version {version} failed: {err}") from err
        if verify:
            self.verify(version, engines)
        self.announce(name)
        # Each engine's answer lists what it holds (a restarted one: only the new adapter).
        fan_out(lambda pair: self._unload_stale(*pair, version), zip(engines.clients, loaded))
        for entry in os.listdir(self.disk_dir):
            v = _version_of(PREFIX + entry[len("lora-v"):]) if entry.startswith("lora-v") else None
            if v is not None and v < version:
                shutil.rmtree(os.path.join(self.disk_dir, entry), ignore_errors=True)
        num_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        return {"perf/weight_sync_bytes": float(num_bytes),
                "perf/weight_sync_save_time": saved - start,
                "perf/weight_sync_time": time.perf_counter() - start}

    def verify(self, version: int, engines=None) -> dict[str, float]:
        check_reported_versions(engines or self.engines, version, "adapter version")
        return {}

    @staticmethod
    def _load(client, name: str, path: str) -> dict:
        try:
            return client.load_lora_adapter(name, path)
        except EngineError as err:
            if "already" not in str(err):
                raise
        # The same version again (a repeated push of one policy version): replace it.
        client.unload_lora_adapter(name)
        return client.load_lora_adapter(name, path)

    @staticmethod
    def _unload_stale(client, answer: dict, version: int) -> None:
        for name in sorted(answer.get("loaded_adapters") or {}):
            v = _version_of(name)
            if v is not None and v < version - 1:
                client.unload_lora_adapter(name)

    @staticmethod
    def _each(engines, fn) -> list:
        return fan_out(fn, engines.clients)
