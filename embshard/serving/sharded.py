"""Serving sharded over ranks, for tables larger than one host: the training sharding
(plan, input all-to-all, column placement, output all-to-all), forward only, each
rank's shards quantized into FBGEMM's inference TBE where the training TBE was.

A column block is quantized on its own (its own row scales and biases), as TorchRec's
sharded quantized column-wise tables are; a row block's rows quantize as the whole
table's do. Ids are checked on the rank that sends them and a bad one is named on every
rank, as in training. Dynamic and managed-collision tables keep their maps (id maps,
MCH modules), split by bucket range or row block as in training, and look ids up as a
trained module in eval mode does.
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
from embshard.plan.specs import ShardedTable, ShardingPlan, TableShard, local_shards
from embshard.serving.precision import Precision
from embshard.serving.tables import PackedRows, QuantizedRows
from embshard.storage.id_map import IdMapSpec
from embshard.storage.optimizers import SGD

# Sharding for serving builds each rank's float shards first (then quantized): SGD keeps
# no optimizer state, and a learning rate of 0 could change nothing if it ran.
NO_OPTIMIZER = SGD(lr=0.0)


class ServedShards(nn.Module):
    """A sharded collection whose rows are quantized: its forward, without autograd
    (so the output all-to-all runs forward alone and nothing is kept for a backward).
    Collective, as the sharded collection's: every rank calls it with its own batch.
    ``lookups`` are this rank's quantized lookups: of its shards, then of its copies of
    data-parallel tables and hot rows (each present where the rank holds any).

    The rows are the collection's own float shards quantized to ``precision``, or
    ``packed``: this rank's shards quantized before (a sharded artifact's), in the
    order of ``served_shards``."""

    def __init__(
        self,
        sharded: ShardedCollection,
        precision: Precision,
        packed: Sequence[PackedRows] | None = None,
    ) -> None:
        super().__init__()
        self.sharded, self.precision = sharded, precision
        self.lookups = nn.ModuleList()
        device = sharded.sharding_mesh.device
        given = None if packed is None else iter(packed)

        def build(tables: list[tuple[str, torch.Tensor]], feature_table_map: list[int]):
            if given is None:
                rows = [PackedRows.of(name, weight, precision) for name, weight in tables]
            else:
                rows = [next(given, None) for _ in tables]
            shapes = [None if t is None else (t.name, t.values.shape[0], t.dim) for t in rows]
            if shapes != [(name, *weight.shape) for name, weight in tables]:
                raise ConfigError(
                    f"rank {sharded.rank}: the quantized shards {shapes} are not those the "
                    "plan puts on this rank"
                )
            lookup = QuantizedRows(rows, feature_table_map, precision, device, PoolingMode.SUM)
            self.lookups.append(lookup)
            return lookup

        sharded.replace_lookup(build)
        if given is not None and next(given, None) is not None:
            raise ConfigError(f"rank {sharded.rank}: more quantized shards than the plan puts here")
        self.requires_grad_(False).eval()

    def train(self, mode: bool = True) -> ServedShards:
        """Serving never learns: the sharded collection stays in eval mode whatever
        ``mode``, so a dynamic or managed-collision table's ids are only looked up
        (no admission, eviction or profiling)."""
        super().train(mode)
        self.sharded.eval()
        return self

    def table_bytes(self) -> int:
        """Bytes this rank's quantized rows take (scale, bias, alignment included)."""
        return sum(lookup.table_bytes() for lookup in self.lookups)

    @torch.no_grad()
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor | dict[str, JaggedTensor]:
        """The sharded collection's output for this rank's batch."""
        return self.sharded(features)


def served_shards(tables: Mapping[str, ShardedTable], rank: int) -> list[tuple[str, TableShard]]:
    """The shards ``rank`` looks up, in the order ``ServedShards`` quantizes them: those
    the all-to-alls serve (``local_shards``), then the rank's copies of data-parallel
    tables and hot rows, in table order."""
    copies = [
        (name, next(s for s in table.shards_on(rank) if s.replica))
        for name, table in tables.items()
        if table.replicated_rows
    ]
    return local_shards(tables, rank) + copies


def check_servable(
    tables: Mapping[str, ShardedTable], precision: Precision, device: torch.device
) -> None:
    """One-line errors, the same on every rank (they read the plan only), for a shard
    width ``precision`` cannot pack or a device FBGEMM cannot serve on."""
    precision.check_device(device)
    for name, table in tables.items():
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
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> nn.Module:
    """``model`` (a TorchRec EmbeddingBagCollection or EmbeddingCollection, or a model
    holding them) sharded by ``plan`` for serving, its tables quantized to
    ``precision`` on each rank. Weights come from ``model`` itself, or, where given,
    from the embshard checkpoint ``checkpoint_path`` (a model's: any world size and
    plan, resharded as it loads; then ``model``'s tables may be on ``meta``).
    ``dynamic`` names the dynamic tables with their specs, as ``shard``'s: their id
    maps come from the checkpoint (without one they hold no id: every id misses).
    Collective; ``torch.distributed`` must be initialized."""
    precision = Precision.parse(precision)
    if isinstance(model, EmbeddingBagCollection | EmbeddingCollection):
        sharded: nn.Module = shard(model, plan, mesh=mesh, optimizer=NO_OPTIMIZER, dynamic=dynamic)
    else:
        sharded = shard_model(
            model,
            plan,
            mesh=mesh,
            optimizer=NO_OPTIMIZER,
            data_parallel_wrapper=lambda m: m,
            dynamic=dynamic,
        )
    if checkpoint_path is not None:
        checkpoint.load(checkpoint_path, sharded)
    return quantize_sharded(sharded, precision)
