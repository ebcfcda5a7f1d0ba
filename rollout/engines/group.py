"""EngineGroup: N engine actors behind one sglang-router, managed as one thing.

The rollout manager only needs ``router_url``; the driver uses the fan-out methods
(pause/abort/continue, release/resume memory, weight versions), each of which returns once
every engine has answered (results in engine order) and raises if any engine failed.
Weights do not pass through here: ``targets()`` tells the training ranks where the
engines are, and they stream the tensors themselves (trainer/weight_sync/push.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rollout.engines.actor import LaunchSpec, bind_host, launch_spec, remote_actor_class
from rollout.engines.client import EngineClient, EngineError, fan_out
from rollout.engines.router import Router

log = logging.getLogger("homegym.engines")


@dataclass(frozen=True)
class EngineTarget:
    """What a process needs to talk to one engine: shipped to the training ranks, which
    stream weights to the engines themselves (the driver never holds a weight)."""

    name: str
    url: str
    api_key: Optional[str]
    tp_size: int
    version: Optional[str] = None  # the SGLang version it reports, where known

    def client(self) -> EngineClient:
        return EngineClient(self.url, self.api_key, name=self.name, version=self.version)


def _version_if_up(client: EngineClient) -> Optional[str]:
    """The engine's SGLang version (asked once per client), or None where it cannot be
    asked: a target for an engine that is down still names it."""
    try:
        return client.version()
    except EngineError:
        return None


class _FanOut:
    """Admin calls over ``self.clients`` (one EngineClient per engine), made concurrently
    from the calling process: each returns once every engine has answered (results in
    engine order) and raises the first engine's EngineError if any failed."""

    clients: list[EngineClient]
    tp_sizes: list[int]

    def _all(self, method: str, *args, **kwargs) -> list:
        return fan_out(lambda c: getattr(c, method)(*args, **kwargs), self.clients)

    def targets(self) -> list[EngineTarget]:
        return [EngineTarget(c.name, c.url, c.api_key, tp, _version_if_up(c))
                for c, tp in zip(self.clients, self.tp_sizes)]

    def release_memory(self, tags: Optional[list[str]] = None) -> list:
        """Release weights and KV cache (colocated training turns). SGLang asserts an idle
        server, so first wait until each one is (its /flush_cache succeeds only then)."""
        self._all("flush_cache")
        return self._all("release_memory", tags)

    def resume_memory(self, tags: Optional[list[str]] = None) -> list:
        return self._all("resume_memory", tags)

    def pause_generation(self, mode: str = "abort") -> list:
        return self._all("pause_generation", mode)

    def continue_generation(self) -> list:
        return self._all("continue_generation")

    def abort_all(self) -> list:
        return self._all("abort_all")

    def flush_cache(self, timeout_s: float = 120.0) -> list:
        """Flush every engine's prefix cache as soon as it is idle (at most ``timeout_s``)."""
        return self._all("flush_cache", timeout_s)

    def server_infos(self) -> list[dict]:
        return self._all("server_info")

    def weight_versions(self) -> list[str]:
        return self._all("weight_version")


class EngineView(_FanOut):
    """Some engines of a group, with the group's fan-out methods (e.g. a weight push to the
    engines just restarted: ``weight_sync.push(version, engines=view)``)."""

    def __init__(self, clients: Sequence[EngineClient], tp_sizes: Sequence[int],
                 indices: Sequence[int]):
        self.clients = list(clients)
        self.tp_sizes = list(tp_sizes)
        self.indices = list(indices)


class EngineGroup(_FanOut):
    def __init__(self, model, rollout, cluster, placement: Optional[Sequence[Any]] = None, *,
                 num_engines: int, seed: int, lora=None, model_path: Optional[str] = None,
                 log_dir: Optional[str] = None, start: bool = True):
        """``placement``: optional per-engine Ray scheduling — a list (one entry per engine)
        of Ray scheduling strategies or ``(placement_group, bundle_index)`` pairs, or a
        ``trainer.training.placement.Placement`` (then its engine_strategy / engine_resources /
        engine_gpu_ids are used); default none (Ray places the actors). ``seed``: engine
        i's sampling seed is seed + i; ``lora``: the ``train.lora`` section when the engines
        serve pushed adapters (``config.derived.lora_push == "adapter"``), else None."""
        from rollout.models import resolve_model_path

        self.model, self.rollout, self.cluster = model, rollout, cluster
        self.seed, self.lora = seed, lora
        self.num_engines = num_engines
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1 (got {self.num_engines})")
        self.resources = None  # (num_cpus, num_gpus) per actor when a Placement says so
        self.gpu_ids: Optional[list] = None  # per engine: physical GPU ids for its server
        if placement is not None and hasattr(placement, "engine_strategy"):
            res = placement.engine_resources()
            self.resources = (res.num_cpus, res.num_gpus)
            if cluster.device == "cuda":
                self.gpu_ids = [placement.engine_gpu_ids(i) for i in range(self.num_engines)]
            placement = [placement.engine_strategy(i) for i in range(self.num_engines)]
        if placement is not None and len(placement) < self.num_engines:
            raise ValueError(f"placement has {len(placement)} entries for {self.num_engines} engines")
        self.placement = list(placement) if placement is not None else None
        self.model_path = model_path or resolve_model_path(model.path, model.cache_dir)
        # Without a log_dir the logs go to a temporary directory, removed by shutdown(); a
        # group that fails to start keeps it (its error names the log and quotes its tail).
        self._temporary_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="hg-engines-")
        self.engines: list[Any] = []  # Ray actor handles, engine order
        self.urls: list[str] = []
        self.names: list[str] = []
        self.clients: list[EngineClient] = []
        self.router: Optional[Router] = None
        self._next_id = 0
        self.restarts = 0  # engines restarted by recover() over the run
        if start:
            self.start()

    # ---- lifecycle ----
    def _options(self, index: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rollout = self.rollout
        gpu = self.cluster.device == "cuda"
        opts: dict = {"num_cpus": 1 if not gpu else 0.1,
                      "num_gpus": rollout.num_gpus_per_engine if gpu else 0,
                      # A sync actor runs its methods on one long-lived thread, which matters:
                      # the server dies with the thread that launched it (PDEATHSIG).
                      # No runtime_env: the actor computes nothing, and it hands the server
                      # its threads in the server's own environment (actor.py); a
                      # runtime_env would start it through Ray's setup shim, ~0.4 CPU-s.
                      "max_concurrency": 1}
        if self.resources is not None:
            opts["num_cpus"], opts["num_gpus"] = self.resources
        if self.placement is not None and index < len(self.placement) and \
                self.placement[index] is not None:
            entry = self.placement[index]
            if isinstance(entry, tuple):
                pg, bundle = entry
                entry = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle,
                    placement_group_capture_child_tasks=True)
            opts["scheduling_strategy"] = entry
        return opts

    def health(self) -> list[bool]:
        """Per engine: its server process is alive and answers /health."""
        import ray

        return ray.get([e.health.remote() for e in self.engines])

    @property
    def tp_sizes(self) -> list[int]:
        return [self.rollout.num_gpus_per_engine] * len(self.engines)

    def _set_url(self, index: int, url: str) -> None:
        self.urls[index] = url
        self.clients[index] = EngineClient(url, None, name=self.names[index])

    def _spawn(self, index: int, spec: Optional[LaunchSpec] = None):
        if spec is None:
            spec = launch_spec(self.model, self.rollout, self.cluster, self.model_path,
                               seed=self.seed, lora=self.lora, index=index)
            if self.gpu_ids is not None and index < len(self.gpu_ids):
                # The actor holds a fraction of one GPU; its server gets all of its GPUs.
                spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids[index]))
        name = f"engine{self._next_id}"
        self._next_id += 1
        actor = remote_actor_class().options(**self._options(index)).remote(spec, name, self.log_dir)
        return actor, name, actor.start.remote()

    def start(self) -> str:
        import ray

        pending = [self._spawn(i) for i in range(self.num_engines)]
        self.engines = [a for a, _, _ in pending]
        self.names = [n for _, n, _ in pending]
        self.urls = ray.get([ref for _, _, ref in pending])  # engines start in parallel
        self.clients = [EngineClient(u, None, name=n) for u, n in zip(self.urls, self.names)]
        cluster = self.cluster
        node_ip = ray.util.get_node_ip_address() if cluster.num_nodes > 1 else None
        self.router = Router(host=bind_host(cluster.host, cluster.num_nodes, node_ip),
                             port=self.rollout.router_port,
                             tokenizer_path=self.model_path,
                             log_dir=os.path.join(self.log_dir, "router"))
        os.makedirs(self.router.log_dir, exist_ok=True)
        self.router.start(self.urls)
        log.info("engines %s behind router %s", self.urls, self.router.url)
        return self.router.url

    @property
    def router_url(self) -> str:
        assert self.router is not None, "EngineGroup not started"
        return self.router.url

    def shutdown(self) -> None:
        import ray

        if self.router is not None:
            self.router.shutdown()
        if self.engines:  # (ray.get would start a Ray instance where none is running)
            try:
                ray.get([e.shutdown.remote() for e in self.engines], timeout=30)
            except Exception:  # engines already gone: killing the actors is enough
                pass
            for e in self.engines:
                ray.kill(e)
        self.engines, self.urls, self.names, self.clients = [], [], [], []
        if self._temporary_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def add_engine(self, placement: Any = None) -> int:
        """Start one more engine and register it with the router; returns its index."""
        import ray

        if placement is not None:
            self.placement = (self.placement or [None] * len(self.engines)) + [placement]
        actor, name, ref = self._spawn(len(self.engines))
        url = ray.get(ref)
        self.router.add_worker(url)
        self.engines.append(actor)
        self.urls.append(url)
        self.names.append(name)
        self.clients.append(EngineClient(url, None, name=name))
        return len(self.engines) - 1

    def remove_engine(self, index: int) -> None:
        """Take an engine out of the router first (no new traffic), then stop it."""
        import ray

        if not 0 <= index < len(self.engines):
            raise ValueError(f"no engine {index} (have {len(self.engines)})")
        url, actor = self.urls.pop(index), self.engines.pop(index)
        self.names.pop(index)
        self.clients.pop(index)
        if self.placement is not None and index < len(self.placement):
            self.placement.pop(index)
        if self.gpu_ids is not None and index < len(self.gpu_ids):
            self.gpu_ids.pop(index)
        try:
            self.router.remove_worker(url)
        except ValueError:
            pass  # the router had already dropped it
        try:
            ray.get(actor.shutdown.remote(), timeout=30)
        finally:
            ray.kill(actor)

    def restart_engine(self, index: int) -> str:
        """Restart a (crashed or stuck) engine's server; the router gets the new URL."""
        import ray

        old = self.urls[index]
        try:
            self.router.remove_worker(old)
        except ValueError:
            pass
        url = ray.get(self.engines[index].restart.remote())
        self.router.add_worker(url)
        self._set_url(index, url)
        return url

    # ---- fault recovery ----
    def find_dead(self, timeout_s: float = 30.0) -> dict[int, str]:
        """Engines that need a restart: ``{index: reason}``. An engine is dead when its
        server process exited or its /health does not answer 200 ("server"), or when its
        Ray actor itself is gone or unresponsive ("actor": it must be re-created)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        refs = [e.health.remote() for e in self.engines]
        dead: dict[int, str] = {}
        for i, ref in enumerate(refs):
            try:
                if not ray.get(ref, timeout=timeout_s):
                    dead[i] = "server"
            except (RayActorError, GetTimeoutError) as err:
                log.warning("engine %d: actor unreachable (%s)", i, type(err).__name__)
                dead[i] = "actor"
        return dead

    def _respawn(self, index: int) -> str:
        """Replace engine ``index``'s Ray actor (same placement slot) and start its server."""
        import ray

        try:
            ray.kill(self.engines[index])
        except Exception:
            pass
        actor, name, ref = self._spawn(index)
        self.engines[index] = actor
        self.names[index] = name
        return ray.get(ref)

    def recover(self, push_weights: Optional[Callable[["EngineView"], Any]] = None) -> dict[str, float]:
        """Restart every dead engine, re-register it with the router and bring it to the
        current weights; returns metrics for the step.

        ``push_weights(view)`` is called once with an ``EngineView`` of the restarted
        engines (same fan-out methods as the group) and must load the current policy into
        them, e.g. ``lambda view: weights.push(version, engines=view)`` with the run's one
        ``WeightSync`` (trainer.driver.runtime does this).
        A restarted server starts from ``model_path``: without ``push_weights`` it serves
        the base weights until the next regular push.

        Call it between rollouts (the driver does, at the start of each step and right
        after each rollout, before any fan-out call that needs every engine). In-flight
        requests of an engine that died mid-rollout were already retried on the others by
        the router (and by ``post``), so the step itself completes without it.
        """
        dead = self.find_dead()
        for index, reason in sorted(dead.items()):
            old = self.urls[index]
            log.warning("engine %d (%s) is dead (%s): restarting it", index, old, reason)
            try:
                self.router.remove_worker(old)
            except ValueError:
                pass  # the router had already dropped it
            if reason == "actor":
                url = self._respawn(index)
            else:
                import ray

                try:
                    url = ray.get(self.engines[index].restart.remote())
                except Exception as err:  # the actor cannot restart its server: replace it
                    log.warning("engine %d: restart failed (%s); re-creating its actor", index, err)
                    url = self._respawn(index)
            self._set_url(index, url)
        indices = sorted(dead)
        try:
            # Weights before traffic: while other engines keep generating (async mode),
            # a restarted engine joins the router only once it serves the current policy.
            if dead and push_weights is not None:
                push_weights(EngineView([self.clients[i] for i in indices],
                                        [self.tp_sizes[i] for i in indices], indices))
        finally:
            for i in indices:
                self.router.add_worker(self.urls[i])
        self.restarts += len(dead)
        return {"rollout/engine_restarts": float(self.restarts),
                "rollout/engines_restarted_now": float(len(dead))}
