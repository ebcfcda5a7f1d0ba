"""The run's distributed pieces, started in order and always torn down.

`Runtime` connects to Ray (the configured cluster, `RAY_ADDRESS`, or a new local one),
creates the placement group, the engines behind the router, the training ranks and the
rollout manager, and stops all of them on exit, Ctrl-C or SIGTERM, so no server process
or actor outlives the run.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Optional

import ray

from trainer.config import HomegymConfig

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


def connect_ray(config: HomegymConfig) -> bool:
    """Join the configured cluster or start a local one. Returns True if we started it."""
    if ray.is_initialized():
        return False
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": worker_env(config)}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return False
    # Logical CPUs: engines and training ranks share bundles when colocated and mostly wait
    # on each other, so the local instance advertises at least what the layout needs.
    needed = max(os.cpu_count() or 1, config.num_engines + config.train.world_size + 2)
    ray.init(num_cpus=needed, include_dashboard=False, runtime_env=runtime_env,
             log_to_driver=True)
    return True


def _progress(message: str) -> None:
    print(f"homegym: {message}", flush=True)


class Runtime:
    def __init__(self, config: HomegymConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.placement = None
        self.engines = None
        self.train_group = None
        self.manager = None
        self._started_ray = False
        self._old_sigterm = None

    def __enter__(self) -> "Runtime":
        from rollout.engines.group import EngineGroup
        from rollout.manager import RolloutManager
        from trainer.placement import Placement
        from trainer.train_group import TrainGroup

        self._install_sigterm()
        try:
            self._started_ray = connect_ray(self.config)
            self.placement = Placement(self.config)
            _progress(f"starting {self.config.num_engines} {self.config.rollout.engine} engines")
            self.engines = EngineGroup(self.config, self.placement,
                                       log_dir=str(self.run_dir / "logs" / "engines"))
            _progress(f"starting {self.config.train.world_size} {self.config.train.backend} "
                      "training ranks")
            self.train_group = TrainGroup(self.config, self.placement)
            self.manager = RolloutManager.remote(self.config, self.engines.router_url)
            _progress("ready")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop everything that was started, newest first; safe to call twice."""
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
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _install_sigterm(self) -> None:
        # SIGTERM (ray job stop, kill, a scheduler) unwinds like Ctrl-C so `close` runs.
        def handler(signum: int, frame: Optional[FrameType]) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        try:
            self._old_sigterm = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread (e.g. inside a Ray task): nothing to do
            self._old_sigterm = None
