"""The driver: the RL loop (warm-up: trainer/driver/warmup.py; evaluations:
trainer/driver/evaluation.py).

Colocated (engines and training ranks share devices and take turns), per step:

    batch = manager.generate_ref(step)     # engines generate, environments score
    engines.release_memory(); ranks onload; train(batch.ref); ranks offload
    engines.resume_memory(weights); push weights (version = step); resume_memory(kv_cache)

The run starts with the ranks offloaded (trainer.driver.runtime), so the first push, the
base evaluation and the first rollout have the engines' memory to themselves.

Disaggregated (async): a ``trainer.driver.pipeline.RolloutPipeline`` generates ahead within the
staleness bound and filters stale groups; the loop trains and pushes weights. How a push
reaches engines and when their prefix cache is flushed: trainer/weight_sync/engine_updates.py.

The driver never holds a rollout batch: the manager leaves it in the object store and
returns a ``BatchRef`` (group ids, labels, versions, metrics, a token digest), and the
training ranks read ``batch.ref`` themselves. Only a checkpoint copies queued batches out.

The run directory holds the resolved config, metrics.jsonl, wandb files, checkpoints,
the base-vs-trained evaluation table and curves.png (trainer/driver/report.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import ray
from omegaconf import OmegaConf

from trainer.driver.checkpoint import CheckpointManager, preflight_output_dir
from config import HomegymConfig, to_dict
from trainer.driver.memory_plan import check_memory
from trainer.driver.evaluation import print_line, run_evaluation, write_eval_table, write_rows
from trainer.driver.metrics import MetricsLogger, redact, timed, write_json
from trainer.driver.mismatch_watch import MismatchWatch, staleness_metrics
from trainer.driver.pipeline import RolloutPipeline, TrailingWork
from trainer.weight_sync.engine_updates import update_generating_engines, update_idle_engines
from rollout.batch_ref import BatchRef
from rollout.models import resolve_model_path
from trainer.driver.report import CurvesWriter
from trainer.driver.runtime import Runtime
from trainer.driver.warmup import warm_up
from trainer.driver.watchdog import HangError, Watchdog

log = logging.getLogger("homegym")


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    evals: dict[str, dict[str, float]] = field(default_factory=dict)
    final_metrics: dict[str, float] = field(default_factory=dict)

    def checkpoints(self) -> list[Path]:
        return CheckpointManager(self.run_dir).all_complete()


def make_run_dir(config: HomegymConfig) -> Path:
    name = config.logging.run_name or (
        f"{config.derived.label}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return Path(config.logging.output_dir).resolve() / name


def estimate_checkpoint_bytes(config: HomegymConfig) -> int:
    """Rough size of one checkpoint (weights + Adam moments + HF export), for the preflight."""
    path = Path(resolve_model_path(config.model.path, config.model.cache_dir))
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) or 1
    return 5 * weights


def train(config: HomegymConfig) -> RunResult:
    check_memory(config)  # a GPU layout that cannot fit stops here, before any GPU work
    run_dir = make_run_dir(config)
    preflight_output_dir(run_dir, min_free_bytes=estimate_checkpoint_bytes(config))
    OmegaConf.save(OmegaConf.create(redact(to_dict(config))), run_dir / "config.yaml")
    print(f"homegym: run {run_dir.name} -> {run_dir}  "
          f"(resume later with logging.run_name={run_dir.name})", flush=True)
    with Runtime(config, run_dir) as runtime:
        return Driver(config, run_dir, runtime).run()


class Driver:
    def __init__(self, config: HomegymConfig, run_dir: Path, runtime: Runtime) -> None:
        self.config = config
        self.run_dir = run_dir
        self.curves = CurvesWriter(run_dir)
        self.rt = runtime
        self.ckpt = CheckpointManager(run_dir)
        self._pipeline: RolloutPipeline | None = None
        self._trailing: TrailingWork | None = None  # async: the last step's trailing work
        self._trailed: dict[str, float] = {}  # its metrics, joined before a step could take them
        self._prefetched: list[tuple[int, Any]] = []  # whole batches from a checkpoint
        self.logger: MetricsLogger | None = None
        self.evals: dict[str, dict[str, float]] = {}
        self.weight_version: int | None = None  # the version the engines hold
        self.mismatch_watch = MismatchWatch(config.algo)

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        """Resume, or start from the base policy (warmed up when warmup.steps > 0); then
        each step generates, trains and pushes the new weights, with checkpoints and
        evaluations on schedule; finally save and evaluate the trained policy."""
        cfg = self.config
        start_step = self.resume()
        self.logger = MetricsLogger(cfg, self.run_dir, total_steps=cfg.train.num_steps)
        self.rt.defer_stop = cfg.train.save_on_interrupt
        metrics: dict[str, float] = {}
        try:
            # The engines get the trainer's weights first: colocated they released theirs
            # for the ranks' start-up, and they report numbered policy versions from here.
            self.push_weights(start_step)
            if start_step == 0:
                self.start_policy()
            steps = self.colocated_steps if cfg.cluster.colocate else self.async_steps
            with self.watched() as watchdog:
                for step, metrics in steps(start_step):
                    watchdog.kick(f"step {step}")
                    self.logger.log(step, metrics)
                    self.mismatch_watch.check(step, metrics)
                    saved = self.save_if_due(step)
                    if self.eval_due(step):
                        self.evaluate(f"step_{step}", step=step)
                    if self.rt.stop_requested:  # Ctrl-C / SIGTERM: keep this step, then stop
                        return self.stop(step, saved, metrics)
                self.finish(start_step)
        finally:
            self.logger.close()
            self.curves.write()
        return RunResult(run_dir=self.run_dir, steps=cfg.train.num_steps, evals=self.evals,
                         final_metrics=metrics)

    def start_policy(self) -> None:
        """Step 0 (the engines already serve the base policy as version 0): warmed up (SFT,
        a training turn) when warmup.steps > 0 and pushed again as version 0; evaluated
        before and after the warm-up."""
        cfg = self.config
        if cfg.warmup.steps > 0:
            if cfg.derived.eval_before_and_after:
                self.evaluate("initial", step=0)
            with self.trainer_turn({}):
                warm_up(cfg, self.rt.train_group)
            self.push_weights(0)
        if cfg.derived.eval_before_and_after:
            self.evaluate("base", step=0)

    @contextlib.contextmanager
    def watched(self) -> Iterator[Watchdog]:
        """The hang watchdog over the steps: a failure after it ended a stuck call is a
        HangError naming that call."""
        watchdog = Watchdog(self.config.train.hang_timeout_s, self.run_dir)
        try:
            yield watchdog
        except Exception as err:
            if watchdog.message:  # it ended the stuck call
                raise HangError(watchdog.message) from err
            raise
        finally:
            watchdog.close()

    def eval_due(self, step: int) -> bool:
        """Whether ``step`` is on the eval.interval schedule. The last step's evaluation is
        the trained policy's (``finish``) when that one runs: the same weights and seeded
        samples, so a second pass would repeat it exactly."""
        cfg = self.config
        if not cfg.eval.interval or step % cfg.eval.interval:
            return False
        return not (step == cfg.train.num_steps and cfg.derived.eval_before_and_after)

    def save_if_due(self, step: int) -> bool:
        interval = self.config.train.save_interval
        due = bool(interval and step % interval == 0)
        if due:
            self.save(step)
        return due

    def stop(self, step: int, saved: bool, metrics: dict[str, float]) -> RunResult:
        """A requested stop after ``step``: save it (unless just saved) and the ledger."""
        if not saved:
            self.save(step)
        self.write_ledger()
        print(f"stopped after step {step}; resume with "
              f"logging.run_name={self.run_dir.name}", flush=True)
        return RunResult(run_dir=self.run_dir, steps=step, evals=self.evals,
                         final_metrics=metrics)

    def finish(self, start_step: int) -> None:
        """The last step saved, the ledger checked, the trained policy evaluated."""
        cfg = self.config
        last = cfg.train.num_steps
        if start_step < last and not (cfg.train.save_interval
                                      and last % cfg.train.save_interval == 0):
            self.save(last)
        self.write_ledger()
        if cfg.derived.eval_before_and_after:
            self.evaluate("trained", step=last)
        if self.evals:
            write_eval_table(self.run_dir, self.evals)

    def colocated_steps(self, start_step: int) -> Iterator[tuple[int, dict[str, float]]]:
        """Generate, then train on the same devices, then push: strictly on-policy."""
        rt = self.rt
        for step in range(start_step + 1, self.config.train.num_steps + 1):
            metrics: dict[str, float] = {}
            with timed(metrics, "perf/step_time"):
                # A dead engine is restarted and given the current weights before and after
                # generation (the router already moved its in-flight requests elsewhere).
                self.recover_engines(metrics)
                with timed(metrics, "perf/rollout_time"):
                    batch = ray.get(rt.manager.generate_ref.remote(step))
                self.recover_engines(metrics)
                if len(batch):
                    with self.trainer_turn(metrics):
                        metrics.update(self.train(step, batch))
                    self.record_trained(step, batch)
                    metrics.update(self.with_recovery(lambda: self.push_weights(step), metrics))
            metrics = {**batch.metrics, **metrics}
            del batch  # trained on: the store frees it while the next step generates
            yield step, metrics

    def async_steps(self, start_step: int) -> Iterator[tuple[int, dict[str, float]]]:
        """Engines keep generating while the ranks train; generation of step s starts once
        the policy is at version >= s - 1 - max_staleness, and samples staler than that
        bound when trained on are dropped (algo.stale_policy=drop) or kept and counted."""
        cfg, rt = self.config, self.rt
        pipeline = RolloutPipeline(rt.manager, max_staleness=cfg.algo.max_staleness,
                                   last_step=cfg.train.num_steps,
                                   drop_stale=cfg.algo.stale_policy == "drop",
                                   prefetched=self._prefetched)
        self._prefetched = []
        self._pipeline = pipeline
        self._trailing = trailing = TrailingWork()
        version = start_step
        try:
            for step in range(start_step + 1, cfg.train.num_steps + 1):
                metrics: dict[str, float] = {}
                with timed(metrics, "perf/step_time"):
                    pipeline.launch_ready(version)
                    with timed(metrics, "perf/trainer_wait_time"):
                        batch, gen_metrics = pipeline.take(step)
                    metrics.update(gen_metrics)
                    batch, stale = pipeline.filter_stale(batch, version=version)
                    metrics.update(stale)
                    if len(batch):
                        metrics.update(self.train(step, batch))
                        # The last step's trailing work ran while this one trained.
                        self.join_trailing(metrics)

                        def update() -> dict[str, float]:
                            pushed, settle = update_generating_engines(
                                rt.engines, rt.weights, step,
                                update_in_flight=cfg.rollout.update_in_flight,
                                hold=lambda: ray.get(rt.manager.hold_generation.remote()),
                                release=lambda: ray.get(rt.manager.release_generation.remote()),
                                flush_timeout_s=cfg.rollout.sample_timeout_s)
                            self.weight_version = step
                            trailing.start(settle)
                            return pushed
                        # Engines that died while generating come back on the current
                        # policy (their requests went to the others), then all are updated.
                        self.recover_engines(metrics)
                        metrics.update(self.with_recovery(update, metrics))
                        trailing.start(functools.partial(self.record_trained, step, batch))
                    version = step
                metrics = {**batch.metrics, **metrics}
                del batch  # trained on (or dropped): the store may free it
                yield step, metrics
        except BaseException:
            # Do not wait for a generation in flight: after a failed update it may wait on
            # a paused engine for ever. Tearing the manager down ends it.
            pipeline.close(wait=False)
            trailing.close(wait=False)
            raise
        else:
            pipeline.close()
            trailing.join()
            trailing.close()
        finally:
            self._pipeline = self._trailing = None

    def push_weights(self, version: int) -> dict[str, float]:
        """Push to engines that are not generating (trainer.weight_sync.engine_updates)."""
        metrics = update_idle_engines(self.rt.engines, self.rt.weights, version,
                                      colocated=self.config.cluster.colocate)
        self.weight_version = version
        return metrics

    @contextlib.contextmanager
    def trainer_turn(self, metrics: dict[str, float]) -> Iterator[None]:
        """Colocated: the engines release their memory and the ranks onload for the
        block, and offload after it (the next push gives the engines theirs back).
        Disaggregated: the ranks keep their GPUs; nothing moves."""
        if not self.config.cluster.colocate:
            yield
            return
        self.with_recovery(self.rt.engines.release_memory, metrics)
        self.rt.train_group.onload()
        yield
        self.rt.train_group.offload()

    def recover_engines(self, metrics: dict[str, float]) -> None:
        """Restart dead engines on the current policy; counts into ``metrics``."""
        out = self.rt.recover_engines(self.weight_version)
        metrics["rollout/engine_restarts"] = out["rollout/engine_restarts"]
        metrics["rollout/engines_restarted_now"] = (
            metrics.get("rollout/engines_restarted_now", 0.0) + out["rollout/engines_restarted_now"])

    def with_recovery(self, phase, metrics: dict[str, float]) -> dict[str, float]:
        """Run ``phase``, engine calls that need every engine (release, pause, push). If it
        fails and an engine is found dead, restart the dead ones and run the phase once
        more, whole: repeating a whole phase is safe where repeating one of its requests
        (a weight update that may have half-applied) is not."""
        from rollout.engines.client import EngineError
        from trainer.weight_sync.push import WeightSyncError

        try:
            return phase() or {}
        except (EngineError, WeightSyncError) as err:
            if not self.rt.engines.find_dead():
                raise
            log.warning("an engine died during %s (%s): restarting it, then again",
                        getattr(phase, "__name__", "a phase"), err)
        self.recover_engines(metrics)
        return phase() or {}

    def train(self, step: int, batch: BatchRef) -> dict[str, float]:
        metrics = staleness_metrics(batch.weight_versions, self.weight_version or 0)
        with timed(metrics, "perf/train_time"):
            # The ref itself, as a top-level argument: each rank resolves it.
            metrics.update(self.rt.train_group.train_step(batch.ref))
        return metrics

    def record_trained(self, step: int, batch: BatchRef) -> None:
        """The prompt ledger marks the batch's groups trained; data_order.jsonl gets the
        step's line."""
        ray.get(self.rt.manager.mark_trained.remote(batch.group_ids))
        self._record_data_order(step, batch)

    def join_trailing(self, metrics: dict[str, float] | None = None) -> None:
        """Wait for the async loop's trailing work: before the next push, a checkpoint, an
        evaluation or the ledger check, which need it done. An engine that died while it
        ran (e.g. paused for the push) is restarted here. Its metrics (the last push's
        read-back) go into ``metrics``, the next step's; joined without them (a checkpoint
        or an evaluation between steps), they wait for the next step that joins."""
        if self._trailing is None:
            return
        if metrics is None:
            self._trailed.update(self.with_recovery(self._trailing.join, self._trailed))
            return
        metrics.update(self._trailed)
        self._trailed = {}
        metrics.update(self.with_recovery(self._trailing.join, metrics))

    def write_ledger(self) -> dict[str, float]:
        """Check the prompt ledger (every group trained at most once, every row of each
        completed epoch accounted for) and write its figures to ledger.json."""
        self.join_trailing()
        summary = ray.get(self.rt.manager.verify_ledger.remote())
        write_json(self.run_dir / "ledger.json", summary)
        return summary

    def _record_data_order(self, step: int, batch: BatchRef) -> None:
        """One line per step: the group labels trained on, in order (resume checks use it)."""
        groups: dict[int, Any] = {}
        for gid, label in zip(batch.group_ids, batch.labels):
            groups.setdefault(gid, label)
        with open(self.run_dir / "data_order.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "labels": list(groups.values()),
                                "tokens_sha256": batch.tokens_sha256}, default=str) + "\n")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, name: str, *, step: int) -> dict[str, float]:
        self.join_trailing()  # the engines let generation through again
        if self._pipeline is not None:
            self._pipeline.prefetched()  # one manager call at a time: let generation finish
        metrics, rows = run_evaluation(self.rt.manager, train_split=self.config.eval.train_split)
        self.evals[name] = metrics
        write_rows(self.run_dir, name, rows)
        if self.logger is not None:
            self.logger.log(step, {f"{name}/{k}": v for k, v in metrics.items()}, progress=False)
            self.curves.write()
        print_line(name, metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        rt = self.rt
        self.join_trailing()  # the ledger holds the last step's groups
        prefetched = self._pipeline.checkpoint_state() if self._pipeline is not None else []
        state = {"manager": ray.get(rt.manager.state_dict.remote()), "prefetched": prefetched}
        model_dir = resolve_model_path(self.config.model.path, self.config.model.cache_dir)
        path = self.ckpt.save(
            step, save_train=lambda d: rt.train_group.save(str(d)),
            export_hf=lambda d: rt.train_group.export_hf(d, model_dir, self.rt.weights.bucket_bytes),
            rollout_state=state, meta={"weight_version": step, "evals": self.evals})
        print(f"checkpoint: {path}", flush=True)
        return path

    def resume(self) -> int:
        path = self.ckpt.resolve_resume(self.config.train.resume)
        if path is None:
            return 0
        resumed = self.ckpt.load(path, load_train=lambda d: self.rt.train_group.load(str(d)))
        ray.get(self.rt.manager.load_state_dict.remote(resumed.rollout_state["manager"]))
        self._prefetched = list(resumed.rollout_state.get("prefetched", []))
        self.evals = dict(resumed.meta.get("evals", {}))
        print(f"resumed from {path} at step {resumed.step}", flush=True)
        return resumed.step

