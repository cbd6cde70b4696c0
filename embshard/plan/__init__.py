"""What a plan says: each table's sharding spec (table-wise, row-wise, column-wise,
data-parallel, grid), the shards it resolves to on a world of ranks, plan YAML, and
conversion to and from TorchRec's plans. The bottom layer: it imports nothing else of
embshard but its errors."""

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
    grid,
    row_wise,
    table_wise,
)

__all__ = [
    "ColumnWise",
    "DataParallel",
    "Grid",
    "PlanError",
    "RowWise",
    "ShardedTable",
    "ShardingPlan",
    "TableShard",
    "TableSpec",
    "TableWise",
    "column_wise",
    "data_parallel",
    "grid",
    "row_wise",
    "table_wise",
]
