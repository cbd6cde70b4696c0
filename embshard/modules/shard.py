"""``shard()``: a TorchRec EmbeddingBagCollection or EmbeddingCollection, sharded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)

from embshard.errors import PlanError
from embshard.modules.collection import ShardedCollection, ShardedEmbeddingBagCollection
from embshard.modules.managed_collision import (
    ShardedManagedCollisionEmbeddingBagCollection,
    ShardedManagedCollisionEmbeddingCollection,
)
from embshard.modules.mesh import world_mesh
from embshard.modules.sequence import ShardedEmbeddingCollection
from embshard.plan.specs import ShardingPlan
from embshard.storage.id_map import IdMapSpec
from embshard.storage.lookup import LookupBackend, TrainingTBE
from embshard.storage.managed_collision import ManagedCollisions
from embshard.storage.optimizers import SGD, FusedOptimizer

_CollectionT = TypeVar("_CollectionT", bound=ShardedCollection)

# TorchRec's managed-collision collections: tables behind their MCH modules.
_MANAGED = ManagedCollisionEmbeddingBagCollection | ManagedCollisionEmbeddingCollection


def shard(
    module: EmbeddingBagCollection
    | EmbeddingCollection
    | ManagedCollisionEmbeddingBagCollection
    | ManagedCollisionEmbeddingCollection,
    plan: ShardingPlan,
    *,
    mesh: DeviceMesh | None = None,
    optimizer: FusedOptimizer = SGD(lr=0.01),
    seed: int = 0,
    comm_precision: str | None = None,
    lookup: LookupBackend = TrainingTBE(),
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> (
    ShardedCollection
    | ShardedManagedCollisionEmbeddingBagCollection
    | ShardedManagedCollisionEmbeddingCollection
):
    """Shard ``module`` by ``plan`` over ``mesh`` (default: the whole default process group).

    An ``EmbeddingCollection`` gives a ``ShardedEmbeddingCollection`` (embshard.modules.sequence):
    one row per id, table-wise, row-wise, column-wise or grid.

    A module on ``meta`` gets the plan-independent seeded initialization; a module with
    real weights keeps them, each rank copying only its own rows and columns. Tables
    keep their ``data_type``: FP32, or FP16 (half the memory; every table of the
    module must then be FP16).

    ``comm_precision`` ``"fp16"`` or ``"bf16"`` sends the pooled rows and their
    gradients in that precision, half the bytes of the default ``None`` (``"fp32"``);
    the output stays float32.

    ``lookup`` builds each rank's lookup over its shards: FBGEMM's training TBE in
    the device's own memory by default, ``TrainingTBE(location="managed")`` for UVM.

    ``dynamic`` names the dynamic tables of the module, each with its ``IdMapSpec``:
    their features take raw ids in ``[0, 2**63)``, each remapped to a row it owns alone
    until evicted (docs/dynamic.md). Such a table has ``num_embeddings == buckets *
    rows_per_bucket`` and a table-wise, row-wise, column-wise or grid plan cutting
    rows on bucket boundaries.

    A ``ManagedCollisionEmbeddingBagCollection`` (TorchRec's, with
    ``MCHManagedCollisionModule``s) gives a
    ``ShardedManagedCollisionEmbeddingBagCollection``: its tables table-wise or row-wise
    (equal row blocks, the last may be smaller), each rank's module rebuilt for its rows
    remapping the raw ids of its input range (docs/dynamic.md). A
    ``ManagedCollisionEmbeddingCollection`` likewise gives a
    ``ShardedManagedCollisionEmbeddingCollection``: a row per id, every raw id sent
    to its owner (repeats too, so its module profiles every sighting), a miss its
    block's last row.
    """
    if not isinstance(module, EmbeddingBagCollection | EmbeddingCollection | _MANAGED):
        raise TypeError(
            "shard() takes a TorchRec EmbeddingBagCollection, EmbeddingCollection or "
            f"their managed-collision collections, got {type(module)}"
        )
    if not dist.is_initialized():
        raise RuntimeError("shard() needs torch.distributed initialized (init_process_group)")
    if mesh is None:
        mesh = world_mesh()
    options = _Options(plan, mesh, optimizer, seed, comm_precision, lookup, dynamic)
    if isinstance(module, EmbeddingCollection):
        return _shard_sequence(module, options)
    if isinstance(module, _MANAGED):
        return _shard_managed(module, options)
    return _shard_bags(module, options)


@dataclass(frozen=True)
class _Options:
    """``shard()``'s arguments beside the module, and the managed collisions of an
    MC collection's tables: what every sharded collection is built with."""

    plan: ShardingPlan
    mesh: DeviceMesh
    optimizer: FusedOptimizer
    seed: int
    comm_precision: str | None
    lookup: LookupBackend
    dynamic: Mapping[str, IdMapSpec] | None
    managed: ManagedCollisions | None = None

    def build(self, collection: type[_CollectionT], configs: list, **kwargs) -> _CollectionT:
        return collection(
            configs,
            self.plan,
            self.mesh,
            self.optimizer,
            self.seed,
            comm_precision=self.comm_precision,
            lookup=self.lookup,
            dynamic=self.dynamic,
            managed=self.managed,
            **kwargs,
        )


def _shard_bags(module: EmbeddingBagCollection, options: _Options) -> ShardedEmbeddingBagCollection:
    return options.build(
        ShardedEmbeddingBagCollection,
        module.embedding_bag_configs(),
        weights=_given_weights(module.embedding_bags),
        is_weighted=module.is_weighted(),
    )


def _shard_managed(
    module: ManagedCollisionEmbeddingBagCollection | ManagedCollisionEmbeddingCollection,
    options: _Options,
) -> ShardedManagedCollisionEmbeddingBagCollection | ShardedManagedCollisionEmbeddingCollection:
    kind = type(module).__name__
    if options.dynamic:
        raise PlanError(
            f"dynamic tables {sorted(options.dynamic)}: a {kind}'s tables are remapped by its "
            "own managed-collision modules"
        )
    if module._return_remapped_features:
        raise ValueError(
            f"return_remapped_features=True is not supported: the sharded {kind} returns "
            "(embeddings, None)"
        )
    mcc = module._managed_collision_collection
    managed = ManagedCollisions(dict(mcc._managed_collision_modules), mcc.need_preprocess)
    options = replace(options, managed=managed)
    if isinstance(module, ManagedCollisionEmbeddingCollection):
        return ShardedManagedCollisionEmbeddingCollection(
            _shard_sequence(module._embedding_module, options)
        )
    return ShardedManagedCollisionEmbeddingBagCollection(
        _shard_bags(module._embedding_module, options)
    )


def _given_weights(tables: nn.ModuleDict) -> dict[str, torch.Tensor] | None:
    """The tables' weights to copy into the shards, or None for a module on ``meta``
    (the seeded initialization)."""
    weights = {name: table.weight for name, table in tables.items()}
    if any(w.is_meta for w in weights.values()):
        return None
    return {name: w.detach() for name, w in weights.items()}


def _shard_sequence(module: EmbeddingCollection, options: _Options) -> ShardedEmbeddingCollection:
    if module.need_indices():
        raise ValueError("need_indices=True is not supported for an EmbeddingCollection yet")
    return options.build(
        ShardedEmbeddingCollection,
        module.embedding_configs(),
        weights=_given_weights(module.embeddings),
    )
