"""Weight updates as the engines' state allows, and never a stale prefix cache after one.

An engine's prefix (radix) cache holds KV computed with the weights it had then. SGLang
keeps it across a weight update unless the update asks for a flush, and flushes only an
idle engine (0.5.18 managers/scheduler.py:4251-4279 ``flush_cache`` on
``is_fully_idle``, 4083-4100); homegym's CPU engine follows the same rules. So whoever
pushes decides when the flush happens, here, by what the engines are doing:

- colocated, idle (``update_idle_engines``): the engines released their KV cache for the
  training turn, which flushed it (SGLang scheduler_components/weight_updater.py:215-231);
  weights come back first, the push goes into them, then the KV cache and CUDA graphs,
  so the push never competes with the KV cache for the memory training freed (slime's
  order, train.py: onload_weights, update_weights, onload_kv);
- disaggregated, idle (the first push, after a warm-up or a resume, a restarted engine):
  push, then flush;
- disaggregated while generating (``update_generating_engines``),
  ``rollout.update_in_flight=abort``: pause (aborts everything in flight: the engines are
  idle), push, flush, continue. ``pause``: the rollout manager holds every new request
  back (rollout.http.GATE), the engines pause in place, the push lands, generation
  continues so the requests in flight finish on the new weights with the KV they hold,
  and each engine's cache is flushed the moment it is idle (SGLang's deferred flush,
  ``/flush_cache?timeout=``); only then are new requests let through. A request already
  inside an engine at the pause, decoding or queued, is in flight: it continues on the
  new weights with the KV it has or finds (SGLang cannot flush under it); the CPU engine
  records both versions for it (``meta_info.weight_versions``).
"""

from __future__ import annotations

from typing import Callable


def update_idle_engines(engines, weights, version: int, *, colocated: bool) -> dict[str, float]:
    """Push ``version`` to engines that are not generating (``engines``: an EngineGroup;
    ``weights``: the run's WeightSync or AdapterSync)."""
    if not colocated:
        return weights.push(version, flush=True)
    engines.resume_memory(["weights"])
    metrics = weights.push(version, flush=False)  # the KV release flushed the cache
    engines.resume_memory(["kv_cache", "cuda_graph"])
    return metrics


def update_generating_engines(engines, weights, version: int, *, update_in_flight: str,
                              hold: Callable[[], None], release: Callable[[], None],
                              flush_timeout_s: float
                              ) -> tuple[dict[str, float], Callable[[], dict[str, float]]]:
    """Push ``version`` to disaggregated engines while the rollout generates.
    ``hold`` / ``release``: stop and restart the rollout's new engine calls (the rollout
    manager's ``hold_generation`` / ``release_generation``). ``flush_timeout_s``: how long
    the requests in flight may take to finish (pause mode).

    Returns the push's metrics and ``settle``, the rest of the update: the engines'
    weights are verified (``weights.verify``), generation goes on, the prefix caches are
    flushed as the engines go idle, new requests are let through.
    The caller runs it next, or later on a thread of its own while it does other work (the
    ranks train the next step), provided it waits for it before the next update. If the
    push fails, generation goes on and new requests are let through before the error is
    raised (no flush: the caller restarts what died and pushes again). ``settle`` runs
    each of its parts even when one fails, then raises the first error; it returns the
    verification's metrics (the tensors read back)."""
    if update_in_flight == "abort":
        engines.pause_generation(mode="abort")
        try:
            metrics = weights.push(version, flush=True, verify=False)
        except BaseException:
            engines.continue_generation()
            raise
        return metrics, lambda: _settle(weights, version, engines.continue_generation)
    if update_in_flight != "pause":
        raise ValueError("rollout.update_in_flight must be pause or abort "
                         f"(got {update_in_flight!r})")
    hold()
    try:
        engines.pause_generation(mode="in_place")
        try:
            metrics = weights.push(version, flush=False, verify=False)
        except BaseException:
            engines.continue_generation()
            raise
    except BaseException:
        release()
        raise
    return metrics, lambda: _settle(
        weights, version, engines.continue_generation,
        lambda: engines.flush_cache(timeout_s=flush_timeout_s), release)


def _settle(weights, version: int, *parts: Callable[[], object]) -> dict[str, float]:
    """Verify the push of ``version`` (``weights.verify``), then run every part in order
    whatever the ones before raised, then raise the first error, or return the
    verification's metrics. An engine that died after the push fails each engine call it
    is in, but the others' part still reaches every live engine (a fan-out raises once all
    have answered): the live ones go on generating and are flushed, the held requests are
    let through, and the caller restarts the dead one (the driver's ``with_recovery``)."""
    metrics: dict[str, float] = {}
    first: BaseException | None = None
    for part in (lambda: metrics.update(weights.verify(version)), *parts):
        try:
            part()
        except BaseException as err:
            first = first or err
    if first is not None:
        raise first
    return metrics
