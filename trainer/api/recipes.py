"""The seed's recipe objects: their fields mapped onto homegym's Hydra config (conf/recipe/)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from config import ConfigError, HomegymConfig, set_dotted
from trainer.api.model_catalog import Qwen3_0_6B, Qwen3_4B, Qwen3_5_4B, Qwen3_8B, TinyQwen3


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


class _ImageRecorder:
    """Stands in for a container image so the seed's ``image_overlay=lambda image:
    image.pip_install(...)`` maps to Ray's ``runtime_env={"pip": [...]}``."""

    def __init__(self) -> None:
        self.pip: list[str] = []

    def pip_install(self, *packages: Any, **_: Any) -> "_ImageRecorder":
        for p in packages:
            self.pip.extend([p] if isinstance(p, str) else list(p))
        return self

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(
            f"recipe.image_overlay: image.{name}(...) has no on-prem equivalent. homegym runs "
            "on your own Ray cluster: install system packages on the nodes (or in the image "
            "your cluster runs), and pass Python packages with Recipe(pip=[...]) (Ray "
            "runtime_env pip); image.pip_install(...) is mapped to that automatically.")


@dataclass
class Recipe:
    """The seed's recipe fields, mapped onto homegym's Hydra config. UNSET keeps the preset's
    value. ``overrides``: extra Hydra overrides (``"warmup.steps=5"``), applied before the
    fields. ``pip``: packages for Ray's runtime_env (``image_overlay`` pip_install calls are
    folded in)."""

    hydra_recipe: ClassVar[Optional[str]] = "number_guess_cpu"
    default_model: ClassVar[type] = TinyQwen3

    gpu_type: Any = UNSET
    actor_num_nodes: Any = UNSET
    actor_num_gpus_per_node: Any = UNSET
    rollout_num_gpus: Any = UNSET
    rollout_num_gpus_per_engine: Any = UNSET
    colocate: Any = UNSET
    tensor_model_parallel_size: Any = UNSET
    sequence_parallel: Any = UNSET
    num_rollout: Any = UNSET
    rollout_batch_size: Any = UNSET
    n_samples_per_prompt: Any = UNSET
    rollout_max_response_len: Any = UNSET
    rollout_temperature: Any = UNSET
    global_batch_size: Any = UNSET
    save_interval: Any = UNSET
    eval_interval: Any = UNSET
    apply_chat_template_kwargs: Any = UNSET
    custom_generate_function: Any = UNSET
    custom_rm_function: Any = UNSET
    extra_config: Any = UNSET
    image_overlay: Any = UNSET
    pip: list = field(default_factory=list)
    overrides: list = field(default_factory=list)

    _SIMPLE: ClassVar[dict[str, str]] = {
        "rollout_num_gpus": "rollout.num_gpus",
        "rollout_num_gpus_per_engine": "rollout.num_gpus_per_engine",
        "colocate": "cluster.colocate",
        "tensor_model_parallel_size": "train.tensor_model_parallel_size",
        "sequence_parallel": "train.sequence_parallel",
        "num_rollout": "train.num_steps",
        "rollout_batch_size": "rollout.rollout_batch_size",
        "n_samples_per_prompt": "rollout.n_samples_per_prompt",
        "rollout_max_response_len": "rollout.max_response_len",
        "rollout_temperature": "rollout.temperature",
        "global_batch_size": "train.global_batch_size",
        "save_interval": "train.save_interval",
        "eval_interval": "eval.interval",
    }

    def hydra_overrides(self) -> list[str]:
        base = [f"+recipe={self.hydra_recipe}"] if self.hydra_recipe else []
        return base + [str(o) for o in self.overrides]

    def pip_packages(self) -> list[str]:
        pkgs = list(self.pip)
        if self.image_overlay is not UNSET and self.image_overlay is not None:
            if not callable(self.image_overlay):
                raise ConfigError("recipe.image_overlay: expected a function of an image; use "
                                  "Recipe(pip=[...]) for Python packages")
            recorder = _ImageRecorder()
            self.image_overlay(recorder)
            pkgs += recorder.pip
        return pkgs

    def values(self, composed: HomegymConfig, *, ship: Callable[[Any, str], Any]) -> dict:
        """Field values as a nested dict for the config (``composed`` is the config before
        them, used to derive cluster sizes)."""
        out: dict = {}
        for name, key in self._SIMPLE.items():
            value = getattr(self, name)
            if value is not UNSET:
                set_dotted(out, key, value)
        if self.actor_num_nodes is not UNSET:
            set_dotted(out, "train.num_nodes", int(self.actor_num_nodes))
        if self.actor_num_gpus_per_node is not UNSET:
            set_dotted(out, "train.ranks_per_node", int(self.actor_num_gpus_per_node))
        if composed.cluster.device == "cuda" and (
                self.actor_num_nodes is not UNSET or self.actor_num_gpus_per_node is not UNSET
                or self.rollout_num_gpus is not UNSET or self.colocate is not UNSET):
            # Size the cluster for the layout: colocated shares the training GPUs,
            # disaggregated adds the rollout GPUs.
            per_node = int(self.actor_num_gpus_per_node or composed.train.ranks_per_node)
            nodes = int(self.actor_num_nodes or composed.train.num_nodes)
            colocate = composed.cluster.colocate if self.colocate is UNSET else bool(self.colocate)
            rollout_gpus = int(self.rollout_num_gpus or composed.rollout.num_gpus)
            gpus_per_node = max(per_node, composed.cluster.gpus_per_node)
            total = nodes * per_node + (0 if colocate else rollout_gpus)
            set_dotted(out, "cluster.gpus_per_node", gpus_per_node)
            set_dotted(out, "cluster.num_nodes", max(nodes, math.ceil(total / gpus_per_node)))
        if self.apply_chat_template_kwargs not in (UNSET, None):
            kwargs = self.apply_chat_template_kwargs
            if isinstance(kwargs, str):
                try:
                    kwargs = json.loads(kwargs)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"recipe.apply_chat_template_kwargs: not JSON: {err}") from None
            if not isinstance(kwargs, dict):
                raise ConfigError("recipe.apply_chat_template_kwargs: must be a dict or a JSON object")
            set_dotted(out, "data.apply_chat_template_kwargs", kwargs)
        for name in ("custom_generate_function", "custom_rm_function"):
            value = getattr(self, name)
            if value is not UNSET:
                set_dotted(out, f"rollout.{name}", ship(value, f"recipe.{name}"))
        if self.extra_config not in (UNSET, None):
            if not isinstance(self.extra_config, dict):
                raise ConfigError("recipe.extra_config: must be a dict")
            set_dotted(out, "rollout.extra_config", dict(self.extra_config))
            if "max_turns" in self.extra_config:  # the built-in env driver's budget too
                set_dotted(out, "env.max_turns", int(self.extra_config["max_turns"]))
        if self.gpu_type not in (UNSET, None):
            if composed.cluster.device != "cuda":
                raise ConfigError(f"recipe.gpu_type={self.gpu_type!r}: this recipe runs on CPU; "
                                  "use a GPU recipe (e.g. Qwen3_4B_Recipe)")
            # On-prem the hardware is what the cluster has; the type is recorded as a tag.
            tags = list(composed.logging.wandb_tags) + [f"gpu:{self.gpu_type}"]
            set_dotted(out, "logging.wandb_tags", tags)
        return out


@dataclass
class NumberGuessCPURecipe(Recipe):
    """The embedded CPU default (conf/recipe/number_guess_cpu.yaml): warm-up SFT + GRPO on
    the guessing game with the tiny model, hf engines, FSDP on gloo."""
    hydra_recipe: ClassVar[Optional[str]] = "number_guess_cpu"
    default_model: ClassVar[type] = TinyQwen3


@dataclass
class Qwen3_0_6B_Recipe(Recipe):
    hydra_recipe: ClassVar[Optional[str]] = "qwen_0_6b"
    default_model: ClassVar[type] = Qwen3_0_6B


@dataclass
class Qwen3_4B_Recipe(Recipe):
    """conf/recipe/qwen_4b.yaml: one 8xH100 node, colocated SGLang + Megatron."""
    hydra_recipe: ClassVar[Optional[str]] = "qwen_4b"
    default_model: ClassVar[type] = Qwen3_4B


@dataclass
class Qwen3_8B_Recipe(Recipe):
    hydra_recipe: ClassVar[Optional[str]] = "qwen_8b"
    default_model: ClassVar[type] = Qwen3_8B


@dataclass
class Qwen3_5_4B_Recipe(Recipe):
    """conf/recipe/qwen3_5_4b.yaml: the seed's Qwen3.5-4B recipe, one 8xH100 node,
    colocated SGLang engines + FSDP training ranks, TP 1."""
    hydra_recipe: ClassVar[Optional[str]] = "qwen3_5_4b"
    default_model: ClassVar[type] = Qwen3_5_4B
