"""Forward-only collections whose tables are quantized rows looked up in FBGEMM's
inference TBE, every table local: the one-host serving case, no process group.

``QuantizedEmbeddingBagCollection`` pools every table in one SUM kernel; a mean-pooled
feature's bags are then multiplied by ``1 / length``, which is what FBGEMM's MEAN mode
computes, so tables need not be split by pooling into several kernels.
``QuantizedEmbeddingCollection`` (sequence tables, one row per id) takes FBGEMM's
unpooled kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from embshard.serving.id_maps import ServedIdMap
from embshard.serving.precision import Precision
from embshard.serving.tables import QuantizedTables, in_order


class QuantizedEmbeddingBagCollection(nn.Module):
    """The tables of a TorchRec ``EmbeddingBagCollection``, each row quantized to
    ``precision``, pooled by FBGEMM's inference kernel; the tables in ``id_maps`` (by
    name) are dynamic: their features take raw ids (``QuantizedTables``). ``forward``
    takes and gives what the float collection does (a KeyedJaggedTensor in, a
    KeyedTensor out, features in table order); ``pooled`` is the same on plain tensors.
    No autograd, no optimizer."""

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        weights: Mapping[str, torch.Tensor],
        precision: Precision | str,
        *,
        is_weighted: bool = False,
        device: torch.device | str = "cpu",
        id_maps: Mapping[str, ServedIdMap] | None = None,
    ) -> None:
        super().__init__()
        self.precision = Precision.parse(precision)
        device = torch.device(device)
        self.lookup = QuantizedTables(
            tables, weights, self.precision, device, PoolingMode.SUM, id_maps
        )
        self.features = self.lookup.features
        self.dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self.is_weighted = is_weighted
        self._configs = list(tables)
        means = [t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names]
        self.has_mean = any(means)
        self.register_buffer("mean", torch.tensor(means, device=device), persistent=False)
        column = torch.repeat_interleave(torch.arange(len(self.dims)), torch.tensor(self.dims))
        self.register_buffer("column_feature", column.to(device), persistent=False)

    @classmethod
    def from_float(
        cls, ebc: EmbeddingBagCollection, precision: Precision | str
    ) -> QuantizedEmbeddingBagCollection:
        """``ebc``'s tables quantized, on its device."""
        weights = {name: bag.weight for name, bag in ebc.embedding_bags.items()}
        device = next(iter(weights.values())).device
        return cls(
            ebc.embedding_bag_configs(),
            weights,
            precision,
            is_weighted=ebc.is_weighted(),
            device=device,
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def table_bytes(self) -> int:
        return self.lookup.table_bytes()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of every feature, keyed and ordered as the float
        collection's."""
        features = in_order(features, self.features)
        pooled = self.pooled(features.values(), features.lengths(), features.weights_or_none())
        return KeyedTensor(keys=self.features, length_per_key=self.dims, values=pooled)

    def pooled(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled rows ``[batch, sum of dims]`` of a batch laid out feature by feature
        (``lengths`` is ``[features * batch]``), in float32."""
        pooled = self.lookup(ids, lengths, per_sample_weights if self.is_weighted else None)
        if not self.has_mean:
            return pooled
        # FBGEMM's MEAN: the sum times the float reciprocal of the bag's length (0 if empty)
        bags = lengths.view(len(self.features), -1).t().clamp(min=1).float()
        scale = torch.where(self.mean, 1.0 / bags, torch.ones_like(bags))
        return pooled.mul_(scale.index_select(1, self.column_feature))


class QuantizedEmbeddingCollection(nn.Module):
    """The tables of a TorchRec ``EmbeddingCollection`` (sequence features: one row per
    id, every table of one dim, as TorchRec requires), each row quantized to
    ``precision`` (those in ``id_maps`` dynamic, as the bag collection's). ``forward``
    takes a KeyedJaggedTensor and gives, as the float collection does, each feature's
    rows as a JaggedTensor."""

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        weights: Mapping[str, torch.Tensor],
        precision: Precision | str,
        *,
        device: torch.device | str = "cpu",
        id_maps: Mapping[str, ServedIdMap] | None = None,
    ) -> None:
        super().__init__()
        self.precision = Precision.parse(precision)
        device = torch.device(device)
        self.lookup = QuantizedTables(
            tables, weights, self.precision, device, PoolingMode.NONE, id_maps
        )
        self.features = self.lookup.features
        self._configs = list(tables)

    @classmethod
    def from_float(
        cls, ec: EmbeddingCollection, precision: Precision | str
    ) -> QuantizedEmbeddingCollection:
        """``ec``'s tables quantized, on its device."""
        weights = {name: e.weight for name, e in ec.embeddings.items()}
        device = next(iter(weights.values())).device
        return cls(ec.embedding_configs(), weights, precision, device=device)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def table_bytes(self) -> int:
        return self.lookup.table_bytes()

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Each feature's rows, one per id, with the batch's lengths."""
        features = in_order(features, self.features)
        rows = self.lookup(features.values(), features.lengths())
        lengths = features.lengths().split(features.stride())
        return {
            name: JaggedTensor(values=values, lengths=bags)
            for name, values, bags in zip(
                self.features, rows.split(features.length_per_key()), lengths, strict=True
            )
        }
