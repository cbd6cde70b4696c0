"""embshard: shard the embedding tables of TorchRec models across torch.distributed ranks.

The public names load on first use (PEP 562), so that the ``embshard`` command and its
``--help`` start without importing torch and TorchRec.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_MODULES = {
    "embshard.errors": [
        "CheckpointError",
        "ConfigError",
        "EmbshardError",
        "InputError",
        "PlanError",
        "PlanningError",
    ],
    "embshard.storage.optimizers": [
        "SGD",
        "Adagrad",
        "Adam",
        "FusedOptimizer",
        "Lamb",
        "RowWiseAdagrad",
    ],
    "embshard.modules.shard_model": ["shard_model", "sync_replicas"],
    "embshard.modules.mesh": ["sharding_mesh"],
    "embshard.modules.collection": ["ShardedEmbeddingBagCollection"],
    "embshard.modules.managed_collision": [
        "ShardedManagedCollisionEmbeddingBagCollection",
        "ShardedManagedCollisionEmbeddingCollection",
    ],
    "embshard.modules.shard": ["shard"],
    "embshard.plan.specs": [
        "ColumnWise",
        "DataParallel",
        "Grid",
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
    ],
    "embshard.modules.pipeline": ["TrainPipeline", "drain", "prefetch"],
    "embshard.modules.sequence": ["ShardedEmbeddingCollection"],
    "embshard.planner.report": ["PlanReport"],
    "embshard.planner.search": ["plan_tables"],
    "embshard.planner.tables": ["TableConstraint"],
    "embshard.planner.topology": ["Topology"],
    "embshard.storage.shards": ["LocalShardsWrapper", "gather_table"],
    "embshard.storage.id_map": ["IdMapSpec"],
    "embshard.storage.dynamic": ["DynamicStats"],
    "embshard.storage.lookup": ["LookupBackend", "LookupModule", "TrainingTBE"],
    "embshard.plan.torchrec": ["from_torchrec_plan", "to_torchrec_plan"],
    "embshard.runtime.teardown": ["shutdown"],
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    """A public name, or a submodule (``embshard.modules.shard_model``), imported on first use."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
