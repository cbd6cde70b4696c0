"""A rank's shards of each table: views of the TBE's weights, wrapped and exposed as DTensors.

``LocalShardsWrapper`` holds one table's local shards (views, never copies) with their
global offsets; it implements the ops DTensor and DCP call on a local tensor and DCP's
chunk protocol, so uneven row-wise blocks and several column blocks per rank, in any
rank order, save and load by their true offsets. ``gather_table`` reads the same
metadata to rebuild a full table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from embshard.plan.specs import (
    ShardedTable,
    TableShard,
    local_shards,
)
from embshard.storage.lookup import LookupBackend, LookupModule, TrainingTBE
from embshard.storage.optimizers import FusedOptimizer
from embshard.storage.replicated import ReplicatedTables

aten = torch.ops.aten


class LocalShardsWrapper(torch.Tensor):
    """One table's shards on this rank, each with its offset in the global table.

    The wrapper's own shape is its shards side by side along the last dim, as tall as
    the tallest (a rank's column blocks of a grid table may differ in rows). A rank
    holding nothing of a table has a wrapper with no shards and shape (0, 0).
    """

    _shards: list[torch.Tensor]
    _offsets: list[torch.Size]

    @staticmethod
    def __new__(
        cls,
        shards: Sequence[torch.Tensor],
        offsets: Sequence[Sequence[int]],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> LocalShardsWrapper:
        if len(shards) != len(offsets):
            raise ValueError(f"got {len(shards)} shards but {len(offsets)} offsets")
        if shards:
            first = shards[0]
            if any(s.dim() != 2 for s in shards):
                raise ValueError("local shards must be 2-D, rows x columns")
            if any(s.dtype != first.dtype or s.device != first.device for s in shards):
                raise ValueError("local shards of one table must share dtype and device")
            if any(len(o) != 2 for o in offsets):
                raise ValueError("every offset needs two entries, (row, column)")
            shape = (max(s.shape[0] for s in shards), sum(s.shape[1] for s in shards))
            dtype, device = first.dtype, first.device
        else:
            shape = (0, 0)
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype or torch.float32, device=device or torch.device("cpu")
        )
        wrapper._shards = list(shards)
        wrapper._offsets = [torch.Size(o) for o in offsets]
        return wrapper

    def local_shards(self) -> list[torch.Tensor]:
        return self._shards

    def local_offsets(self) -> list[torch.Size]:
        return self._offsets

    def local_sizes(self) -> list[torch.Size]:
        return [s.shape for s in self._shards]

    def _same_layout(self, shards: Sequence[torch.Tensor]) -> LocalShardsWrapper:
        return LocalShardsWrapper(shards, self._offsets, dtype=self.dtype, device=self.device)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LocalShardsWrapper:
        if not self._shards:
            return LocalShardsWrapper([], [], dtype=self.dtype, device=self.device)
        return self._same_layout([fn(s) for s in self._shards])

    def __repr__(self) -> str:  # type: ignore[override]
        parts = ", ".join(
            f"{tuple(s.shape)}@{tuple(o)}" for s, o in zip(self._shards, self._offsets)
        )
        return f"LocalShardsWrapper([{parts}], dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        handler = _DISPATCH.get(func)
        if handler is None:
            raise NotImplementedError(
                f"LocalShardsWrapper does not support {func}; read the shards with "
                "local_shards() or the whole table with embshard.gather_table()"
            )
        return handler(*args, **kwargs)

    # DCP's chunk protocol: one chunk per local shard, at its global offset.

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=shard.shape),
                    properties=TensorProperties.create_from_tensor(shard),
                    size=object.size(),
                ),
            )
            for shard, offsets in zip(self._shards, self._offsets)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=o, sizes=s.shape)
            for s, o in zip(self._shards, self._offsets)
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for shard, offsets in zip(self._shards, self._offsets):
            if offsets == index.offset:
                return shard
        raise ValueError(f"{index.fqn}: this rank holds no shard at offset {index.offset}")


def _view(self: LocalShardsWrapper, size: Sequence[int]) -> LocalShardsWrapper:
    # DTensor.from_local calls view_as(itself); per-shard views keep aliasing the TBE.
    if tuple(size) != tuple(self.shape):
        raise NotImplementedError(f"LocalShardsWrapper cannot be viewed as {tuple(size)}")
    return self._map(lambda s: s.view(s.shape))


def _copy_(dst: LocalShardsWrapper, src: torch.Tensor, non_blocking: bool = False) -> Any:
    if isinstance(src, LocalShardsWrapper):
        if src.local_offsets() != dst.local_offsets() or src.local_sizes() != dst.local_sizes():
            raise ValueError("copy_ between LocalShardsWrappers needs the same shard layout")
        sources = src.local_shards()
    else:  # laid out as the wrapper's shape: side by side, each its top rows
        columns = src.split([s.shape[1] for s in dst.local_shards()], dim=1)
        sources = [c[: s.shape[0]] for c, s in zip(columns, dst.local_shards())]
    for shard, source in zip(dst.local_shards(), sources):
        shard.copy_(source, non_blocking=non_blocking)
    return dst


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (isinstance(a, LocalShardsWrapper) and isinstance(b, LocalShardsWrapper)):
        return False
    return (
        a.local_offsets() == b.local_offsets()
        and a.local_sizes() == b.local_sizes()
        and all(torch.equal(x, y) for x, y in zip(a.local_shards(), b.local_shards()))
    )


def _new_empty(self: LocalShardsWrapper, size: Sequence[int], **kwargs: Any) -> torch.Tensor:
    if tuple(size) == tuple(self.shape):
        return self._map(lambda s: torch.empty_like(s, **kwargs))
    return torch.empty(size, dtype=kwargs.get("dtype") or self.dtype, device=self.device)


_DISPATCH: dict[Any, Callable[..., Any]] = {
    aten.view.default: _view,
    aten.detach.default: lambda self: self._map(torch.Tensor.detach),
    aten.alias.default: lambda self: self._map(lambda s: s.view(s.shape)),
    aten.clone.default: lambda self, **kw: self._map(lambda s: s.clone(**kw)),
    aten._to_copy.default: lambda self, **kw: self._map(lambda s: aten._to_copy.default(s, **kw)),
    aten.copy_.default: _copy_,
    aten.equal.default: _equal,
    aten.empty_like.default: lambda self, **kw: self._map(lambda s: torch.empty_like(s, **kw)),
    aten.zeros_like.default: lambda self, **kw: self._map(lambda s: torch.zeros_like(s, **kw)),
    aten.new_empty.default: _new_empty,
    aten.is_same_size.default: lambda a, b: a.shape == b.shape,
}


def table_dtensor(
    table: ShardedTable,
    local: LocalShardsWrapper,
    mesh: DeviceMesh,
    submesh: Callable[[tuple[int, ...]], DeviceMesh],
    shape: tuple[int, int] | None = None,
) -> DTensor:
    """The table as a DTensor with its global shape and stride.

    Table-wise: ``Replicate()`` on its owner's one-rank mesh. Data-parallel:
    ``Replicate()`` on ``mesh``. Row-wise: ``Shard(0)`` on ``mesh``. Column-wise and
    grid: ``Shard(1)`` on the mesh of its owners (as TorchRec places grid tables; each
    rank's row blocks are in its wrapper's offsets). ``submesh(ranks)`` gives the mesh
    of plan ranks ``ranks``. On a 2-D mesh (replicas x sharding group) that placement
    is the second, after ``Replicate()`` over the replicas: DCP saves one copy.
    ``shape`` overrides the global shape, for optimizer state laid out like the
    table's rows.
    """
    ranks, placement = table.spec.placement(table.shards)
    table_mesh = mesh if ranks is None else submesh(ranks)
    rows, cols = shape or (table.num_embeddings, table.embedding_dim)
    return DTensor.from_local(
        local,
        table_mesh,
        [Replicate()] * (table_mesh.ndim - 1) + [placement],
        run_check=False,
        shape=torch.Size((rows, cols)),
        stride=(cols, 1),
    )


def gather_table(table: DTensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full table on every rank, for any embshard layout.

    Collective over ``group`` (default: the whole world), which must hold every rank
    that owns part of the table. Each rank writes its shards at their offsets into a
    zero tensor and the ranks sum; a rectangle several ranks hold (hot rows copied on
    every rank) is written by the first of them only, so the sum is exact. A table
    replicated over every rank of ``group`` is already whole on each.
    """
    local = table.to_local()
    if local.numel() and not hasattr(local, "local_shards"):
        raise TypeError("gather_table needs a DTensor whose local tensor is a LocalShardsWrapper")
    full = torch.zeros(table.shape, dtype=table.dtype, device=local.device)
    chunks = list(zip(local.local_shards(), local.local_offsets())) if local.numel() else []
    whole = table.device_mesh.size() == dist.get_world_size(group) > 1 and all(
        p.is_replicate() for p in table.placements
    )
    if not whole:
        layouts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(layouts, [(tuple(o), tuple(s.shape)) for s, o in chunks], group)
        earlier = {c for layout in layouts[: dist.get_rank(group)] for c in layout}
        chunks = [(s, o) for s, o in chunks if (tuple(o), tuple(s.shape)) not in earlier]
    for shard, offsets in chunks:
        full[tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape))] = shard
    if not whole:
        dist.all_reduce(full, group=group)
    return full


@dataclass
class LocalStorage:
    """A rank's shards of every table: the sharded ones in one lookup module (none if
    the rank holds none), the data-parallel copies in ``replicated``'s TBE.

    Lookup table ``i`` holds ``shards[i]``, the replicated TBE's ``replicas[i]``.
    ``weights`` views every table's local part;
    ``optimizer_state`` views each of the fused optimizer's state tensors per table,
    by (table, state name), with its global shape, laid out as the optimizer's
    ``STATES`` say (none for SGD).
    """

    tbe: LookupModule | None
    shards: list[tuple[str, TableShard]]
    replicated: ReplicatedTables | None
    replicas: list[tuple[str, TableShard]]
    weights: dict[str, LocalShardsWrapper]
    optimizer_state: dict[tuple[str, str], tuple[LocalShardsWrapper, tuple[int, int]]]

    def weight_views(self) -> list[tuple[str, TableShard, torch.Tensor]]:
        """Every local shard with its view of the TBE weights, copies included."""
        return _local_views(self, _weights)

    def replica_tensors(self) -> list[torch.Tensor]:
        """Every local weight and optimizer state tensor (views, both lookups): what the
        copies of these shards in other sharding groups average."""
        tensors = [view for _, _, view in self.weight_views()]
        for lookup in self._lookups():
            tensors += [state for states in lookup.split_optimizer_states() for state in states]
        return tensors

    def optimizer_steps(self) -> int:
        """The steps this rank's lookups have counted (each forward counts one, in every
        lookup alike); 0 where the rank has none."""
        return max((int(lookup.iter.item()) for lookup in self._lookups()), default=0)

    def set_optimizer_steps(self, steps: int) -> None:
        """Make every lookup of this rank continue counting from ``steps``."""
        for lookup in self._lookups():
            lookup.iter.fill_(steps)
            lookup.iter_cpu.fill_(steps)

    def _lookups(self) -> list[LookupModule]:
        replicated = self.replicated.tbe if self.replicated is not None else None
        return [lookup for lookup in (self.tbe, replicated) if lookup is not None]


def _per_table(
    tables: Mapping[str, ShardedTable],
    views: Sequence[tuple[str, TableShard, torch.Tensor]],
    offset: Callable[[ShardedTable, TableShard], tuple[int, int]],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, LocalShardsWrapper]:
    wrappers = {}
    for name, table in tables.items():
        mine = [(s, v) for n, s, v in views if n == name]
        wrappers[name] = LocalShardsWrapper(
            [v for _, v in mine],
            [offset(table, s) for s, _ in mine],
            dtype=dtype,
            device=device,
        )
    return wrappers


def _at_offset(table: ShardedTable, shard: TableShard) -> tuple[int, int]:
    return shard.row_offset, shard.col_offset


def _weights(tbe: LookupModule) -> list[torch.Tensor]:
    return tbe.split_embedding_weights()


def _state(index: int) -> Callable[[LookupModule], list[torch.Tensor]]:
    """The optimizer's ``index``-th state tensor of every TBE table, 2-D (a per-row one
    as one column)."""

    def views(tbe: LookupModule) -> list[torch.Tensor]:
        return [st[index].view(st[index].shape[0], -1) for st in tbe.split_optimizer_states()]

    return views


def _local_views(
    storage: LocalStorage,
    per_table: Callable[[LookupModule], list[torch.Tensor]],
) -> list[tuple[str, TableShard, torch.Tensor]]:
    """``per_table``'s tensors of both TBEs, each with its table name and shard."""
    replicated = storage.replicated.tbe if storage.replicated is not None else None
    views = []
    for tbe, shards in ((storage.tbe, storage.shards), (replicated, storage.replicas)):
        if tbe is not None:
            views += [(n, s, v) for (n, s), v in zip(shards, per_table(tbe))]
    return views


def allocate_storage(
    tables: Mapping[str, ShardedTable],
    rank: int,
    optimizer: FusedOptimizer,
    device: torch.device,
    feature_table_map: Sequence[int],
    dtype: torch.dtype = torch.float32,
    replicated: ReplicatedTables | None = None,
    lookup: LookupBackend = TrainingTBE(),
) -> LocalStorage:
    """Allocate only this rank's non-empty shards, in one SUM-pooled lookup module that
    ``lookup`` builds, zero-filled, and wrap them with ``replicated``'s copies of the
    data-parallel tables.

    ``feature_table_map`` gives, for each lookup feature, the index of its shard in
    ``local_shards(tables, rank)``. Weights are ``dtype``, optimizer state float32.
    Every rank first asks ``lookup`` whether it can serve ``optimizer`` on ``device``,
    so a refusal is raised on every rank, shards or none.
    """
    lookup.check(optimizer, device)
    shards = local_shards(tables, rank)
    shapes = [(s.rows, s.cols) for _, s in shards]
    tbe = lookup.build(shapes, optimizer, device, feature_table_map, dtype) if shards else None
    replicas = [
        (n, next(s for s in tables[n].shards_on(rank) if s.replica))
        for n in (replicated.names if replicated else [])
    ]
    storage = LocalStorage(tbe, shards, replicated, replicas, {}, {})
    storage.weights = _per_table(tables, storage.weight_views(), _at_offset, device, dtype)
    for index, (state, layout) in enumerate(optimizer.STATES):
        views = _local_views(storage, _state(index))
        wrappers = _per_table(tables, views, layout.offset, device, torch.float32)
        for name, table in tables.items():
            storage.optimizer_state[name, state] = (wrappers[name], layout.shape(table))
    return storage
