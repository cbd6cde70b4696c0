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
    default_plan,
    row_wise,
    table_wise,
)
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
    "RowWise",
    "RowWiseAdagrad",
    "ShardedEmbeddingBagCollection",
    "ShardedTable",
    "ShardingPlan",
    "TableShard",
    "TableSpec",
    "TableWise",
    "column_wise",
    "default_plan",
    "from_torchrec_plan",
    "gather_table",
    "row_wise",
    "shard",
    "shard_model",
    "table_wise",
    "to_torchrec_plan",
]
