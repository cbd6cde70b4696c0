"""Serving sharded over ranks, for tables larger than one host: the training sharding
(plan, input all-to-all, column placement, output all-to-all), forward only, each
rank's shards quantized into FBGEMM's inference TBE where the training TBE was.

A column block is quantized on its own (its own row scales and biases), as TorchRec's
sharded quantized column-wise tables are; a row block's rows quantize as the whole
table's do. Ids are checked on the rank that sends them and a bad one is named on every
rank, as in training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from embshard import checkpoint
from embshard.errors import ConfigError
from embshard.modules.collection import ShardedCollection
from embshard.modules.shard import shard
from embshard.modules.shard_model import shard_model
from embshard.plan.specs import ShardedTable, ShardingPlan
from embshard.serving.precision import Precision
from embshard.serving.tables import PackedRows, QuantizedRows
from embshard.storage.optimizers import SGD

# Sharding for serving builds each rank's float shards first (then quantized): SGD keeps
# no optimizer state, and a learning rate of 0 could change nothing if it ran.
_NO_OPTIMIZER = SGD(lr=0.0)


class ServedShards(nn.Module):
    """A sharded collection whose rows are quantized: its forward, without autograd
    (so the output all-to-all runs forward alone and nothing is kept for a backward).
    Collective, as the sharded collection's: every rank calls it with its own batch.
    ``shards`` is this rank's quantized lookup (None where the rank holds no shard).

    The rows are the collection's own float shards quantized to ``precision``, or
    ``packed``: this rank's shards quantized before (a sharded artifact's), in the
    collection's lookup order."""

    def __init__(
        self,
        sharded: ShardedCollection,
        precision: Precision,
        packed: Sequence[PackedRows] | None = None,
    ) -> None:
        super().__init__()
        self.sharded, self.precision = sharded, precision
        self.shards: QuantizedRows | None = None
        device = sharded.sharding_mesh.device

        def build(tables: list[tuple[str, torch.Tensor]], feature_table_map: list[int]):
            rows = packed
            if rows is None:
                rows = [PackedRows.of(name, weight, precision) for name, weight in tables]
            shapes = [(t.name, t.values.shape[0], t.dim) for t in rows]
            if shapes != [(name, *weight.shape) for name, weight in tables]:
                raise ConfigError(
                    f"rank {sharded.rank}: the quantized shards {shapes} are not those the "
                    "plan puts on this rank"
                )
            self.shards = QuantizedRows(rows, feature_table_map, precision, device, PoolingMode.SUM)
            return self.shards

        sharded.replace_lookup(build)
        self.requires_grad_(False)

    def table_bytes(self) -> int:
        """Bytes this rank's quantized shards take (scale, bias, alignment included)."""
        return 0 if self.shards is None else self.shards.table_bytes()

    @torch.no_grad()
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor | dict[str, JaggedTensor]:
        """The sharded collection's output for this rank's batch."""
        return self.sharded(features)


def check_servable(
    tables: Mapping[str, ShardedTable], precision: Precision, device: torch.device
) -> None:
    """One-line errors, the same on every rank (they read the plan only), for what
    cannot be served sharded: copies of rows on every rank (data-parallel tables, hot
    rows), a shard width ``precision`` cannot pack, a device FBGEMM cannot serve on."""
    precision.check_device(device)
    for name, table in tables.items():
        if table.replicated_rows:
            raise ConfigError(
                f"table {name!r}: data-parallel tables and hot rows are not served "
                "sharded; plan it table-, row- or column-wise"
            )
        for s in table.shards:
            precision.check_dim(f"{name} (columns {s.col_offset}+)", s.cols)


def quantize_sharded(
    model: nn.Module,
    precision: Precision | str,
    packed: Mapping[str, Sequence[PackedRows]] | None = None,
) -> nn.Module:
    """``model`` (a sharded collection, or a model holding them) with every sharded
    collection's lookup quantized to ``precision``, in place, in eval mode without
    gradients: from its own float shards, or from ``packed``, this rank's shards
    quantized before, by the collection's path in the model."""
    precision = Precision.parse(precision)
    found = {p: m for p, m in model.named_modules() if isinstance(m, ShardedCollection)}
    if not found:
        raise ValueError("the model has no sharded collection to quantize (shard it first)")
    for sharded in found.values():
        check_servable(sharded.tables, precision, sharded.sharding_mesh.device)
    for path, sharded in found.items():
        served = ServedShards(sharded, precision, None if packed is None else packed[path])
        if not path:
            return served.eval()
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, served)
    return model.eval().requires_grad_(False)


def shard_quantized(
    model: nn.Module,
    plan: ShardingPlan,
    precision: Precision | str,
    *,
    mesh: DeviceMesh | None = None,
    checkpoint_path: str | Path | None = None,
) -> nn.Module:
    """``model`` (a TorchRec EmbeddingBagCollection or EmbeddingCollection, or a model
    holding them) sharded by ``plan`` for serving, its tables quantized to
    ``precision`` on each rank. Weights come from ``model`` itself, or, where given,
    from the embshard checkpoint ``checkpoint_path`` (a model's: any world size and
    plan, resharded as it loads; then ``model``'s tables may be on ``meta``).
    Collective; ``torch.distributed`` must be initialized."""
    precision = Precision.parse(precision)
    if isinstance(model, EmbeddingBagCollection | EmbeddingCollection):
        sharded: nn.Module = shard(model, plan, mesh=mesh, optimizer=_NO_OPTIMIZER)
    else:
        sharded = shard_model(
            model, plan, mesh=mesh, optimizer=_NO_OPTIMIZER, data_parallel_wrapper=lambda m: m
        )
    if checkpoint_path is not None:
        checkpoint.load(checkpoint_path, sharded)
    return quantize_sharded(sharded, precision)
