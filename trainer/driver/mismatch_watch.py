"""The driver's side of the train/rollout mismatch.

The training ranks measure the gap between the engines' and the trainer's log-probs every
step (``trainer.algo.mismatch``); what only the driver knows is how many policy versions
behind each trained sample is (``staleness_metrics``). ``MismatchWatch`` warns, once per run
and metric, when a step's mismatch crosses its ``algo.mismatch_warn`` threshold, naming the
config keys that address it: runs whose engines drift from the trainer often look fine for
a while and then collapse.
"""

from __future__ import annotations

import logging
from typing import Sequence

from config import AlgoConfig
from trainer.driver.pipeline import sample_staleness

log = logging.getLogger("homegym")
PREFIX = "mismatch/"


def staleness_metrics(weight_versions: Sequence[int], version: int) -> dict[str, float]:
    """Mean and max policy versions behind ``version`` of a trained batch's samples."""
    staleness = sample_staleness(weight_versions, version)
    if not staleness:
        return {}
    return {f"{PREFIX}staleness_mean": sum(staleness) / len(staleness),
            f"{PREFIX}staleness_max": float(max(staleness))}


def remedy(name: str, algo: AlgoConfig) -> str:
    """The config keys that address a mismatch metric crossing its threshold."""
    if name.startswith("staleness"):
        return (f"algo.max_staleness (now {algo.max_staleness}) bounds it; algo.stale_policy "
                f"(now {algo.stale_policy}) drops staler groups; algo.rollout_correction (now "
                f"{algo.rollout_correction}) corrects what is trained")
    now = algo.rollout_correction
    if now != "none":
        low, high = algo.correction_bounds
        now += f"; algo.correction_low={low} algo.correction_high={high}"
    return (f"algo.rollout_correction (now {now}) corrects or drops the mismatched tokens; "
            "rollout.dtype / model.dtype set the engines' and trainer's numerics; "
            f"algo.max_staleness (now {algo.max_staleness}) how stale samples may be")


class MismatchWatch:
    """Warns the first time each metric of ``algo.mismatch_warn`` exceeds its threshold."""

    def __init__(self, algo: AlgoConfig) -> None:
        self.algo = algo
        self.warned: set[str] = set()

    def check(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Warn about this step's metrics; returns the warnings issued."""
        issued = []
        for name, threshold in self.algo.mismatch_warn.items():
            value = metrics.get(PREFIX + name)
            if value is None or name in self.warned or not value > threshold:
                continue
            self.warned.add(name)
            message = (f"train/rollout mismatch at step {step}: {PREFIX}{name} = {value:.4g} "
                       f"exceeds algo.mismatch_warn.{name} = {threshold:g} (warned once per "
                       f"run). {remedy(name, self.algo)}")
            log.warning(message)
            issued.append(message)
        return issued
