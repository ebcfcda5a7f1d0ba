"""RolloutManager: turns prompts into a scored, filtered ``RolloutBatch`` for one step.

One asyncio coroutine per sample (bounded by the GenerateState semaphore), one task per
group. A step keeps ``over_sampling_batch_size`` groups in flight (default
``rollout_batch_size``), replacing each group the dynamic-sampling filter drops, until
``rollout_batch_size`` groups pass.

Failure policy: a sample whose generate or reward function raises, or that exceeds
``rollout.sample_timeout_s``, is marked FAILED, logged and counted
(``rollout/failed_samples``) -- and its *whole group is dropped*, because group-relative
advantages (GRPO, RLOO, ...) are wrong for a group with a missing member. A replacement
group is launched, so the step still returns ``rollout_batch_size`` full groups.

End of step: groups still in flight are aborted (``abort_all`` on every engine). With
``rollout.partial_rollout`` they are kept in a buffer and continue first next step -- an
episode of the built-in env driver resumes exactly where it stopped (the partial turn's
tokens are kept, the environment object too); a sample from a custom generate function
restarts from its prompt (its state lives inside user code). Without it they are dropped.
Samples are stamped with the weight version of their oldest token.

The training loop calls ``generate_ref``: the batch stays in the object store, where the
training ranks read it, and the driver gets a ``rollout.batch_ref.BatchRef`` (counts, group
ids, labels, versions, metrics). ``select`` cuts a stored batch the same way.

The abort switch (rollout.http.ABORT) is process-wide: run one ``generate`` or
``evaluate`` at a time per manager process (the training loop does).
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray

from rollout.filters import FILTERS
from rollout.plugins import get_env_class, registered_or_dotted
from rollout.args import RolloutArgs, load_plugin
from rollout.data import DataSource
from rollout.ledger import Ledger, epoch_and_row, key_of
from rollout.generate import (EnginePolicy, Episode, GenerateState, close_episode, run_episode,
                              sampling_params_from)
from rollout.http import ABORT, ENDPOINT_NAMES, GATE, LAST_WEIGHT_VERSION, RETRIES, post
from rollout.batch_ref import BatchRef
from rollout.sample import RolloutBatch, Sample

logger = logging.getLogger(__name__)

Status = Sample.Status


@dataclass
class _Item:
    """One sample slot of a group: its episode, prompt, and result once finished."""

    episode: Episode
    prompt_ids: list[int]
    result: Optional[list[Sample]] = None  # set when finished (COMPLETED/TRUNCATED/FAILED)
    seed: Optional[int] = None  # sampling seed of the episode (seeded evaluation)


@dataclass
class _StepStats:
    launched: int = 0
    resumed: int = 0
    failed_samples: int = 0
    failed_groups: int = 0
    filtered_groups: int = 0
    aborted_groups: int = 0
    model_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def _check_reward(s: Sample) -> None:
    """Raise inside the sample's try-block, so a bad reward fails only that sample/group."""
    if s.reward is None:
        raise ValueError("no reward: the sample has none and no rollout.custom_rm_function "
                         "is set")
    if not math.isfinite(s.scalar_reward):
        raise ValueError(f"reward {s.scalar_reward} is not finite")


def _meta_values(samples: list[Sample]) -> dict[str, list[float]]:
    """Numeric/bool metadata, top level and one level nested (slime-style user code nests,
    e.g. metadata["guessing"]["success"]), as ``key`` or ``outer/inner``."""
    values: dict[str, list[float]] = {}

    def add(key: str, v: Any) -> None:
        if isinstance(v, (bool, int, float)) and not key.startswith("_"):
            values.setdefault(key, []).append(float(v))

    for s in samples:
        for k, v in (s.metadata or {}).items():
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    add(f"{k}/{k2}", v2)
            else:
                add(k, v)
    return values


def _find(values: dict[str, list[float]], name: str) -> Optional[list[float]]:
    if name in values:
        return values[name]
    for key, v in values.items():
        if key.endswith("/" + name):
            return v
    return None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    if not xs:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def summarize(samples: list[Sample], prefix: str) -> dict[str, float]:
    """Reward, length, truncation, turns and per-env metadata means for finished samples."""
    if not samples:
        return {}
    rewards = [s.scalar_reward for s in samples]
    lengths = [s.response_length for s in samples]
    m: dict[str, float] = {
        f"{prefix}/raw_reward": _mean(rewards), f"{prefix}/raw_reward_std": _std(rewards),
        f"{prefix}/mean_reward": _mean(rewards),
        f"{prefix}/response_len/mean": _mean(lengths),
        f"{prefix}/response_len/max": float(max(lengths)),
        f"{prefix}/response_len/min": float(min(lengths)),
        f"{prefix}/truncated_ratio": _mean([float(s.status == Status.TRUNCATED)
                                            for s in samples]),
        f"{prefix}/num_samples": float(len(samples)),
    }
    values = _meta_values(samples)
    for key, vs in values.items():
        m[f"{prefix}/{key}"] = _mean(vs)
    for name, metric in (("success", "success_rate"), ("format_error", "format_error_rate")):
        vs = _find(values, name)
        if vs is not None:
            m[f"{prefix}/{metric}"] = _mean(vs)
    turns = _find(values, "turns_taken") or values.get("num_turns")
    if turns is not None:
        m[f"{prefix}/mean_turns"] = _mean(turns)
    return m


class RolloutManagerCore:
    """The manager's logic; ``RolloutManager`` below is this class as a Ray actor."""

    def __init__(self, rollout: Any, env: Any, data: Any, eval: Any, *, model: Any,
                 router_url: str) -> None:
        self.rollout, self.env, self.data, self.eval = rollout, env, data, eval
        r = rollout
        self.args = RolloutArgs(router_url, model=model, rollout=rollout, data=data, env=env)
        self.state = GenerateState(self.args)
        ENDPOINT_NAMES[self.state.router_url] = "router"
        self.env_cls = get_env_class(env.name) if env.enabled else None
        self.custom_generate = (load_plugin(r.custom_generate_function,
                                            "rollout.custom_generate_function")
                                if r.custom_generate_function else None)
        # An OpenAI-API agent (rollout/agent) runs as a custom generate function that
        # takes seeds like the built-in driver does.
        self.agent = r.agent.function is not None
        if self.agent:
            from rollout.agent import make_agent_generate

            self.custom_generate = make_agent_generate(
                load_plugin(r.agent.function, "rollout.agent.function"), r.agent.history_policy)
        self.custom_rm = (load_plugin(r.custom_rm_function, "rollout.custom_rm_function")
                          if r.custom_rm_function else None)
        if r.group_rm and self.custom_rm is None:
            raise ValueError("rollout.group_rm=true needs rollout.custom_rm_function")
        if self.env_cls is None and self.custom_rm is None and self.custom_generate is None:
            raise ValueError("no reward source: set env.name to an environment or "
                             "rollout.custom_rm_function")
        if self.env_cls is not None:
            try:  # one throwaway instance: bad env.kwargs fail here, not in every sample
                self.env_cls(max_turns=env.max_turns, **env.init_kwargs)
            except TypeError as e:
                raise ValueError(f"env.kwargs: {self.env_cls.__name__} rejects "
                                 f"{env.init_kwargs}: {e}") from e
        self.filter = self._load_filter(r.dynamic_sampling_filter)
        self.train_data = self._data_source("train")
        self._eval_data: Optional[DataSource] = None
        self.buffer: list[list[_Item]] = []  # aborted groups to continue next step
        self.ledger = Ledger()  # where every prompt group of every epoch is

    @staticmethod
    def _load_filter(name: Optional[str]) -> Optional[Callable[[Any, list[Sample]], bool]]:
        if name is None:
            return None
        fn = registered_or_dotted(name, FILTERS, "rollout.dynamic_sampling_filter", "filter")
        if not callable(fn):
            raise ValueError(f"rollout.dynamic_sampling_filter: {name!r} is not callable")
        return fn

    # ---- one sample / one group --------------------------------------------------------
    def _draw_group(self) -> list[_Item]:
        """A dropped group's prompt again (failed, too stale, an unused extra), else the
        next row of the data; recorded in the ledger as in flight."""
        key = self.ledger.next_requeued()
        if key is None:
            group = self.train_data.next_group()
            epoch, row = self.train_data.epoch, self.train_data.last_row
            key = key_of(epoch, row)
        else:
            epoch, row = epoch_and_row(key)
            group = self.train_data.make_group(row)
            self.ledger.counts["replaced"] += 1
        self.ledger.drawn(key, group[0].group_index)
        items = self._new_items(group)
        if self.rollout.seed is not None:
            _seed_items(items, self.rollout.seed, epoch * len(self.train_data) + row)
        return items

    def _new_items(self, group: list[Sample]) -> list[_Item]:
        items = []
        for s in group:
            env = None
            if self.env_cls is not None and self.custom_generate is None:
                env = self.env_cls(max_turns=self.env.max_turns, seed=s.index,
                                   **self.env.init_kwargs)
            items.append(_Item(Episode(sample=s, env=env), prompt_ids=list(s.tokens)))
        return items

    async def _generate_one(self, item: _Item, sampling_params: dict) -> list[Sample]:
        ep = item.episode
        if self.custom_generate is not None:
            # User code posts by itself; an episode has at most one request in flight, so
            # bounding samples bounds its requests (rollout.max_concurrency).
            if item.seed is not None:
                sampling_params = dict(sampling_params, sampling_seed=item.seed)
            if self.agent:
                # An agent's requests go through EnginePolicy, which takes the semaphore
                # per request; holding it per episode as well would deadlock once
                # max_concurrency episodes wait for a request permit.
                out = await self.custom_generate(self.args, ep.sample, dict(sampling_params))
            else:
                async with self.state.semaphore:
                    out = await self.custom_generate(self.args, ep.sample,
                                                     dict(sampling_params))
            samples = list(out) if isinstance(out, (list, tuple)) else [out]
            version = LAST_WEIGHT_VERSION[0]
            for s in samples:
                if not isinstance(s, Sample):
                    raise TypeError(f"rollout.custom_generate_function returned "
                                    f"{type(s).__name__}, expected Sample or list[Sample]")
                if s.weight_version is None:
                    s.weight_version = version
            return samples
        if item.seed is not None:
            sampling_params = dict(sampling_params, sampling_seed=item.seed)
        policy = EnginePolicy(self.state, sampling_params)
        max_turns = self.env.max_turns if ep.env is not None else 1
        return [await run_episode(ep, policy, self.state.renderer, max_turns=max_turns,
                                  max_context_len=self.state.max_context_len,
                                  max_response_len=sampling_params["max_new_tokens"])]

    async def _run_item(self, item: _Item, sampling_params: dict, stats: _StepStats) -> None:
        if item.result is not None:  # finished before an abort; kept as it was
            return
        try:
            async with asyncio.timeout(self.rollout.sample_timeout_s):
                samples = await self._generate_one(item, sampling_params)
                if any(s.status == Status.ABORTED for s in samples):
                    if self.custom_generate is not None:  # cannot resume user code: restart
                        s = item.episode.sample
                        s.set_prompt(item.prompt_ids)
                        s.status, s.metadata = Status.ABORTED, {}
                    return
                if self.custom_rm is not None and not self.rollout.group_rm:
                    for s in samples:
                        s.reward = await self.custom_rm(self.args, s)
                for s in samples:
                    if not self.rollout.group_rm:
                        _check_reward(s)
                    s.check()
        except Exception as e:  # contained: one bad sample must not crash the step
            s = item.episode.sample
            s.status = Status.FAILED
            reason = ("timeout after %.1fs" % self.rollout.sample_timeout_s
                      if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}")
            s.metadata["error"] = reason
            stats.failed_samples += 1
            if len(stats.errors) < 5:
                stats.errors.append(reason)
            logger.warning("sample %s (group %s) FAILED: %s", s.index, s.group_index, reason)
            samples = [s]
        item.result = samples

    async def _run_group(self, items: list[_Item], sampling_params: dict,
                         stats: _StepStats) -> list[_Item]:
        await asyncio.gather(*(self._run_item(it, sampling_params, stats) for it in items))
        if (self.rollout.group_rm and all(it.result is not None for it in items)
                and not any(s.status == Status.FAILED for it in items for s in it.result)):
            samples = [s for it in items for s in it.result]
            try:
                async with asyncio.timeout(self.rollout.sample_timeout_s):
                    rewards = await self.custom_rm(self.args, samples)
                if len(rewards) != len(samples):
                    raise ValueError(f"group reward function returned {len(rewards)} rewards "
                                     f"for {len(samples)} samples")
                for s, reward in zip(samples, rewards):
                    s.reward = reward
                    _check_reward(s)
            except Exception as e:
                reason = f"group reward: {type(e).__name__}: {e}"
                logger.warning("group %s FAILED: %s", samples[0].group_index, reason)
                stats.failed_samples += len(samples)
                if len(stats.errors) < 5:
                    stats.errors.append(reason)
                for s in samples:
                    s.status = Status.FAILED
                    s.metadata["error"] = reason
        return items

    # ---- aborting --------------------------------------------------------------------
    async def _abort_engines(self) -> None:
        """abort_all on every engine (the router does not broadcast /abort_request)."""
        router = self.state.router_url
        try:
            workers = await post(f"{router}/workers", None, method="GET", max_retries=1)
            if isinstance(workers, dict):
                workers = workers.get("workers", [])
            urls = [w["url"] if isinstance(w, dict) else str(w) for w in workers]
        except Exception as e:
            logger.warning("could not list the router's workers (%s); aborting via router", e)
            urls = [router]
        results = await asyncio.gather(
            *(post(f"{u}/abort_request", {"abort_all": True}, max_retries=1) for u in urls),
            return_exceptions=True)
        for u, res in zip(urls, results):
            if isinstance(res, Exception):
                logger.warning("abort_request on %s failed: %s", u, res)

    async def _drain(self, tasks: dict[asyncio.Task, list[_Item]], stats: _StepStats,
                     keep: bool, grace_s: float = 30.0) -> None:
        """Abort everything in flight; buffer the groups (``keep``) or drop them."""
        ABORT.on = True
        try:
            deadline = time.monotonic() + grace_s
            while tasks and time.monotonic() < deadline:
                await self._abort_engines()
                done, _ = await asyncio.wait(tasks, timeout=1.0)
                for t in done:
                    items = tasks.pop(t)
                    t.result()
                    failed = any(s.status == Status.FAILED for it in items
                                 for s in (it.result or []))
                    if failed:
                        stats.failed_groups += 1
                    else:
                        stats.aborted_groups += 1
                    if keep and not failed:
                        for it in items:
                            if it.result and it.result[0].status == Status.ABORTED:
                                it.result = None  # to continue
                        self.buffer.append(items)
                        self.ledger.buffered(_group_index(items))
                    else:
                        # A group with a failed sample counts as failed whether it ended
                        # before or during the drain.
                        self.ledger.requeue(_group_index(items),
                                            "failed" if failed else "aborted")
                        await asyncio.gather(*(close_episode(it.episode) for it in items))
            for t, items in tasks.items():  # engines ignored the abort: give up on these
                t.cancel()
                self.ledger.requeue(_group_index(items), "aborted")
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
                stats.aborted_groups += len(tasks)
                tasks.clear()
        finally:
            ABORT.on = False

    # ---- a training step -------------------------------------------------------------
    def _classify(self, items: list[_Item], stats: _StepStats) -> Optional[list[Sample]]:
        samples = [s for it in items for s in (it.result or [])]
        for s in samples:
            stats.model_tokens += sum(s.loss_mask) if s.loss_mask is not None else s.response_length
        if any(s.status == Status.FAILED for s in samples):
            stats.failed_groups += 1
            self.ledger.requeue(_group_index(items), "failed")
            return None
        if any(it.result is None for it in items) or any(s.status == Status.ABORTED
                                                         for s in samples):
            # Aborted by someone else (e.g. a weight update): continue it later.
            self.buffer.append(items)
            self.ledger.buffered(_group_index(items))
            stats.aborted_groups += 1
            for it in items:
                if it.result and it.result[0].status == Status.ABORTED:
                    it.result = None
            return None
        if self.filter is not None and not self.filter(self.args, samples):
            stats.filtered_groups += 1
            self.ledger.filtered(_group_index(items))
            return None
        return samples

    async def generate(self, step: int) -> RolloutBatch:
        r = self.rollout
        t0 = time.perf_counter()
        stats = _StepStats()
        retries_before = RETRIES["requests"]
        sampling_params = dict(self.state.sampling_params)
        want = r.rollout_batch_size
        in_flight_target = r.over_sampling_batch_size or want
        # Bound a step whose filter rejects (nearly) everything instead of looping forever.
        max_launch = 10 * in_flight_target + len(self.buffer)
        accepted: list[list[Sample]] = []
        tasks: dict[asyncio.Task, list[_Item]] = {}
        while len(accepted) < want:
            while len(tasks) + len(accepted) < in_flight_target and stats.launched < max_launch:
                if self.buffer:
                    items = self.buffer.pop(0)
                    self.ledger.resumed(_group_index(items))
                    stats.resumed += 1
                else:
                    items = self._draw_group()
                stats.launched += 1
                task = asyncio.create_task(self._run_group(items, sampling_params, stats))
                tasks[task] = items
            if not tasks:
                break
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                items = tasks.pop(t)
                t.result()
                samples = self._classify(items, stats)
                if samples is not None:
                    if len(accepted) < want:
                        accepted.append(samples)
                        self.ledger.generated(samples[0].group_index)
                    elif r.partial_rollout:
                        self.buffer.append(items)  # finished extra: first in line next step
                        self.ledger.buffered(samples[0].group_index)
                    else:
                        self.ledger.requeue(samples[0].group_index, "extra")
        if tasks:
            await self._drain(tasks, stats, keep=r.partial_rollout)
        if len(accepted) < want:
            logger.warning("step %d: only %d of %d groups passed (launched %d, filtered %d, "
                           "failed %d)", step, len(accepted), want, stats.launched,
                           stats.filtered_groups, stats.failed_groups)
        # Groups finish in whatever order the engines serve them; train in launch order so
        # a step's batch is a function of the data order and the weights alone.
        accepted.sort(key=lambda g: g[0].group_index)
        samples = [s for g in accepted for s in g]
        elapsed = time.perf_counter() - t0
        metrics = summarize(samples, "rollout")
        metrics.update({
            "rollout/failed_samples": float(stats.failed_samples),
            "rollout/failed_groups": float(stats.failed_groups),
            "rollout/filtered_groups": float(stats.filtered_groups),
            "rollout/aborted_groups": float(stats.aborted_groups),
            "rollout/launched_groups": float(stats.launched),
            "rollout/resumed_groups": float(stats.resumed),
            "rollout/buffered_groups": float(len(self.buffer)),
            "rollout/accepted_groups": float(len(accepted)),
            "rollout/request_retries": float(RETRIES["requests"] - retries_before),
            "perf/rollout_time": elapsed,
            "perf/tokens_per_s": stats.model_tokens / elapsed if elapsed > 0 else 0.0,
        })
        if stats.errors:
            logger.warning("step %d: %d failed samples; first errors: %s", step,
                           stats.failed_samples, stats.errors)
        return RolloutBatch.from_samples(samples, metrics)

    # ---- batches for the training ranks (the driver sees only a BatchRef) -------------
    async def generate_ref(self, step: int) -> BatchRef:
        """``generate(step)``, with the batch left in the object store (owned by this
        actor) for the training ranks to read by reference."""
        return BatchRef.put(await self.generate(step))

    def select(self, batch: RolloutBatch, indices: list[int]) -> BatchRef:
        """The samples at ``indices`` of a stored batch (pass its ref: Ray resolves it
        here), stored as a new batch; e.g. the async pipeline's staleness filter."""
        return BatchRef.put(batch.select(indices))

    # ---- evaluation ------------------------------------------------------------------
    def _data_source(self, split: str) -> DataSource:
        return DataSource.for_split(split, self.state.tokenizer, data=self.data, env=self.env,
                                    n_samples_per_prompt=self.rollout.n_samples_per_prompt)

    def _eval_source(self, split: str) -> DataSource:
        if split == "train":
            return self._data_source("train")
        if self._eval_data is None:
            self._eval_data = self._data_source("eval")
        return self._eval_data

    async def _eval_pass(self, data: DataSource, n: int, sampling_params: dict,
                         prefix: str) -> tuple[dict[str, float], list[dict]]:
        stats = _StepStats()
        groups = [self._new_items(g) for g in data.all_groups(n)]
        if self.eval.seed is not None and (self.custom_generate is None or self.agent):
            # The same draws for the same (prompt, attempt) in every evaluation: base and
            # trained models are compared on paired samples, not on two independent ones.
            for g, items in enumerate(groups):
                _seed_items(items, self.eval.seed, g)
        await asyncio.gather(*(self._run_group(g, sampling_params, stats) for g in groups))
        samples = [s for g in groups for it in g for s in (it.result or [])]
        ok = [s for s in samples if s.status != Status.FAILED]
        metrics = summarize(ok, prefix)
        metrics[f"{prefix}/failed_samples"] = float(stats.failed_samples)
        rows = [{"pass": prefix, "group": s.group_index, "label": s.label,
                 "response": s.response, "reward": s.scalar_reward if s.reward is not None
                 else None, "status": s.status.value, "metadata": s.metadata} for s in samples]
        return metrics, rows

    async def evaluate(self, split: str = "eval") -> dict:
        """Sampled pass (eval.n_samples_per_prompt at eval.temperature) over every prompt
        of ``split``, plus a greedy pass when eval.greedy. Returns {"metrics", "rows"}."""
        ev, r = self.eval, self.rollout
        data = self._eval_source(split)
        passes = [("eval", ev.n_samples_per_prompt,
                   sampling_params_from(ev.temperature, r.top_p, r.top_k, r.max_response_len,
                                        list(r.stop)))]
        if ev.greedy:
            passes.append(("eval_greedy", 1, sampling_params_from(
                0.0, 1.0, -1, r.max_response_len, list(r.stop))))
        metrics: dict[str, float] = {}
        rows: list[dict] = []
        t0 = time.perf_counter()
        for prefix, n, params in passes:
            m, rw = await self._eval_pass(data, n, params, prefix)
            metrics.update(m)
            rows += rw
        metrics["perf/eval_time"] = time.perf_counter() - t0
        return {"metrics": metrics, "rows": rows}

    async def hold_generation(self) -> None:
        """Keep every new engine call of this process back until ``release_generation``
        (rollout.http.GATE); requests already sent go on."""
        GATE.hold()

    async def release_generation(self) -> None:
        GATE.release()

    def set_lora_adapter(self, name: Optional[str]) -> None:
        """Name the LoRA adapter every /generate of this process asks for (rollout.http)."""
        from rollout import http

        http.LORA_ADAPTER[0] = name

    # ---- the prompt ledger -------------------------------------------------------------
    def mark_trained(self, group_ids: list[int]) -> None:
        self.ledger.mark_trained(group_ids)

    def requeue_groups(self, group_ids: list[int], why: str) -> None:
        """Groups the trainer dropped (e.g. too stale): their prompts are generated again."""
        for g in dict.fromkeys(group_ids):
            self.ledger.requeue(g, why)

    def verify_ledger(self) -> dict:
        """Raises LedgerError unless every group so far is trained at most once and every
        row of each completed epoch is accounted for; returns the ledger's figures."""
        return self.ledger.verify(num_rows=len(self.train_data),
                                  complete_epochs=self.train_data.epoch)

    # ---- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict:
        # The buffer holds live episodes (environment objects included): pickled whole.
        return {"train_data": self.train_data.state_dict(),
                "buffer": pickle.dumps(self.buffer), "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.train_data.load_state_dict(state["train_data"])
        self.buffer = pickle.loads(state["buffer"]) if state.get("buffer") else []
        if "ledger" in state:  # checkpoints from before the ledger have none
            self.ledger.load_state_dict(state["ledger"])


def _group_index(items: list[_Item]) -> int:
    return items[0].episode.sample.group_index


def _seed_items(items: list[_Item], base: int, group: int) -> None:
    """One sampling seed per sample of ``group`` under ``base``: distinct within the group
    (its samples must differ), the same whenever the group is generated again."""
    for j, it in enumerate(items):
        it.seed = (base * 1_000_003 + group * 1_009 + j) % 2**31


# Async methods run on the actor's event loop; the manager is one process per run.
RolloutManager = ray.remote(num_cpus=0)(RolloutManagerCore)
