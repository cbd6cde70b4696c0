"""Input and output distribution: the collectives of a training step.

Forward: one all-to-all of counts (payload sizes, batch sizes, and a status that
lets a rank with a bad batch stop everyone), one all-to-all of the packed ids
(lengths, ids and weights of every slot, all sharding types together), and one
all-to-all of pooled embeddings. Backward: that last one in reverse. Four in all,
whatever the plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from embshard.inputs import InputError, LocalBatch
from embshard.routes import ColumnMove, Routes

_OK, _BAD, _ENDED = 0, 1, 2  # a rank's status in the counts exchange


@dataclass(frozen=True)
class Counts:
    """What the counts exchange told this rank, on the host."""

    recv_sizes: list[int]  # payload elements from each rank
    batch_sizes: list[int]  # each rank's local batch size
    failed: bool  # some rank's batch is bad
    ended: tuple[int, ...]  # ranks that have no batch: their batches ran out
    send_sizes: list[int]  # payload elements for each rank
    sent_ids: list[int]  # ids this rank sends each rank
    # Sequence lookups only (``sent_ids`` then counts distinct ids): ids of each feature
    # in this rank's batch (model order), the ids it sent (not distinct) and the blocks
    # their rows fill (SequenceCounts), and the distinct ids each rank sent for each of
    # this rank's slots, and this rank sent for each of each rank's.
    ids_per_feature: list[int] = field(default_factory=list)
    rows_sent: int = 0
    blocks_placed: int = 0
    slot_ids: list[list[int]] = field(default_factory=list)
    sent_slot_ids: list[list[int]] = field(default_factory=list)


def exchange_counts(
    send_sizes: torch.Tensor,
    sent_ids: torch.Tensor,
    batch_size: int,
    valid: torch.Tensor,
    group: dist.ProcessGroup | None,
    sequence: SequenceCounts | None = None,
    ended: bool = False,
) -> Counts:
    """Tell every rank how much this rank sends it, its batch size, and whether its
    batch is good or it has none (``ended``: its batches ran out), and for a sequence
    lookup, the distinct ids it sends for each of that rank's slots. The step's one
    host sync: reading back what arrived, together with ``send_sizes`` and
    ``sent_ids`` (per destination), which size the payload, and for a sequence lookup
    its ids per feature and per destination, which size its outputs."""
    world = send_sizes.numel()
    status = torch.full_like(send_sizes, _ENDED) if ended else torch.where(valid, _OK, _BAD)
    status = status.expand(world)
    columns = [send_sizes, torch.full_like(send_sizes, batch_size), status]
    counts = torch.stack(columns, dim=1)
    local = []
    if sequence is not None:
        slot_ids = sequence.slot_ids.to(counts.dtype)
        counts = torch.cat([counts, slot_ids], dim=1)
        totals = torch.stack([sequence.rows_sent, sequence.blocks_placed]).to(counts.dtype)
        local = [slot_ids.view(-1), totals, sequence.ids_per_feature.to(counts.dtype)]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    host = torch.cat([received.view(-1), send_sizes, sent_ids, *local]).tolist()
    width = counts.shape[1]
    rows = [host[width * r : width * (r + 1)] for r in range(world)]
    rest = host[width * world :]
    found = Counts(
        recv_sizes=[r[0] for r in rows],
        batch_sizes=[r[1] for r in rows],
        failed=any(r[2] == _BAD for r in rows),
        ended=tuple(rank for rank, r in enumerate(rows) if r[2] == _ENDED),
        send_sizes=rest[:world],
        sent_ids=rest[world : 2 * world],
    )
    if sequence is None:
        return found
    mine = rest[2 * world : 2 * world + world * (width - 3)]
    rows_sent, blocks_placed, *ids_per_feature = rest[2 * world + len(mine) :]
    return dataclasses.replace(
        found,
        ids_per_feature=ids_per_feature,
        rows_sent=rows_sent,
        blocks_placed=blocks_placed,
        slot_ids=[r[3:] for r in rows],
        sent_slot_ids=[mine[(width - 3) * d : (width - 3) * (d + 1)] for d in range(world)],
    )


@dataclass(frozen=True)
class SequenceCounts:
    """What a sequence lookup adds to the counts exchange: [ranks, most slots a rank
    holds] the distinct ids sent for each slot of each rank, and, read back with them,
    the ids sent (not distinct), the blocks their rows fill in the output
    (``InputDistribution.block`` columns each) and this rank's ids per feature."""

    slot_ids: torch.Tensor
    rows_sent: torch.Tensor
    blocks_placed: torch.Tensor
    ids_per_feature: torch.Tensor


def gather_input_error(problem: str | None, group: dist.ProcessGroup | None) -> InputError:
    """The same InputError on every rank, naming what each bad rank found. A
    collective: called by every rank once the counts say some batch is bad."""
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
    return InputError("bad input batch:\n  " + "\n  ".join(found))


def _to_bits(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weights.view(torch.int32).to(dtype)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.int().view(torch.float32)


class Scratch:
    """Buffers kept from step to step. On CPU, glibc hands large freed blocks back to
    the kernel, so a fresh buffer each step page-faults on its first touch: a third of
    a row-wise step on workload (b) (`tools/profile_step.py`). A buffer is handed out
    again only when no tensor holds it any more, so neither a gradient that autograd
    has not consumed yet nor an output the caller still holds is ever overwritten;
    two buffers a name let an output alternate while the caller holds the last one.
    CUDA's caching allocator already reuses memory: there every call gets a new
    tensor."""

    def __init__(self) -> None:
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        like: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """A contiguous tensor of ``shape`` on ``like``'s device, of ``dtype`` (default
        ``like``'s). Not a view to autograd: the caller may modify an output built in it
        in place."""
        dtype = dtype or like.dtype
        if like.device.type != "cpu":
            return like.new_empty(shape, dtype=dtype)
        numel = math.prod(shape)
        kept = self._buffers.setdefault(name, [])
        in_use = [_held_elsewhere(b) for b in kept]
        held = [b for b, used in zip(kept, in_use) if used]
        fits = [
            b
            for b, used in zip(kept, in_use)
            if not used and b.numel() >= numel and b.dtype == dtype
        ]
        if fits:
            buffer = fits[0]
        else:
            # Room to spare once sizes are seen to change (ids vary from step to step).
            room = numel // 4 if kept and kept[-1].numel() != numel else 0
            buffer = like.new_empty(numel + room, dtype=dtype)
            kept[:] = [*held[-1:], buffer]
        return buffer.new_empty(0).set_(buffer.untyped_storage(), 0, shape)


def _held_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether a tensor other than ``buffer`` uses its memory (views included)."""
    storage = buffer.untyped_storage()
    # Counted: ``buffer`` itself and ``storage`` here.
    return torch._C._storage_Use_Count(storage._cdata) > 2


@dataclass(frozen=True)
class Routed:
    """A batch's bags sorted by who gets them, before the payload is built: the
    lengths table (features, or every bucketizing pass's buckets of every feature),
    the ids and weights it describes, and how many ids go to each rank (on the
    device: read back in the counts exchange)."""

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    ids_per_rank: torch.Tensor
    batch_size: int
    # Sequence lookups only: every id routed, of which lengths and values hold the
    # distinct ones.
    sequence: SequenceIds | None = None


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


@dataclass(frozen=True)
class SentIds:
    """Every id a sequence lookup sent, in payload order (destination, slot, sample): its
    index in the batch's ids, the row of ``Routes.send_rows()`` it went in, and the first
    block (``InputDistribution.block`` values) of its distinct id's row among all the
    rows that come back (those of every destination, in rank order)."""

    positions: torch.Tensor
    send_row: torch.Tensor
    first_block: torch.Tensor


class InputDistribution:
    """Routes a local batch to the ranks that own its rows, packs it into one buffer
    for all destinations, and unpacks what a rank receives into its TBE's indices,
    offsets and weights. Every tensor lives on ``device``; the only host read is the
    counts exchange between ``route`` and ``pack``."""

    def __init__(
        self,
        routes: Routes,
        rank: int,
        scratch: Scratch,
        device: torch.device,
        sequence: bool = False,
    ) -> None:
        self.routes = routes
        # Sequence lookups (EmbeddingCollection) return a row per id, which must find
        # its way back to the id's place in the batch: ``route`` keeps where each id was.
        self.sequence = sequence
        self.rank = rank
        self.world = routes.world_size
        self.scratch = scratch
        self.device = device
        # The id bounds the batch check takes: one when every feature has the same.
        distinct = sorted(set(routes.feature_rows))
        self.feature_rows = torch.tensor(
            distinct if len(distinct) == 1 else routes.feature_rows, device=device
        )
        self.slots_per_rank = [len(s) for s in routes.slots]
        self.slot_counts = torch.tensor(self.slots_per_rank, device=device)
        self.send_rows = routes.send_rows().to(device, torch.int32)
        self.slot_rank = torch.repeat_interleave(
            torch.arange(self.world, device=device),
            self.slot_counts,
            output_size=len(self.send_rows),
        )
        dtype = routes.id_dtype
        self.passes = [
            (
                # Only used by FBGEMM when boundaries are absent; the boundaries rule.
                torch.tensor([max(1, b[1] - b[0]) for b in bounds], dtype=dtype, device=device),
                [torch.tensor(b, dtype=dtype, device=device) for b in bounds],
            )
            for bounds in routes.bucket_passes
        ]
        self.ids_per_element = 2 if routes.weighted else 1
        # Above every id a lengths-table row holds (rebased into its block or not).
        self.id_bound = max(routes.feature_rows, default=0) + 1
        per_dest = torch.zeros(self.world, dtype=torch.long, device=device)
        per_dest.index_add_(0, self.slot_rank, torch.ones_like(self.slot_rank))
        self.first_send_row = (torch.cumsum(per_dest, 0) - per_dest)[self.slot_rank]
        # Each send row's slot among its destination's.
        self.slot_index = torch.arange(len(self.send_rows), device=device) - self.first_send_row
        # Sequence rows travel and land in blocks of columns dividing every dim, shard
        # width and first column; each send row's shard is this many blocks wide.
        shards = [s.shard for slots in routes.slots for s in slots]
        self.block = math.gcd(
            *(e.dim for e in routes.embeddings), *(s.cols for s in shards),
            *(s.col_offset for s in shards),
        ) or 1  # fmt: skip
        self.send_row_blocks = torch.tensor(
            [s.cols // self.block for s in shards], dtype=torch.long, device=device
        )

    def route(self, batch: LocalBatch) -> Routed:
        """Bucketize row-wise ids by owner (rebased into its block), and count what
        each rank gets. Ids of hot rows stay home, in bucket 0."""
        lengths, values, weights = batch.lengths, batch.values, batch.weights
        positions = torch.arange(values.numel(), device=self.device) if self.sequence else None
        if self.passes:
            buckets = [
                torch.ops.fbgemm.block_bucketize_sparse_features(
                    lengths.view(-1),
                    values,
                    False,
                    self.sequence,
                    block_sizes,
                    self.routes.buckets,
                    weights,
                    None,
                    -1,
                    boundaries,
                )
                for block_sizes, boundaries in self.passes
            ]
            table_rows = len(self.passes) * self.routes.buckets * len(self.routes.features)
            lengths = torch.cat([b[0] for b in buckets]).view(table_rows, batch.batch_size)
            values = _cat([b[1] for b in buckets])
            weights = None if weights is None else _cat([b[2] for b in buckets])
            if positions is not None:  # b[4][i]: where id i went in its pass's buckets
                ids = positions
                positions = _cat(
                    [torch.empty_like(ids).scatter_(0, b[4].long(), ids) for b in buckets]
                )
        if positions is None:
            return Routed(lengths, values, weights, self._per_rank(lengths), batch.batch_size)
        distinct_lengths, distinct_values, sequence = self._distinct(lengths, values, positions)
        return Routed(
            distinct_lengths,
            distinct_values,
            None,
            self._per_rank(distinct_lengths),
            batch.batch_size,
            sequence,
        )

    def _per_rank(self, lengths: torch.Tensor) -> torch.Tensor:
        """Ids each rank gets from the lengths table ``lengths``."""
        per_slot = lengths.index_select(0, self.send_rows).sum(1)
        ids_per_rank = torch.zeros(self.world, dtype=torch.long, device=self.device)
        return ids_per_rank.index_add_(0, self.slot_rank, per_slot)

    def _distinct(
        self, lengths: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, SequenceIds]:
        """Each lengths-table row's distinct ids, in its first bag (values past the
        last row's are left over: the payload reads rows by their lengths), and the
        SequenceIds that bring every id's row back. Sorting keys of (row, id) finds
        them without reading anything back to the host."""
        rows, count = lengths.shape[0], values.numel()
        row_of = torch.repeat_interleave(
            torch.arange(rows, device=self.device), lengths.sum(1), output_size=count
        )
        if rows * self.id_bound < 2**63:  # one sort of combined keys
            key = row_of * self.id_bound + values.long()
            key, order = torch.sort(key)
            first = torch.ones_like(key, dtype=torch.bool)
            first[1:] = key[1:] != key[:-1]
        else:  # rows, then ids within a row: two stable sorts
            order = torch.sort(values, stable=True)[1]
            order = order[torch.sort(row_of[order], stable=True)[1]]
            ids, row = values[order], row_of[order]
            first = torch.ones_like(ids, dtype=torch.bool)
            first[1:] = (ids[1:] != ids[:-1]) | (row[1:] != row[:-1])
        index = torch.cumsum(first, 0) - 1  # each sorted id's distinct id
        distinct = torch.empty_like(index).scatter_(0, order, index)
        distinct_values = torch.empty_like(values).scatter_(0, index, values[order])
        per_row = torch.zeros(rows, dtype=torch.long, device=self.device)
        per_row.index_add_(0, row_of[order], first.long())
        distinct_lengths = torch.zeros_like(lengths)
        if lengths.shape[1]:
            distinct_lengths[:, 0] = per_row
        starts = torch.cumsum(per_row, 0) - per_row
        return distinct_lengths, distinct_values, SequenceIds(lengths, positions, distinct, starts)

    def nothing(self) -> Routed:
        """The route of a batch that cannot be sent: nothing for anyone."""
        zeros = torch.zeros(self.world, dtype=torch.long, device=self.device)
        empty = torch.zeros(0, dtype=self.routes.id_dtype, device=self.device)
        return Routed(empty.view(0, 0), empty, None, zeros, 0)

    def sequence_counts(self, batch: LocalBatch | None, routed: Routed) -> SequenceCounts:
        """The counts a sequence lookup exchanges (SequenceCounts); zeros for a batch
        that cannot be sent."""
        long = {"dtype": torch.long, "device": self.device}
        slot_ids = torch.zeros(self.world, max(self.slots_per_rank, default=0), **long)
        if batch is None:
            zero = torch.zeros((), **long)
            return SequenceCounts(
                slot_ids, zero, zero, torch.zeros(len(self.routes.features), **long)
            )
        slot_ids[self.slot_rank, self.slot_index] = routed.lengths.index_select(
            0, self.send_rows
        ).sum(1)
        rows = routed.sequence.lengths.index_select(0, self.send_rows).sum(1)
        return SequenceCounts(
            slot_ids, rows.sum(), (rows * self.send_row_blocks).sum(), batch.lengths.sum(1)
        )

    def sent_ids(self, routed: Routed, counts: Counts) -> SentIds:
        """Where every id of a sequence lookup went, and where its row comes back
        (SentIds)."""
        total, ids = counts.rows_sent, routed.sequence
        lengths, positions, _ = torch.ops.fbgemm.permute_2D_sparse_data(
            self.send_rows, ids.lengths, ids.positions, None, total
        )
        _, distinct, _ = torch.ops.fbgemm.permute_2D_sparse_data(
            self.send_rows, ids.lengths, ids.distinct, None, total
        )
        send_row = torch.repeat_interleave(
            torch.arange(len(self.send_rows), device=self.device),
            lengths.sum(1),
            output_size=total,
        )
        # A send row's distinct rows come back after those of the send rows before it.
        sent = routed.lengths.index_select(0, self.send_rows).sum(1) * self.send_row_blocks
        starts = torch.cumsum(sent, 0) - sent
        local = distinct - ids.row_starts[self.send_rows.long()][send_row]
        first_block = starts[send_row] + local * self.send_row_blocks[send_row]
        return SentIds(positions, send_row, first_block)

    def send_sizes(self, routed: Routed) -> torch.Tensor:
        """Payload elements for each rank: its slots' lengths, then ids (and weights)."""
        return self.slot_counts * routed.batch_size + routed.ids_per_rank * self.ids_per_element

    def pack(self, routed: Routed, ids_per_rank: list[int]) -> torch.Tensor:
        """One buffer for all destinations: for each, its slots' lengths, ids, weights."""
        lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
            self.send_rows, routed.lengths, routed.values, routed.weights, sum(ids_per_rank)
        )
        rows = lengths.split(self.slots_per_rank)
        id_chunks = values.split(ids_per_rank)
        weight_chunks = weights.split(ids_per_rank) if weights is not None else None
        pieces = []
        for dest, dest_lengths in enumerate(rows):
            pieces += [dest_lengths.reshape(-1), id_chunks[dest]]
            if weight_chunks is not None:
                pieces.append(_to_bits(weight_chunks[dest], values.dtype))
        return torch.cat(pieces)

    def exchange(
        self,
        payload: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        group: dist.ProcessGroup | None,
    ) -> tuple[torch.Tensor, dist.Work]:
        """Start the payload's all-to-all; the buffer it fills, and the work to wait on."""
        received = self.scratch.take("ids", (sum(recv_sizes),), payload)
        work = dist.all_to_all_single(
            received, payload, recv_sizes, send_sizes, group=group, async_op=True
        )
        return received, work

    def unpack(
        self, received: torch.Tensor, recv_sizes: list[int], batch_sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """TBE input for the global batch: every slot's bags, sources in rank order."""
        bag_lengths, values, bag_weights = self._received_bags(received, recv_sizes, batch_sizes)
        if self.world > 1:
            order = self._slot_major(batch_sizes)
            bag_lengths, values, bag_weights = torch.ops.fbgemm.permute_1D_sparse_data(
                order, bag_lengths, values, bag_weights, values.numel()
            )
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(bag_lengths)
        return values, offsets, bag_weights

    def unpack_sequence(
        self, received: torch.Tensor, recv_sizes: list[int], batch_sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids received in TBE order (slot by slot, sources in rank order), and for
        each the index it arrived at (ids of all sources in rank order): where its row
        goes back."""
        bag_lengths, values, _ = self._received_bags(received, recv_sizes, batch_sizes)
        arrived = torch.arange(values.numel(), device=self.device)
        if self.world > 1:
            order = self._slot_major(batch_sizes)
            _, arrived, _ = torch.ops.fbgemm.permute_1D_sparse_data(
                order, bag_lengths, arrived, None, values.numel()
            )
            _, values, _ = torch.ops.fbgemm.permute_1D_sparse_data(
                order, bag_lengths, values, None, values.numel()
            )
        return values, arrived

    def _slot_major(self, batch_sizes: list[int]) -> torch.Tensor:
        return _slot_major_order(self.slots_per_rank[self.rank], batch_sizes, self.device)

    def _received_bags(
        self, received: torch.Tensor, recv_sizes: list[int], batch_sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Bag lengths, ids and weights as they arrived: (source, slot, sample)."""
        slots = self.slots_per_rank[self.rank]
        lengths, ids, weights = [], [], []
        for chunk, size, batch_size in zip(received.split(recv_sizes), recv_sizes, batch_sizes):
            start = slots * batch_size
            count = (size - start) // self.ids_per_element
            lengths.append(chunk[:start])
            ids.append(chunk[start : start + count])
            if self.routes.weighted:
                weights.append(_from_bits(chunk[start + count :]))
        bag_weights = torch.cat(weights) if self.routes.weighted else None
        return torch.cat(lengths), torch.cat(ids), bag_weights


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _slot_major_order(slots: int, batch_sizes: list[int], device: torch.device) -> torch.Tensor:
    """Bags arrive as (source, slot, sample); the TBE wants (slot, source, sample)."""
    sizes = torch.tensor(batch_sizes, dtype=torch.long, device=device)
    total = sum(batch_sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    source = torch.repeat_interleave(
        torch.arange(len(batch_sizes), device=device), sizes, output_size=total
    )
    sample = torch.arange(total, device=device) - starts[source]
    slot = torch.arange(slots, device=device)[:, None]
    return (slots * starts[source] + slot * sizes[source] + sample).reshape(-1).int()


def _column_runs(t: torch.Tensor, start: int, step: int, move: ColumnMove) -> torch.Tensor:
    """The [rows, count, width] view of ``move``'s column runs in 2-D ``t``."""
    rows, columns = t.stride()
    return t.as_strided(
        (t.shape[0], move.count, move.width),
        (rows, step * columns, columns),
        t.storage_offset() + start * columns,
    )


COMM_DTYPES = {
    None: torch.float32,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class OutputLayout:
    """What the pooled all-to-all needs besides the batch sizes, fixed at sharding:
    every rank's pooled block width, the column moves into the output (those of the
    received blocks, and those of the local lookup's block), where this rank stands,
    and the precision the pooled rows and their gradients travel in."""

    block_dims: list[int]
    moves: list[ColumnMove]
    output_dim: int
    rank: int
    group: dist.ProcessGroup | None
    scratch: Scratch
    comm_precision: str | None = None
    local_moves: list[ColumnMove] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.comm_precision not in COMM_DTYPES:
            raise ValueError(
                f"comm_precision must be one of {list(COMM_DTYPES)}, got {self.comm_precision!r}"
            )

    @property
    def comm_dtype(self) -> torch.dtype:
        return COMM_DTYPES[self.comm_precision]

    def to_wire(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the comm dtype: themselves, or rounded into scratch ``name``."""
        if values.dtype == self.comm_dtype:
            return values
        return self.scratch.take(name, values.shape, values, self.comm_dtype).copy_(values)

    def from_wire(self, name: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``values`` as ``dtype``: themselves, or widened into scratch ``name``."""
        if values.dtype == dtype:
            return values
        return self.scratch.take(name, values.shape, values, dtype).copy_(values)


class PooledAllToAll(torch.autograd.Function):
    """Each rank's pooled rows go back to the ranks whose samples they are, and land
    in their output columns, beside the local lookup's (data-parallel tables).

    Forward: [global batch, this rank's slot dims] -> [local batch, output dims]: the
    all-to-all, then every slot's columns copied to (or, for row-wise partials, added
    into) their output columns, and ``local``'s copied to theirs (added, for hot rows'
    partial sums). Backward:
    each slot takes its output columns' gradient, the all-to-all runs in reverse, and
    the result is divided by the world size, so the sparse gradients are averaged over
    ranks as DDP averages the dense ones.
    ``anchor`` requires grad on every rank, so every rank joins the backward
    all-to-all even when it holds no shards.

    Both all-to-alls carry ``layout.comm_dtype``: with fp16 or bf16, each value is
    rounded once on the wire and back to float32 on arrival, before row-wise partials
    are added and before the division.
    """

    @staticmethod
    def forward(ctx, anchor, pooled, local, batch_sizes, layout):  # type: ignore[override]
        local_batch = batch_sizes[layout.rank]
        send_splits = [b * pooled.shape[1] for b in batch_sizes]
        recv_splits = [local_batch * d for d in layout.block_dims]
        send = layout.to_wire("pooled_send", pooled.contiguous().view(-1))
        received = layout.scratch.take("pooled", (sum(recv_splits),), pooled, layout.comm_dtype)
        dist.all_to_all_single(received, send, recv_splits, send_splits, group=layout.group)
        blocks = _blocks(received, recv_splits, local_batch, layout.block_dims)
        out = layout.scratch.take("out", (local_batch, layout.output_dim), pooled)
        moves = [(blocks[m.rank], m) for m in layout.moves]
        for source, m in moves + [(local, m) for m in layout.local_moves]:
            piece = _column_runs(source, m.source, m.source_step, m)
            target = _column_runs(out, m.target, m.target_step, m)
            if m.add:
                target.add_(piece)
            else:
                target.copy_(piece)
        ctx.save_for_backward(anchor)
        ctx.splits = (send_splits, recv_splits, local_batch, pooled.shape, local.shape)
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (send_splits, recv_splits, local_batch, pooled_shape, local_shape) = ctx.splits
        layout = ctx.layout
        grad_local = grad.new_empty(local_shape)
        for m in layout.local_moves:
            _column_runs(grad_local, m.source, m.source_step, m).copy_(
                _column_runs(grad, m.target, m.target_step, m)
            )
        send = layout.scratch.take("grad_out", (sum(recv_splits),), grad, layout.comm_dtype)
        blocks = _blocks(send, recv_splits, local_batch, layout.block_dims)
        for m in layout.moves:
            _column_runs(blocks[m.rank], m.source, m.source_step, m).copy_(
                _column_runs(grad, m.target, m.target_step, m)
            )
        received = layout.scratch.take("grad_pooled", pooled_shape, grad, layout.comm_dtype)
        dist.all_to_all_single(
            received.view(-1), send, send_splits, recv_splits, group=layout.group
        )
        grad_pooled = layout.from_wire("grad_pooled_fp32", received, grad.dtype)
        grad_pooled.div_(dist.get_world_size(layout.group))
        return None, grad_pooled, grad_local, None, None


def _blocks(
    flat: torch.Tensor, splits: list[int], rows: int, dims: list[int]
) -> list[torch.Tensor]:
    """Every rank's [rows, dim] block of an all-to-all buffer."""
    return [c.view(rows, d) for c, d in zip(flat.split(splits), dims)]
