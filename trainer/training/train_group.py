"""The training ranks: ``TrainActor`` Ray actors forming one torch.distributed group.

``TrainGroup`` starts ``train.world_size`` actors on the bundles ``Placement`` hands out,
lets rank 0 pick the rendezvous address, initialises the process group (gloo on CPU,
NCCL on GPU) and a backend per rank, then fans every call out to all ranks (the
backends run collectives, so all must take part) and returns rank 0's answer.

A batch reaches the ranks as one object-store reference, passed to every rank as a
top-level argument so each resolves it itself: a rollout batch is already there (the
rollout manager put it, ``rollout.batch_ref.BatchRef``) and never passes through the
driver; one built in the driver (warm-up SFT, tests) is put once. Every rank reads the
whole batch and derives its own share (``trainer.training.backends.batching.plan_step``) and the
global loss denominators from it, so no rank needs another rank's data.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Iterator, Optional

import ray

# How long ranks wait for each other, at the rendezvous and in every collective.
_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


class TrainActor:
    """One training rank (use through ``TrainGroup``; wrapped with ``ray.remote`` there).
    ``env``: variables set in the rank's process first. ``backend_args``: what
    ``TrainBackend.init`` takes besides rank and world size (the model, train, algo, warmup
    and cluster sections, share_prompts, total_optimizer_steps)."""

    def __init__(self, rank: int, world_size: int, env: Optional[dict[str, str]] = None,
                 **backend_args: Any) -> None:
        cluster = backend_args["cluster"]
        # The rank's variables are set here rather than as the actor's runtime_env: a
        # runtime_env starts the worker through Ray's setup shim, a second interpreter
        # start (~0.4 CPU-s and ~0.45 s per actor). Here is early enough: before the
        # first OpenMP region and before any NCCL communicator reads NCCL_CUMEM_ENABLE.
        os.environ.update(env or {})
        os.environ.setdefault("OMP_NUM_THREADS", str(cluster.torch_threads))
        import torch

        torch.set_num_threads(cluster.torch_threads)
        self.rank, self.world_size = rank, world_size
        self.device, self.backend_name = cluster.device, backend_args["train"].backend
        self.backend_args = backend_args
        self.backend = None
        self._weight_groups: dict = {}  # rank 0: the broadcast group with each engine, by name
        self._store = None  # rank 0: the rendezvous store (rendezvous_address)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: start the group's rendezvous store and return this node's IP and the
        store's port. The store binds port 0 itself: a port found free and bound later was
        at times taken by another process in between (EADDRINUSE on a busy node)."""
        import torch.distributed as dist

        address = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(address, 0, self.world_size, is_master=True,
                                    timeout=_RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        return address, self._store.port

    def init(self, master_address: str, master_port: int) -> None:
        import torch.distributed as dist

        from trainer.training.backends import make_backend

        backend = "nccl" if self.device == "cuda" else "gloo"
        store = self._store if self.rank == 0 else dist.TCPStore(
            master_address, master_port, self.world_size, is_master=False,
            timeout=_RENDEZVOUS_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=self.rank,
                                world_size=self.world_size, timeout=_RENDEZVOUS_TIMEOUT)
        self.backend = make_backend(self.backend_name)
        self.backend.init(rank=self.rank, world_size=self.world_size, **self.backend_args)

    def train_step(self, batch) -> dict[str, float]:
        return self.backend.train_step(batch)

    def sft_step(self, batch) -> dict[str, float]:
        return self.backend.sft_step(batch)

    def set_algo(self, algo) -> None:
        self.backend.set_algo(algo)

    def log_probs(self, batch) -> Optional[list]:
        out = self.backend.log_probs(batch)
        return out if self.rank == 0 else None

    def named_weight_buckets(self, bucket_bytes: int) -> Optional[list]:
        # Every rank drains the iterator (the gathers are collectives); rank 0 keeps it.
        buckets = list(self.backend.named_weight_buckets(bucket_bytes))
        return buckets if self.rank == 0 else None

    def weight_bucket_stream(self, bucket_bytes: int) -> Iterator[list]:
        """Streaming variant (a Ray generator): rank 0 yields bucket by bucket, the other
        ranks take part in the gathers and yield nothing."""
        for bucket in self.backend.named_weight_buckets(bucket_bytes):
            if self.rank == 0:
                yield bucket

    # ---- weights to the engines (trainer.weight_sync.push) and to disk -----------------
    def init_weight_broadcast(self, targets: list, group_names: list, backend: str) -> None:
        """Rank 0 forms a weight-update group with each of ``targets`` (named by
        ``group_names``), as that group's rank 0 (SGLang's protocol)."""
        if self.rank != 0:
            return
        from rollout.engines.actor import free_port
        from trainer.weight_sync.push import join_broadcast_group

        # SGLang's protocol tells the engine where to meet before the group's store exists,
        # so the port is one found free (on every interface: engines may be on other nodes).
        address = ray.util.get_node_ip_address()
        for target, name in zip(targets, group_names):
            self._weight_groups[name] = join_broadcast_group(target, address, free_port(""),
                                                             name, backend)

    def destroy_weight_broadcast(self, group_names: Optional[list] = None) -> None:
        """Rank 0 leaves weight-update groups (all by default), freeing what each holds
        (sockets or an NCCL communicator); dropping the reference frees nothing, torch
        keeps it."""
        import torch.distributed as dist

        for name in list(self._weight_groups) if group_names is None else group_names:
            group = self._weight_groups.pop(name, None)
            if group is not None:
                dist.destroy_process_group(group)

    def send_weights(self, plan) -> tuple[dict[str, float], dict]:
        """Stream this backend's weights to the engines of ``plan``
        (trainer.weight_sync.push.PushPlan); this rank's metrics and the check tensors it
        leaves to the driver (``trainer.weight_sync.push.send_weights``)."""
        from trainer.weight_sync.push import DTYPES, send_weights

        buckets = self.backend.named_weight_buckets(plan.bucket_bytes, device=plan.device,
                                                    dtype=DTYPES[plan.dtype])
        # Only rank 0 is in the broadcast groups; the other ranks take part in the gathers.
        groups = [self._weight_groups[n] for n in plan.group_names] if self.rank == 0 else []
        return send_weights(buckets, plan, rank=self.rank, world_size=self.world_size,
                            weight_groups=groups)

    def export_hf(self, out_dir: str, source_dir: str, bucket_bytes: int) -> None:
        """Rank 0 writes the policy as a HF checkpoint (every rank takes part in the gathers).
        A LoRA policy is exported merged, and its adapter in peft format next to it
        (``<out_dir>/../adapter``, trainer.driver.checkpoint's layout)."""
        from trainer.driver.checkpoint import ADAPTER_DIR, export_hf

        buckets = list(self.backend.named_weight_buckets(bucket_bytes))
        if self.rank == 0:
            export_hf(buckets, source_dir, out_dir)
        if getattr(self.backend, "lora", None) is not None:
            self.backend.save_adapter(os.path.join(os.path.dirname(os.path.normpath(out_dir)),
                                                   ADAPTER_DIR))

    def save_adapter(self, out_dir: str) -> None:
        """Rank 0 writes the LoRA adapter in peft format (collective: every rank gathers)."""
        self.backend.save_adapter(out_dir)

    def adapter_tensors(self) -> Optional[list]:
        """A LoRA policy's adapter matrices under peft's names (rank 0's; collective)."""
        tensors = self.backend.adapter_tensors()
        return tensors if self.rank == 0 else None

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)

    def offload(self) -> None:
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    def shutdown(self) -> None:
        import gc

        import torch.distributed as dist

        from trainer.weight_sync.push import release_staging

        # Free the backend's tensors and the staged push buffers before the group kills
        # this process: a /dev/shm buffer (torch's file_system sharing) still mapped at
        # SIGKILL stays behind in /dev/shm, which is memory, for the life of the machine.
        self.backend = None
        release_staging()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainGroup:
    """``world_size`` training ranks behind one object; every method fans out to all.

    ``placement`` is a ``trainer.training.placement.Placement``; without one the actors are
    scheduled freely (tests, a single process slot per rank). The sections and values
    every rank's backend is built from: ``TrainBackend.init``'s (trainer/training/backends/
    base.py). ``env``: variables every rank's process gets besides OMP_NUM_THREADS
    (``trainer.driver.components.rank_env``).
    """

    def __init__(self, model, train, algo, warmup, cluster, placement=None, *,
                 share_prompts: bool, total_optimizer_steps: int,
                 env: Optional[dict[str, str]] = None) -> None:
        self.world_size = train.world_size
        backend_args = dict(model=model, train=train, algo=algo, warmup=warmup, cluster=cluster,
                            share_prompts=share_prompts,
                            total_optimizer_steps=total_optimizer_steps)
        actor_cls = ray.remote(TrainActor)
        env = {"OMP_NUM_THREADS": str(cluster.torch_threads), **(env or {})}
        self.actors = []
        for rank in range(self.world_size):
            if placement is not None:
                res = placement.train_resources()
                options: dict[str, Any] = dict(
                    num_cpus=res.num_cpus, num_gpus=res.num_gpus,
                    scheduling_strategy=placement.train_strategy(rank))
            else:
                gpu = cluster.device == "cuda"
                options = dict(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)
            self.actors.append(actor_cls.options(**options).remote(
                rank, self.world_size, env, **backend_args))
        address, port = ray.get(self.actors[0].rendezvous_address.remote())
        ray.get([a.init.remote(address, port) for a in self.actors])

    def _all(self, method: str, *args) -> list:
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def _with_batch(self, method: str, batch) -> Any:
        """``batch``: a RolloutBatch or an ObjectRef to one (used as it is)."""
        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        return self._all(method, ref)[0]

    def train_step(self, batch) -> dict[str, float]:
        """RL update on a rollout batch (or its ObjectRef); metrics are global (all-reduced
        over ranks)."""
        return self._with_batch("train_step", batch)

    def sft_step(self, batch) -> dict[str, float]:
        """One supervised (warm-up) optimizer step."""
        return self._with_batch("sft_step", batch)

    def set_algo(self, algo) -> None:
        """Swap the loss settings (``AlgoConfig``) of every rank between steps
        (``StepLoop.set_algo``)."""
        self._all("set_algo", algo)

    def log_probs(self, batch) -> list:
        """Per sample, the current policy's response-token log-probs (CPU tensors)."""
        return self._with_batch("log_probs", batch)

    def named_weight_buckets(self, bucket_bytes: int) -> list[list[tuple[str, Any]]]:
        """HF-named full tensors in buckets of ~bucket_bytes, gathered on rank 0."""
        return self._all("named_weight_buckets", bucket_bytes)[0]

    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        """Like ``named_weight_buckets`` but one bucket at a time, so the driver holds only
        one bucket of a large model (e.g. to push each to the engines as it arrives)."""
        streams = [a.weight_bucket_stream.options(num_returns="streaming").remote(bucket_bytes)
                   for a in self.actors]
        try:
            for ref in streams[0]:
                yield ray.get(ref)
        finally:
            for stream in streams[1:]:  # other ranks finish their part of the gathers
                for ref in stream:
                    ray.get(ref)

    def init_weight_broadcast(self, targets: list, group_names: list, backend: str) -> None:
        """Rank 0 forms the distributed weight path's broadcast group with each engine."""
        ray.get(self.actors[0].init_weight_broadcast.remote(targets, group_names, backend))

    def destroy_weight_broadcast(self, group_names: Optional[list] = None) -> None:
        ray.get(self.actors[0].destroy_weight_broadcast.remote(group_names))

    def send_weights(self, plan) -> tuple[dict[str, float], dict]:
        """Every rank streams its share of ``plan`` to the engines; rank 0's metrics (the
        model's bytes and buckets) plus the tensors read back on every rank, and the check
        tensors left to the driver when ``plan.read_back`` is off (rank 0's)."""
        results = self._all("send_weights", plan)
        metrics = dict(results[0][0])
        if plan.read_back:
            metrics["perf/weight_sync_checked_tensors"] = sum(
                m["perf/weight_sync_checked_tensors"] for m, _ in results)
        return metrics, results[0][1]

    def export_hf(self, out_dir: str, source_dir: str, bucket_bytes: int) -> None:
        self._all("export_hf", str(out_dir), source_dir, bucket_bytes)

    def save_adapter(self, out_dir: str) -> None:
        self._all("save_adapter", str(out_dir))

    def adapter_tensors(self) -> list[tuple[str, Any]]:
        """A LoRA policy's adapter matrices (peft names), gathered on rank 0."""
        return self._all("adapter_tensors")[0]

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self._all("load", path)

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        finally:
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
