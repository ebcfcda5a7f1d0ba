"""Weight sync from the training ranks to the inference engines: bucketed, versioned, verified.

The driver only decides *when* and *what version* (``WeightSync.push``); the tensors go
from the training ranks straight to the engines (``send_weights`` runs on every rank), so
no process ever holds a second full copy of the model and nothing passes through the
driver. Two paths, both SGLang's own routes:
- ``tensor`` (colocated: engine and rank share a device): each engine TP rank gets a handle
  to a bucket the training rank on its device holds (SGLang's `update_weights_from_tensor`;
  CUDA IPC on GPU, shared memory on CPU). Engine e's TP rank k is served by training rank
  (e * tp + k) mod world size -- the rank on the same GPU when colocated.
- ``distributed`` (disaggregated): rank 0 broadcasts each bucket over one torch.distributed
  group per engine, rank 0 and that engine's TP ranks (`init_weights_update_group` +
  `update_weights_from_distributed`; NCCL on GPU, gloo on CPU), a bucket's tensors under
  ``FLATTEN_BELOW_BYTES`` as one broadcast of their bytes (`load_format="flattened_bucket"`),
  the larger ones one broadcast each. One group per engine costs
  rank 0 one send per engine instead of one broadcast to all, and buys isolation: an engine
  that dies mid-push breaks only its own group, where a shared group leaves every other
  engine waiting in a receive until its timeout.
- ``disk``: rank 0 writes safetensors files that every engine loads
  (`update_weights_from_disk`); the slowest, and the one that needs no shared memory or
  process group between trainer and engines.

Every update runs inside the server's weight-update session where it has one (SGLang
0.5.23), never asks the server to flush per bucket (that fails, or on 0.5.18 kills the
scheduler, whenever a request is queued) and carries the version on its last bucket only.
Verification uses what a real server offers: every engine must report the new version in
`/model_info`, and the sending rank reads back a few tensors with `/get_weights_by_name`
and compares them with what it sent, where the engine implements that for the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from rollout.checkpoints import is_hybrid, read_config
from rollout.modeling.hybrid import transfer_dtype
from rollout.engines.actor import SGLANG_CPU_LOADERS
from rollout.engines.client import EngineError, fan_out
from rollout.engines.weights_io import (
    FLATTENED_BUCKET, MultiprocessingSerializer, SharedStaging, broadcast_bucket,
    serialize_for_sglang)
from rollout.models import resolve_model_path

log = logging.getLogger("homegym.weights")

GROUP_NAME = "homegym_weights"
# Tensors read back after a push: the embedding's first rows sit on every engine's TP rank
# 0 and the final norm is replicated, so both compare whole whatever the engine's TP size.
CHECK_NAMES = ("model.embed_tokens.weight", "model.norm.weight")
CHECK_ROWS = 4

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightSyncError(RuntimeError):
    pass


@dataclass(frozen=True)
class PushPlan:
    """One push, as every training rank executes it."""

    mode: str  # tensor | distributed | disk
    version: int
    targets: tuple  # rollout.engines.group.EngineTarget, engine order
    bucket_bytes: int
    dtype: str  # the engines' dtype: tensors are cast once, on the sender
    device: str  # where the gathered buckets live: cuda for CUDA IPC / NCCL, else cpu
    flush_cache: bool  # flush each engine's prefix cache once after the push
    group_names: tuple = ()  # each target's broadcast group (distributed mode)
    disk_dir: str = ""  # where rank 0 writes the weights (disk mode); "" = a temp dir
    # The server-side loaders of SGLang's CPU backend (SGLANG_CPU_LOADERS): buckets are
    # loaded with the first, and a final empty update with the second re-packs them.
    loaders: tuple = ()
    # The ranks read the check tensors back from their engines; False: rank 0 returns them
    # instead, for the driver to read back later (WeightSync.verify).
    read_back: bool = True


def source_rank(engine: int, tp_rank: int, tp_size: int, world_size: int) -> int:
    """The training rank that hands engine ``engine``'s TP rank ``tp_rank`` its tensors
    in tensor mode (the rank on the same GPU when colocated)."""
    return (engine * tp_size + tp_rank) % world_size


def broadcast_group_ranks(tp_size: int) -> tuple[int, int]:
    """An engine's first rank in its weight-broadcast group and the group's size: the
    trainer is rank 0, the engine's TP ranks follow."""
    return 1, 1 + tp_size


class WeightSync:
    """Driver-side: one per run (built by the Runtime); ``push(version)`` per update.
    ``mode``: ``config.derived.weight_sync``; the sections give the bucket size (train),
    the engines' dtype (rollout, model) and the layout (cluster)."""

    def __init__(self, train, rollout, model, cluster, train_group, engines, *, mode: str,
                 disk_dir: str = "") -> None:
        if mode not in ("tensor", "distributed", "disk"):
            raise ValueError(f"weight sync mode must be tensor, distributed or disk (got {mode!r})")
        self.rollout, self.model, self.cluster = rollout, model, cluster
        self.train_group = train_group
        self.engines = engines
        self.mode = mode
        self.disk_dir = disk_dir
        self.bucket_bytes = train.weight_bucket_mb * 2**20
        # Distributed mode: each engine's broadcast group (its name, and the EngineTarget
        # that joined it), by the engine's URL (a restarted engine has a new one). Rank 0
        # holds the other end of each.
        self._groups: dict[str, tuple[str, Any]] = {}
        self._groups_made = 0
        self._unchecked: dict[str, torch.Tensor] = {}  # the last push's, if it left them
        # A hybrid model's cached prefixes carry recurrent states computed with the old
        # weights: every push flushes them (trainer/driver/preflight.py refuses the one layout
        # where a flush cannot happen, requests waiting in place).
        self.flush_always = is_hybrid(read_config(
            resolve_model_path(model.path, model.cache_dir)))

    def plan(self, version: int, engines=None, *, flush: Optional[bool] = None) -> PushPlan:
        """``flush``: flush each engine's prefix cache after the push (waiting until it is
        idle); None: disaggregated engines are flushed, colocated ones not (releasing their
        KV cache for training flushed it); a hybrid model's engines always are.
        trainer/weight_sync/engine_updates.py says when."""
        rollout, cluster = self.rollout, self.cluster
        return PushPlan(
            mode=self.mode, version=version, targets=tuple((engines or self.engines).targets()),
            bucket_bytes=self.bucket_bytes, dtype=rollout.dtype or self.model.dtype,
            device="cuda" if cluster.device == "cuda" else "cpu",
            flush_cache=self.flush_always or (not cluster.colocate if flush is None
                                              else flush),
            disk_dir=self.disk_dir,
            # SGLang's CPU backend computes garbage after an in-place update unless its AMX
            # weights are re-packed (rollout/engines/sglang_plugins/homegym_sglang_cpu.py).
            loaders=SGLANG_CPU_LOADERS if (rollout.engine == "sglang"
                                           and cluster.device == "cpu") else ())

    def push(self, version: int, engines=None, *, flush: Optional[bool] = None,
             verify: bool = True) -> dict[str, float]:
        """Load the trainer's current weights into every engine (or into ``engines``, an
        EngineView, e.g. those just restarted) as ``version``, and verify them; ``flush``
        as in ``plan``. ``verify=False``: the checks wait for ``verify(version)``, which
        the caller runs later (the async loop: while the ranks train the next step)."""
        start = time.perf_counter()
        engines = engines or self.engines
        plan = dataclasses.replace(self.plan(version, engines, flush=flush), read_back=verify)
        if plan.mode == "distributed":
            plan = dataclasses.replace(plan, group_names=self._join_groups(plan.targets))
        try:
            metrics, self._unchecked = self.train_group.send_weights(plan)
        except Exception as err:
            if plan.mode == "distributed":
                # Which group broke is not known here; every engine of the push joins anew
                # (a survivor's group is intact, so leaving it is prompt).
                self._leave_groups([t.url for t in plan.targets],
                                   running={t.url for t in self.engines.targets()})
            raise WeightSyncError(f"weight update to version {version} failed: {err}") from err
        if verify:
            self.verify(version, engines)
        metrics["perf/weight_sync_time"] = time.perf_counter() - start
        return metrics

    def _join_groups(self, targets: tuple) -> tuple:
        """The broadcast group of each of ``targets``, formed for those without one; returns
        their names in ``targets``' order. Groups of engines no longer running (restarted
        ones have new URLs) are taken apart first."""
        running = {t.url for t in self.engines.targets()}
        self._leave_groups([url for url in self._groups if url not in running], running)
        new = [t for t in targets if t.url not in self._groups]
        if new:
            backend = "nccl" if self.cluster.device == "cuda" else "gloo"
            names = []
            for _ in new:
                self._groups_made += 1  # a name is new each time: a process cannot create
                names.append(f"{GROUP_NAME}_{self._groups_made}")  # two groups of one name
            try:
                self.train_group.init_weight_broadcast(list(new), names, backend)
            except Exception as err:
                raise WeightSyncError(
                    f"engines could not join their weight-update groups: {err}") from err
            for target, name in zip(new, names):
                self._groups[target.url] = (name, target)
        return tuple(self._groups[t.url][0] for t in targets)

    def _leave_groups(self, urls: Sequence[str], running: set[str]) -> None:
        """Take the groups of the engines at ``urls`` apart: a process keeps every group it
        joined (its connections, an NCCL communicator and its buffers) until it is
        destroyed. An engine that died (its URL not in ``running``) took its side with it;
        rank 0's side goes always."""
        names = []
        for url in urls:
            if url not in self._groups:
                continue
            name, target = self._groups.pop(url)
            names.append(name)
            if url not in running:
                continue
            try:
                target.client().destroy_weights_update_group(name)
            except EngineError as err:  # e.g. it never joined: there is nothing to free
                log.warning("%s: leaving weight-update group %s failed: %s",
                            target.name, name, err)
        if names:
            self.train_group.destroy_weight_broadcast(names)

    def verify(self, version: int, engines=None) -> dict[str, float]:
        """Every engine reports ``version``, and holds the check tensors of a push that
        left them to this call (``push(verify=False)``). Returns that read-back's metrics
        (none when the push read back itself)."""
        engines = engines or self.engines
        checks, self._unchecked = self._unchecked, {}
        metrics: dict[str, float] = {}
        if checks:
            start = time.perf_counter()
            metrics["perf/weight_sync_checked_tensors"] = float(
                read_back(engines.clients, checks, version))
            metrics["perf/weight_sync_verify_time"] = time.perf_counter() - start
        check_reported_versions(engines, version, "version")
        return metrics


def check_reported_versions(engines, version: int, what: str) -> None:
    """Every engine of ``engines`` (an EngineGroup or EngineView) reports ``version`` after
    a push of ``what`` (for the message); else a WeightSyncError naming the ones that don't."""
    reported = engines.weight_versions()
    stale = [i for i, v in enumerate(reported) if str(v) != str(version)]
    if stale:
        raise WeightSyncError(f"engines {stale} report weight versions "
                              f"{[reported[i] for i in stale]} after pushing {what} {version}")


# ---------------------------------------------------------------------------------------
# The rank side (trainer.training.train_group.TrainActor calls these on every rank).
# ---------------------------------------------------------------------------------------

def cast_bucket(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype
                ) -> list[tuple[str, torch.Tensor]]:
    """``bucket`` in the engines' ``dtype``, but for the few tensors engines hold in fp32
    whatever the model's dtype (a Gated DeltaNet's ``A_log``: ``transfer_dtype``)."""
    return [(n, t.detach().to(dtype=transfer_dtype(n, dtype))) for n, t in bucket]


def send_weights(buckets: Iterable[list[tuple[str, torch.Tensor]]], plan: PushPlan, *,
                 rank: int, world_size: int, weight_groups: Sequence = ()
                 ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Stream ``buckets`` (a backend's ``named_weight_buckets``, drained on every rank:
    its gathers are collectives) to the engines of ``plan``; returns this rank's metrics
    and, on rank 0 when ``plan.read_back`` is off, the check tensors (the first rows of
    ``CHECK_NAMES``) for the driver to read back (else empty: the rank read them back).
    ``weight_groups``: rank 0's broadcast group of each target (distributed mode)."""
    dtype = DTYPES[plan.dtype]
    if plan.mode == "tensor":
        sender = _TensorSender(plan, rank, world_size)
    elif plan.mode == "disk":
        sender = _DiskSender(plan, rank)
    else:
        sender = _BroadcastSender(plan, rank, weight_groups)
    num_bytes = num_buckets = 0
    checks: dict[str, torch.Tensor] = {}
    # Where this rank's time goes: gathering (the backend's collectives and copies), the
    # cast to the engines' dtype, sending (staging + the engines' loads) and reading back.
    phases = dict.fromkeys(("gather", "cast", "send") + (("verify",) if plan.read_back else ()),
                           0.0)
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[phase] += now - clock
        clock = now

    with sender:
        lap("send")  # opening the sessions
        for bucket, last in _with_last(buckets):
            lap("gather")
            bucket = cast_bucket(bucket, dtype)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
            for name, t in bucket:
                if name in CHECK_NAMES:
                    checks[name] = t[:CHECK_ROWS].to("cpu", torch.float32)
            lap("cast")
            sender.send(bucket, plan.version if last else None)
            lap("send")
    lap("send")  # closing the sessions
    metrics = {"perf/weight_sync_bytes": float(num_bytes),
               "perf/weight_sync_buckets": float(num_buckets)}
    if plan.read_back:  # else the driver reads back later (WeightSync.verify) and counts
        metrics["perf/weight_sync_checked_tensors"] = float(read_back(
            [sender.clients[e] for e in sender.engines], checks, plan.version))
        lap("verify")
    metrics.update({f"perf/weight_sync_{k}_time": v for k, v in phases.items()})
    return metrics, checks if rank == 0 and not plan.read_back else {}


def read_back(clients: Sequence, checks: dict[str, torch.Tensor], version: int) -> int:
    """Compare what each engine of ``clients`` (EngineClients) holds with ``checks``, the
    first rows of a few pushed tensors; returns the number of (engine, tensor) pairs
    compared (none for an engine that cannot report weights)."""
    pairs = [(client, name) for client in clients for name in checks]
    # Read back all at once: each is an HTTP round trip the push would otherwise wait for
    # in turn.
    held = fan_out(lambda pair: pair[0].get_weights_by_name(pair[1], truncate_size=CHECK_ROWS),
                   pairs)
    compared, unreported = 0, set()
    for (client, name), got in zip(pairs, held):
        expected = checks[name]
        if got is None:
            unreported.add(client.name)
            continue
        got_t = torch.tensor(got, dtype=torch.float32).reshape(expected.shape)
        if not torch.allclose(got_t, expected, rtol=1e-6, atol=1e-6):
            diff = (got_t - expected).abs().max().item()
            raise WeightSyncError(f"{client.name}: {name} differs from what was pushed "
                                  f"(version {version}) by up to {diff:.3g}")
        compared += 1
    for name in sorted(unreported):
        log.info("%s cannot report weights by name; verified by version only", name)
    return compared


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


class _Sender:
    """Opens and closes each served engine's weight-update session, sends buckets and
    flushes once at the end (``send_weights`` reads the check tensors back after it)."""

    def __init__(self, plan: PushPlan, engines: Sequence[int]):
        self.plan = plan
        self.engines = list(engines)  # indices into plan.targets this rank talks to
        self.clients = {e: plan.targets[e].client() for e in self.engines}
        self._sessions = contextlib.ExitStack()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)))

    def __enter__(self):
        # Sessions wrap the in-place routes only: SGLang's disk route re-processes the
        # weights itself, and an end_weight_update after it would post-process them again.
        for e in self.engines if self.plan.mode != "disk" else ():
            self._sessions.enter_context(self.clients[e].weight_update_session())
        if self.plan.loaders and self.plan.mode == "distributed":
            self._loader_call(self.plan.loaders[0], None)  # installs the marks first
        return self

    def _loader_call(self, load_format: str, version: Optional[int]) -> None:
        """An update of no tensors that runs one of the engines' server-side loaders."""
        def call(e, client):
            empty, _ = serialize_for_sglang([], tp_size=self.plan.targets[e].tp_size)
            client.update_weights_from_tensor(empty, load_format=load_format, version=version)
        self._each(call)

    def __exit__(self, *exc):
        try:
            if exc[0] is None and self.plan.loaders and self.plan.mode != "disk":
                self._loader_call(self.plan.loaders[1], self.plan.version)
            self._sessions.close()
            if exc[0] is None and self.plan.flush_cache:
                self._each(lambda e, c: c.flush_cache())
        finally:
            self._pool.shutdown()

    def _each(self, fn) -> list:
        """``fn(engine, client)`` on every served engine concurrently; re-raises the first
        failure."""
        return fan_out(lambda e: fn(e, self.clients[e]), self.engines, self._pool)

    def send(self, bucket, version: Optional[int]) -> None:
        raise NotImplementedError


# This process's shared-memory buffers for CPU tensor pushes (one set per training rank).
_STAGING = SharedStaging()


def release_staging() -> None:
    """Free this process's staged push buffers (before it is killed: a /dev/shm file still
    mapped then outlives the process)."""
    _STAGING.clear()


class _TensorSender(_Sender):
    def __init__(self, plan: PushPlan, rank: int, world_size: int):
        tp = [t.tp_size for t in plan.targets]
        self.rank, self.world_size = rank, world_size
        self.sources = [[source_rank(e, k, tp[e], world_size) for k in range(tp[e])]
                        for e in range(len(tp))]
        self.gather = any(len(set(s)) > 1 for s in self.sources)
        self.buckets_sent = 0
        super().__init__(plan, [e for e, s in enumerate(self.sources) if s[0] == rank])

    def send(self, bucket, version: Optional[int]) -> None:
        # Serializing shares the bucket's storage (CUDA IPC, or /dev/shm on CPU): only the
        # ranks that serve an engine pay for it. One pickle per receiving engine TP rank:
        # each pickle holds one reference to the shared storage, which its receiver drops,
        # so a payload opened by two engines would free the storage under the second.
        # CPU buckets go through this rank's reused /dev/shm buffers (SGLang-CPU's
        # server-side loaders read plain lists instead).
        mine = [(e, k) for e, ranks in enumerate(self.sources)
                for k, r in enumerate(ranks) if r == self.rank]
        staged = (_STAGING.flatten(self.buckets_sent, bucket)
                  if mine and not self.plan.loaders
                  and all(t.device.type == "cpu" for _, t in bucket) else None)
        self.buckets_sent += 1
        load_format = FLATTENED_BUCKET if staged is not None else None
        payloads = {}
        for slot in mine:
            if staged is not None:
                payloads[slot] = MultiprocessingSerializer.serialize(staged, output_str=True)
            else:
                (payloads[slot],), load_format = serialize_for_sglang(bucket)
        if self.gather:  # an engine's TP ranks are served by several training ranks
            import torch.distributed as dist

            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, (payloads, load_format))
            payloads = {slot: p for part, _ in gathered for slot, p in part.items()}
            load_format = next(fmt for part, fmt in gathered if part)
        if self.plan.loaders:  # the version goes with the final re-pack
            load_format, version = self.plan.loaders[0], None
        self._each(lambda e, c: c.update_weights_from_tensor(
            [payloads[(e, k)] for k in range(len(self.sources[e]))],
            load_format=load_format, version=version))


# Distributed pushes: tensors under this size share one broadcast (see _BroadcastSender).
FLATTEN_BELOW_BYTES = 1 << 20


class _BroadcastSender(_Sender):
    def __init__(self, plan: PushPlan, rank: int, groups: Sequence):
        self.rank, self.groups = rank, list(groups)
        super().__init__(plan, range(len(plan.targets)) if rank == 0 else [])

    def send(self, bucket, version: Optional[int]) -> None:
        """The bucket's small tensors as one broadcast of their bytes (SGLang's
        ``flattened_bucket``), the others one broadcast each: every broadcast is a
        collective with a round trip of its own, which outweighs a small tensor's bytes,
        while copying a large tensor into the flat buffer costs more than its round trip."""
        if self.rank != 0:
            return
        small, large = [], []
        for name, t in bucket:
            (small if t.nbytes < FLATTEN_BELOW_BYTES else large).append(
                (name, t.to(self.plan.device)))
        calls = []
        if len(small) > 1:
            small, flat = broadcast_bucket(small)
            calls.append((small, [flat], FLATTENED_BUCKET))
        else:
            large = small + large
        if large:
            calls.append((large, [t.contiguous() for _, t in large], None))
        for i, (named, tensors, load_format) in enumerate(calls):
            self._broadcast(named, tensors, load_format,
                            version if i == len(calls) - 1 else None)

    def _broadcast(self, named, tensors, load_format: Optional[str],
                   version: Optional[int]) -> None:
        import torch.distributed as dist

        names = [n for n, _ in named]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        # Each engine's call returns once it has received every tensor, so the calls run
        # on threads while this rank broadcasts.
        futures = {e: self._pool.submit(self.clients[e].update_weights_from_distributed, names,
                                        dtypes, shapes, group_name=self.plan.group_names[e],
                                        version=version, load_format=load_format)
                   for e in self.engines}
        works = {e: [dist.broadcast(t, src=0, group=self.groups[e], async_op=True)
                     for t in tensors] for e in self.engines}

        def settled(e) -> bool:
            # An engine that refuses the update (or died) never receives: its failed call
            # settles it; the others' groups are their own, so their receives complete.
            failed = futures[e].done() and futures[e].exception() is not None
            return failed or all(w.is_completed() for w in works[e])

        while not all(settled(e) for e in self.engines):
            time.sleep(0.001)
        for e in self.engines:
            futures[e].result()  # the first failure, once every other engine has its bucket


class _DiskSender(_Sender):
    """Rank 0 writes the buckets as safetensors files, then every engine loads the
    directory (SGLang's `update_weights_from_disk`, its full load-and-postprocess path)."""

    def __init__(self, plan: PushPlan, rank: int):
        self.rank, self.dir, self.files = rank, None, 0
        super().__init__(plan, range(len(plan.targets)) if rank == 0 else [])

    def send(self, bucket, version: Optional[int]) -> None:
        if self.rank != 0:
            return
        import tempfile

        from safetensors.torch import save_file

        if self.dir is None:
            if self.plan.disk_dir:
                os.makedirs(self.plan.disk_dir, exist_ok=True)
            self.dir = tempfile.mkdtemp(prefix=f"v{self.plan.version}-", dir=self.plan.disk_dir or None)
        save_file({n: t.to("cpu").contiguous() for n, t in bucket},
                  os.path.join(self.dir, f"model-{self.files:05d}.safetensors"))
        self.files += 1

    def __exit__(self, *exc):
        try:
            if exc[0] is None and self.dir is not None:
                self._each(lambda e, c: c.update_weights_from_disk(self.dir, version=self.plan.version))
            return super().__exit__(*exc)
        finally:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)


def join_broadcast_group(target: Any, address: str, port: int, group_name: str,
                         backend: str, *, timeout_s: float = 600.0):
    """Rank 0's side of `init_weights_update_group` for one engine: the engine joins with
    all of its TP ranks while this process joins as rank 0; returns the group."""
    from rollout.engines.weights_io import init_custom_process_group

    offset, world_size = broadcast_group_ranks(target.tp_size)
    with ThreadPoolExecutor(max_workers=1) as pool:
        joined = pool.submit(target.client().init_weights_update_group, address, port, offset,
                             world_size, group_name, backend)
        try:
            group = init_custom_process_group(backend, f"tcp://{address}:{port}", world_size, 0,
                                              group_name, timeout_s=timeout_s)
        finally:
            error = joined.exception()
        if error is not None:
            raise error if isinstance(error, EngineError) else EngineError(str(error))
    return group
