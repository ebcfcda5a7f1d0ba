"""The supervised warm-up before RL (the ``warmup:`` stage): SFT on the environment's
scripted transcripts, so the base policy already finishes episodes RL can improve on."""

from __future__ import annotations

import time
from typing import Any

from config import HomegymConfig


def warm_up(config: HomegymConfig, train_group: Any) -> None:
    """``warmup.steps`` SFT steps of ``warmup.batch_size`` transcripts on ``train_group``
    (the weights are not pushed: the driver does that next)."""
    from transformers import AutoTokenizer

    from rollout.demos import make_demos
    from rollout.models import resolve_model_path
    from rollout.sample import RolloutBatch
    from trainer.driver import components

    cfg = config.warmup
    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_path(config.model.path, config.model.cache_dir))
    start = time.perf_counter()
    demos = make_demos(tokenizer, cfg.steps * cfg.batch_size, seed=cfg.seed,
                       splits=cfg.splits, **components.rollout_sections(config))
    for s in demos:
        s.reward = 0.0  # SFT ignores rewards; the batch format requires one
    print(f"warm-up: {len(demos)} scripted transcripts ({'+'.join(cfg.splits)} prompts) in "
          f"{time.perf_counter() - start:.1f}s; {cfg.steps} SFT steps", flush=True)
    for i in range(cfg.steps):
        chunk = demos[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        m = train_group.sft_step(RolloutBatch.from_samples(chunk))
        if (i + 1) % max(1, cfg.steps // 10) == 0 or i + 1 == cfg.steps:
            print(f"warm-up step {i + 1}/{cfg.steps} | nll "
                  f"{m.get('train/sft_loss', float('nan')):.4f}"
                  f" | {time.perf_counter() - start:.1f}s", flush=True)
