"""TorchRec's managed-collision collections, sharded: build them with ``shard()``.

A ManagedCollisionEmbeddingBagCollection's tables are a ShardedEmbeddingBagCollection,
a ManagedCollisionEmbeddingCollection's a ShardedEmbeddingCollection, whose
managed-collision tables route raw ids by input range to the rank that owns each
range's rows, where TorchRec's own MCH module, rebuilt for those rows, profiles and
remaps them (``storage.managed_collision``). A step keeps the collection's exchanges.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from torch import nn
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from embshard.modules.collection import ShardedCollection, ShardedEmbeddingBagCollection
from embshard.modules.sequence import ShardedEmbeddingCollection

CollectionT = TypeVar("CollectionT", bound=ShardedCollection)
OutputT = TypeVar("OutputT")


class _ShardedManagedCollision(nn.Module, Generic[CollectionT, OutputT]):
    """What both sharded managed-collision collections share: the call and output of
    TorchRec's, ``(embeddings, None)``. Its state dict holds the tables under the
    unsharded module's keys (``_embedding_module.<tables' prefix>.<table>.weight``),
    not the MCH modules' state (checkpoints save those: ``checkpoint.managed_collision``)."""

    def __init__(self, collection: CollectionT) -> None:
        super().__init__()
        self._embedding_module = collection

    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[OutputT, None]:
        """This rank's local batch of raw ids, remapped and looked up (collective, as
        the sharded collection's forward). ``mutate_miss_lengths`` is TorchRec's
        argument, which its MCH modules ignore."""
        return self._embedding_module(features), None

    def managed_collision_modules(self) -> dict[str, MCHManagedCollisionModule]:
        """This rank's MCH modules, by table: TorchRec's, rebuilt for the rows it holds
        (``rebuild_with_output_id_range``); empty where it holds none."""
        return self._embedding_module.managed_collision_modules()


class ShardedManagedCollisionEmbeddingBagCollection(
    _ShardedManagedCollision[ShardedEmbeddingBagCollection, KeyedTensor]
):
    """The sharded form of a TorchRec ``ManagedCollisionEmbeddingBagCollection``: the
    same call and output, ``(KeyedTensor, None)``."""

    @property
    def embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        """The sharded tables (a ShardedEmbeddingBagCollection)."""
        return self._embedding_module


class ShardedManagedCollisionEmbeddingCollection(
    _ShardedManagedCollision[ShardedEmbeddingCollection, dict[str, JaggedTensor]]
):
    """The sharded form of a TorchRec ``ManagedCollisionEmbeddingCollection``: the same
    call and output, ``(dict of JaggedTensor, None)``: a row per id, a miss its block's
    last row."""

    @property
    def embedding_collection(self) -> ShardedEmbeddingCollection:
        """The sharded tables (a ShardedEmbeddingCollection)."""
        return self._embedding_module
