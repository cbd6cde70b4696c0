"""Stage 1 for a sequence lookup (an EmbeddingCollection's: a row per id): each rank
sends an owner the distinct ids of each lengths-table row only, in the row's first bag,
so the owner looks each up once and its row travels back once; the route keeps where
every id was, and the counts exchange carries what sizes the rows' way back. The
packing and the payload's all-to-all are the pooled lookup's (``InputDistribution``).

A dynamic table's features send every id, repeats included, as keys: its owner's id
map counts every sighting (``admit_after``, LFU), as for a pooled lookup, so a map
decides the same whatever the world size and however the samples are split. A
managed-collision table's features send every raw id too: its owner's MCH module
profiles every sighting, as TorchRec's unsharded module does."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from embshard.runtime.batch import LocalBatch
from embshard.runtime.input_dist import (
    Counts,
    ExtraCounts,
    InputDistribution,
    InputInFlight,
    Routed,
)
from embshard.runtime.routes import Routes
from embshard.runtime.scratch import Scratch
from embshard.runtime.sparse_ops import permute_1d, permute_2d


@dataclass(frozen=True)
class SequenceIds:
    """A sequence lookup sends each row of the lengths table's distinct ids only, all in
    the row's first bag: the owner looks each up once, and its row goes back once.
    Every id routed, in ``lengths``' order: its index in the batch's ids (model order)
    and the index of its distinct id among all rows' (``row_starts``: each row's
    first)."""

    lengths: torch.Tensor
    positions: torch.Tensor
    distinct: torch.Tensor
    row_starts: torch.Tensor


class SequenceRouted(NamedTuple):
    """A sequence batch's route: the bags that travel (each lengths-table row's
    distinct ids), and every id routed (None for a batch that cannot be sent)."""

    bags: Routed
    ids: SequenceIds | None


@dataclass(frozen=True)
class SequenceCounts:
    """What the counts exchange told a sequence lookup, on the host: this rank's ids
    of each feature (model order), the ids it sent (not distinct) and the blocks their
    rows fill in its output (``SequenceInputDistribution.block`` columns each), and the
    distinct ids each rank sent for each of this rank's slots, and this rank sent for
    each of each rank's."""

    ids_per_feature: list[int]
    rows_sent: int
    blocks_placed: int
    slot_ids: list[list[int]]
    sent_slot_ids: list[list[int]]

    @staticmethod
    def read(counts: Counts) -> SequenceCounts:
        rows_sent, blocks_placed, *ids_per_feature = counts.extra_local
        return SequenceCounts(
            ids_per_feature, rows_sent, blocks_placed, counts.extra_received, counts.extra_sent
        )


@dataclass(frozen=True)
class SentIds:
    """Every id a sequence lookup sent, in payload order (destination, slot, sample): its
    index in the batch's ids, the row of ``Routes.send_rows()`` it went in, and the first
    block (``InputDistribution.block`` values) of its distinct id's row among all the
    rows that come back (those of every destination, in rank order)."""

    positions: torch.Tensor
    send_row: torch.Tensor
    first_block: torch.Tensor


class SequenceInFlight(NamedTuple):
    """What a sequence lookup keeps from stage 1 to bring every id's row home."""

    counts: SequenceCounts
    sent: SentIds


class SequenceInputDistribution:
    """A sequence lookup's stage 1 (``IdsRouting``): distinct ids out, and what brings
    a row back to every id."""

    def __init__(self, routes: Routes, rank: int, scratch: Scratch, device: torch.device) -> None:
        self.bags = InputDistribution(routes, rank, scratch, device)
        world, send_rows = routes.world_size, self.bags.send_rows
        # Above every id a lengths-table row holds (rebased into its block or not; a
        # dynamic table's keys are 63 bits).
        self.id_bound = max(routes.id_limits, default=0) + 1
        # Per feature, whether its ids all travel, repeats included (a dynamic or
        # managed-collision table's), or None where no feature's do. A lengths-table
        # row's feature is its index modulo the features (every bucketizing pass's
        # buckets repeat them).
        repeats = [
            b is not None or r is not None
            for b, r in zip(routes.buckets_or_none, routes.ranges_or_none)
        ]
        self.repeats = torch.tensor(repeats, device=device) if any(repeats) else None
        per_dest = torch.zeros(world, dtype=torch.long, device=device)
        per_dest.index_add_(0, self.bags.slot_rank, torch.ones_like(self.bags.slot_rank))
        first_send_row = (torch.cumsum(per_dest, 0) - per_dest)[self.bags.slot_rank]
        # Each send row's slot among its destination's.
        self.slot_index = torch.arange(len(send_rows), device=device) - first_send_row
        # Rows travel and land in blocks of columns dividing every dim, shard width and
        # first column; each send row's shard is this many blocks wide.
        shards = [s.shard for slots in routes.slots for s in slots]
        self.block = math.gcd(
            *(e.dim for e in routes.embeddings), *(s.cols for s in shards),
            *(s.col_offset for s in shards),
        ) or 1  # fmt: skip
        self.send_row_blocks = torch.tensor(
            [s.cols // self.block for s in shards], dtype=torch.long, device=device
        )
        # Whether every shard is one block wide (equal widths: every plan but column
        # blocks of different widths): then an id's row is one block, and the blocks'
        # arithmetic below is the ids' own.
        self.one_block = all(s.cols == self.block for s in shards)

    def route(self, batch: LocalBatch) -> SequenceRouted:
        """Bucketize row-wise ids by owner (rebased into its block), keeping where each
        id was, and keep each lengths-table row's distinct ids to send (a dynamic
        table's keys all, a managed-collision table's raw ids all)."""
        batch = self.bags.keyed(batch)
        positions = torch.arange(batch.values.numel(), device=self.bags.device)
        lengths, values, _, positions = self.bags.bucketize(batch, positions)
        distinct_lengths, distinct_values, ids = self._distinct(lengths, values, positions)
        tally = self.bags.tally(distinct_lengths, batch.row_ids)
        return SequenceRouted(
            Routed(distinct_lengths, distinct_values, None, tally, batch.batch_size), ids
        )

    def _distinct(
        self, lengths: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, SequenceIds]:
        """Each lengths-table row's distinct ids (a dynamic or managed-collision
        table's: all its ids, each its own), in its first bag (values past the last
        row's are left over: the payload reads rows by their lengths), and the
        SequenceIds that bring every id's row back. Sorting keys of (row, id) finds them
        without reading anything back to the host; keys of (row, place in the row) keep
        a row of all its ids in the batch's order, the order the unsharded module sees
        them in (an MCH module's evictions depend on it)."""
        rows, count = lengths.shape[0], values.numel()
        row_of = torch.repeat_interleave(
            torch.arange(rows, device=self.bags.device), lengths.sum(1), output_size=count
        )
        sortable, bound = values.long(), self.id_bound
        if self.repeats is not None:  # their ids keep their order: by place in the row
            per_row = lengths.sum(1)
            place = torch.arange(count, device=self.bags.device)
            place -= (torch.cumsum(per_row, 0) - per_row)[row_of]
            sortable = torch.where(self.repeats[row_of % len(self.repeats)], place, sortable)
            bound = max(bound, count)
        if rows * bound < 2**63:  # one sort of combined keys
            key = row_of * bound + sortable
            key, order = torch.sort(key)
            first = torch.ones_like(key, dtype=torch.bool)
            first[1:] = key[1:] != key[:-1]
        else:  # rows, then ids within a row: two stable sorts
            order = torch.sort(sortable, stable=True)[1]
            order = order[torch.sort(row_of[order], stable=True)[1]]
            ids, row = values[order], row_of[order]
            first = torch.ones_like(ids, dtype=torch.bool)
            first[1:] = (ids[1:] != ids[:-1]) | (row[1:] != row[:-1])
        if self.repeats is not None:  # a dynamic or managed table's ids are each their own
            first |= self.repeats[row_of[order] % len(self.repeats)]
        index = torch.cumsum(first, 0) - 1  # each sorted id's distinct id
        distinct = torch.empty_like(index).scatter_(0, order, index)
        distinct_values = torch.empty_like(values).scatter_(0, index, values[order])
        per_row = torch.zeros(rows, dtype=torch.long, device=self.bags.device)
        per_row.index_add_(0, row_of[order], first.long())
        distinct_lengths = torch.zeros_like(lengths)
        if lengths.shape[1]:
            distinct_lengths[:, 0] = per_row
        starts = torch.cumsum(per_row, 0) - per_row
        return distinct_lengths, distinct_values, SequenceIds(lengths, positions, distinct, starts)

    def nothing(self) -> SequenceRouted:
        """The route of a batch that cannot be sent: nothing for anyone."""
        return SequenceRouted(self.bags.nothing(), None)

    def to_send(self, routed: SequenceRouted) -> Routed:
        """The distinct ids travel; the route of every id stays home."""
        return routed.bags

    def extra_counts(self, batch: LocalBatch | None, routed: SequenceRouted) -> ExtraCounts:
        """For each rank, the distinct ids sent for each of its slots; and this rank's
        ids sent (not distinct), the blocks their rows fill, its ids per feature (zeros
        for a batch that cannot be sent)."""
        bags = self.bags
        long = {"dtype": torch.long, "device": bags.device}
        slot_ids = torch.zeros(bags.world, max(bags.slots_per_rank, default=0), **long)
        if batch is None or routed.ids is None:
            zeros = torch.zeros(2 + len(bags.routes.features), **long)
            return ExtraCounts(slot_ids, zeros)
        slot_ids[bags.slot_rank, self.slot_index] = bags.ids_per_slot(routed.bags.tally)
        rows = routed.ids.lengths.index_select(0, bags.send_rows).sum(1)
        sent = rows.sum()
        blocks = sent if self.one_block else (rows * self.send_row_blocks).sum()
        totals = torch.stack([sent, blocks])
        return ExtraCounts(slot_ids, torch.cat([totals, batch.ids_per_feature]))

    def keep(self, routed: SequenceRouted, counts: Counts) -> SequenceInFlight:
        """The counts that size the rows' way back, and where every id went."""
        found = SequenceCounts.read(counts)
        return SequenceInFlight(found, self._sent_ids(routed, found))

    def _sent_ids(self, routed: SequenceRouted, counts: SequenceCounts) -> SentIds:
        """Where every id of a sequence lookup went, and where its row comes back
        (SentIds)."""
        total, ids = counts.rows_sent, routed.ids
        lengths, positions, _ = permute_2d(
            self.bags.send_rows, ids.lengths, ids.positions, None, total
        )
        _, distinct, _ = permute_2d(self.bags.send_rows, ids.lengths, ids.distinct, None, total)
        send_row = torch.repeat_interleave(
            torch.arange(len(self.bags.send_rows), device=self.bags.device),
            lengths.sum(1),
            output_size=total,
        )
        # A send row's distinct rows come back after those of the send rows before it.
        sent = self.bags.ids_per_slot(routed.bags.tally)
        if not self.one_block:
            sent = sent * self.send_row_blocks
        starts = torch.cumsum(sent, 0) - sent
        local = distinct - ids.row_starts[self.bags.send_rows.long()][send_row]
        if not self.one_block:
            local = local * self.send_row_blocks[send_row]
        first_block = starts[send_row] + local
        return SentIds(positions, send_row, first_block)

    def arrived(self, in_flight: InputInFlight) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids in TBE order (slot by slot, sources in rank order), and for each the
        index it arrived at (ids of all sources in rank order): where its row goes back.
        On one rank they never left: the TBE's order is theirs."""
        if in_flight.own is not None:
            values = in_flight.own.values
            return values, torch.arange(values.numel(), device=self.bags.device)
        counts, bags = in_flight.counts, self.bags
        received = in_flight.take_received()
        bag_lengths, values, _ = bags.received_bags(received, counts.recv_sizes, counts.batch_sizes)
        arrived = torch.arange(values.numel(), device=bags.device)
        order = bags.slot_major(counts.batch_sizes)
        _, arrived, _ = permute_1d(order, bag_lengths, arrived, None, values.numel())
        _, values, _ = permute_1d(order, bag_lengths, values, None, values.numel())
        return values, arrived
