"""Finding user code by name: plug-in functions by dotted path, environment classes by
registered name (envs.base.register) or dotted path."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from envs.base import BUILTIN_MODULES, REGISTRY, Environment


def load_object(path: str, what: str = "object") -> Any:
    """Import ``package.module:attr`` or ``package.module.attr``."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} is not a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {e}") from e
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from e
    return obj


def registered_or_dotted(name: str, registry: Mapping[str, Any], key: str, what: str,
                         known: Any = None) -> Any:
    """``registry[name]``, else the object at the dotted path ``name``. A bare name that is
    not registered is a ValueError naming ``key``, the ``known`` names (default: the
    registry's) and the dotted-path alternative."""
    if name in registry:
        return registry[name]
    if "." not in name and ":" not in name:
        raise ValueError(f"{key}: unknown {what} {name!r}; registered: "
                         f"{', '.join(sorted(known if known is not None else registry))}, "
                         "or a dotted path")
    return load_object(name, key)


def get_env_class(name: str) -> type[Environment]:
    """A registered environment name (number_guess, arithmetic) or a dotted class path."""
    if name in BUILTIN_MODULES and name not in REGISTRY:
        importlib.import_module(BUILTIN_MODULES[name])
    cls = registered_or_dotted(name, REGISTRY, "env.name", "environment",
                               known=set(REGISTRY) | set(BUILTIN_MODULES))
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"env.name: {name!r} is not an envs.base.Environment subclass")
    return cls
