"""A TorchRec ManagedCollisionEmbeddingBagCollection, sharded: build it with ``shard()``.

Its tables are a ShardedEmbeddingBagCollection whose managed-collision tables route
raw ids by input range to the rank that owns each range's rows, where TorchRec's own
MCH module, rebuilt for those rows, profiles and remaps them
(``storage.managed_collision``). A step keeps the collection's exchanges: one ids
all-to-all and one pooled all-to-all.
"""

from __future__ import annotations

from torch import nn
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from embshard.modules.collection import ShardedEmbeddingBagCollection


class ShardedManagedCollisionEmbeddingBagCollection(nn.Module):
    """The sharded form of a TorchRec ``ManagedCollisionEmbeddingBagCollection``: the
    same call and output, ``(KeyedTensor, None)``. Its state dict holds the tables under
    the unsharded module's keys (``_embedding_module.embedding_bags.<table>.weight``),
    not the MCH modules' state (checkpoints save those: ``checkpoint.managed_collision``)."""

    def __init__(self, collection: ShardedEmbeddingBagCollection) -> None:
        super().__init__()
        self._embedding_module = collection

    @property
    def embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        """The sharded tables (a ShardedEmbeddingBagCollection)."""
        return self._embedding_module

    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[KeyedTensor, None]:
        """This rank's local batch of raw ids, remapped and looked up (collective, as
        the sharded collection's forward). ``mutate_miss_lengths`` is TorchRec's
        argument, which its MCH modules ignore."""
        return self._embedding_module(features), None

    def managed_collision_modules(self) -> dict[str, MCHManagedCollisionModule]:
        """This rank's MCH modules, by table: TorchRec's, rebuilt for the rows it holds
        (``rebuild_with_output_id_range``); empty where it holds none."""
        return self._embedding_module.managed_collision_modules()
