"""ShardedEmbeddingCollection: a TorchRec EmbeddingCollection sharded over a mesh.

An EmbeddingCollection returns one row per id (``Dict[str, JaggedTensor]``), not a
pooled row per bag. The data path is the EmbeddingBagCollection's (collection.py): the
same checked batch and routing, each rank sending an owner its distinct ids only;
then one call of the rank's pooled TBE with one id a bag (FBGEMM's pooled CPU
kernels update rows several times faster than its unpooled ones, and take shards of
any widths), and one all-to-all of the rows back to their requesters, each copied to
the places of the ids it stands for, at its shard's columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor

from embshard.modules.collection import ShardedCollection
from embshard.runtime.input_dist import InputInFlight
from embshard.runtime.scratch import Scratch
from embshard.runtime.sequence_dist import (
    SequenceInFlight,
    SequenceInputDistribution,
)


@dataclass(frozen=True)
class SequenceLayout:
    """What the rows' all-to-all needs besides the batch, fixed at sharding: the
    sharded embeddings' dim and features, each rank's slots' widths, and per row of
    ``Routes.send_rows()`` (destination, slot) its embedding (among the sharded ones),
    feature and first output column. Rows travel and land in ``block`` columns at a
    time (``block`` divides the dim and every shard's width and first column), so one
    gather of blocks on each side places every id's row, whatever the widths of the
    shards."""

    dim: int
    block: int
    one_block: bool  # every shard one block wide: an id's row is one block
    slot_cols: list[list[int]]
    embedding_feature: list[int]
    send_row_embedding: list[int]
    send_row_feature: list[int]
    send_row_column: torch.Tensor
    send_row_blocks: torch.Tensor
    rank: int
    # This rank's slots: each one's width and first column in a row of the TBE's
    # output, in blocks.
    slot_blocks: torch.Tensor
    slot_first_block: torch.Tensor
    group: dist.ProcessGroup | None
    scratch: Scratch

    def sizes(self, slot_ids: list[list[int]], ranks: list[int]) -> list[int]:
        """Values of the rows of ``slot_ids`` (for each of ``ranks``, the ids of each of
        its slots)."""
        return [
            sum(n * cols for n, cols in zip(ids, self.slot_cols[r]))
            for ids, r in zip(slot_ids, ranks)
        ]


class Rows(NamedTuple):
    """The lookup's result: the pooled TBE's output as [blocks, block], the blocks to
    send back, in order (the rows of the ids of all sources in rank order, as they
    arrived, each id's row whole), and the data-parallel embeddings' rows of the local
    batch."""

    blocks: torch.Tensor
    sent: torch.Tensor
    local: list[torch.Tensor]


class RowsAllToAll(torch.autograd.Function):
    """Each distinct id's row goes back once to the rank that sent the id, and from there
    into the place of every id it stands for in that rank's output [ids of every
    embedding, dim], at its shard's columns: output block j is block ``source[j]`` of
    what came back (every output block has exactly one source, so one gather fills the
    output).

    Backward: each requester sums the gradients of the ids a distinct id stands for and
    sends them back to its owner, which puts them in TBE order for the fused backward,
    divided by the world size (the loss is averaged over ranks, as for the pooled
    all-to-all).
    """

    @staticmethod
    def forward(ctx, anchor, blocks, to_send, source, layout, counts):  # type: ignore[override]
        world = len(counts.slot_ids)
        came = layout.sizes(counts.slot_ids, [layout.rank] * world)
        sent = layout.sizes(counts.sent_slot_ids, list(range(world)))
        send = blocks.index_select(0, to_send)
        received = send.view(-1)
        if world > 1:  # on one rank nothing travels
            received = blocks.new_empty(sum(sent))
            dist.all_to_all_single(received, send.view(-1), sent, came, group=layout.group)
        out = layout.scratch.take("sequence_out", (len(source), layout.block), blocks)
        torch.index_select(received.view(-1, layout.block), 0, source, out=out)
        ctx.save_for_backward(anchor, to_send, source)
        ctx.splits, ctx.shape, ctx.layout = (sent, came), blocks.shape, layout
        return out.view(-1, layout.dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _, to_send, source = ctx.saved_tensors
        sent, came = ctx.splits
        layout, block = ctx.layout, ctx.layout.block
        # Scatters of rows are several times slower than gathers on CPU: the sums are
        # an embedding bag over the output's blocks grouped by source, and the TBE's
        # gradient a gather of what came back (blocks no id asked for read a zero block).
        summed = _sum_by_index(grad.contiguous().view(-1, block), source, sum(sent) // block)
        received = grad.new_empty(sum(came) + block)
        received[-block:] = 0
        if len(sent) > 1:
            summed.div_(len(sent))
            dist.all_to_all_single(
                received[:-block], summed.view(-1), came, sent, group=layout.group
            )
        else:  # on one rank nothing travels, and no division: the loss is its own
            received[:-block] = summed.view(-1)
        back = torch.full((ctx.shape[0],), sum(came) // block, dtype=torch.long, device=grad.device)
        back.scatter_(0, to_send, torch.arange(len(to_send), device=grad.device))
        grad_blocks = layout.scratch.take("sequence_grad_blocks", tuple(ctx.shape), grad)
        torch.index_select(received.view(-1, block), 0, back, out=grad_blocks)
        return None, grad_blocks, None, None, None, None


def _sum_by_index(rows: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """``out[i]`` = the sum of the ``rows[j]`` with ``index[j] == i``, for i < ``size``."""
    order = torch.argsort(index, stable=True)
    per_row = torch.bincount(index, minlength=size)
    offsets = torch.cumsum(per_row, 0) - per_row
    return torch.nn.functional.embedding_bag(order, rows, offsets, mode="sum")


def _one_id_a_bag(
    per_slot: list[int], ids: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pooled TBE's offsets for ``ids`` ids in TBE order, ``per_slot`` a slot, one id
    a bag: each slot's ids in its first bags, as many bags a slot as the fullest slot
    has ids. Also each id's slot and bag. FBGEMM's pooled CPU kernels update rows
    several times faster than its unpooled ones."""
    counts = torch.tensor(per_slot, dtype=torch.long, device=device)
    starts = torch.cumsum(counts, 0) - counts
    bags = torch.arange(max(per_slot, default=0), device=device)
    offsets = (starts[:, None] + torch.minimum(bags, counts[:, None])).reshape(-1)
    end = torch.full((1,), ids, dtype=torch.long, device=device)
    slot = torch.repeat_interleave(
        torch.arange(len(per_slot), device=device), counts, output_size=ids
    )
    bag = torch.arange(ids, device=device) - starts[slot]
    return torch.cat([offsets, end]), slot, bag


def _places(arrived: torch.Tensor, span: torch.Tensor, total: int) -> torch.Tensor:
    """Each id's blocks' places among all ids' blocks in arrival order (id i arrived
    ``arrived[i]``-th and is ``span[i]`` blocks wide)."""
    span_arrived = torch.empty_like(span).index_copy_(0, arrived, span)
    start_arrived = torch.cumsum(span_arrived, 0) - span_arrived
    return _spread(start_arrived[arrived], span, total)


def _spread(first: torch.Tensor, span: torch.Tensor | None, total: int) -> torch.Tensor:
    """``first[i], first[i] + 1, ..., first[i] + span[i] - 1`` for every i, in order
    (``total``: the sum of ``span``); ``first`` itself where every span is 1 (None)."""
    if span is None:
        return first
    starts = torch.cumsum(span, 0) - span
    runs = torch.repeat_interleave(first - starts, span, output_size=total)
    return runs + torch.arange(total, device=first.device)


class ShardedEmbeddingCollection(
    ShardedCollection[SequenceInFlight, Rows, dict[str, JaggedTensor]]
):
    """The sharded form of a TorchRec ``EmbeddingCollection``; build it with ``shard()``.

    Table-wise, row-wise, column-wise, grid and data-parallel plans of FP32 or FP16
    tables, and dynamic tables (no copies, rows cut on bucket boundaries:
    docs/dynamic.md), whose ids without a row get zeros, and managed-collision tables
    (a ManagedCollisionEmbeddingCollection's: ``shard()``). ``state_dict()`` has the
    unsharded module's keys (``embeddings.<table>.weight``).
    """

    _PREFIX = "embeddings"

    def _input_stage(self, scratch: Scratch) -> SequenceInputDistribution:
        return SequenceInputDistribution(self._routes, self._rank, scratch, self._device)

    def _output_stage(self, scratch: Scratch, comm_precision: str | None) -> SequenceLayout:
        """Refuse what it does not support yet, and fix the rows' routes."""
        if comm_precision not in (None, "fp32"):
            raise ValueError(
                f"comm_precision {comm_precision!r} is not supported for an EmbeddingCollection "
                "yet: its rows travel in fp32"
            )
        hot = [n for n, t in self._tables.items() if t.hot_rows]
        if hot:
            raise ValueError(
                f"tables {hot}: row_wise hot_rows is not supported for an EmbeddingCollection "
                "yet; shard them row-wise without hot rows"
            )
        routes, stage = self._routes, self._input_dist
        send = [s for slots in routes.slots for s in slots]
        # The sharded embeddings' rows come back in one output, in embedding order.
        sharded = [i for i, e in enumerate(routes.embeddings) if not e.data_parallel]
        cols = torch.tensor(
            [s.shard.cols for s in routes.slots[self._rank]], dtype=torch.long, device=self._device
        )
        return SequenceLayout(
            dim=self._configs[0].embedding_dim if self._configs else 0,
            block=stage.block,
            one_block=stage.one_block,
            slot_cols=[[s.shard.cols for s in slots] for slots in routes.slots],
            embedding_feature=[routes.embeddings[i].feature for i in sharded],
            send_row_embedding=[sharded.index(s.embedding) for s in send],
            send_row_feature=[routes.embeddings[s.embedding].feature for s in send],
            send_row_column=torch.tensor(
                [s.shard.col_offset for s in send], dtype=torch.long, device=self._device
            ),
            send_row_blocks=stage.send_row_blocks,
            rank=self._rank,
            slot_blocks=cols // stage.block,
            slot_first_block=(torch.cumsum(cols, 0) - cols) // stage.block,
            group=self._group,
            scratch=scratch,
        )

    def lookup(self, in_flight: InputInFlight[SequenceInFlight]) -> Rows:
        """Stage 2: wait for the ids, and look up a row for each in one TBE call; look
        the local batch's ids of the data-parallel tables up in their copies."""
        if in_flight.error is not None:
            raise in_flight.error
        replicated = self._storage.replicated
        local = (
            replicated.per_id(in_flight.batch, in_flight.kept.counts.ids_per_feature)
            if replicated is not None
            else []
        )
        ids, arrived = self._input_dist.arrived(in_flight)
        layout, device = self._output_layout, self._device
        if self._storage.tbe is None:
            if self._dynamic is not None:  # no slots, no bags: the step counts on every rank
                self._dynamic.remap(ids, ids.new_zeros(1), None, 0, learn=self.training)
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return Rows(torch.zeros(0, layout.block, device=device), empty, local)
        mine = layout.slot_cols[self._rank]
        slot_ids = in_flight.kept.counts.slot_ids
        per_slot = [sum(ids[s] for ids in slot_ids) for s in range(len(mine))]
        offsets, slot, bag = _one_id_a_bag(per_slot, len(ids), device)
        lookup_ids, lookup_offsets = ids, offsets
        bags = max(per_slot, default=0)  # a slot's one-id bags
        if self._dynamic is not None:  # an id without a row leaves its bag empty: zeros
            lookup_ids, lookup_offsets, _ = self._dynamic.remap(
                ids, offsets, None, bags, learn=self.training
            )
        if self._managed is not None:  # a miss gets its block's last row, as in TorchRec
            lookup_ids = self._managed.remap(ids, offsets, bags, learn=self.training)
        # [fullest slot's ids, slots' widths]
        pooled = self._storage.tbe(lookup_ids, lookup_offsets)
        # Each id's row: blocks of bag ``bag`` (a row of ``pooled``) at its slot's columns.
        span = None if layout.one_block else layout.slot_blocks[slot]
        total = sum(n * c for n, c in zip(per_slot, mine)) // layout.block
        first = bag * (pooled.shape[1] // layout.block) + layout.slot_first_block[slot]
        # Sent back in arrival order: each id's blocks at its place among them.
        place = arrived if span is None else _places(arrived, span, total)
        to_send = torch.empty_like(place).index_copy_(0, place, _spread(first, span, total))
        return Rows(pooled.view(-1, layout.block), to_send, local)

    def output_dist(
        self, looked_up: Rows, in_flight: InputInFlight[SequenceInFlight]
    ) -> dict[str, JaggedTensor]:
        """Stage 3 (collective): the rows home, each in its id's place."""
        layout, batch = self._output_layout, in_flight.batch
        counts, sent = in_flight.kept
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
        block = layout.block
        span = None if layout.one_block else layout.send_row_blocks[send_row]
        first = (positions + shift[send_row]) * layout.dim + layout.send_row_column[send_row]
        total = counts.blocks_placed
        target = _spread(first // block, span, total)
        source = torch.empty_like(target).index_copy_(
            0, target, _spread(sent.first_block, span, total)
        )
        out = RowsAllToAll.apply(
            self._anchor, looked_up.blocks, looked_up.sent, source, layout, counts
        )
        lengths = batch.lengths.long()
        sharded, local = iter(out.split(per_embedding)), iter(looked_up.local)
        return {
            e.name: JaggedTensor(
                values=next(local) if e.data_parallel else next(sharded),
                lengths=lengths[e.feature],
            )
            for e in self._routes.embeddings
        }

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)
