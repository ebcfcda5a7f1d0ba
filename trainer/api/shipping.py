"""User functions to Ray workers: by dotted path, or by value through Ray's key-value store.

Custom functions (``custom_generate_function`` / ``custom_rm_function``) may be dotted paths
or callables. A callable from an importable module is passed by its dotted path; one
defined in ``__main__`` (a notebook, a script) or inside a function is shipped BY VALUE:
cloudpickled into Ray's cluster-wide key-value store and referenced as
``trainer.api.shipping:shipped__<name>__<hash>``, which this module resolves (module
``__getattr__``) inside any Ray worker on any node.
"""

from __future__ import annotations

import hashlib
import importlib
from typing import Any, Callable, Optional, Union

from config import ConfigError

_SHIPPED: dict[str, Callable] = {}
_SHIP_PREFIX = "shipped__"
_KV_NAMESPACE = "homegym"


def _importable_path(fn: Callable) -> Optional[str]:
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qual or "<lambda>" in qual:
        return None
    try:
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qual}" if obj is fn else None


def ship_function(fn: Union[str, Callable, None], key: str) -> Optional[str]:
    """A dotted path Ray workers can load for ``fn`` (see the module docstring)."""
    if fn is None or isinstance(fn, str):
        return fn
    if not callable(fn):
        raise ConfigError(f"{key}: expected a callable or a dotted path (got {type(fn).__name__})")
    path = _importable_path(fn)
    if path is not None:
        return path
    import ray
    from ray import cloudpickle
    from ray.experimental.internal_kv import _internal_kv_put

    if not ray.is_initialized():
        raise RuntimeError(f"{key}: {getattr(fn, '__qualname__', fn)!r} is not importable by Ray "
                           "workers, so it is shipped by value, which needs a running Ray "
                           "cluster (TrainJob.launch() connects first)")
    blob = cloudpickle.dumps(fn)
    digest = hashlib.sha256(blob).hexdigest()[:20]
    name = "".join(c if c.isalnum() else "_" for c in getattr(fn, "__name__", "fn")).strip("_")
    attr = f"{_SHIP_PREFIX}{name or 'fn'}__{digest}"
    _internal_kv_put(f"fn:{digest}".encode(), blob, overwrite=True, namespace=_KV_NAMESPACE)
    _SHIPPED[attr] = fn
    return f"{__name__}:{attr}"


def ship_or_describe(fn: Union[str, Callable, None], key: str) -> Optional[str]:
    """For ``build()`` without Ray: a by-value function gets a placeholder path."""
    import ray

    if fn is None or isinstance(fn, str) or _importable_path(fn) is not None or ray.is_initialized():
        return ship_function(fn, key)
    return f"{__name__}:{_SHIP_PREFIX}{getattr(fn, '__name__', 'fn')}__not_shipped_yet"


def ship_locally(fn: Union[str, Callable, None], key: str) -> Optional[str]:
    """For the start-up checks, before Ray: a function that would be shipped by value is
    registered in this process only, where ``__getattr__`` below finds it."""
    if fn is None or isinstance(fn, str) or not callable(fn) or _importable_path(fn) is not None:
        return ship_function(fn, key)
    attr = f"{_SHIP_PREFIX}{getattr(fn, '__name__', 'fn')}__local_{id(fn):x}"
    _SHIPPED[attr] = fn
    return f"{__name__}:{attr}"


def __getattr__(name: str) -> Any:  # PEP 562: resolves shipped functions inside workers
    if not name.startswith(_SHIP_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _SHIPPED:
        return _SHIPPED[name]
    digest = name.rsplit("__", 1)[-1]
    import ray
    from ray import cloudpickle
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not (ray.is_initialized() or _internal_kv_initialized()):
        raise AttributeError(f"{name}: a shipped function is only available inside the Ray "
                             "cluster that launched the run")
    blob = _internal_kv_get(f"fn:{digest}".encode(), namespace=_KV_NAMESPACE)
    if blob is None:
        raise AttributeError(f"{name}: not found in this Ray cluster's key-value store (it "
                             "lives as long as the cluster that launched the run)")
    fn = _SHIPPED[name] = cloudpickle.loads(blob)
    return fn
