"""Quantized tables in one FBGEMM inference layout, and their lookup: what the served
collections (pooled and sequence) are built on.

FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` lays the tables out (one buffer,
each table's rows packed with their scale and bias); ``QuantizedTables`` keeps that
layout's tensors as its own buffers and calls the TBE's lookup op on them, so that
``torch.export`` traces the lookup (the TBE module itself holds script objects that
export cannot trace) and every table is looked up in one kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.errors import CheckpointError, ConfigError, InputError
from embshard.runtime.keys import KEY_LIMIT
from embshard.serving.id_maps import ServedIdMap
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


@dataclass(frozen=True)
class PackedRows:
    """One table's rows as FBGEMM's inference TBE stores them: packed values (uint8)
    and, for integer precisions, each row's scale and bias (uint8 view of two fp16)."""

    name: str
    dim: int
    values: torch.Tensor
    scale_bias: torch.Tensor | None

    @classmethod
    def of(cls, name: str, weight: torch.Tensor, precision: Precision) -> PackedRows:
        """``weight`` ([rows, dim], float) quantized to ``precision``."""
        precision.check_dim(name, weight.shape[1])
        return cls(name, weight.shape[1], *precision.quantize(weight))


class QuantizedRows(nn.Module):
    """Tables of ``precision`` rows in FBGEMM's inference layout on ``device``, pooled
    by ``pooling`` (SUM, or NONE: one row per id); feature ``f`` looks up table
    ``feature_table_map[f]``. The lookup takes ids and offsets as FBGEMM's TBE does and
    checks nothing. Forward only."""

    def __init__(
        self,
        tables: Sequence[PackedRows],
        feature_table_map: Sequence[int],
        precision: Precision,
        device: torch.device,
        pooling: PoolingMode,
    ) -> None:
        super().__init__()
        precision.check_device(device)
        self.pooling = pooling
        tbe = _build_tbe(tables, feature_table_map, precision, device, pooling)
        self.register_buffer("weights", tbe.weights_host if tbe.host_size else tbe.weights_dev)
        for name in ("weights_offsets", "weights_placements", "weights_tys", "D_offsets"):
            self.register_buffer(name, getattr(tbe, name))
        self.layout = {name: int(getattr(tbe, name)) for name in _LAYOUT_INTS}
        self.requires_grad_(False)

    def table_bytes(self) -> int:
        """Bytes the quantized tables take: packed rows, scales and biases, FBGEMM's
        alignment padding."""
        return self.weights.numel() * self.weights.element_size()

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FBGEMM's inference lookup of ids known to be in range, in float32: what a
        sharded collection's lookup module does (``storage.lookup.LookupModule``)."""
        if self.weights.device.type != "cpu":  # the CUDA kernel takes int32 only
            indices, offsets = indices.int(), offsets.int()
        else:
            offsets = offsets.to(indices.dtype)
        device = self.weights.device
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=self.weights,
            uvm_weights=torch.empty(0, dtype=torch.uint8, device=device),
            weights_placements=self.weights_placements,
            weights_offsets=self.weights_offsets,
            weights_tys=self.weights_tys,
            D_offsets=self.D_offsets,
            indices=indices,
            offsets=offsets,
            pooling_mode=int(self.pooling),
            indice_weights=None if per_sample_weights is None else per_sample_weights.float(),
            output_dtype=SparseType.FP32.as_int(),
            lxu_cache_weights=torch.empty(0, 0, dtype=torch.uint8, device=device),
            lxu_cache_locations=torch.empty(0, dtype=torch.int32, device=device),
            **self.layout,
        )


class QuantizedTables(nn.Module):
    """Whole ``tables`` (TorchRec configs, ``weights`` by table name) quantized, one
    lookup per feature, in table order: the one-host collections' lookup, which takes a
    batch's lengths and checks its ids.

    A table in ``id_maps`` (by name) is dynamic: its features take raw ids, which its
    map turns into rows; an id without a row is looked up in a row of zeros after the
    table's own (so it adds nothing to its bag, and a sequence table gives it zeros), as
    a trained dynamic table in eval mode does."""

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        weights: Mapping[str, torch.Tensor],
        precision: Precision,
        device: torch.device,
        pooling: PoolingMode,
        id_maps: Mapping[str, ServedIdMap] | None = None,
    ) -> None:
        super().__init__()
        _check_tables(tables, weights)
        id_maps = dict(id_maps or {})
        _check_maps(tables, id_maps)
        self.quantized = QuantizedRows(
            [
                PackedRows.of(t.name, _with_miss_row(weights[t.name], t.name in id_maps), precision)
                for t in tables
            ],
            [i for i, t in enumerate(tables) for _ in t.feature_names],
            precision,
            device,
            pooling,
        )
        self.features = [f for t in tables for f in t.feature_names]
        self._table_of = {f: t for t in tables for f in t.feature_names}
        configs = [self._table_of[f] for f in self.features]
        rows = [t.num_embeddings + (t.name in id_maps) for t in configs]
        self.register_buffer("rows", torch.tensor(rows, device=device), persistent=False)
        # The highest id a feature takes: its table's last row, any raw id if dynamic.
        highest = [KEY_LIMIT - 1 if t.name in id_maps else t.num_embeddings - 1 for t in configs]
        self.register_buffer("highest", torch.tensor(highest, device=device), persistent=False)
        self.id_maps = nn.ModuleDict({n: m.to(device) for n, m in id_maps.items()})
        # Each dynamic table's features, a range of feature positions, and its miss row.
        starts = {}
        for at, f in enumerate(self.features):
            starts.setdefault(self._table_of[f].name, at)
        self._dynamic = [
            (t.name, starts[t.name], starts[t.name] + len(t.feature_names), t.num_embeddings)
            for t in tables
            if t.name in id_maps
        ]

    def forward(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rows of a batch laid out feature by feature (``lengths`` is ``[features *
        batch]``) in float32: pooled ``[batch, sum of dims]``, or one row per id. Ids
        are checked: a one-line error names the first bad one, and an exported program
        runs FBGEMM's own check (which names none) on the rows ids are mapped to."""
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        if not torch.compiler.is_compiling():
            self.check(ids, lengths)
        ids = self._remapped(ids, lengths)
        if torch.compiler.is_compiling():
            self._bounds_check(ids, offsets)
        return self.quantized(ids, offsets, per_sample_weights)

    def _remapped(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``ids`` with each dynamic feature's raw ids replaced by their rows (a miss:
        the table's zero row)."""
        if not self._dynamic:
            return ids
        per_feature = lengths.view(len(self.features), -1).sum(1)
        position = torch.arange(len(self.features), device=ids.device)
        feature = torch.repeat_interleave(position, per_feature, output_size=ids.numel())
        for name, first, last, miss in self._dynamic:
            mine = (feature >= first) & (feature < last)
            # The other features' ids searched as one id (-1, no key): the same path,
            # in cache, each time; a search of every id costs several times more.
            rows = self.id_maps[name](torch.where(mine, ids, -1))
            ids = torch.where(mine, torch.where(rows >= 0, rows, miss), ids)
        return ids

    def table_bytes(self) -> int:
        return self.quantized.table_bytes()

    def check(self, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """A one-line InputError naming the first id outside its table's rows, or
        lengths that do not describe ``ids`` for every feature."""
        count = len(self.features)
        total = int(lengths.sum())
        if lengths.numel() % count or total != ids.numel() or bool((lengths < 0).any()):
            raise InputError(
                f"lengths ({lengths.numel()} bags summing to {total}) do not describe "
                f"{ids.numel()} ids in {count} features of equal batch"
            )
        per_feature = lengths.view(count, -1).sum(1)
        highest = torch.repeat_interleave(self.highest, per_feature, output_size=ids.numel())
        bad = (ids < 0) | (ids > highest)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            name = self.features[int(torch.searchsorted(per_feature.cumsum(0), at, right=True))]
            table = self._table_of[name]
            where = f"feature {name!r} (table {table.name!r})"
            if table.name in self.id_maps:
                raise InputError(f"{where}: raw id {int(ids[at])} is negative")
            raise InputError(
                f"{where}: id {int(ids[at])} is out of range [0, {table.num_embeddings})"
            )

    def _bounds_check(self, ids: torch.Tensor, offsets: torch.Tensor) -> None:
        torch.ops.fbgemm.bounds_check_indices(
            self.rows,
            ids,
            offsets,
            BoundsCheckMode.FATAL.value,
            torch.zeros(1, dtype=torch.int64, device=ids.device),
        )


def in_order(features: KeyedJaggedTensor, order: list[str]) -> KeyedJaggedTensor:
    """``features`` with the features ``order`` names, in that order; a one-line error
    naming those missing."""
    keys = features.keys()
    if keys == order:
        return features
    missing = [f for f in order if f not in keys]
    if missing:
        raise InputError(f"the batch has no feature {', '.join(map(repr, missing))}")
    return features.permute([keys.index(f) for f in order])


def _check_tables(
    tables: Sequence[BaseEmbeddingConfig], weights: Mapping[str, torch.Tensor]
) -> None:
    """One-line errors for a table without weights or weights of the wrong shape."""
    for t in tables:
        if t.name not in weights:
            raise CheckpointError(f"no weights for table {t.name!r}")
        shape = tuple(weights[t.name].shape)
        if shape != (t.num_embeddings, t.embedding_dim):
            raise CheckpointError(
                f"table {t.name!r}: weights of shape {shape}, the model's table is "
                f"{(t.num_embeddings, t.embedding_dim)}"
            )


def _check_maps(tables: Sequence[BaseEmbeddingConfig], id_maps: Mapping[str, ServedIdMap]) -> None:
    """One-line errors for a map of no table, or rows outside its table."""
    by_name = {t.name: t for t in tables}
    for name, served in id_maps.items():
        if name not in by_name:
            raise ConfigError(f"an id map for {name!r}, which is no table here ({sorted(by_name)})")
        top = int(served.rows.max())
        if top >= by_name[name].num_embeddings:
            raise CheckpointError(
                f"table {name!r}: its id map gives row {top}, the table has "
                f"{by_name[name].num_embeddings}"
            )


def _with_miss_row(weight: torch.Tensor, dynamic: bool) -> torch.Tensor:
    """A dynamic table's rows and a row of zeros after them: where its misses look up."""
    if not dynamic:
        return weight
    return torch.cat([weight.detach(), weight.new_zeros(1, weight.shape[1])])


def _build_tbe(
    tables: Sequence[PackedRows],
    feature_table_map: Sequence[int],
    precision: Precision,
    device: torch.device,
    pooling: PoolingMode,
) -> IntNBitTableBatchedEmbeddingBagsCodegen:
    """FBGEMM's inference TBE holding the tables' rows."""
    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
    specs = [(t.name, t.values.shape[0], t.dim, precision.sparse_type, location) for t in tables]
    return IntNBitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=list(feature_table_map),
        pooling_mode=pooling,
        device=device,
        bounds_check_mode=BoundsCheckMode.NONE,
        output_dtype=SparseType.FP32,
        weight_lists=[
            (t.values.to(device), None if t.scale_bias is None else t.scale_bias.to(device))
            for t in tables
        ],
    )
