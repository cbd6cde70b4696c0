"""Sharding whole TorchRec models: every EmbeddingBagCollection sharded, the rest DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embshard.lookup import SGD, FusedOptimizer
from embshard.module import ShardedEmbeddingBagCollection, shard
from embshard.plan import ShardingPlan


def embedding_bag_collections(model: nn.Module) -> dict[str, EmbeddingBagCollection]:
    """Every EmbeddingBagCollection in ``model``, by module path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)}


def shard_model(
    model: nn.Module,
    plan: ShardingPlan,
    *,
    mesh: DeviceMesh | None = None,
    optimizer: FusedOptimizer = SGD(lr=0.01),
    seed: int = 0,
    device: torch.device | None = None,
) -> DistributedDataParallel:
    """Shard every EmbeddingBagCollection of ``model`` by ``plan`` (one plan naming the
    tables of all of them) and wrap the model in DDP, which then holds only the dense
    parameters: the sharded tables are trained by their fused optimizer.

    Dense parameters on ``meta`` are materialized on ``device`` (default CPU) and
    reset; DDP then broadcasts rank 0's, so every rank starts from the same model.
    """
    collections = embedding_bag_collections(model)
    if not collections:
        raise ValueError(f"{type(model).__name__} holds no EmbeddingBagCollection to shard")
    configs = [c for ebc in collections.values() for c in ebc.embedding_bag_configs()]
    names = [c.name for c in configs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"table names {repeated} appear in more than one EmbeddingBagCollection")
    plan.resolve(configs, dist.get_world_size())  # one error naming every problem
    for path, ebc in collections.items():
        own = {c.name for c in ebc.embedding_bag_configs()}
        sub_plan = ShardingPlan({n: s for n, s in plan.tables.items() if n in own})
        _replace(model, path, shard(ebc, sub_plan, mesh=mesh, optimizer=optimizer, seed=seed))
    _materialize_dense(model, device or torch.device("cpu"))
    return DistributedDataParallel(model)


def sharded_collections(model: nn.Module) -> dict[str, ShardedEmbeddingBagCollection]:
    return {
        path: m for path, m in model.named_modules() if isinstance(m, ShardedEmbeddingBagCollection)
    }


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    if not path:
        raise ValueError(
            "shard_model takes a model that holds EmbeddingBagCollections; use shard()"
        )
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, module)


def _materialize_dense(model: nn.Module, device: torch.device) -> None:
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif any(True for _ in module.parameters(recurse=False)):
                # Modules without reset_parameters (TorchRec's LowRankCrossNet): its init.
                for param in module.parameters(recurse=False):
                    if param.dim() > 1:
                        nn.init.xavier_normal_(param)
                    else:
                        param.zero_()
