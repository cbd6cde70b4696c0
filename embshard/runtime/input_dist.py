"""Stage 1, the input distribution: check a rank's batch, route its ids to the ranks
that own their rows, exchange counts (the step's one host sync; a status in it lets a
rank with a bad batch, or none, stop everyone alike) and send the packed ids (lengths,
ids and weights of every slot, all sharding types together) in one all-to-all."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.errors import InputError
from embshard.runtime.batch import LocalBatch, check_batch, describe_problem
from embshard.runtime.routes import Routes
from embshard.runtime.scratch import Scratch

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


@dataclass
class InputInFlight:
    """A batch after its input distribution started: what the counts exchange said, the
    checked local batch (for the data-parallel tables and MEAN pooling), and the ids
    all-to-all on its way. Or the InputError its batch (or another rank's) raised, to
    raise when it is used."""

    counts: Counts | None = None
    batch: LocalBatch | None = None
    received: torch.Tensor | None = None
    work: dist.Work | None = None
    error: InputError | None = None
    # Sequence lookups only: where the ids sent went.
    sent: SentIds | None = None
    # Ranks whose batches ran out (``signal_end``): nothing travels, the batch is not used.
    ended: tuple[int, ...] = ()


def start_input_dist(
    features: KeyedJaggedTensor | None,
    stage: InputDistribution,
    group: dist.ProcessGroup | None,
) -> InputInFlight:
    """Stage 1 (collective): check the batch, route its ids to their owners,
    exchange counts (the one host sync), and start the ids all-to-all. Needs only the
    input distribution, no tables: ``embshard simulate`` runs it too.

    ``features`` None says, in the counts exchange, that this rank's batches ran out;
    when any rank says so, no ids travel and every rank learns which ranks ended."""
    batch, routed, problem = (None, stage.nothing(), None)
    if features is not None:
        batch, routed, problem = _route(features, stage)
    sequence = stage.sequence_counts(batch, routed) if stage.sequence else None
    counts = exchange_counts(
        stage.send_sizes(routed),
        routed.ids_per_rank,
        routed.batch_size,
        batch.valid
        if batch is not None
        else torch.zeros((), dtype=torch.bool, device=stage.device),
        group,
        sequence,
        ended=features is None,
    )
    if counts.ended:
        error = InputError(f"{_ranks(counts.ended)} ran out of batches: this batch was not used")
        return InputInFlight(counts, error=error, ended=counts.ended)
    if counts.failed:
        problem = _problem(features, stage.routes, batch, problem)
        return InputInFlight(error=gather_input_error(problem, group))
    payload = stage.pack(routed, counts.sent_ids)
    received, work = stage.exchange(payload, counts.send_sizes, counts.recv_sizes, group)
    sent = stage.sent_ids(routed, counts) if stage.sequence else None
    return InputInFlight(counts, batch, received, work, sent=sent)


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _route(
    features: KeyedJaggedTensor, stage: InputDistribution
) -> tuple[LocalBatch | None, Routed, str | None]:
    """The checked batch, routed to its owners, or what is wrong with it (and an
    empty route). Never raises: a rank that failed here must still tell the others
    in the counts exchange."""
    try:
        batch = check_batch(features, stage.routes, stage.feature_rows)
        if isinstance(batch, str):
            return None, stage.nothing(), batch
        return batch, stage.route(batch), None
    except Exception as e:
        return None, stage.nothing(), f"routing the batch failed: {e!r}"


def _problem(
    features: KeyedJaggedTensor, routes: Routes, batch: LocalBatch | None, problem: str | None
) -> str | None:
    """What is wrong with this rank's batch, if anything, once some rank's is bad."""
    if problem is not None or batch is None or bool(batch.valid):
        return problem
    try:
        return describe_problem(features, routes)
    except Exception as e:
        return f"checking the batch failed: {e!r}"
