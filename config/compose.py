"""The run config from conf/: one composition for the CLI's overrides, the Python API's
values, serving, evaluation and the tests (``trainer.main``'s ``@hydra.main`` composes the
same directory the same way)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from config.schema import ConfigError, HomegymConfig, build_config, register_schema

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
# Hydra's global state is per process: one composition at a time.
_HYDRA_LOCK = threading.Lock()


def compose_config(overrides: Sequence[str] = (), values: Optional[dict] = None) -> HomegymConfig:
    """``conf/`` composed with Hydra overrides (as on the command line), then ``values`` (a
    nested dict of typed field values, merged onto the schema), then ``build_config``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schema()
    with _HYDRA_LOCK:
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
                cfg = compose(config_name="config", overrides=list(overrides))
            if values:
                _check_keys(cfg, values)
                with open_dict(cfg):  # free-form dicts (extra_config, ...) take new keys
                    cfg = OmegaConf.merge(cfg, OmegaConf.create(values))
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(" ".join(line.strip() for line in str(err).splitlines() if line.strip()) or repr(err)) from err
    return build_config(cfg)


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """``tree["a"]["b"] = value`` for ``"a.b"``: builds the nested ``values`` dict above."""
    *parents, last = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def split_args(argv: Sequence[str], keys: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Pull ``key=value`` for a command's own keys out of argv; the rest are Hydra overrides."""
    own: dict[str, str] = {}
    rest: list[str] = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        if sep and name in keys:
            own[name] = value
        else:
            rest.append(arg)
    return own, rest


def _check_keys(cfg: DictConfig, values: dict, prefix: str = "") -> None:
    """Every key of ``values`` must exist in the schema (free-form dicts take any key)."""
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in cfg:
            raise ConfigError(f"{full}: no such config key")
        node = cfg._get_node(key)
        if isinstance(value, dict) and isinstance(node, DictConfig) and \
                node._metadata.object_type not in (None, dict):
            _check_keys(node, value, full + ".")
