"""embshard: shard the embedding tables of TorchRec models across torch.distributed ranks."""

from embshard.inputs import InputError
from embshard.lookup import SGD, Adagrad, FusedOptimizer, RowWiseAdagrad
from embshard.model import shard_model
from embshard.module import ShardedEmbeddingBagCollection, shard
from embshard.plan import (
    ColumnWise,
    PlanError,
    RowWise,
    ShardedTable,
    ShardingPlan,
    TableShard,
    TableSpec,
    TableWise,
    column_wise,
    row_wise,
    table_wise,
)
from embshard.planner import PlanningError, PlanReport, TableConstraint, Topology, plan_tables
from embshard.shards import LocalShardsWrapper, gather_table
from embshard.torchrec_plan import from_torchrec_plan, to_torchrec_plan

__all__ = [
    "SGD",
    "Adagrad",
    "ColumnWise",
    "FusedOptimizer",
    "InputError",
    "LocalShardsWrapper",
    "PlanError",
    "PlanReport",
    "PlanningError",
    "RowWise",
    "RowWiseAdagrad",
    "ShardedEmbeddingBagCollection",
    "ShardedTable",
    "ShardingPlan",
    "TableConstraint",
    "TableShard",
    "TableSpec",
    "TableWise",
    "Topology",
    "column_wise",
    "from_torchrec_plan",
    "gather_table",
    "plan_tables",
    "row_wise",
    "shard",
    "shard_model",
    "table_wise",
    "to_torchrec_plan",
]
