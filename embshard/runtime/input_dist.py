"""Stage 1, the input distribution: check a rank's batch, route its ids to the ranks
that own their rows, exchange counts (the step's one host sync; a status in it lets a
rank with a bad batch, or none, stop everyone alike) and send the packed ids (lengths,
ids and weights of every slot, all sharding types together) in one all-to-all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.errors import InputError
from embshard.runtime.batch import LocalBatch, check_batch, describe_problem
from embshard.runtime.routes import Routes
from embshard.runtime.scratch import Scratch

_OK, _BAD, _ENDED = 0, 1, 2  # a rank's status in the counts exchange


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


def exchange_counts(
    send_sizes: torch.Tensor,
    sent_ids: torch.Tensor,
    batch_size: int,
    valid: torch.Tensor,
    group: dist.ProcessGroup | None,
    extra: ExtraCounts | None = None,
    ended: bool = False,
) -> Counts:
    """Tell every rank how much this rank sends it, its batch size, and whether its
    batch is good or it has none (``ended``: its batches ran out), with the lookup's
    ``extra`` columns. The step's one host sync: reading back what arrived, together
    with ``send_sizes`` and ``sent_ids`` (per destination), which size the payload, and
    the extra columns sent and local values, which size a sequence lookup's outputs."""
    world = send_sizes.numel()
    status = torch.full_like(send_sizes, _ENDED) if ended else torch.where(valid, _OK, _BAD)
    status = status.expand(world)
    columns = [send_sizes, torch.full_like(send_sizes, batch_size), status]
    counts = torch.stack(columns, dim=1)
    local = []
    if extra is not None:
        per_rank = extra.per_rank.to(counts.dtype)
        counts = torch.cat([counts, per_rank], dim=1)
        local = [per_rank.view(-1), extra.local.to(counts.dtype)]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    host = torch.cat([received.view(-1), send_sizes, sent_ids, *local]).tolist()
    width = counts.shape[1]
    rows = [host[width * r : width * (r + 1)] for r in range(world)]
    rest = host[width * world :]
    k = width - len(columns)
    extra_sent = rest[2 * world : 2 * world + world * k]
    return Counts(
        recv_sizes=[r[0] for r in rows],
        batch_sizes=[r[1] for r in rows],
        failed=any(r[2] == _BAD for r in rows),
        ended=tuple(rank for rank, r in enumerate(rows) if r[2] == _ENDED),
        send_sizes=rest[:world],
        sent_ids=rest[world : 2 * world],
        extra_received=[r[len(columns) :] for r in rows] if extra is not None else [],
        extra_sent=[extra_sent[k * d : k * (d + 1)] for d in range(world)]
        if extra is not None
        else [],
        extra_local=rest[2 * world + world * k :],
    )


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

    @property
    def bags(self) -> InputDistribution:
        """The packing: a pooled lookup's own."""
        return self

    def route(self, batch: LocalBatch) -> Routed:
        """Bucketize row-wise ids by owner (rebased into its block), and count what
        each rank gets. Ids of hot rows stay home, in bucket 0."""
        lengths, values, weights, _ = self.bucketize(batch)
        return Routed(lengths, values, weights, self.ids_per_rank(lengths), batch.batch_size)

    def bucketize(
        self, batch: LocalBatch, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The batch's lengths table (features, or every bucketizing pass's buckets of
        every feature), ids and weights; with ``positions`` (a value per id), those
        values in the ids' new order."""
        lengths, values, weights = batch.lengths, batch.values, batch.weights
        if not self.passes:
            return lengths, values, weights, positions
        buckets = [
            torch.ops.fbgemm.block_bucketize_sparse_features(
                lengths.view(-1),
                values,
                False,
                positions is not None,
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
            positions = _cat([torch.empty_like(ids).scatter_(0, b[4].long(), ids) for b in buckets])
        return lengths, values, weights, positions

    def ids_per_rank(self, lengths: torch.Tensor) -> torch.Tensor:
        """Ids each rank gets from the lengths table ``lengths``."""
        per_slot = lengths.index_select(0, self.send_rows).sum(1)
        ids_per_rank = torch.zeros(self.world, dtype=torch.long, device=self.device)
        return ids_per_rank.index_add_(0, self.slot_rank, per_slot)

    def nothing(self) -> Routed:
        """The route of a batch that cannot be sent: nothing for anyone."""
        zeros = torch.zeros(self.world, dtype=torch.long, device=self.device)
        empty = torch.zeros(0, dtype=self.routes.id_dtype, device=self.device)
        return Routed(empty.view(0, 0), empty, None, zeros, 0)

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
        bag_lengths, values, bag_weights = self.received_bags(received, recv_sizes, batch_sizes)
        if self.world > 1:
            order = self.slot_major(batch_sizes)
            bag_lengths, values, bag_weights = torch.ops.fbgemm.permute_1D_sparse_data(
                order, bag_lengths, values, bag_weights, values.numel()
            )
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(bag_lengths)
        return values, offsets, bag_weights

    def slot_major(self, batch_sizes: list[int]) -> torch.Tensor:
        """The order that takes bags as they arrived to the TBE's (``_slot_major_order``)."""
        return _slot_major_order(self.slots_per_rank[self.rank], batch_sizes, self.device)

    def received_bags(
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


KeptT = TypeVar("KeptT")
RoutedT = TypeVar("RoutedT")


@dataclass
class InputInFlight(Generic[KeptT]):
    """A batch after its input distribution started: what the counts exchange said, the
    checked local batch (for the data-parallel tables and MEAN pooling), the ids
    all-to-all on its way, and what the kind of lookup kept to bring its rows back.
    Or the InputError its batch (or another rank's) raised, to raise when it is used."""

    counts: Counts | None = None
    batch: LocalBatch | None = None
    received: torch.Tensor | None = None
    work: dist.Work | None = None
    error: InputError | None = None
    kept: KeptT | None = None
    # Ranks whose batches ran out (``signal_end``): nothing travels, the batch is not used.
    ended: tuple[int, ...] = ()


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
    input distribution, no tables: ``embshard simulate`` runs it too.

    ``features`` None says, in the counts exchange, that this rank's batches ran out;
    when any rank says so, no ids travel and every rank learns which ranks ended."""
    bags = stage.bags
    batch, routed, problem = (None, stage.nothing(), None)
    if features is not None:
        batch, routed, problem = _route(features, stage)
    sent = stage.to_send(routed)
    counts = exchange_counts(
        bags.send_sizes(sent),
        sent.ids_per_rank,
        sent.batch_size,
        batch.valid if batch is not None else torch.zeros((), dtype=torch.bool, device=bags.device),
        group,
        stage.extra_counts(batch, routed),
        ended=features is None,
    )
    if counts.ended:
        error = InputError(f"{_ranks(counts.ended)} ran out of batches: this batch was not used")
        return InputInFlight(counts, error=error, ended=counts.ended)
    if counts.failed:
        problem = _problem(features, bags.routes, batch, problem)
        return InputInFlight(error=gather_input_error(problem, group))
    payload = bags.pack(sent, counts.sent_ids)
    received, work = bags.exchange(payload, counts.send_sizes, counts.recv_sizes, group)
    return InputInFlight(counts, batch, received, work, kept=stage.keep(routed, counts))


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
        batch = check_batch(features, stage.bags.routes, stage.bags.feature_rows)
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
