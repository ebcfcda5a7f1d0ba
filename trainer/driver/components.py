"""The run's components, each built from the config sections it uses.

Below the driver nothing receives the root ``HomegymConfig``: an engine group gets the
model, rollout and cluster sections, a training rank the model, train, algo, warmup and
cluster sections, and so on, plus the derived values (``config.derived``) they need as
named arguments. These functions are the one place that splits a root config into those
inputs (the driver's Runtime, the eval and serve commands, scripts and tests use them).
"""

from __future__ import annotations

from typing import Any, Optional

from config import HomegymConfig


def placement(config: HomegymConfig, **kwargs: Any):
    from trainer.training.placement import Placement

    return Placement(config.cluster, num_engines=config.derived.num_engines,
                     gpus_per_engine=config.rollout.num_gpus_per_engine,
                     num_train_ranks=config.train.world_size, **kwargs)


def engine_args(config: HomegymConfig) -> dict[str, Any]:
    """``EngineGroup``'s inputs besides placement and paths."""
    return dict(model=config.model, rollout=config.rollout, cluster=config.cluster,
                num_engines=config.derived.num_engines, seed=config.train.seed,
                lora=_served_lora(config))


def _served_lora(config: HomegymConfig):
    """The LoRA section when the engines serve the adapters the trainer pushes."""
    return config.train.lora if config.derived.lora_push == "adapter" else None


def engine_spec(config: HomegymConfig, model_path: str, **kwargs: Any):
    """Engine ``index``'s ``LaunchSpec`` (``rollout.engines.actor.launch_spec``)."""
    from rollout.engines.actor import launch_spec

    return launch_spec(config.model, config.rollout, config.cluster, model_path,
                       seed=config.train.seed, lora=_served_lora(config), **kwargs)


def engine_group(config: HomegymConfig, placement: Optional[Any] = None, **kwargs: Any):
    from rollout.engines.group import EngineGroup

    return EngineGroup(placement=placement, **{**engine_args(config), **kwargs})


def backend_args(config: HomegymConfig) -> dict[str, Any]:
    """``TrainBackend.init``'s inputs besides rank and world size (also ``TrainGroup``'s)."""
    return dict(model=config.model, train=config.train, algo=config.algo,
                warmup=config.warmup, cluster=config.cluster,
                share_prompts=config.derived.share_prompts,
                total_optimizer_steps=config.derived.total_optimizer_steps)


def rank_env(config: HomegymConfig) -> dict[str, str]:
    """What every training rank's process gets in its environment: NCCL_CUMEM_ENABLE as
    the SGLang engines have it, since rank 0 shares the weight-broadcast communicator with
    them (``rollout.engines.actor.nccl_cumem_enable``)."""
    from rollout.engines.actor import nccl_cumem_enable

    return {"NCCL_CUMEM_ENABLE": nccl_cumem_enable(config.rollout.sglang_args)}


def train_group(config: HomegymConfig, placement: Optional[Any] = None):
    from trainer.training.train_group import TrainGroup

    return TrainGroup(placement=placement, env=rank_env(config), **backend_args(config))


def rollout_sections(config: HomegymConfig) -> dict[str, Any]:
    """The sections the rollout side runs on: ``RolloutArgs``' and ``make_demos``'."""
    return dict(model=config.model, rollout=config.rollout, data=config.data, env=config.env)


def manager_args(config: HomegymConfig) -> dict[str, Any]:
    """``RolloutManager``'s inputs besides the router URL."""
    return dict(rollout_sections(config), eval=config.eval)


def data_source(config: HomegymConfig, split: str, tokenizer: Any):
    """The prompts of ``split`` ("train" | "eval") as the rollout manager reads them."""
    from rollout.data import DataSource

    return DataSource.for_split(split, tokenizer, data=config.data, env=config.env,
                                n_samples_per_prompt=config.rollout.n_samples_per_prompt)


def weight_sync(config: HomegymConfig, train_group: Any, engines: Any, *,
                mode: Optional[str] = None, disk_dir: str = ""):
    """The run's weight push (``mode`` None: ``config.derived.weight_sync``)."""
    from trainer.weight_sync.push import WeightSync

    return WeightSync(config.train, config.rollout, config.model, config.cluster, train_group,
                      engines, mode=mode or config.derived.weight_sync, disk_dir=disk_dir)
