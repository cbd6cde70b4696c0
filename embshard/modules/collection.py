"""ShardedEmbeddingBagCollection: a TorchRec EmbeddingBagCollection sharded over a mesh.

Each rank allocates only its own shards, in one FBGEMM TBE, and exposes every table
as a DTensor over views of the TBE's weights. ``forward`` is one training step's
data path, in three stages read top to bottom: ``input_dist`` (check the local
batch, route its ids, exchange counts, start the ids all-to-all), ``lookup`` (one
TBE call) and ``output_dist`` (send the pooled rows home, assemble the KeyedTensor).
On one rank nothing travels: no stage runs a collective. ``prefetch`` runs the first
stage ahead, for a pipeline. ``state_dict()`` has the unsharded module's keys
(``embedding_bags.<table>.weight``), so TorchRec state dicts load into it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    PoolingType,
)
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from embshard.modules.mesh import ShardingMesh
from embshard.plan.specs import ShardedTable, ShardingPlan
from embshard.runtime.columns import ColumnPlacement
from embshard.runtime.input_dist import (
    IdsRouting,
    InputDistribution,
    InputInFlight,
    start_input_dist,
)
from embshard.runtime.output_dist import OutputLayout, PooledAllToAll, send_home
from embshard.runtime.routes import build_routes
from embshard.runtime.scratch import Scratch
from embshard.storage.dynamic import DynamicStats, DynamicTables, check_dynamic
from embshard.storage.id_map import IdMapSpec
from embshard.storage.init import init_shard
from embshard.storage.lookup import LookupBackend, LookupModule, TrainingTBE
from embshard.storage.managed_collision import ManagedCollisions, ManagedTables
from embshard.storage.optimizers import FusedOptimizer
from embshard.storage.replicated import build_replicated
from embshard.storage.shards import allocate_storage, gather_table, table_dtensor


def _silence_fx_tracing_notice() -> None:
    """TorchRec 1.8's KeyedTensor calls torch's deprecated ``is_fx_tracing``, whose
    one-time notice every process would print at its first forward. It concerns
    TorchRec's call, not the user's code: spend the once while the logger is off."""
    from torch.fx import _symbolic_trace

    notice = getattr(_symbolic_trace, "is_fx_tracing_warning", None)
    if notice is None:
        return
    logger = logging.getLogger(_symbolic_trace.__name__)
    disabled, logger.disabled = logger.disabled, True
    try:
        notice()
    finally:
        logger.disabled = disabled


_silence_fx_tracing_notice()

KeptT = TypeVar("KeptT")
LookedUpT = TypeVar("LookedUpT")
OutputT = TypeVar("OutputT")


class Pooled(NamedTuple):
    """The lookup's results: the sharded tables' pooled rows for the global batch,
    [global batch, this rank's slot dims], and the data-parallel tables' for the local
    batch, [local batch, their dims]."""

    sharded: torch.Tensor
    local: torch.Tensor


_WEIGHT_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16}


def _check_configs(configs: Sequence[BaseEmbeddingConfig], weighted: bool) -> torch.dtype:
    """The tables' one weight dtype, once every config is found usable. A rank's tables
    share one TBE, which has one weight precision: FP32 and FP16 tables go in separate
    EmbeddingBagCollections."""
    by_type: dict[DataType, list[str]] = {}
    for c in configs:
        if c.data_type not in _WEIGHT_DTYPES:
            raise ValueError(
                f"table {c.name!r}: embshard stores FP32 or FP16 tables, got {c.data_type}"
            )
        by_type.setdefault(c.data_type, []).append(c.name)
        if not isinstance(c, EmbeddingBagConfig):  # unpooled: an EmbeddingCollection's
            continue
        if weighted and c.pooling != PoolingType.SUM:
            raise ValueError(
                f"table {c.name!r}: weighted features need SUM pooling, as in TorchRec"
            )
        if c.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(f"table {c.name!r}: pooling {c.pooling} is not SUM or MEAN")
    if len(by_type) > 1:
        found = "; ".join(f"{t.name}: {names}" for t, names in by_type.items())
        raise ValueError(
            "one EmbeddingBagCollection mixes table data types, which embshard does not "
            f"support ({found}): put the FP16 tables in an EmbeddingBagCollection of their own"
        )
    return _WEIGHT_DTYPES[next(iter(by_type), DataType.FP32)]


class ShardedCollection(nn.Module, Generic[KeptT, LookedUpT, OutputT]):
    """What a sharded EmbeddingBagCollection and EmbeddingCollection share: the plan
    resolved to shards, the routes, the local shards in one FBGEMM TBE exposed as
    DTensors, the input distribution (stage 1) with its prefetching, and state dicts
    under the unsharded module's keys. The subclass gives its kind of input
    distribution (``_input_stage``), the output layout (``_output_stage``) and stages
    2 and 3 (``lookup``, ``output_dist``): together, the stage contract its type parameters name."""

    # The unsharded module's attribute holding the tables: state dict keys start so.
    _PREFIX: str

    def __init__(
        self,
        configs: Sequence[BaseEmbeddingConfig],
        plan: ShardingPlan,
        mesh: DeviceMesh,
        optimizer: FusedOptimizer,
        seed: int = 0,
        weights: Mapping[str, torch.Tensor] | None = None,
        is_weighted: bool = False,
        comm_precision: str | None = None,
        lookup: LookupBackend = TrainingTBE(),
        dynamic: Mapping[str, IdMapSpec] | None = None,
        managed: ManagedCollisions | None = None,
    ) -> None:
        super().__init__()
        self._mesh = ShardingMesh.of(mesh)
        dtype = _check_configs(configs, is_weighted)
        self._configs = list(configs)
        self._optimizer = optimizer
        self._tables = plan.resolve(self._configs, self._mesh.size)
        dynamic = dict(dynamic or {})
        check_dynamic(dynamic, self._configs, self._tables)
        if managed is not None:
            managed.check(self._configs, self._tables, self._mesh.replicas)
        self._managed_collisions = managed
        self._plan = plan
        self._group = self._mesh.sharding_group
        self._rank = self._mesh.rank
        self._device = self._mesh.device
        buckets = {n: (s.buckets, s.rows_per_bucket) for n, s in dynamic.items()}
        ranges = managed.ranges(self._tables) if managed is not None else None
        self._routes = build_routes(
            self._configs, self._tables, self._mesh.size, is_weighted, buckets, ranges
        )
        scratch = Scratch()
        self._input_dist = self._input_stage(scratch)
        self._output_layout = self._output_stage(scratch, comm_precision)
        replicated = build_replicated(
            self._routes,
            {
                n: (t.replicated_rows, t.embedding_dim)
                for n, t in self._tables.items()
                if t.replicated_rows
            },
            optimizer,
            self._device,
            dtype,
            self._group,
        )
        self._anchor = torch.zeros(0, device=self._device, requires_grad=True)
        self._prefetched: list[tuple[KeyedJaggedTensor, InputInFlight[KeptT]]] = []
        feature_table_map = [s.tbe_table for s in self._routes.slots[self._rank]]
        self._storage = allocate_storage(
            self._tables,
            self._rank,
            optimizer,
            self._device,
            feature_table_map,
            dtype,
            replicated,
            lookup,
        )
        self._fill(seed, weights)
        self._dynamic = (
            DynamicTables(
                dynamic,
                self._configs,
                self._storage.shards,
                self._routes.slots[self._rank],
                self._storage.tbe,
                self._device,
                self._mesh.replica_group,
            )
            if dynamic
            else None
        )
        self._managed = (
            ManagedTables(
                managed,
                self._configs,
                self._tables,
                self._storage.shards,
                self._routes.slots[self._rank],
                self._storage.tbe,
                self._device,
                seed,
            )
            if managed is not None
            else None
        )
        if any(spec.policy == "none" for spec in dynamic.values()):
            self._input_dist.bags.held = self._dynamic
        submesh = self._mesh.submesh
        self._weights = {
            name: table_dtensor(table, self._storage.weights[name], mesh, submesh)
            for name, table in self._tables.items()
        }
        self._optimizer_state = {
            f"{self.table_key(name)}.{state}": table_dtensor(
                self._tables[name], wrapper, mesh, submesh, shape
            )
            for (name, state), (wrapper, shape) in self._storage.optimizer_state.items()
        }

    def _input_stage(self, scratch: Scratch) -> IdsRouting[object, KeptT]:
        """Stage 1's kind: how this module's batches are routed and what comes back."""
        raise NotImplementedError

    def _output_stage(self, scratch: Scratch, comm_precision: str | None) -> object:
        """What stage 3 needs, fixed at sharding (routes and tables known, storage not
        yet allocated)."""
        raise NotImplementedError

    def lookup(self, in_flight: InputInFlight[KeptT]) -> LookedUpT:
        """Stage 2: this rank's shards looked up for what arrived."""
        raise NotImplementedError

    def output_dist(self, looked_up: LookedUpT, in_flight: InputInFlight[KeptT]) -> OutputT:
        """Stage 3 (collective): the looked-up rows home, as the unsharded module's output."""
        raise NotImplementedError

    def table_key(self, table: str) -> str:
        """Where ``table``'s entries sit in state dicts: ``embedding_bags.<table>``
        (``embeddings.<table>`` for an EmbeddingCollection), as in TorchRec's."""
        return f"{self._PREFIX}.{table}"

    def _key(self, table: str) -> str:
        return f"{self.table_key(table)}.weight"

    def forward(self, features: KeyedJaggedTensor) -> OutputT:
        """This rank's local batch looked up: only that batch's rows, as the unsharded
        module returns them (a KeyedTensor of pooled bags, or each id's row by feature).

        Collective: every rank of the mesh must call it, each with its own batch (batch
        sizes may differ, and may be zero). A bad batch on any rank raises the same
        InputError on every rank. One host sync: reading back the counts exchange (on
        one rank, which runs no collective, the batch's validity flag).
        A batch given to ``prefetch`` before (the same object) skips its input
        distribution here.
        """
        in_flight = self._take_prefetched(features) or self.input_dist(features)
        return self.output_dist(self.lookup(in_flight), in_flight)

    def prefetch(self, features: KeyedJaggedTensor) -> tuple[int, ...]:
        """Start ``features``' input distribution now (collective), so that its
        forward, later, begins with the lookup: what a training pipeline overlaps
        with the step before. Errors surface at that forward, on every rank. Returns
        the ranks that called ``signal_end`` instead (the batch then is not used)."""
        in_flight = self.input_dist(features)
        self._prefetched.append((features, in_flight))
        return in_flight.ended

    def signal_end(self) -> tuple[int, ...]:
        """Join the other ranks' ``prefetch`` with no batch, telling them this rank's
        batches ran out (collective). Returns every rank that did so."""
        return start_input_dist(None, self._input_dist, self._group).ended

    def input_dist(self, features: KeyedJaggedTensor) -> InputInFlight[KeptT]:
        """Stage 1 (collective): see ``start_input_dist``. Managed-collision tables'
        ids are first preprocessed (their modules' ``input_hash_func``)."""
        if self._managed_collisions is not None:
            routes = self._routes
            features = self._managed_collisions.preprocess(
                features, dict(zip(routes.features, routes.feature_table))
            )
        return start_input_dist(features, self._input_dist, self._group)

    def drop_prefetched(self) -> None:
        """Wait for the input distributions started ahead and forget them: nothing may
        be in flight when the process group goes (torch 2.13's gloo aborts then)."""
        for _, in_flight in self._prefetched:
            if in_flight.work is not None:
                in_flight.work.wait()
        self._prefetched.clear()

    def is_prefetched(self, features: KeyedJaggedTensor) -> bool:
        """Whether ``features`` (this object) was prefetched and not yet used."""
        return any(prefetched is features for prefetched, _ in self._prefetched)

    def _take_prefetched(self, features: KeyedJaggedTensor) -> InputInFlight[KeptT] | None:
        """The prefetched input of this very batch object, if any; prefetched batches
        before it were skipped and are dropped."""
        for i, (prefetched, in_flight) in enumerate(self._prefetched):
            if prefetched is features:
                for _, skipped in self._prefetched[:i]:
                    if skipped.work is not None:
                        skipped.work.wait()  # nothing may still write into a freed buffer
                del self._prefetched[: i + 1]
                return in_flight
        return None

    def _fill(self, seed: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Write each local shard: from ``weights`` (full tables) or the seeded init.

        Copies (data-parallel tables, hot rows) filled from ``weights`` then take
        the sharding group's first rank's, and on a 2-D mesh every shard takes the
        first replica's: a module built differently on each rank still has one value
        per row, as DDP makes of its parameters."""
        configs = {c.name: c for c in self._configs}
        for name, s, view in self._storage.weight_views():
            if weights is None:
                init_shard(view, configs[name], s.row_offset, s.col_offset, seed)
            else:
                source = weights[name][s.row_offset : s.row_offset + s.rows]
                view.copy_(source[:, s.col_offset : s.col_offset + s.cols])
        if weights is not None and self._storage.replicated is not None:
            self._storage.replicated.broadcast(src=0)
        if weights is not None:
            self._exchange_with_replicas(average=False)

    def sync_replicas(self) -> None:
        """Average this rank's shards, and the fused optimizer's state, with their
        copies in the other sharding groups: one all-reduce over the replica group
        (collective there; every rank calls it once a step, after the backward). Each
        sharding group's fused optimizer updated its own copy from its own batch; after
        this every copy is their mean, as TorchRec's ``DMPCollection.sync()`` makes it.
        On a 1-D mesh there are no copies, and nothing runs."""
        self._exchange_with_replicas(average=True)

    def _exchange_with_replicas(self, average: bool) -> None:
        """One collective over the replica group on every local weight and state
        tensor, flattened into one float32 buffer: an all-reduce averaging them, or
        (not ``average``) the first replica's broadcast to the others."""
        group = self._mesh.replica_group
        tensors = self._storage.replica_tensors()
        if group is None or not tensors:  # a replica group's ranks hold the same shards
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        if average:
            dist.all_reduce(flat, group=group)
            flat.div_(self._mesh.replicas)
        else:
            dist.broadcast(flat, group=group, group_src=0)
        with torch.no_grad():
            for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                tensor.copy_(part.view_as(tensor))

    def dynamic_stats(self) -> dict[str, DynamicStats]:
        """Each dynamic table's admitted, evicted and overflowing ids since sharding
        (continuing a loaded checkpoint's), and its live ids now, over every rank
        (collective: every rank calls it); empty without dynamic tables."""
        if self._dynamic is None:
            return {}
        return self._dynamic.stats(self._group)

    @property
    def dynamic_tables(self) -> DynamicTables | None:
        """This rank's dynamic shards, their id maps and counts (None without dynamic
        tables): what checkpoints save and restore."""
        return self._dynamic

    @property
    def managed_collisions(self) -> ManagedCollisions | None:
        """The managed-collision modules the collection was given, by table (None
        without): the same on every rank, what checkpoints record and check."""
        return self._managed_collisions

    @property
    def managed_tables(self) -> ManagedTables | None:
        """This rank's managed-collision shards (None without managed-collision tables
        on this rank)."""
        return self._managed

    def managed_collision_modules(self) -> dict[str, MCHManagedCollisionModule]:
        """This rank's managed-collision modules, by table (``storage.managed_collision``);
        empty without managed-collision tables or where the rank holds none."""
        return {} if self._managed is None else self._managed.modules

    def replace_lookup(
        self, build: Callable[[list[tuple[str, torch.Tensor]], list[int]], nn.Module]
    ) -> None:
        """Look up from what ``build(tables, feature_table_map)`` makes from now on, for
        the sharded tables and then the copies: ``tables`` are a lookup's tables in
        order, each ``(name, float weights)``. The float tables, their views and the
        optimizer state go: the module then serves only (its dynamic and
        managed-collision tables' maps stay, to look ids up in eval mode)."""
        if self._dynamic is not None:
            self._dynamic.serve()
        if self._managed is not None:
            self._managed.serve()
        storage = self._storage

        def rebuilt(lookup: LookupModule, shards: list, feature_table_map: list[int]):
            weights = lookup.split_embedding_weights()
            return build(
                [(n, w) for (n, _), w in zip(shards, weights, strict=True)], feature_table_map
            )

        tbe, replicated = storage.tbe, storage.replicated
        if tbe is not None:
            slots = self._routes.slots[self._rank]
            tbe = rebuilt(tbe, storage.shards, [s.tbe_table for s in slots])
        if replicated is not None:
            copies = rebuilt(replicated.tbe, storage.replicas, replicated.tbe.feature_table_map)
            replicated = dataclasses.replace(replicated, tbe=copies)
        self._storage = dataclasses.replace(
            storage, tbe=tbe, replicated=replicated, weights={}, optimizer_state={}
        )
        self._weights, self._optimizer_state = {}, {}

    @property
    def feature_names(self) -> set[str]:
        """The keys its input KeyedJaggedTensor holds."""
        return set(self._routes.features)

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def weights(self) -> dict[str, DTensor]:
        """Every table as a DTensor over this rank's shards (views of the TBE's weights)."""
        return dict(self._weights)

    @property
    def rank(self) -> int:
        """This rank's position in its sharding group: the rank numbers plans use."""
        return self._rank

    @property
    def sharding_mesh(self) -> ShardingMesh:
        """The ranks it spans: its sharding group and, on a 2-D mesh, its replicas."""
        return self._mesh

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optimizer

    @property
    def tables(self) -> dict[str, ShardedTable]:
        """Every table's resolved shards."""
        return dict(self._tables)

    def optimizer_state(self) -> dict[str, DTensor]:
        """The fused optimizer's state, ``<table_key>.momentum1`` (and for Adam and LAMB
        ``<table_key>.momentum2``): per element (Adagrad, Adam, LAMB: shaped like the
        table) or per row and column block (row-wise Adagrad, one column per block);
        empty for SGD. Views: writes go to the TBE."""
        return dict(self._optimizer_state)

    def optimizer_steps(self) -> torch.Tensor | None:
        """The fused optimizer's step count, which Adam's and LAMB's bias correction
        reads (an int64 scalar on the CPU, the same on every rank); None for the
        optimizers that do not count. FBGEMM counts every forward, evaluation included.
        Collective: a rank holding no table learns it from the others."""
        if not self._optimizer.COUNTS_STEPS:
            return None
        steps = torch.tensor(self._storage.optimizer_steps(), device=self._device)
        if dist.get_world_size(self._group) > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self._group)
        return steps.cpu()

    def set_optimizer_steps(self, steps: int) -> None:
        """Continue the fused optimizer's step count from ``steps`` (a resumed Adam or
        LAMB then corrects its bias as the uninterrupted run does)."""
        self._storage.set_optimizer_steps(steps)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        for name, weight in self._weights.items():
            destination[prefix + self._key(name)] = weight

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        """Take full tensors (a TorchRec state dict) or DTensors of any embshard layout.

        Every entry is checked before any is written, so a failing load (under
        ``strict``, a missing or unexpected key too) changes no table. DTensor entries
        are gathered one table at a time: a collective, as loading a sharded module is
        on every rank.
        """
        ours = {prefix + self._key(name): name for name in self._tables}
        missing = [k for k in ours if k not in state_dict]
        unexpected = [k for k in state_dict if k.startswith(prefix) and k not in ours]
        missing_keys.extend(missing)
        if strict:
            unexpected_keys.extend(unexpected)
        present = {key: name for key, name in ours.items() if key in state_dict}
        errors = []
        for key, name in present.items():
            value, shape = state_dict[key], self._weights[name].shape
            if not isinstance(value, torch.Tensor):
                errors.append(f"{key}: expected a tensor, got {type(value).__name__}")
            elif value.shape != shape:
                errors.append(
                    f"size mismatch for {key}: the checkpoint has {tuple(value.shape)}, "
                    f"table {name!r} is {tuple(shape)}"
                )
        error_msgs.extend(errors)
        if errors or (strict and (missing or unexpected)):
            return
        for key, name in present.items():
            self._load_table(name, state_dict[key])

    def _load_table(self, name: str, value: torch.Tensor) -> None:
        full = gather_table(value) if isinstance(value, DTensor) else value
        wrapper = self._storage.weights[name]
        with torch.no_grad():
            for shard, (row, col) in zip(wrapper.local_shards(), wrapper.local_offsets()):
                rows, cols = shard.shape
                shard.copy_(full[row : row + rows, col : col + cols])


class ShardedEmbeddingBagCollection(ShardedCollection[None, Pooled, KeyedTensor]):
    """The sharded form of a TorchRec ``EmbeddingBagCollection``; build it with ``shard()``."""

    _PREFIX = "embedding_bags"

    @functools.cached_property
    def _mean_feature(self) -> torch.Tensor | None:
        """``Routes.mean_feature_by_column`` on the device, computed once."""
        mean_feature = self._routes.mean_feature_by_column()
        return None if mean_feature is None else mean_feature.to(self._device)

    @functools.cached_property
    def _lookup_is_output(self) -> bool:
        """On one rank, whether the TBE's output is the module's output as it is: every
        column in output order, none from copies. Then stage 3 has nothing to do."""
        routes = self._routes
        return (
            routes.world_size == 1
            and not routes.local_embeddings
            and self._output_layout.placement.identity
        )

    def _input_stage(self, scratch: Scratch) -> InputDistribution:
        return InputDistribution(self._routes, self._rank, scratch, self._device)

    def _output_stage(self, scratch: Scratch, comm_precision: str | None) -> OutputLayout:
        return OutputLayout(
            placement=ColumnPlacement(self._routes.column_targets(), self._routes.output_dim),
            rank=self._rank,
            group=self._group,
            scratch=scratch,
            comm_precision=comm_precision,
        )

    def lookup(self, in_flight: InputInFlight[None]) -> Pooled:
        """Stage 2: wait for the ids, and pool every local shard's rows for the global
        batch in one TBE call; pool the data-parallel tables' rows for the local batch."""
        if in_flight.error is not None:
            raise in_flight.error
        batch, replicated = in_flight.batch, self._storage.replicated
        local = (
            replicated(batch)
            if replicated is not None
            else torch.empty(batch.batch_size, 0, device=self._device)
        )
        indices, offsets, weights = self._input_dist.arrived(in_flight)
        batch_size = sum(in_flight.counts.batch_sizes)
        if self._dynamic is not None:
            indices, offsets, weights = self._dynamic.remap(
                indices, offsets, weights, batch_size, learn=self.training
            )
        if self._managed is not None:
            indices = self._managed.remap(indices, offsets, batch_size, learn=self.training)
        if self._storage.tbe is None:
            return Pooled(torch.zeros(batch_size, 0, device=self._device), local)
        return Pooled(self._storage.tbe(indices, offsets, per_sample_weights=weights), local)

    def output_dist(self, looked_up: Pooled, in_flight: InputInFlight[None]) -> KeyedTensor:
        """Stage 3 (collective): the pooled rows home to their requesters, in their
        output columns beside the local lookup's, as the unsharded module's KeyedTensor."""
        args = (looked_up.sharded, looked_up.local, in_flight.counts.batch_sizes)
        if self._lookup_is_output:
            gathered = looked_up.sharded
        elif torch.is_grad_enabled():
            gathered = PooledAllToAll.apply(self._anchor, *args, self._output_layout)
        else:
            gathered = send_home(*args, self._output_layout)
        embeddings = self._routes.embeddings
        return KeyedTensor(
            keys=[e.name for e in embeddings],
            length_per_key=[e.dim for e in embeddings],
            values=self._mean_pool(gathered, in_flight.batch.lengths),
        )

    def _mean_pool(self, out: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """MEAN-pooled features divided by the requester's own bag lengths."""
        if self._mean_feature is None:
            return out
        ones = torch.ones(1, lengths.shape[1], dtype=lengths.dtype, device=lengths.device)
        divisors = torch.cat([ones, lengths.clamp(min=1)])[self._mean_feature]
        return out / divisors.t().to(out.dtype)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)
