"""ShardedEmbeddingCollection: a TorchRec EmbeddingCollection sharded over a mesh.

An EmbeddingCollection returns one row per id (``Dict[str, JaggedTensor]``), not a
pooled row per bag. The data path is the EmbeddingBagCollection's (module.py): the
same checked batch and routing, each rank sending an owner its distinct ids only;
then one call of the rank's pooled TBE with one id a bag (FBGEMM's pooled CPU
kernels update rows several times faster than its unpooled ones), and one
all-to-all of the rows back to their requesters, each copied to the places of the
ids it stands for, at its shard's columns. Every shard on a rank has the same
number of columns: the rows travel as one [ids, width] block a rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor

from embshard.dist import Counts, Scratch
from embshard.lookup import FusedOptimizer
from embshard.module import InputInFlight, ShardedCollection
from embshard.plan import DataParallel, PlanError, ShardingPlan


@dataclass(frozen=True)
class SequenceLayout:
    """What the rows' all-to-all needs besides the batch, fixed at sharding: every
    rank's shard width, the embeddings' dim and features, and per row of
    ``Routes.send_rows()`` (destination, slot) its embedding, feature and first
    output column. ``block`` divides the dim and every shard's width and first column,
    so each shard's part of an output row is whole rows of the output viewed as
    [ids x dim / block, block]: rows are placed a block at a time, not element by
    element."""

    widths: list[int]
    dim: int
    block: int
    embedding_feature: list[int]
    send_row_embedding: list[int]
    send_row_feature: list[int]
    send_row_column: torch.Tensor
    rank: int
    slots: int  # this rank's
    group: dist.ProcessGroup | None


class Rows(NamedTuple):
    """The lookup's result: a row per id received, in TBE order, and for each the
    index it arrived at (ids of all sources in rank order)."""

    rows: torch.Tensor
    arrived: torch.Tensor


class RowsAllToAll(torch.autograd.Function):
    """Each distinct id's row goes back once to the rank that sent the id, and from there
    into the place of every id it stands for in that rank's output [ids of every
    embedding, dim], at its shard's columns.

    Backward: each requester sums the gradients of the ids a distinct id stands for and
    sends them back to its owner, which puts them in TBE order for the fused backward,
    divided by the world size (the loss is averaged over ranks, as for the pooled
    all-to-all).
    """

    @staticmethod
    def forward(ctx, anchor, rows, arrived, targets, columns, distinct, out_rows, counts, layout):  # type: ignore[override]
        width = layout.widths[layout.rank]
        came = [ids * width for ids in _ids_from(counts, layout.slots)]
        sent = [ids * w for ids, w in zip(counts.sent_ids, layout.widths)]
        send = rows.new_empty(rows.shape).index_copy_(0, arrived, rows)
        received = rows.new_empty(sum(sent))
        dist.all_to_all_single(received, send.view(-1), sent, came, group=layout.group)
        out = rows.new_zeros(out_rows, layout.dim)
        blocks = out.view(-1, layout.block)
        places = _places(targets, columns, distinct, counts.rows_per_rank, layout)
        for chunk, ids, (index, which), w in zip(
            received.split(sent), counts.sent_ids, places, layout.widths
        ):
            placed = chunk.view(ids, w).index_select(0, which)
            blocks.index_copy_(0, index, placed.view(len(index), layout.block))
        ctx.save_for_backward(anchor, arrived)
        ctx.places, ctx.splits, ctx.shape = places, (sent, came), rows.shape
        ctx.distinct, ctx.layout = counts.sent_ids, layout
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _, arrived = ctx.saved_tensors
        sent, came = ctx.splits
        blocks = grad.contiguous().view(-1, ctx.layout.block)
        summed = [
            grad.new_zeros(ids, w).index_add_(0, which, blocks[index].view(len(which), w))
            for ids, w, (index, which) in zip(ctx.distinct, ctx.layout.widths, ctx.places)
        ]
        send = torch.cat([g.view(-1) for g in summed])
        received = grad.new_empty(sum(came))
        dist.all_to_all_single(received, send, came, sent, group=ctx.layout.group)
        grad_rows = received.view(ctx.shape).index_select(0, arrived)
        grad_rows.div_(dist.get_world_size(ctx.layout.group))
        return None, grad_rows, None, None, None, None, None, None, None


def _ids_from(counts: Counts, slots: int) -> list[int]:
    """Ids received from each rank: its payload less the lengths of this rank's
    ``slots`` (an EmbeddingCollection has no weights)."""
    return [size - slots * b for size, b in zip(counts.recv_sizes, counts.batch_sizes)]


def _places(
    targets: torch.Tensor,
    columns: torch.Tensor,
    distinct: torch.Tensor,
    rows_per_rank: list[int],
    layout: SequenceLayout,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per destination rank, for the ids sent to it: the rows of the output viewed as
    [ids x dim / block, block] their shards fill (``width / block`` a shard, in
    order), and their distinct ids' rows among those it returns."""
    places = []
    for ids, cols, which, width in zip(
        targets.split(rows_per_rank),
        columns.split(rows_per_rank),
        distinct.split(rows_per_rank),
        layout.widths,
    ):
        first = (ids * layout.dim + cols) // layout.block
        span = torch.arange(width // layout.block, device=ids.device)
        places.append(((first[:, None] + span).view(-1), which))
    return places


class ShardedEmbeddingCollection(ShardedCollection):
    """The sharded form of a TorchRec ``EmbeddingCollection``; build it with ``shard()``.

    Table-wise, row-wise, column-wise and grid plans of FP32 tables; every shard on a rank
    must have the same number of columns (FBGEMM's unpooled TBE takes one dim). ``state_dict()``
    has the unsharded module's keys (``embeddings.<table>.weight``).
    """

    _PREFIX = "embeddings"
    _SEQUENCE = True

    def __init__(
        self,
        configs: Sequence[EmbeddingConfig],
        plan: ShardingPlan,
        mesh: DeviceMesh,
        optimizer: FusedOptimizer,
        seed: int = 0,
        weights: Mapping[str, torch.Tensor] | None = None,
        comm_precision: str | None = None,
    ) -> None:
        super().__init__(configs, plan, mesh, optimizer, seed, weights, False, comm_precision)

    def _output_stage(self, scratch: Scratch, comm_precision: str | None) -> SequenceLayout:
        """Check what an unpooled TBE cannot hold, and fix the rows' routes."""
        if comm_precision not in (None, "fp32"):
            raise ValueError(
                f"comm_precision {comm_precision!r} is not supported for an EmbeddingCollection "
                "yet: its rows travel in fp32"
            )
        fp16 = [c.name for c in self._configs if c.data_type != DataType.FP32]
        if fp16:
            raise ValueError(
                f"tables {fp16}: only FP32 tables are supported for an EmbeddingCollection yet"
            )
        replicated = [n for n, t in self._tables.items() if isinstance(t.spec, DataParallel)]
        if replicated:
            raise PlanError(
                f"tables {replicated}: data_parallel is not supported for an "
                "EmbeddingCollection yet"
            )
        routes, widths = self._routes, []
        for rank, slots in enumerate(routes.slots):
            cols = sorted({s.shard.cols for s in slots})
            if len(cols) > 1:
                held = sorted({(s.shard.cols, routes.embeddings[s.embedding].table) for s in slots})
                raise PlanError(
                    f"rank {rank} holds shards of different widths {held}: FBGEMM's unpooled "
                    "TBE takes one dim, so every shard of an EmbeddingCollection on a rank "
                    "must have the same number of columns"
                )
            widths.append(cols[0] if cols else 0)
        send = [(rank, s) for rank, slots in enumerate(routes.slots) for s in slots]
        dim = self._configs[0].embedding_dim if self._configs else 0
        return SequenceLayout(
            widths=widths,
            dim=dim,
            block=math.gcd(dim, *widths, *(s.shard.col_offset for _, s in send)) or 1,
            embedding_feature=[e.feature for e in routes.embeddings],
            send_row_embedding=[s.embedding for _, s in send],
            send_row_feature=[routes.embeddings[s.embedding].feature for _, s in send],
            send_row_column=torch.tensor(
                [s.shard.col_offset for _, s in send], dtype=torch.long, device=self._device
            ),
            rank=self._rank,
            slots=len(routes.slots[self._rank]),
            group=self._group,
        )

    def lookup(self, in_flight: InputInFlight) -> Rows:  # type: ignore[override]
        """Stage 2: wait for the ids, and look up a row for each in one TBE call."""
        if in_flight.error is not None:
            raise in_flight.error
        unpack = functools.partial(
            self._input_dist.unpack_sequence, slot_ids=in_flight.counts.slot_ids
        )
        ids, offsets, arrived, per_slot = self._arrived(in_flight, unpack)
        if self._storage.tbe is None:
            return Rows(torch.zeros(0, 0, device=self._device), arrived)
        pooled = self._storage.tbe(ids, offsets)  # [fullest slot's ids, slots x width]
        width, slots = self._output_layout.widths[self._rank], len(per_slot)
        # Bag b of slot s is row b x slots + s of the bags viewed one a row.
        counts = torch.tensor(per_slot, dtype=torch.long, device=self._device)
        slot = torch.repeat_interleave(
            torch.arange(slots, device=self._device), counts, output_size=len(ids)
        )
        bag = torch.arange(len(ids), device=self._device) - (torch.cumsum(counts, 0) - counts)[slot]
        return Rows(pooled.view(-1, width).index_select(0, bag * slots + slot), arrived)

    def output_dist(  # type: ignore[override]
        self, looked_up: Rows, in_flight: InputInFlight
    ) -> dict[str, JaggedTensor]:
        """Stage 3 (collective): the rows home, each in its id's place."""
        layout, counts, batch = self._output_layout, in_flight.counts, in_flight.batch
        sent = in_flight.sent
        positions, send_row = sent.positions, sent.send_row
        per_feature = counts.ids_per_feature
        per_embedding = [per_feature[f] for f in layout.embedding_feature]
        feature_start = [sum(per_feature[:f]) for f in range(len(per_feature))]
        embedding_start = [sum(per_embedding[:e]) for e in range(len(per_embedding))]
        shift = torch.tensor(
            [
                embedding_start[e] - feature_start[f]
                for e, f in zip(layout.send_row_embedding, layout.send_row_feature)
            ],
            dtype=torch.long,
            device=self._device,
        )
        out = RowsAllToAll.apply(
            self._anchor,
            looked_up.rows,
            looked_up.arrived,
            positions + shift[send_row],
            layout.send_row_column[send_row],
            sent.distinct,
            sum(per_embedding),
            counts,
            layout,
        )
        lengths = batch.lengths.long()
        return {
            e.name: JaggedTensor(values=values, lengths=lengths[e.feature])
            for e, values in zip(self._routes.embeddings, out.split(per_embedding))
        }

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)
