"""Values that follow from the config, resolved once when it is built.

A config key whose default is "auto" or null (``train.weight_sync``, ``train.lora.push``,
``train.share_prompts``, ``rollout.num_engines``) means "whatever the rest of the config
implies"; ``derive`` works that out in one place, and the built ``HomegymConfig`` carries
the answers as ``config.derived``. The keys themselves keep what the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Derived:
    # What the run trains, for run names: the recipe, else <env>-<model>, where <env> is an
    # adapter's task or game, the environment's name, or the agent's (an agent-only run).
    label: str
    # Inference engines: rollout.num_engines, else rollout.num_gpus / num_gpus_per_engine.
    num_engines: int
    # train.weight_sync resolved: tensor | distributed | disk.
    weight_sync: str
    # train.lora.push resolved: adapter | merged; None without LoRA.
    lora_push: Optional[str]
    # train.share_prompts resolved (null = wherever it applies).
    share_prompts: bool
    # Optimizer steps of the whole run: the horizon of the LR decay.
    total_optimizer_steps: int
    # eval.before_and_after resolved (null = wherever there is an eval split: an
    # environment's, or data.eval_path).
    eval_before_and_after: bool


def derive(config) -> Derived:
    """The derived values of a ``HomegymConfig`` (called by its ``__post_init__``)."""
    rollout, train, env = config.rollout, config.train, config.env
    named = (env.task or env.id or (env.name if env.enabled else None) or
             rollout.agent.function or rollout.custom_generate_function or "run")
    trains = named.replace(":", ".").rsplit(".", 1)[-1].lower()
    model = config.model.path.rstrip("/").rsplit("/", 1)[-1]
    label = config.recipe_name or f"{trains}-{model}"

    num_engines = rollout.num_engines
    if num_engines is None:
        num_engines = rollout.num_gpus // rollout.num_gpus_per_engine

    # auto: tensor handles between colocated processes, a broadcast to disaggregated engines.
    weight_sync = train.weight_sync
    if weight_sync == "auto":
        weight_sync = "tensor" if config.cluster.colocate else "distributed"

    lora_push = None
    if train.lora.enabled:
        lora_push = train.lora.push
        if lora_push == "auto":
            lora_push = "adapter" if rollout.engine == "sglang" else "merged"

    share_prompts = train.share_prompts
    if share_prompts is None:
        share_prompts = train.backend == "fsdp" and not train.gradient_checkpointing

    eval_before_and_after = config.eval.before_and_after
    if eval_before_and_after is None:
        eval_before_and_after = env.enabled or config.data.eval_path is not None

    return Derived(label=label, num_engines=num_engines, weight_sync=weight_sync,
                   lora_push=lora_push, share_prompts=share_prompts,
                   total_optimizer_steps=total_optimizer_steps(rollout, train),
                   eval_before_and_after=eval_before_and_after)


def total_optimizer_steps(rollout, train) -> int:
    """Optimizer steps of the whole run, the horizon of the LR decay (``rollout``:
    RolloutConfig, ``train``: TrainConfig): ``train.num_steps`` rollouts of
    rollout_batch_size x n_samples_per_prompt samples, ``global_batch_size`` samples per
    optimizer step (None: the whole rollout)."""
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    per_rollout = samples // (train.global_batch_size or samples)
    return max(train.num_steps * per_rollout, 1)
