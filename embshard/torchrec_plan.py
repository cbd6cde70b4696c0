"""Conversion between embshard plans and TorchRec's per-module sharding plans.

The same plan can then drive both libraries (the benchmark relies on it). Only the
sharding types both know convert; TorchRec's others are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import placement
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embshard.plan import (
    ColumnWise,
    DataParallel,
    PlanError,
    RowWise,
    ShardingPlan,
    TableSpec,
    TableWise,
    column_wise,
    data_parallel,
    even_row_sizes,
    plan_from_entries,
    row_wise,
    table_wise,
)

_SHARDING_TYPE = {
    TableWise: ShardingType.TABLE_WISE,
    RowWise: ShardingType.ROW_WISE,
    ColumnWise: ShardingType.COLUMN_WISE,
    DataParallel: ShardingType.DATA_PARALLEL,
}


def to_torchrec_plan(
    plan: ShardingPlan,
    tables: Sequence[EmbeddingBagConfig],
    world_size: int,
    *,
    device_type: str = "cpu",
    local_size: int | None = None,
) -> EmbeddingModuleShardingPlan:
    """TorchRec's plan for an ``EmbeddingBagCollection`` of ``tables``, FUSED kernel
    (data-parallel tables: TorchRec's DENSE kernel, on every rank).

    Wrap it as ``torchrec.distributed.types.ShardingPlan({module_path: result})``.
    """
    local_size = local_size or world_size
    module_plan = EmbeddingModuleShardingPlan()
    for name, table in plan.resolve(tables, world_size).items():
        if table.replicated:
            module_plan[name] = ParameterSharding(
                sharding_type=ShardingType.DATA_PARALLEL.value,
                compute_kernel=EmbeddingComputeKernel.DENSE.value,
                ranks=list(range(world_size)),
            )
            continue
        module_plan[name] = ParameterSharding(
            sharding_type=_SHARDING_TYPE[type(table.spec)].value,
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


def from_torchrec_plan(module_plan: Mapping[str, ParameterSharding]) -> ShardingPlan:
    """The embshard plan equal to a TorchRec per-module plan (table name -> sharding)."""
    return plan_from_entries(
        module_plan, _spec_from_parameter_sharding, "cannot convert TorchRec plan"
    )


def _spec_from_parameter_sharding(sharding: ParameterSharding) -> TableSpec:
    kind = sharding.sharding_type
    known = {t.value for t in _SHARDING_TYPE.values()}
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

    if kind == ShardingType.ROW_WISE.value:
        by_row = sorted(zip(shards, ranks), key=lambda sr: sr[0].shard_offsets[0])
        if [r for _, r in by_row] != list(range(len(by_row))):
            raise PlanError(f"row blocks are on ranks {[r for _, r in by_row]}, not in rank order")
        sizes = tuple(s.shard_sizes[0] for s, _ in by_row)
        return row_wise(None if sizes == even_row_sizes(sum(sizes), len(sizes)) else sizes)

    by_col = sorted(zip(shards, ranks), key=lambda sr: sr[0].shard_offsets[1])
    widths = [s.shard_sizes[1] for s, _ in by_col]
    equal = len(set(widths)) == 1
    return column_wise([r for _, r in by_col], None if equal else widths)
