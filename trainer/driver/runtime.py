"""The run's distributed pieces, started in order and always torn down.

`Runtime` connects to Ray (the configured cluster, `RAY_ADDRESS`, or a new local one),
creates the placement group, the engines behind the router, the training ranks and the
rollout manager, and stops all of them on exit, Ctrl-C or SIGTERM, so no server process
or actor outlives the run.

Colocated, the engines start first and take their static share of each device, then
release all of it before the training ranks build (a Megatron rank's start-up peak: the
model, then DDP's parameter and gradient buffers while the first parameters are alive,
megatron-core distributed/param_and_grad_buffer.py:795-835), and the ranks offload once
built: the run starts with the engines' memory released and the trainer's offloaded
(slime's order: ray/placement_group.py create_rollout_manager offloads the engines before
create_training_models; its actors sleep at the end of init). The driver's first push
gives the engines their memory back (trainer/weight_sync/engine_updates.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Optional, Sequence

import ray

from config import ConfigError, HomegymConfig

log = logging.getLogger("homegym")


def worker_env(config: HomegymConfig) -> dict[str, str]:
    """Environment every Ray worker of this run starts with."""
    env = {
        "OMP_NUM_THREADS": str(config.cluster.torch_threads),
        "MKL_NUM_THREADS": str(config.cluster.torch_threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if "HOMEGYM_CACHE" in os.environ:
        env["HOMEGYM_CACHE"] = os.environ["HOMEGYM_CACHE"]
    return env


def _job_env_vars() -> dict:
    """Env vars of the Ray job this driver runs in (empty outside a job)."""
    import json

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return {}
    try:
        return dict((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})
    except (ValueError, AttributeError):
        return {}


def connect_ray(config: HomegymConfig, *, pip: Sequence[str] = ()) -> bool:
    """Join the configured cluster or start a local one. Returns True if we started it.
    ``pip``: packages for Ray's runtime_env (the Python API's ``Recipe(pip=[...])``)."""
    if ray.is_initialized():
        if pip:
            raise ConfigError(f"recipe.pip={list(pip)}: Ray is already initialized in this "
                              "process, so its runtime_env cannot change; call "
                              "ray.init(runtime_env={'pip': [...]}) yourself or install the "
                              "packages on the cluster")
        return False
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    env_vars = worker_env(config)
    # Inside a Ray job (scripts/submit.py, `ray job submit`) the job's runtime_env already
    # reaches every worker; Ray refuses a driver runtime_env that sets one of its env var
    # keys again, so the job's values win and only the missing keys are added.
    for key in _job_env_vars():
        env_vars.pop(key, None)
    if address:
        runtime_env: dict = {"env_vars": env_vars}
        if pip:
            runtime_env["pip"] = list(pip)
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return False
    # Logical CPUs: engines and training ranks share bundles when colocated and mostly wait
    # on each other, so the local instance advertises at least what the layout needs.
    needed = max(os.cpu_count() or 1, config.derived.num_engines + config.train.world_size + 2)
    # address="local": always a new instance of our own. Without it Ray joins whatever
    # cluster it finds on this machine (a `ray start --head`, another run's), which is
    # neither what the user asked for nor compatible with num_cpus.
    # The workers' variables go in the environment the local instance starts with (its
    # raylet passes it on to every worker), not in a runtime_env: any runtime_env starts
    # each worker through Ray's setup shim, a second interpreter start per actor (~0.4
    # CPU-s, ~0.45 s). No prestarted workers: they sat idle through every launch, ~1.4
    # CPU-s for nothing (docs/testing.md).
    with _environ(env_vars):
        ray.init(address="local", num_cpus=needed, include_dashboard=False,
                 runtime_env={"pip": list(pip)} if pip else None, log_to_driver=True,
                 _system_config={"enable_worker_prestart": False,
                                 "prestart_worker_first_driver": False})
    return True


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """``os.environ`` with ``values`` set, as it was again afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _hold_signals() -> dict:
    """Ignore SIGINT/SIGTERM (main thread only); returns the handlers to restore."""
    held = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            held[sig] = signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass
    return held


def _release_signals(held: dict) -> None:
    for sig, handler in held.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _progress(message: str) -> None:
    print(f"homegym: {message}", flush=True)


class Runtime:
    def __init__(self, config: HomegymConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.placement = None
        self.engines = None
        self.train_group = None
        self.weights = None  # trainer.weight_sync.push.WeightSync, the run's one
        self.manager = None
        self._started_ray = False
        self._old_handlers: dict = {}
        # Graceful stop: when the driver sets ``defer_stop`` (it then checks
        # ``stop_requested`` at every step boundary, saves a checkpoint and returns), the
        # first Ctrl-C / SIGTERM only sets ``stop_requested``; a second one stops at once.
        # Without it, the first signal unwinds immediately (KeyboardInterrupt).
        self.defer_stop = False
        self.stop_requested = False

    def __enter__(self) -> "Runtime":
        from rollout.manager import RolloutManager
        from trainer.driver import components

        config = self.config
        try:
            self._started_ray = connect_ray(config)
            # After ray.init, which installs a SIGTERM handler of its own in the driver.
            self._install_signal_handlers()
            self.placement = components.placement(config)
            _progress(f"starting {self.config.derived.num_engines} {self.config.rollout.engine} "
                      "engines")
            self.engines = components.engine_group(
                config, self.placement, log_dir=str(self.run_dir / "logs" / "engines"))
            colocated = config.cluster.colocate
            if colocated:
                self.engines.release_memory()  # before the ranks build on the same devices
            _progress(f"starting {self.config.train.world_size} {self.config.train.backend} "
                      "training ranks")
            self.train_group = components.train_group(config, self.placement)
            if colocated:
                self.train_group.offload()
            self.manager = RolloutManager.remote(router_url=self.engines.router_url,
                                                 **components.manager_args(config))
            if config.derived.lora_push == "adapter":
                from trainer.weight_sync.adapter import AdapterSync

                manager = self.manager
                self.weights = AdapterSync(
                    config.train, self.train_group, self.engines,
                    disk_dir=str(self.run_dir / "weight_push"),
                    announce=lambda name: ray.get(manager.set_lora_adapter.remote(name)))
            else:
                self.weights = components.weight_sync(config, self.train_group, self.engines,
                                                      disk_dir=str(self.run_dir / "weight_push"))
            _progress("ready")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def recover_engines(self, weight_version: Optional[int]) -> dict[str, float]:
        """Restart engines that died (server or actor), re-register them with the router
        and load the policy the others serve; returns ``rollout/engine_restarts`` (run
        total) and ``rollout/engines_restarted_now``.

        ``weight_version``: the version of the last weight push (None before the first:
        a restarted engine then already serves the base model it loads at start-up).
        Call between rollouts -- the driver does so before each rollout and right after
        it, before any call that needs every engine (release_memory, weight push)."""
        def push(view) -> None:
            if weight_version is not None:
                self.weights.push(weight_version, engines=view)

        return self.engines.recover(push_weights=push)

    def close(self) -> None:
        """Stop everything that was started, newest first; safe to call twice.

        A second Ctrl-C / SIGTERM while tearing down is ignored (it would otherwise abort
        the teardown half-way and leave engine servers, the router or Ray behind)."""
        held = _hold_signals()
        try:
            self._close()
        finally:
            _release_signals(held)
            for sig, previous in self._old_handlers.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self._old_handlers = {}

    def _close(self) -> None:
        for name in ("manager", "train_group", "engines", "placement"):
            part = getattr(self, name)
            if part is None:
                continue
            setattr(self, name, None)
            try:
                if name == "manager":
                    ray.kill(part)
                else:
                    part.shutdown()
            except Exception as err:  # keep tearing down the rest
                log.warning("stopping %s failed: %s", name, err)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def _install_signal_handlers(self) -> None:
        """SIGTERM (ray job stop, kill, a scheduler) and SIGINT (Ctrl-C) unwind the driver
        so that ``close`` runs -- or, with ``defer_stop``, first ask for a stop at the end
        of the current step."""
        def handler(signum: int, frame: Optional[FrameType]) -> None:
            if self.defer_stop and not self.stop_requested:
                self.stop_requested = True
                _progress(f"{signal.Signals(signum).name}: finishing the current step, then "
                          "checkpoint and exit (send it again to stop now)")
                return
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. inside a Ray task): nothing to do
                pass
