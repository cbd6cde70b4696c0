"""A forward-only EmbeddingBagCollection whose tables are quantized rows in FBGEMM's
inference TBE, every table local: the one-host serving case, no process group.

FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` lays the tables out (one buffer,
each table's rows packed with their scale and bias); the module keeps that layout's
tensors as its own buffers and calls the TBE's lookup op on them. So the forward is
one kernel for every table, and ``torch.export`` traces it (the TBE module itself holds
script objects that export cannot trace). Mean pooling is the SUM kernel's output times
``1 / length``, which is what FBGEMM's MEAN mode computes, so the tables need not be
split by pooling into several kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
    IntNBitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from embshard.errors import CheckpointError, InputError
from embshard.serving.precision import Precision

# The lookup op's integer arguments, as the TBE computed them for its layout.
_LAYOUT_INTS = (
    "total_D",
    "max_int2_D",
    "max_int4_D",
    "max_int8_D",
    "max_float16_D",
    "max_float32_D",
    "max_float8_D",
    "row_alignment",
    "fp8_exponent_bits",
    "fp8_exponent_bias",
)


class QuantizedEmbeddingBagCollection(nn.Module):
    """The tables of a TorchRec ``EmbeddingBagCollection``, each row quantized to
    ``precision``, pooled by FBGEMM's inference kernel. ``forward`` takes and gives what
    the float collection does (a KeyedJaggedTensor in, a KeyedTensor out, features in
    table order); ``pooled`` is the same on plain tensors. No autograd, no optimizer."""

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        weights: Mapping[str, torch.Tensor],
        precision: Precision | str,
        *,
        is_weighted: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        precision = Precision.parse(precision)
        device = torch.device(device)
        precision.check_device(device)
        _check_tables(tables, weights, precision)
        self.precision = precision
        self.tables = [t.name for t in tables]
        self.features = [f for t in tables for f in t.feature_names]
        self.dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self.is_weighted = is_weighted
        self._configs = list(tables)
        self._table_of = {f: t for t in tables for f in t.feature_names}
        tbe = _build_tbe(tables, weights, precision, device)
        self.register_buffer("weights", tbe.weights_host if tbe.host_size else tbe.weights_dev)
        for name in ("weights_offsets", "weights_placements", "weights_tys", "D_offsets"):
            self.register_buffer(name, getattr(tbe, name))
        self.layout = {name: int(getattr(tbe, name)) for name in _LAYOUT_INTS}
        rows = [self._table_of[f].num_embeddings for f in self.features]
        self.register_buffer("rows", torch.tensor(rows, device=device), persistent=False)
        means = [self._table_of[f].pooling == PoolingType.MEAN for f in self.features]
        self.has_mean = any(means)
        self.register_buffer("mean", torch.tensor(means, device=device), persistent=False)
        column = torch.repeat_interleave(torch.arange(len(self.dims)), torch.tensor(self.dims))
        self.register_buffer("column_feature", column.to(device), persistent=False)
        self.requires_grad_(False)

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
        """Bytes the quantized tables take: packed rows, scales and biases, FBGEMM's
        alignment padding."""
        return self.weights.numel() * self.weights.element_size()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of every feature, keyed and ordered as the float
        collection's. Ids are checked (a one-line error names the first bad one) except
        while ``torch.export`` traces."""
        features = self._in_order(features)
        ids, lengths = features.values(), features.lengths()
        if torch.compiler.is_compiling():  # exported: FBGEMM's check, in the program
            self.bounds_check(ids, lengths)
        else:
            self.check(ids, lengths)
        pooled = self.pooled(ids, lengths, features.weights_or_none())
        return KeyedTensor(keys=self.features, length_per_key=self.dims, values=pooled)

    def pooled(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled rows ``[batch, sum of dims]`` of a batch laid out feature by feature
        (``lengths`` is ``[features * batch]``), in float32. Ids are not checked."""
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        if self.weights.device.type != "cpu":  # the CUDA kernel takes int32 only
            ids, offsets = ids.int(), offsets.int()
        else:
            offsets = offsets.to(ids.dtype)
        pooled = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=self.weights,
            uvm_weights=torch.empty(0, dtype=torch.uint8, device=self.weights.device),
            weights_placements=self.weights_placements,
            weights_offsets=self.weights_offsets,
            weights_tys=self.weights_tys,
            D_offsets=self.D_offsets,
            indices=ids,
            offsets=offsets,
            pooling_mode=int(PoolingMode.SUM),
            indice_weights=per_sample_weights.float() if self.is_weighted else None,
            output_dtype=SparseType.FP32.as_int(),
            lxu_cache_weights=torch.empty(0, 0, dtype=torch.uint8, device=self.weights.device),
            lxu_cache_locations=torch.empty(0, dtype=torch.int32, device=self.weights.device),
            **self.layout,
        )
        if not self.has_mean:
            return pooled
        # FBGEMM's MEAN: the sum times the float reciprocal of the bag's length (0 if empty)
        bags = lengths.view(len(self.features), -1).t().clamp(min=1).float()
        scale = torch.where(self.mean, 1.0 / bags, torch.ones_like(bags))
        return pooled.mul_(scale.index_select(1, self.column_feature))

    def check(self, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """A one-line InputError naming the first id outside its table's rows, or
        lengths that do not describe ``ids`` for every feature."""
        count = len(self.features)
        if (
            lengths.numel() % count
            or int(lengths.sum()) != ids.numel()
            or bool((lengths < 0).any())
        ):
            raise InputError(
                f"lengths ({lengths.numel()} bags summing to {int(lengths.sum())}) do not "
                f"describe {ids.numel()} ids in {count} features of equal batch"
            )
        per_feature = lengths.view(count, -1).sum(1)
        limit = torch.repeat_interleave(self.rows, per_feature, output_size=ids.numel())
        bad = (ids < 0) | (ids >= limit)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            feature = int(torch.searchsorted(per_feature.cumsum(0), at, right=True))
            name = self.features[feature]
            rows = self._table_of[name].num_embeddings
            raise InputError(
                f"feature {name!r} (table {self._table_of[name].name!r}): id "
                f"{int(ids[at])} is out of range [0, {rows})"
            )

    def bounds_check(self, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """FBGEMM's id check, which raises on an id outside its table's rows (without
        naming it): what the exported program runs in place of ``check``."""
        torch.ops.fbgemm.bounds_check_indices(
            self.rows,
            ids,
            torch.ops.fbgemm.asynchronous_complete_cumsum(lengths),
            BoundsCheckMode.FATAL.value,
            torch.zeros(1, dtype=torch.int64, device=ids.device),
        )

    def _in_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with the collection's features in its order; a one-line error
        naming those missing."""
        keys = features.keys()
        if keys == self.features:
            return features
        missing = [f for f in self.features if f not in keys]
        if missing:
            raise InputError(f"the batch has no feature {', '.join(map(repr, missing))}")
        return features.permute([keys.index(f) for f in self.features])


def _check_tables(
    tables: Sequence[EmbeddingBagConfig], weights: Mapping[str, torch.Tensor], precision: Precision
) -> None:
    """One-line errors for a table without weights, weights of the wrong shape, or a dim
    the precision cannot pack."""
    for t in tables:
        if t.name not in weights:
            raise CheckpointError(f"no weights for table {t.name!r}")
        shape = tuple(weights[t.name].shape)
        if shape != (t.num_embeddings, t.embedding_dim):
            raise CheckpointError(
                f"table {t.name!r}: weights of shape {shape}, the model's table is "
                f"{(t.num_embeddings, t.embedding_dim)}"
            )
        precision.check_dim(t.name, t.embedding_dim)


def _build_tbe(
    tables: Sequence[EmbeddingBagConfig],
    weights: Mapping[str, torch.Tensor],
    precision: Precision,
    device: torch.device,
) -> IntNBitTableBatchedEmbeddingBagsCodegen:
    """FBGEMM's inference TBE holding every table quantized, one feature per lookup."""
    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
    specs = [
        (t.name, t.num_embeddings, t.embedding_dim, precision.sparse_type, location) for t in tables
    ]
    return IntNBitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
        pooling_mode=PoolingMode.SUM,
        device=device,
        bounds_check_mode=BoundsCheckMode.NONE,
        output_dtype=SparseType.FP32,
        weight_lists=[precision.quantize(weights[t.name].to(device)) for t in tables],
    )
