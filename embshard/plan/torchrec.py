"""Conversion between embshard plans and TorchRec's per-module sharding plans.

The same plan can then drive both libraries (the benchmark relies on it). Only the
sharding types both know convert; TorchRec's others are refused by name. A grid is
TorchRec's grid sharding (table-row-wise with one column block) where TorchRec's
shape fits it: every block split evenly over the ranks of one host, equal widths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import placement
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from embshard.errors import PlanError
from embshard.plan.specs import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    ShardedTable,
    ShardingPlan,
    TableShard,
    TableSpec,
    TableWise,
    column_wise,
    data_parallel,
    even_row_sizes,
    grid,
    plan_from_entries,
    raise_problems,
    row_wise,
    table_wise,
)

_SHARDING_TYPE = {
    TableWise: ShardingType.TABLE_WISE,
    RowWise: ShardingType.ROW_WISE,
    ColumnWise: ShardingType.COLUMN_WISE,
    DataParallel: ShardingType.DATA_PARALLEL,
}
_GRID_TYPES = (ShardingType.GRID_SHARD, ShardingType.TABLE_ROW_WISE)


def to_torchrec_plan(
    plan: ShardingPlan,
    tables: Sequence[BaseEmbeddingConfig],
    world_size: int,
    *,
    device_type: str = "cpu",
    local_size: int | None = None,
) -> EmbeddingModuleShardingPlan:
    """TorchRec's plan for an ``EmbeddingBagCollection`` or ``EmbeddingCollection`` of
    ``tables`` (both shard their tables alike), FUSED kernel
    (data-parallel tables: TorchRec's DENSE kernel, on every rank); ``local_size``
    ranks a host (default: all on one). A grid table TorchRec cannot shard as a grid
    (see ``_grid_misfit``), or a row-wise table with hot rows or with its row blocks
    out of rank order, is a PlanError naming it.

    Wrap it as ``torchrec.distributed.types.ShardingPlan({module_path: result})``.
    """
    local_size = local_size or world_size
    resolved = plan.resolve(tables, world_size)
    misfits = {n: _row_wise_misfit(t) or _grid_misfit(t, local_size) for n, t in resolved.items()}
    raise_problems(
        "cannot convert to a TorchRec plan",
        [f"table {n!r}: {why}" for n, why in misfits.items() if why is not None],
    )
    module_plan = EmbeddingModuleShardingPlan()
    for name, table in resolved.items():
        if table.replicated:
            module_plan[name] = ParameterSharding(
                sharding_type=ShardingType.DATA_PARALLEL.value,
                compute_kernel=EmbeddingComputeKernel.DENSE.value,
                ranks=list(range(world_size)),
            )
            continue
        module_plan[name] = ParameterSharding(
            sharding_type=_sharding_type(table).value,
            compute_kernel=EmbeddingComputeKernel.FUSED.value,
            ranks=[s.rank for s in table.shards],
            sharding_spec=EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=[s.row_offset, s.col_offset],
                        shard_sizes=[s.rows, s.cols],
                        placement=placement(device_type, s.rank, local_size),
                    )
                    for s in table.shards
                ]
            ),
        )
    return module_plan


def _sharding_type(table: ShardedTable) -> ShardingType:
    groups = table.spec.row_groups
    if groups is not None:
        return ShardingType.TABLE_ROW_WISE if len(groups) == 1 else ShardingType.GRID_SHARD
    return _SHARDING_TYPE[type(table.spec)]


def _row_wise_misfit(table: ShardedTable) -> str | None:
    """Why TorchRec cannot shard a row-wise table as embshard does: hot rows, or row
    blocks out of rank order (TorchRec gives rank r the r-th block, whatever its
    placement says); None when it can (or the table is not row-wise)."""
    if table.hot_rows:
        return "TorchRec has no row-wise sharding with hot rows copied on every rank"
    ranks = [s.rank for s in table.shards if not s.replica]  # row blocks, in row order
    if table.spec.ROW_BLOCK_ON_EVERY_RANK and ranks != sorted(ranks):
        return (
            f"TorchRec's row-wise sharding puts row block r on rank r; these are on ranks {ranks}"
        )
    return None


def _grid_misfit(table: ShardedTable, local_size: int) -> str | None:
    """Why TorchRec cannot shard a grid table as its grid (or, one block, table-row-wise)
    sharding, which splits every column block evenly over the ranks of one host, in
    equal widths; None when it can (or the table is no grid)."""
    if table.spec.row_groups is None:
        return None
    blocks: dict[tuple[int, int], list[TableShard]] = {}
    for s in table.shards:
        blocks.setdefault((s.col_offset, s.cols), []).append(s)
    if len({cols for _, cols in blocks}) > 1:
        return "TorchRec's grid sharding needs column blocks of equal widths"
    even = list(even_row_sizes(table.num_embeddings, local_size))
    for (col, _), shards in blocks.items():
        ranks, rows = [s.rank for s in shards], [s.rows for s in shards]
        host = list(range(ranks[0], ranks[0] + local_size))
        if ranks[0] % local_size or ranks != host or rows != even:
            return (
                f"TorchRec's grid sharding splits each column block evenly over the "
                f"{local_size} ranks of one host; the block at column {col} has rows "
                f"{rows} on ranks {ranks}"
            )
    return None


def from_torchrec_plan(module_plan: Mapping[str, ParameterSharding]) -> ShardingPlan:
    """The embshard plan equal to a TorchRec per-module plan (table name -> sharding)."""
    return plan_from_entries(
        module_plan, _spec_from_parameter_sharding, "cannot convert TorchRec plan"
    )


def _spec_from_parameter_sharding(sharding: ParameterSharding) -> TableSpec:
    kind = sharding.sharding_type
    known = {t.value for t in [*_SHARDING_TYPE.values(), *_GRID_TYPES]}
    if kind not in known:
        raise PlanError(f"TorchRec sharding type {kind!r} has no embshard equivalent ({known})")
    if kind == ShardingType.DATA_PARALLEL.value:
        return data_parallel()
    if not isinstance(sharding.sharding_spec, EnumerableShardingSpec):
        raise PlanError("expected an EnumerableShardingSpec listing the shards")
    shards = sharding.sharding_spec.shards
    ranks = [s.placement.rank() for s in shards]

    if kind == ShardingType.TABLE_WISE.value:
        return table_wise(ranks[0])

    if kind in {t.value for t in _GRID_TYPES}:
        return _grid_spec(shards, ranks)

    if kind == ShardingType.ROW_WISE.value:
        by_row = sorted(zip(shards, ranks), key=lambda sr: sr[0].shard_offsets[0])
        order = [r for _, r in by_row]
        sizes = tuple(s.shard_sizes[0] for s, _ in by_row)
        return row_wise(
            None if sizes == even_row_sizes(sum(sizes), len(sizes)) else sizes,
            ranks=None if order == list(range(len(order))) else order,
        )

    by_col = sorted(zip(shards, ranks), key=lambda sr: sr[0].shard_offsets[1])
    widths = [s.shard_sizes[1] for s, _ in by_col]
    equal = len(set(widths)) == 1
    return column_wise([r for _, r in by_col], None if equal else widths)


def _grid_spec(shards: list[ShardMetadata], ranks: list[int]) -> Grid:
    """Column blocks in column order, each's ranks in row order; even sizes and equal
    widths where they are."""
    blocks: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for s, r in zip(shards, ranks):
        blocks.setdefault((s.shard_offsets[1], s.shard_sizes[1]), []).append(
            (s.shard_offsets[0], s.shard_sizes[0], r)
        )
    ordered = [sorted(rows) for _, rows in sorted(blocks.items())]
    widths = [cols for _, cols in sorted(blocks)]
    sizes = [tuple(n for _, n, _ in rows) for rows in ordered]
    even = all(s == even_row_sizes(sum(s), len(s)) for s in sizes)
    return grid(
        len(widths) if len(set(widths)) == 1 else widths,
        [[r for _, _, r in rows] for rows in ordered],
        None if even else sizes,
    )
