"""Stage 1, the input distribution: check a rank's batch, route its ids to the ranks
that own their rows, exchange counts (the step's one host sync; a batch size and a
problem count in it let a rank with a bad batch, or none, stop everyone alike) and
send the packed ids (lengths, ids and weights of every slot, all sharding types
together) in one all-to-all.

On one rank nothing travels and no collective runs: the checked batch's bags go to
the rank's TBE as they are (or gathered into its order), after the one host read, of
the batch's problem count."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.errors import InputError
from embshard.runtime import native
from embshard.runtime.batch import CheckInputs, LocalBatch, check_batch, describe_problem
from embshard.runtime.dynamic_ids import DynamicIds
from embshard.runtime.routes import Routes
from embshard.runtime.scratch import Scratch, kept
from embshard.runtime.sparse_ops import BucketBounds, block_bucketize, permute_1d, permute_2d

# The counts exchange's int64 columns per peer: the ids sent to it, the sender's batch
# size + 1 (_ENDED when its batches ran out), and the problems its batch has (0 for a
# good one). A lookup's ExtraCounts columns follow.
COUNT_COLUMNS = 3
_IDS, _SIZE, _PROBLEMS = range(COUNT_COLUMNS)
_ENDED = -1


class HeldProblem(Protocol):
    """A problem a lookup found after its step's exchanges (a dynamic table's overflow):
    ``fine`` (a 0-dim bool on the device, no host read) joins the next batch's problem
    count in the counts exchange, so every rank raises together; ``take`` says what it
    was (a host read, only once some rank's flag is down) and forgets it."""

    def fine(self) -> torch.Tensor: ...

    def take(self) -> str | None: ...


@dataclass(frozen=True)
class ExtraCounts:
    """What a kind of lookup adds to the counts exchange: ``per_rank`` [ranks, k],
    columns each rank gets beside its counts, and ``local``, values of this rank read
    back to the host with them (no host sync of their own)."""

    per_rank: torch.Tensor
    local: torch.Tensor


@dataclass(frozen=True)
class Counts:
    """What the counts exchange told this rank, on the host."""

    recv_sizes: list[int]  # payload elements from each rank
    batch_sizes: list[int]  # each rank's local batch size
    failed: bool  # some rank's batch is bad
    ended: tuple[int, ...]  # ranks that have no batch: their batches ran out
    send_sizes: list[int]  # payload elements for each rank
    sent_ids: list[int]  # ids this rank sends each rank
    # The ExtraCounts, read back: the columns each rank sent this one, those this rank
    # sent each, and this rank's local values.
    extra_received: list[list[int]] = field(default_factory=list)
    extra_sent: list[list[int]] = field(default_factory=list)
    extra_local: list[int] = field(default_factory=list)


def gather_input_error(problem: str | None, group: dist.ProcessGroup | None) -> InputError:
    """The same InputError on every rank, naming what each bad rank found. A
    collective: called by every rank once the counts say some batch is bad."""
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return _input_error(problems)


def _input_error(problems: Sequence[str | None]) -> InputError:
    """The InputError naming what each bad rank (``problems[rank]`` not None) found."""
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
    return InputError("bad input batch:\n  " + "\n  ".join(found))


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Weights as they travel among the ids: their float32 bits, as an id dtype."""
    return bits.int().view(torch.float32)


@dataclass(frozen=True)
class Routed:
    """A batch's bags sorted by who gets them, before the payload is built: the
    lengths table (features, or every bucketizing pass's buckets of every feature),
    the ids and weights it describes, and its ``tally`` (``InputDistribution.tally``,
    read back in the counts exchange): how many ids each send row (a destination's
    slot: ``InputDistribution.send_rows``) takes, then the batch's problem count once
    per rank, on the device; None on one rank when its TBE takes the batch's own bags,
    whose flat offsets are then ``offsets``."""

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    tally: torch.Tensor | None
    batch_size: int
    offsets: torch.Tensor | None = None


class Bags(NamedTuple):
    """Bags in a TBE's order (slot by slot, [slots, batch] lengths or flat), their ids
    and weights, and their flat offsets when known."""

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    offsets: torch.Tensor | None = None


class InputDistribution:
    """Routes a local batch's bags to the ranks that own their rows, packs them into
    one buffer for all destinations, and unpacks what a rank receives into its TBE's
    indices, offsets and weights: a pooled lookup's stage 1, and the packing every
    kind of lookup shares (``bags``). Every tensor lives on ``device``; the only host
    read is the counts exchange between ``route`` and ``pack``."""

    def __init__(
        self,
        routes: Routes,
        rank: int,
        scratch: Scratch,
        device: torch.device,
    ) -> None:
        self.routes = routes
        self.rank = rank
        self.world = routes.world_size
        self.scratch = scratch
        self.device = device
        self.slots_per_rank = [len(s) for s in routes.slots]
        # On one rank without hot rows every bucketizing pass keeps each feature whole
        # in bucket 0 (its own rows, none rebased): the TBE's bags are rows of the
        # batch's own lengths, each slot its feature's.
        whole = self.world == 1 and not routes.home_bucket
        self.passes = [] if whole else [BucketBounds.of(b, device) for b in routes.bucket_passes]
        table_rows = len(routes.features) * max(1, len(self.passes) * routes.buckets)
        self.check_inputs = CheckInputs(routes.features, routes.id_limits, table_rows, device)
        send_rows = (
            torch.tensor([routes.embeddings[s.embedding].feature for s in routes.slots[0]])
            if whole
            else routes.send_rows()
        )
        self.send_rows = send_rows.to(device, torch.int32)
        # On one rank, whether the TBE takes the batch's bags as they are.
        self.takes_batch = whole and send_rows.tolist() == list(range(len(routes.features)))
        self.slot_rank = torch.repeat_interleave(
            torch.arange(self.world, device=device),
            torch.tensor(self.slots_per_rank, device=device),
            output_size=len(self.send_rows),
        )
        # The tally's rows of LocalBatch.row_ids: every send row's, then the problem
        # count (its last) once per rank.
        self.tally_rows = torch.cat(
            [self.send_rows.long(), torch.full((self.world,), table_rows, device=device)]
        )
        self._size_tables: dict[tuple[int, int], torch.Tensor] = {}
        self._tally_indices: dict[int, torch.Tensor] = {}
        self.ids_per_element = 2 if routes.weighted else 1
        self._slot_major: tuple[tuple[int, ...], torch.Tensor] | None = None
        keyed = routes.feature_buckets or routes.feature_ranges
        self.dynamic = DynamicIds(routes, device) if keyed else None
        # What the lookup holds against the next step (a dynamic table's overflow).
        self.held: HeldProblem | None = None

    @property
    def bags(self) -> InputDistribution:
        """The packing: a pooled lookup's own."""
        return self

    def route(self, batch: LocalBatch) -> Routed:
        """Bucketize row-wise ids by owner (rebased into its block), and count what
        each slot of each rank gets. Ids of hot rows stay home, in bucket 0. Without
        bucketizing, the batch's own lengths are only summed before the counts have
        said the batch is good, so they need no stand-in; a TBE that takes the
        batch's own bags gets them as they are. Dynamic tables' raw ids go as keys."""
        batch = self.keyed(batch)
        if self.takes_batch:
            return Routed(
                batch.lengths, batch.values, batch.weights, None, batch.batch_size, batch.offsets
            )
        if not self.passes:  # the lengths table is the batch's
            tally = self.tally(batch.lengths, batch.row_ids)
            return Routed(batch.lengths, batch.values, batch.weights, tally, batch.batch_size)
        lengths, values, weights, _ = self.bucketize(batch)
        return Routed(
            lengths, values, weights, self.tally(lengths, batch.row_ids), batch.batch_size
        )

    def keyed(self, batch: LocalBatch) -> LocalBatch:
        """``batch`` with its dynamic tables' raw ids as their keys (``DynamicIds.keyed``),
        what they travel as; the batch itself without dynamic tables."""
        return batch if self.dynamic is None else self.dynamic.keyed(batch)

    def bucketize(
        self, batch: LocalBatch, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The batch's lengths table (features, or every bucketizing pass's buckets of
        every feature), ids and weights; with ``positions`` (a value per id), those
        values in the ids' new order."""
        lengths, values, weights = batch.routable_lengths, batch.values, batch.weights
        if not self.passes:
            return lengths, values, weights, positions
        keys, is_key = values, None
        if self.dynamic is not None:  # keys are routed by their buckets' first rows
            values, is_key = self.dynamic.stand_ins(lengths, keys)
        buckets = [
            block_bucketize(
                lengths.view(-1),
                values,
                weights,
                bounds,
                positions is not None or is_key is not None,
            )
            for bounds in self.passes
        ]
        table_rows = len(self.passes) * self.routes.buckets * len(self.routes.features)
        lengths = _cat([b[0] for b in buckets]).view(table_rows, batch.batch_size)
        if is_key is not None:
            values = _cat([self.dynamic.put_back(b[1], b[3], keys, is_key) for b in buckets])
        else:
            values = _cat([b[1] for b in buckets])
        weights = None if weights is None else _cat([b[2] for b in buckets])
        if positions is not None:  # b[3][i]: where id i went in its pass's buckets
            ids = positions
            positions = _cat([torch.empty_like(ids).scatter_(0, b[3].long(), ids) for b in buckets])
        return lengths, values, weights, positions

    def tally(self, lengths: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """Ids each row of ``Routes.send_rows()`` takes from the lengths table
        ``lengths``, then the problem count of the batch once per rank: what the counts
        exchange adds up, in one gather. The rows' sums are written into ``row_ids``
        (``LocalBatch.row_ids``), in front of the problem count."""
        torch.sum(lengths, 1, out=row_ids[:-1])
        return row_ids.index_select(0, self.tally_rows)

    def ids_per_slot(self, tally: torch.Tensor) -> torch.Tensor:
        """The ids each send row takes, of a ``tally`` (a view)."""
        return tally[: len(self.send_rows)]

    def flag(self, tally: torch.Tensor, bad: torch.Tensor | int) -> None:
        """Count ``bad`` (1 or a 0-dim bool) as one more problem in ``tally``."""
        tally[len(self.send_rows) :].add_(bad)

    def nothing(self) -> Routed:
        """The route of a batch that cannot be sent: nothing for anyone."""
        tally = torch.zeros(len(self.tally_rows), dtype=torch.long, device=self.device)
        empty = torch.zeros(0, dtype=self.routes.id_dtype, device=self.device)
        return Routed(empty.view(0, 0), empty, None, tally, 0)

    def to_send(self, routed: Routed) -> Routed:
        """A pooled lookup sends all it routed."""
        return routed

    def extra_counts(self, batch: LocalBatch | None, routed: Routed) -> None:
        """A pooled lookup adds nothing to the counts exchange."""
        return None

    def keep(self, routed: Routed, counts: Counts) -> None:
        """A pooled lookup's rows come back a bag each, in the order sent: nothing to
        keep."""
        return None

    def exchange_counts(
        self,
        sent: Routed,
        ended: bool,
        group: dist.ProcessGroup | None,
        extra: ExtraCounts | None = None,
    ) -> Counts:
        """Tell every rank how many ids this rank sends it, its batch size, or that it
        has none (``ended``: its batches ran out), and how many problems its batch has
        (``sent.tally``), with the lookup's ``extra`` columns. The step's one host sync:
        one read of one buffer holding what arrived, what this rank sent and the extra
        local values; the payload's sizes follow on the host. The counts sent are one
        kernel: the tally added into each peer's columns, over the batch size's."""
        world, k = self.world, 0 if extra is None else extra.per_rank.shape[1]
        width = COUNT_COLUMNS + k
        local = 0 if extra is None else extra.local.numel()
        buffer = torch.empty(2 * world * width + local, dtype=torch.long, device=self.device)
        received = buffer[: world * width].view(world, width)
        counts = buffer[world * width : 2 * world * width].view(world, width)
        size = _ENDED if ended else sent.batch_size + 1
        torch.index_add(
            self._sizes(size, width), 0, self._tally_index(width), sent.tally, out=counts.view(-1)
        )
        if extra is not None:
            counts[:, COUNT_COLUMNS:] = extra.per_rank
            buffer[2 * world * width :] = extra.local
        dist.all_to_all_single(received, counts, group=group)
        host = buffer.tolist()
        rows = [host[width * r : width * (r + 1)] for r in range(2 * world)]
        came, went = rows[:world], rows[world:]
        batch_sizes = [max(r[_SIZE] - 1, 0) for r in came]
        mine, per_id = self.slots_per_rank[self.rank], self.ids_per_element
        return Counts(
            recv_sizes=[mine * b + per_id * r[_IDS] for b, r in zip(batch_sizes, came)],
            batch_sizes=batch_sizes,
            failed=any(r[_PROBLEMS] != 0 for r in came),
            ended=tuple(rank for rank, r in enumerate(came) if r[_SIZE] == _ENDED),
            send_sizes=[
                slots * sent.batch_size + per_id * r[_IDS]
                for slots, r in zip(self.slots_per_rank, went)
            ],
            sent_ids=[r[_IDS] for r in went],
            extra_received=[r[COUNT_COLUMNS:] for r in came] if extra is not None else [],
            extra_sent=[r[COUNT_COLUMNS:] for r in went] if extra is not None else [],
            extra_local=host[2 * world * width :],
        )

    def _sizes(self, size: int, width: int) -> torch.Tensor:
        """The counts a rank sends before its tally is added: ``size`` (its batch size
        + 1, or _ENDED) in every peer's size column, kept for the last few sizes."""

        def make() -> torch.Tensor:
            sizes = torch.zeros(self.world, width, dtype=torch.long)
            sizes[:, _SIZE] = size
            return sizes.view(-1).to(self.device)

        return kept(self._size_tables, (size, width), make)

    def _tally_index(self, width: int) -> torch.Tensor:
        """Where each value of a tally is added in the counts sent (``world`` rows of
        ``width``): a send row's ids into its rank's ids column, a copy of the problem
        count into each rank's problems column. Kept: a kind of lookup has one width."""

        def make() -> torch.Tensor:
            ranks = torch.arange(self.world, device=self.device)
            return torch.cat([self.slot_rank * width + _IDS, ranks * width + _PROBLEMS])

        return kept(self._tally_indices, width, make)

    def counts_on_one_rank(
        self, sent: Routed, problems: torch.Tensor, extra: ExtraCounts | None = None
    ) -> Counts:
        """What the counts exchange tells the only rank, with no exchange: whether its
        batch is good (no ``problems``: its tally's, when it has one), what it sends
        itself and the extra columns, in the one host read (of ``problems`` alone when
        its TBE takes the batch's own bags). Nothing travels: no payload."""
        if sent.tally is None:
            failed, ids, extra_host = bool(problems), sent.values.numel(), []
        else:
            parts = [sent.tally]
            if extra is not None:
                parts += [extra.per_rank.view(-1), extra.local]
            host = _cat(parts).tolist()
            slots = len(self.send_rows)
            failed, ids, extra_host = host[slots] != 0, sum(host[:slots]), host[slots + 1 :]
        k = 0 if extra is None else extra.per_rank.numel()
        return Counts(
            recv_sizes=[0],
            batch_sizes=[sent.batch_size],
            failed=failed,
            ended=(),
            send_sizes=[0],
            sent_ids=[ids],
            extra_received=[extra_host[:k]] if extra is not None else [],
            extra_sent=[extra_host[:k]] if extra is not None else [],
            extra_local=extra_host[k:],
        )

    def own_bags(self, sent: Routed, counts: Counts) -> Bags:
        """On one rank, the TBE's bags: the batch's own, or the rows of its lengths
        table that the TBE's slots take, gathered in their order."""
        if sent.tally is None:
            return Bags(sent.lengths, sent.values, sent.weights, sent.offsets)
        return Bags(
            *permute_2d(self.send_rows, sent.lengths, sent.values, sent.weights, counts.sent_ids[0])
        )

    def pack(self, routed: Routed, counts: Counts) -> torch.Tensor:
        """One buffer for all destinations: for each, its slots' lengths, ids, weights,
        as ``Routes.id_dtype`` (the copy into the buffer converts them). On CPU one
        kernel (``native.pack``); elsewhere FBGEMM's permute and a ``cat``."""
        payload = self.scratch.take(
            "payload", (sum(counts.send_sizes),), routed.values, self.routes.id_dtype
        )
        if native.available(routed.values):
            native.pack(
                routed.lengths,
                routed.values,
                routed.weights,
                self.send_rows,
                self.slots_per_rank,
                payload,
            )
            return payload
        lengths, values, weights = permute_2d(
            self.send_rows, routed.lengths, routed.values, routed.weights, sum(counts.sent_ids)
        )
        rows = lengths.split(self.slots_per_rank)
        id_chunks = values.split(counts.sent_ids)
        weight_chunks = weights.split(counts.sent_ids) if weights is not None else None
        pieces = []
        for dest, dest_lengths in enumerate(rows):
            pieces += [dest_lengths.reshape(-1), id_chunks[dest]]
            if weight_chunks is not None:
                pieces.append(weight_chunks[dest].view(torch.int32))
        return torch.cat(pieces, out=payload)

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

    def arrived(
        self, in_flight: InputInFlight
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The TBE's input (indices, offsets, weights): on one rank its own bags,
        else what the ids all-to-all brought, once it is done."""
        if in_flight.own is not None:
            lengths, values, weights, offsets = in_flight.own
            if offsets is None:
                offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.view(-1))
            return values, offsets, weights
        counts = in_flight.counts
        return self.unpack(in_flight.take_received(), counts.recv_sizes, counts.batch_sizes)

    def unpack(
        self, received: torch.Tensor, recv_sizes: list[int], batch_sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """TBE input for the global batch: every slot's bags, sources in rank order. On
        CPU one kernel (``native.unpack``); elsewhere FBGEMM's permute and cumsum."""
        if native.available(received):
            slots = self.slots_per_rank[self.rank]
            ids = sum(self.ids_received(recv_sizes, batch_sizes))
            values = self.scratch.take("tbe_ids", (ids,), received)
            offsets = self.scratch.take("tbe_offsets", (slots * sum(batch_sizes) + 1,), received)
            weights = None
            if self.routes.weighted:
                weights = self.scratch.take("tbe_weights", (ids,), received, torch.float32)
            native.unpack(received, recv_sizes, batch_sizes, slots, values, offsets, weights)
            return values, offsets, weights
        bag_lengths, values, bag_weights = self.received_bags(received, recv_sizes, batch_sizes)
        bag_lengths, values, bag_weights = permute_1d(
            self.slot_major(batch_sizes), bag_lengths, values, bag_weights, values.numel()
        )
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(bag_lengths)
        return values, offsets, bag_weights

    def slot_major(self, batch_sizes: list[int]) -> torch.Tensor:
        """The order that takes bags as they arrived to the TBE's
        (``_slot_major_order``), kept while the batch sizes stay the same."""
        key = tuple(batch_sizes)
        if self._slot_major is None or self._slot_major[0] != key:
            order = _slot_major_order(self.slots_per_rank[self.rank], batch_sizes, self.device)
            self._slot_major = (key, order)
        return self._slot_major[1]

    def ids_received(self, recv_sizes: list[int], batch_sizes: list[int]) -> list[int]:
        """The ids in each source's chunk: what follows its slots' bag lengths, less
        the weights' bits."""
        slots = self.slots_per_rank[self.rank]
        return [
            (size - slots * batch) // self.ids_per_element
            for size, batch in zip(recv_sizes, batch_sizes)
        ]

    def received_bags(
        self, received: torch.Tensor, recv_sizes: list[int], batch_sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Bag lengths, ids and weights as they arrived: (source, slot, sample)."""
        slots = self.slots_per_rank[self.rank]
        counts = self.ids_received(recv_sizes, batch_sizes)
        lengths, ids, weights = [], [], []
        for chunk, count, batch_size in zip(received.split(recv_sizes), counts, batch_sizes):
            start = slots * batch_size
            lengths.append(chunk[:start])
            ids.append(chunk[start : start + count])
            weights.append(chunk[start + count :])
        bag_weights = _from_bits(torch.cat(weights)) if self.routes.weighted else None
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


KeptT = TypeVar("KeptT")
RoutedT = TypeVar("RoutedT")


@dataclass
class InputInFlight(Generic[KeptT]):
    """A batch after its input distribution started: what the counts exchange said, the
    checked local batch (for the data-parallel tables and MEAN pooling), the ids
    all-to-all on its way (or, on one rank, the TBE's bags, which never left), and what
    the kind of lookup kept to bring its rows back. Or the InputError its batch (or
    another rank's) raised, to raise when it is used."""

    counts: Counts | None = None
    batch: LocalBatch | None = None
    received: torch.Tensor | None = None
    work: dist.Work | None = None
    error: InputError | None = None
    kept: KeptT | None = None
    # Ranks whose batches ran out (``signal_end``): nothing travels, the batch is not used.
    ended: tuple[int, ...] = ()
    own: Bags | None = None

    def take_received(self) -> torch.Tensor:
        """Wait for the ids all-to-all and take its buffer: once the caller drops it,
        it may serve the next batch."""
        self.work.wait()
        received, self.received = self.received, None
        return received


class IdsRouting(Protocol[RoutedT, KeptT]):
    """What a kind of lookup brings to stage 1 (``start_input_dist``): how it routes a
    checked batch, what it sends of the route (packed by ``bags``, the one packing
    every kind shares), what it adds to the counts exchange, and what it keeps of the
    route to bring its rows back. ``InputDistribution`` is the pooled kind;
    ``SequenceInputDistribution`` the kind of a row per id."""

    @property
    def bags(self) -> InputDistribution: ...

    def route(self, batch: LocalBatch) -> RoutedT: ...

    def nothing(self) -> RoutedT: ...

    def to_send(self, routed: RoutedT) -> Routed: ...

    def extra_counts(self, batch: LocalBatch | None, routed: RoutedT) -> ExtraCounts | None: ...

    def keep(self, routed: RoutedT, counts: Counts) -> KeptT: ...


def start_input_dist(
    features: KeyedJaggedTensor | None,
    stage: IdsRouting[RoutedT, KeptT],
    group: dist.ProcessGroup | None,
) -> InputInFlight[KeptT]:
    """Stage 1 (collective): check the batch, route its ids to their owners,
    exchange counts (the one host sync), and start the ids all-to-all. Needs only the
    input distribution, no tables: ``embshard simulate`` runs it too. On one rank,
    ``_start_on_one_rank``.

    ``features`` None says, in the counts exchange, that this rank's batches ran out;
    when any rank says so, no ids travel and every rank learns which ranks ended."""
    bags = stage.bags
    if bags.world == 1:
        return _start_on_one_rank(features, stage)
    if features is None:
        batch, routed, problem = None, stage.nothing(), None
    else:
        batch, routed, problem = _route(features, stage)
    sent = stage.to_send(routed)
    if features is not None and batch is None:  # its structure is wrong
        bags.flag(sent.tally, 1)
    elif batch is not None and bags.held is not None:
        bags.flag(sent.tally, ~bags.held.fine())
    extra = stage.extra_counts(batch, routed)
    counts = bags.exchange_counts(sent, features is None, group, extra)
    if counts.ended:
        return _ended(counts)
    if counts.failed:
        problem = _problem(features, bags, batch, problem)
        return InputInFlight(error=gather_input_error(problem, group))
    payload = bags.pack(sent, counts)
    received, work = bags.exchange(payload, counts.send_sizes, counts.recv_sizes, group)
    return InputInFlight(counts, batch, received, work, kept=stage.keep(routed, counts))


def _start_on_one_rank(
    features: KeyedJaggedTensor | None, stage: IdsRouting[RoutedT, KeptT]
) -> InputInFlight[KeptT]:
    """Stage 1 on one rank: no collective. The same check, the same InputError (no
    other rank to tell), and one host read: the batch's problem count, with what sizes
    the TBE's input where that is not the batch's own. The TBE's bags stay here."""
    bags = stage.bags
    if features is None:
        return _ended(Counts([0], [0], failed=False, ended=(0,), send_sizes=[0], sent_ids=[0]))
    batch, routed, problem = _route(features, stage)
    if problem is None:
        sent = stage.to_send(routed)
        problems = batch.problems
        if bags.held is not None and sent.tally is None:
            problems = problems + (~bags.held.fine()).long()
        elif bags.held is not None:
            bags.flag(sent.tally, ~bags.held.fine())
        counts = bags.counts_on_one_rank(sent, problems, stage.extra_counts(batch, routed))
        if not counts.failed:
            own = bags.own_bags(sent, counts)
            return InputInFlight(counts, batch, kept=stage.keep(routed, counts), own=own)
        problem = _problem(features, bags, batch, problem)
    return InputInFlight(error=_input_error([problem]))


def _ended(counts: Counts) -> InputInFlight:
    """The input of a step that does not run: ``counts.ended`` ran out of batches."""
    error = InputError(f"{_ranks(counts.ended)} ran out of batches: this batch was not used")
    return InputInFlight(counts, error=error, ended=counts.ended)


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _route(
    features: KeyedJaggedTensor, stage: IdsRouting[RoutedT, KeptT]
) -> tuple[LocalBatch | None, RoutedT, str | None]:
    """The checked batch, routed to its owners, or what is wrong with it (and an
    empty route). Never raises: a rank that failed here must still tell the others
    in the counts exchange."""
    try:
        batch = check_batch(features, stage.bags.routes, stage.bags.check_inputs)
        if isinstance(batch, str):
            return None, stage.nothing(), batch
        return batch, stage.route(batch), None
    except Exception as e:
        return None, stage.nothing(), f"routing the batch failed: {e!r}"


def _problem(
    features: KeyedJaggedTensor,
    bags: InputDistribution,
    batch: LocalBatch | None,
    problem: str | None,
) -> str | None:
    """What is wrong with this rank's batch, or held against it by its lookup, if
    anything, once some rank's is bad."""
    held = bags.held.take() if bags.held is not None else None
    if problem is None and batch is not None and bool(batch.problems):
        try:
            problem = describe_problem(features, bags.routes)
        except Exception as e:
            problem = f"checking the batch failed: {e!r}"
    return "; ".join(p for p in (problem, held) if p) or None
