"""Ray placement: which bundle each training rank and each inference engine runs on.

One placement group holds every bundle: ``{"GPU": 1, "CPU": k}`` per GPU on a GPU cluster,
``{"CPU": 1}`` per process slot on a CPU box. Bundles are reordered by (node, GPU id) after
the group is ready, so "bundle slot s" means the same physical device everywhere and an
engine spanning ``rollout.num_gpus_per_engine`` GPUs gets consecutive slots of one node.

Colocated: engines and training ranks use the same slots (each actor asks for a fraction
of its bundle, so both fit). Disaggregated: engines take the first slots, training ranks
the following ones.

``Placement`` is the one object that knows this layout; actors get their scheduling
strategy from it by role and index, never by computing bundle numbers themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

# Fractions of a bundle each role asks for when colocated: together they fit in one
# bundle (1.0), and Ray admits an actor and an engine on the same slot.
_COLOCATED_TRAIN_FRACTION = 0.4
_COLOCATED_ENGINE_FRACTION = 0.4


@dataclass(frozen=True)
class ActorResources:
    """What to pass to ``RayActor.options(...)`` besides the scheduling strategy."""

    num_cpus: float
    num_gpus: float


class Placement:
    """Creates the placement group for ``num_engines`` engines of ``gpus_per_engine`` GPUs
    (rollout.num_gpus_per_engine) and ``num_train_ranks`` training ranks on the
    ``cluster`` section's nodes, and hands out strategies by name.

    ``cpus_per_gpu_bundle``: CPUs reserved next to each GPU (tokenizer, data, server
    processes); unused on CPU boxes.
    """

    def __init__(self, cluster, *, num_engines: int, gpus_per_engine: int, num_train_ranks: int,
                 cpus_per_gpu_bundle: int = 1, timeout_s: float = 120.0) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self.gpu = cluster.device == "cuda"
        self.colocate = cluster.colocate
        self.num_train = num_train_ranks
        self.num_engines = num_engines
        self.gpus_per_engine = gpus_per_engine if self.gpu else 1
        if self.gpu and cluster.gpus_per_node % self.gpus_per_engine:
            raise ValueError(f"rollout.num_gpus_per_engine={self.gpus_per_engine} must divide "
                             f"cluster.gpus_per_node={cluster.gpus_per_node} so no engine "
                             "spans two nodes")
        engine_slots = self.num_engines * self.gpus_per_engine
        if self.colocate:
            self.num_slots = max(self.num_train, engine_slots)
            self._engine_offset = self._train_offset = 0
        else:
            self.num_slots = engine_slots + self.num_train
            self._engine_offset, self._train_offset = 0, engine_slots
        bundle = {"GPU": 1, "CPU": cpus_per_gpu_bundle} if self.gpu else {"CPU": 1}
        # PACK: fill a node before the next, so an engine's GPUs and NVLink peers share one.
        self.pg = placement_group([dict(bundle) for _ in range(self.num_slots)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"placement: {self.num_slots} bundles of {bundle} not available within "
                f"{timeout_s:.0f}s; the cluster has {ray.available_resources()} free. Check "
                "cluster.num_nodes / cluster.gpus_per_node against `ray status`.") from None
        self._slot_to_bundle = self._sorted_bundles()
        self._check_engines_on_one_node()

    def _sorted_bundles(self) -> list[int]:
        """Bundle indices ordered by (node, GPU id): slot s -> bundle index."""
        import ray
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        if not self.gpu:
            self._bundle_gpu: dict[int, tuple[str, int]] = {}
            return sorted(range(self.num_slots), key=lambda b: (nodes.get(b, ""), b))

        @ray.remote(num_gpus=0.01, num_cpus=0)
        def probe() -> tuple[str, int]:
            return ray.get_runtime_context().get_node_id(), int(ray.get_gpu_ids()[0])

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        infos = ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=b)).remote()
            for b in range(self.num_slots)])
        self._bundle_gpu = dict(enumerate(infos))
        return sorted(range(self.num_slots), key=lambda b: (infos[b], b))

    def node_of_slot(self, slot: int) -> str:
        """Ray node id holding bundle slot ``slot``."""
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        return nodes.get(self._slot_to_bundle[slot], "")

    def _check_engines_on_one_node(self) -> None:
        """An engine's GPUs (tensor parallel over NVLink) must share a node. PACK fills
        nodes in order, but a node with GPUs already taken by something else can leave a
        partial run of bundles, so an engine would straddle two nodes: refuse that."""
        if self.gpus_per_engine <= 1:
            return
        from ray.util.placement_group import placement_group_table, remove_placement_group

        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        for index in range(self.num_engines):
            spread = {nodes.get(self._slot_to_bundle[s]) for s in self.engine_slots(index)}
            if len(spread) > 1:
                remove_placement_group(self.pg)
                raise RuntimeError(
                    f"placement: engine {index} would span nodes {sorted(map(str, spread))}: "
                    f"the placement group got a number of GPUs per node that is not a multiple "
                    f"of rollout.num_gpus_per_engine={self.gpus_per_engine} (GPUs busy with "
                    "other work?). Free whole nodes or lower num_gpus_per_engine.")

    # ------------------------------------------------------------------ strategies
    def _strategy(self, slot: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self._slot_to_bundle[slot],
            placement_group_capture_child_tasks=True)

    def train_slot(self, rank: int) -> int:
        if not 0 <= rank < self.num_train:
            raise ValueError(f"training rank {rank} out of range [0, {self.num_train})")
        return self._train_offset + rank

    def engine_slots(self, index: int) -> list[int]:
        """The slots (GPUs) engine ``index`` spans; its actor runs on the first."""
        if not 0 <= index < self.num_engines:
            raise ValueError(f"engine {index} out of range [0, {self.num_engines})")
        first = self._engine_offset + index * self.gpus_per_engine
        return [first + k for k in range(self.gpus_per_engine)]

    def train_strategy(self, rank: int):
        """Scheduling strategy (bundle) for training rank ``rank``."""
        return self._strategy(self.train_slot(rank))

    def engine_strategy(self, index: int):
        """Scheduling strategy for engine ``index`` (on the first of its bundles)."""
        return self._strategy(self.engine_slots(index)[0])

    def engine_bundle_indices(self, index: int) -> list[int]:
        """Raw placement-group bundle indices of engine ``index`` (for its GPU server)."""
        return [self._slot_to_bundle[s] for s in self.engine_slots(index)]

    def engine_gpu_ids(self, index: int) -> list[int]:
        """Physical GPU ids (on the engine's node) of engine ``index``'s bundles.

        The engine actor holds only a fraction of its first GPU, so Ray shows it one
        device; its server process needs CUDA_VISIBLE_DEVICES set to these ids.
        """
        if not self.gpu:
            raise ValueError("engine_gpu_ids: cluster.device is cpu (no GPUs to map)")
        return [self._bundle_gpu[self._slot_to_bundle[s]][1] for s in self.engine_slots(index)]

    def train_resources(self) -> ActorResources:
        if not self.gpu:
            # CPU bundles are logical accounting (threads come from cluster.torch_threads).
            # Colocated, a training rank takes turns with the engine on its bundle, so it
            # asks for none of it: it then fits whatever share the engine requested.
            return ActorResources(num_cpus=0.0 if self.colocate else 1.0, num_gpus=0.0)
        frac = _COLOCATED_TRAIN_FRACTION if self.colocate else 1.0
        return ActorResources(num_cpus=0.0, num_gpus=frac)

    def engine_resources(self) -> ActorResources:
        """Resources an engine actor must request so it fits its bundle next to a
        training rank (colocated) — requesting a whole CPU/GPU would not fit."""
        frac = _COLOCATED_ENGINE_FRACTION if self.colocate else 1.0
        # An engine spanning several GPUs reserves its other bundles through its server
        # process (CUDA_VISIBLE_DEVICES); the actor itself takes a fraction of the first.
        return ActorResources(num_cpus=frac if not self.gpu else 0.0,
                              num_gpus=frac if self.gpu else 0.0)

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
