"""Copies on every rank, looked up in the rank's own batch: data-parallel tables, and the
hot rows of row-wise tables (``row_wise(hot_rows=...)``).

No ids or pooled rows travel for them. The copies live in one TBE of their own, so
that the same fused optimizer as the sharded tables' updates them. Each step reads
every row out of that TBE (one bag a row), looks the local batch up in those rows
and, in the backward, averages the rows' gradient over the ranks with one
all-reduce for all data-parallel tables before the TBE's fused backward applies it:
every copy takes the same update, the one the unsharded table takes from the global
batch. On one rank the copies are the tables: no collective runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)

from embshard.errors import PlanError
from embshard.runtime.batch import LocalBatch
from embshard.runtime.routes import Routes
from embshard.storage.lookup import build_tbe, check_optimizer
from embshard.storage.optimizers import FusedOptimizer

# Rows are read out of the TBE in bags of one row, ``chunk`` bags a TBE feature: a
# table of n rows takes ceil(n / chunk) features, and the padding is at most a
# quarter of all rows on average.
_CHUNKS_PER_TABLE = 4


class AverageOverRanks(torch.autograd.Function):
    """The identity forward; the backward averages the gradient over ``group``'s
    ranks in one all-reduce, as DDP averages the dense parameters' gradients."""

    @staticmethod
    def forward(ctx, rows, group):  # type: ignore[override]
        ctx.group = group
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.div_(dist.get_world_size(ctx.group)), None


@dataclass
class ReplicatedTables:
    """A rank's copies of every data-parallel table, TBE table ``i`` holding
    ``names[i]``, and the fixed index tensors of their per-step lookup."""

    tbe: SplitTableBatchedEmbeddingBagsCodegen
    names: list[str]
    rows: list[int]
    dims: list[int]
    chunk: int
    # Every row of every table, one bag each (TBE indices and offsets).
    all_rows: torch.Tensor
    all_offsets: torch.Tensor
    # Per pass, per feature: where the feature's table starts in the stacked rows, and
    # the rows copied (0 where the pass does not look the feature up): ids at or past
    # them read the zero padding row.
    table_starts: torch.Tensor
    table_rows: torch.Tensor
    # Per data-parallel embedding, in output order: (pass, feature, dim), and where its
    # table starts in the stacked rows.
    embeddings: list[tuple[int, int, int]]
    embedding_starts: list[int]
    group: dist.ProcessGroup | None

    def __call__(self, batch: LocalBatch) -> torch.Tensor:
        """The local batch's pooled rows of every copied embedding, SUM pooled, side by
        side in output order: [local batch, their dims]. A hot row-wise table's are the
        partial sums of its hot rows."""
        stacked = self._stacked_rows()
        padding = stacked.shape[0] - 1
        lengths = batch.lengths.long()
        features, samples = lengths.shape
        feature_of_id = torch.repeat_interleave(
            torch.arange(features, device=lengths.device),
            lengths.sum(1),
            output_size=batch.values.numel(),
        )
        bag_offsets = F.pad(lengths.view(-1).cumsum(0), (1, 0))
        pooled = []
        values = batch.values.long()
        for starts, rows in zip(self.table_starts, self.table_rows):
            ids = torch.where(values < rows[feature_of_id], values + starts[feature_of_id], padding)
            pooled.append(
                F.embedding_bag(
                    ids,
                    stacked,
                    bag_offsets,
                    mode="sum",
                    per_sample_weights=batch.weights,
                    include_last_offset=True,
                    padding_idx=padding,
                ).view(features, samples, stacked.shape[1])
            )
        return torch.cat([pooled[p][f, :, :dim] for p, f, dim in self.embeddings], dim=1)

    def per_id(self, batch: LocalBatch, ids_per_feature: list[int]) -> list[torch.Tensor]:
        """An EmbeddingCollection's rows: for each data-parallel embedding, in output
        order, the row of every id of its feature in the local batch."""
        stacked = self._stacked_rows()
        ids = batch.values.long().split(ids_per_feature)
        return [
            F.embedding(ids[feature] + start, stacked)[:, :dim]
            for (_, feature, dim), start in zip(self.embeddings, self.embedding_starts)
        ]

    def broadcast(self, src: int = 0) -> None:
        """Give every rank of the group the copies of its rank ``src``, in one
        broadcast: copies filled from each rank's own module only agree after it (DDP
        broadcasts its parameters alike). On one rank there is nothing to give."""
        if dist.get_world_size(self.group) == 1:
            return
        weights = self.tbe.split_embedding_weights()
        flat = torch.cat([w.reshape(-1) for w in weights])
        dist.broadcast(flat, group=self.group, group_src=src)
        with torch.no_grad():
            for weight, part in zip(weights, flat.split([w.numel() for w in weights])):
                weight.copy_(part.view_as(weight))

    def _stacked_rows(self) -> torch.Tensor:
        """Every table's rows, read through the TBE (so its fused backward updates
        them), one table after another, padded to the widest dim, and one zero row
        last for ids of other tables."""
        out = self.tbe(self.all_rows, self.all_offsets)
        if dist.get_world_size(self.group) > 1:  # on one rank the copy is the table
            out = AverageOverRanks.apply(out, self.group)
        widest, tables, column = max(self.dims), [], 0
        for rows, dim in zip(self.rows, self.dims):
            chunks = math.ceil(rows / self.chunk)
            blocks = out[:, column : column + chunks * dim].split(dim, dim=1)
            tables.append(F.pad(torch.cat(blocks)[:rows], (0, widest - dim)))
            column += chunks * dim
        tables.append(out.new_zeros(1, widest))
        return torch.cat(tables)


def build_replicated(
    routes: Routes,
    shapes: dict[str, tuple[int, int]],
    optimizer: FusedOptimizer,
    device: torch.device,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
) -> ReplicatedTables | None:
    """The copies ``shapes`` (name: rows copied, dim, in the model's order) in one TBE,
    zero-filled; None when there are none.

    The TBE is FBGEMM's training TBE in the device's own memory whatever lookup backend
    the sharded tables have: every rank reads every copied row each step, which only
    that memory serves well, and copies are small by design (TorchRec keeps its
    data-parallel tables on its dense kernel whatever the sharded tables' placement).

    Every row of the copies takes a gradient each step, so only an optimizer that
    leaves a row with a zero gradient alone (SGD, both Adagrads) can update them as the
    unsharded table is updated: others are a PlanError, on every rank."""
    if not shapes:
        return None
    names = list(shapes)
    check_optimizer(optimizer, device)  # the refusal the sharded tables get, first
    if not optimizer.ZERO_GRADIENT_KEEPS:
        raise PlanError(
            f"tables {names}: data-parallel tables and hot rows cannot use the fused "
            f"optimizer {optimizer.KIND}: their copies take a gradient in every row each "
            "step, zero in rows no rank looked up, and it would move those rows (the "
            "unsharded table keeps them); shard them table-wise, column-wise or row-wise "
            "without hot rows"
        )
    rows = [shapes[n][0] for n in names]
    dims = [shapes[n][1] for n in names]
    chunk = max(1, math.ceil(sum(rows) / (_CHUNKS_PER_TABLE * len(names))))
    feature_table_map, ids, lengths = [], [], []
    for table, count in enumerate(rows):
        for start in range(0, max(count, 1), chunk):
            feature_table_map.append(table)
            block = torch.arange(start, min(start + chunk, count))
            ids.append(block)
            lengths.append(F.pad(torch.ones_like(block), (0, chunk - len(block))))
    tbe = build_tbe(list(zip(rows, dims)), optimizer, device, feature_table_map, dtype)
    passes = _passes(routes)
    table_starts, table_rows = _table_starts(passes, len(routes.features), names, rows)
    embeddings = _embedding_passes(routes, passes)
    return ReplicatedTables(
        tbe=tbe,
        names=names,
        rows=rows,
        dims=dims,
        chunk=chunk,
        all_rows=torch.cat(ids).to(device),
        all_offsets=F.pad(torch.cat(lengths).cumsum(0), (1, 0)).to(device),
        table_starts=table_starts.to(device),
        table_rows=table_rows.to(device),
        embeddings=embeddings,
        embedding_starts=[int(table_starts[p, f]) for p, f, _ in embeddings],
        group=group,
    )


def _passes(routes: Routes) -> list[list[tuple[int, str]]]:
    """The copied (feature, table) lookups dealt into passes, each feature at most once
    a pass: a feature feeding two such tables takes two."""
    passes: list[list[tuple[int, str]]] = []
    for e in routes.local_embeddings:
        taken = next((p for p in passes if all(f != e.feature for f, _ in p)), None)
        if taken is None:
            passes.append(taken := [])
        taken.append((e.feature, e.table))
    return passes


def _table_starts(
    passes: list[list[tuple[int, str]]], features: int, names: Sequence[str], rows: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pass and feature, its table's first row among the stacked rows and its rows
    (0: not looked up in that pass)."""
    starts = dict(zip(names, [0, *torch.tensor(rows).cumsum(0).tolist()]))
    table_starts = torch.zeros((len(passes), features), dtype=torch.long)
    table_rows = torch.zeros((len(passes), features), dtype=torch.long)
    for k, lookups in enumerate(passes):
        for feature, table in lookups:
            table_starts[k, feature] = starts[table]
            table_rows[k, feature] = rows[names.index(table)]
    return table_starts, table_rows


def _embedding_passes(
    routes: Routes, passes: list[list[tuple[int, str]]]
) -> list[tuple[int, int, int]]:
    return [
        (next(k for k, p in enumerate(passes) if (e.feature, e.table) in p), e.feature, e.dim)
        for e in routes.local_embeddings
    ]
