"""The async loop's overlap: generation ahead of training, within the staleness bound, and
each step's trailing work behind it.

``RolloutPipeline`` runs the rollout manager's ``generate_ref`` calls one after another on
a background thread, as far ahead of training as ``algo.max_staleness`` allows, and drops
(or counts) the samples that are staler than the bound by the time they are trained on
(``filter_stale``). Batches stay in the object store throughout: the pipeline holds
``BatchRef``s, and a batch is cut where it lives, by the manager's ``select``.

``TrailingWork`` runs what is left of a step once its weights are pushed (the read-back
of the pushed weights and the rest of the engines' update, the prompt ledger's record)
while the ranks train the next one.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import ray

from rollout.batch_ref import BatchRef
from rollout.sample import RolloutBatch

# One queued step: its batch and the pipeline's own timings of its generation.
Queued = tuple[BatchRef, dict[str, float]]


def sample_staleness(weight_versions: Sequence[int], version: int) -> list[int]:
    """Per sample: policy versions between ``version`` and its oldest token's (0 for a
    sample from an engine on no pushed policy, version -1: it serves the start-up weights)."""
    return [version - v if v >= 0 else 0 for v in weight_versions]


def filter_stale(batch, *, version: int, max_staleness: int,
                 drop: bool) -> tuple[Optional[list[int]], dict[str, float]]:
    """Staleness of each sample = policy version now - version of its oldest token.
    Groups holding a sample staler than `max_staleness` are dropped (or kept, counted).

    ``batch`` is a ``RolloutBatch`` or a ``BatchRef`` (only ``group_ids`` and
    ``weight_versions`` are read). Returns the indices of the samples to keep, or None to
    keep the batch as it is, and the ``async/*`` metrics."""
    staleness = sample_staleness(batch.weight_versions, version)
    metrics = {f"async/staleness_{d}": float(staleness.count(d)) for d in sorted(set(staleness))}
    metrics["async/max_staleness"] = float(max(staleness, default=0))
    # From an engine on no pushed policy (a restarted one serving its start-up weights).
    metrics["async/unversioned_samples"] = float(sum(v < 0 for v in batch.weight_versions))
    stale_groups = {g for g, d in zip(batch.group_ids, staleness) if d > max_staleness}
    metrics["async/stale_samples"] = float(sum(g in stale_groups for g in batch.group_ids))
    if not drop or not stale_groups:
        metrics["async/dropped_stale_samples"] = 0.0
        metrics["async/trained_max_staleness"] = metrics["async/max_staleness"]
        return None, metrics
    keep = [i for i, g in enumerate(batch.group_ids) if g not in stale_groups]
    metrics["async/dropped_stale_samples"] = float(len(batch) - len(keep))
    metrics["async/trained_max_staleness"] = float(max(
        (d for d, g in zip(staleness, batch.group_ids) if g not in stale_groups), default=0))
    return keep, metrics


class RolloutPipeline:
    """Generation of the steps ahead, queued in step order, for the async loop.

    ``manager`` is the ``RolloutManager`` actor (``generate_ref``, ``select``,
    ``requeue_groups``). ``prefetched``: batches a checkpoint saved, generated but not yet
    trained on, as ``checkpoint_state`` returns them; they are taken first."""

    def __init__(self, manager, *, max_staleness: int, last_step: int, drop_stale: bool = True,
                 prefetched: Sequence[tuple[int, tuple[RolloutBatch, dict]]] = ()) -> None:
        self.manager = manager
        self.max_staleness = max_staleness
        self.last_step = last_step
        self.drop_stale = drop_stale
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._queue: deque[tuple[int, Future]] = deque()
        self._next: Optional[int] = None
        self._last_end: Optional[float] = None
        for step, (batch, metrics) in prefetched:
            future: Future = Future()
            # Restored in the driver, so put by it: the ranks still read it by reference.
            future.set_result((BatchRef.put(batch), metrics))
            self._queue.append((step, future))
            self._next = step + 1

    def prefetched(self) -> list[tuple[int, Queued]]:
        """Wait for queued generations; return them (still in the object store)."""
        return [(step, future.result()) for step, future in self._queue]

    def checkpoint_state(self) -> list[tuple[int, tuple[RolloutBatch, dict]]]:
        """The queued batches, whole: they belong in a checkpoint, since the manager's data
        position has already moved past them. The one place a batch is copied out."""
        return [(step, (ref.get(), metrics)) for step, (ref, metrics) in self.prefetched()]

    def launch_ready(self, version: int) -> None:
        """Queue every step whose generation may start under policy `version`."""
        if self._next is None:
            self._next = version + 1
        while (self._next <= self.last_step and len(self._queue) <= self.max_staleness
               and version >= self._next - 1 - self.max_staleness):
            self._queue.append((self._next, self._executor.submit(self._generate, self._next)))
            self._next += 1

    def _generate(self, step: int) -> Queued:
        start = time.perf_counter()
        idle = start - self._last_end if self._last_end is not None else 0.0
        batch = ray.get(self.manager.generate_ref.remote(step))
        self._last_end = time.perf_counter()
        return batch, {"perf/rollout_time": self._last_end - start, "perf/engine_idle_time": idle}

    def take(self, step: int) -> Queued:
        """Step ``step``'s batch and generation timings (waits for its generation)."""
        queued, future = self._queue.popleft()
        assert queued == step, (queued, step)
        return future.result()

    def filter_stale(self, batch: BatchRef, *, version: int) -> tuple[BatchRef, dict[str, float]]:
        """``filter_stale`` under policy ``version``; dropped groups are cut out by the
        manager, where the batch lives, and requeued there, to be generated again from
        their prompts on a newer policy."""
        keep, metrics = filter_stale(batch, version=version, max_staleness=self.max_staleness,
                                     drop=self.drop_stale)
        if keep is None:
            return batch, metrics
        kept_groups = {batch.group_ids[i] for i in keep}
        dropped = sorted(set(batch.group_ids) - kept_groups)
        kept = ray.get(self.manager.select.remote(batch.ref, keep))
        ray.get(self.manager.requeue_groups.remote(dropped, "stale"))
        return kept, metrics

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)


class TrailingWork:
    """What a step leaves to do after its push: calls the ranks need not wait for, run in
    order on a thread of their own while the driver goes on with the next step. ``join``
    waits for them and raises the first one's error, or returns the metrics those that
    return some gave, merged; call it before anything that needs them done (the next
    update, a checkpoint, an evaluation, the ledger check)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trailing")
        self._pending: list[Future] = []

    def start(self, work: Callable[[], object]) -> None:
        self._pending.append(self._executor.submit(work))

    def join(self) -> dict[str, float]:
        pending, self._pending = self._pending, []
        for future in pending:  # all of them, so none still runs when the first error is raised
            future.exception()
        metrics: dict[str, float] = {}
        for future in pending:
            result = future.result()
            if isinstance(result, dict):
                metrics.update(result)
        return metrics

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)
