"""What one simulated step moved through a rank, and its totals over the steps.

Both ways ``embshard simulate`` runs (every rank a thread, or one sending rank at a
time) count a step by what each rank sent and received of the ids all-to-all, what
its slots received and its own batch's ids in copies; ``step_report`` turns those into
a ``RankReport`` the same way for both. The pooled all-to-alls' bytes follow from the
batch sizes and the slot widths: no table is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from embshard.runtime.batch import LocalBatch
from embshard.runtime.input_dist import COUNT_COLUMNS
from embshard.runtime.routes import Routes
from embshard.storage.dynamic import DynamicStats

_COUNTS_BYTES = COUNT_COLUMNS * 8  # the counts all-to-all, per peer (int64)
_WEIGHT_BYTES = 4  # FP32 tables and pooled rows


@dataclass(frozen=True)
class Traffic:
    """Bytes a rank puts into one all-to-all, and gets out of it."""

    sent: int = 0
    received: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent + other.sent, self.received + other.received)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent - other.sent, self.received - other.received)

    def __mul__(self, factor: int) -> Traffic:
        return Traffic(self.sent * factor, self.received * factor)

    @property
    def both(self) -> int:
        return self.sent + self.received

    @property
    def reversed(self) -> Traffic:
        """The same all-to-all run backward: what was sent is received."""
        return Traffic(self.received, self.sent)


@dataclass
class RankReport:
    """One rank over the simulated batches: totals, except ``buffers`` (the largest
    step's) and ``seconds`` (per step)."""

    rank: int
    samples: int = 0  # its own
    ids_received: int = 0  # = the rows its TBE looks up
    ids_local: int = 0  # its own batch's ids of copies (data-parallel, hot rows), looked up here
    bags_received: int = 0  # = the pooled rows it sends back
    lookup_bytes: int = 0  # embedding bytes all those lookups read
    counts: Traffic = Traffic()
    ids: Traffic = Traffic()
    pooled: Traffic = Traffic()  # forward
    pooled_grad: Traffic = Traffic()  # backward: the pooled all-to-all in reverse
    # The part of ids, pooled and pooled_grad to or from ranks of other hosts; the rest
    # stays inside the rank's host (its bytes to itself among them).
    ids_across: Traffic = Traffic()
    pooled_across: Traffic = Traffic()
    pooled_grad_across: Traffic = Traffic()
    buffers: int = 0  # the four all-to-alls' send and receive buffers
    weights: int = 0
    optimizer_state: int = 0
    shards: list[str] = field(default_factory=list)
    lookup_seconds: float = 0.0  # per step, at the planner's prices
    moving_seconds: float = 0.0
    remap_seconds: float = 0.0  # its dynamic tables' id maps
    # In sharding groups (2-D), a step's all-reduce over the rank's copies in the other
    # groups: bytes it sends (and receives), whether they cross hosts, their seconds.
    sync_bytes: int = 0
    sync_across: bool = False
    sync_seconds: float = 0.0
    # Its dynamic tables' ids over the batches (live: at the end), and per table it
    # holds, the rows those counts cover (of a column-wise or grid table, the first
    # column block it holds) and the bytes of its id maps (every column block's). The
    # tables it holds later column blocks of only: their counts repeat those of the
    # first block's ranks, and the table's totals leave them out.
    dynamic: dict[str, DynamicStats] = field(default_factory=dict)
    dynamic_rows: dict[str, int] = field(default_factory=dict)
    dynamic_repeats: list[str] = field(default_factory=list)
    dynamic_ids: int = 0  # the ids its id maps remapped
    id_maps: dict[str, int] = field(default_factory=dict)

    def add_step(self, step: RankReport) -> None:
        self.samples += step.samples
        self.ids_received += step.ids_received
        self.ids_local += step.ids_local
        self.bags_received += step.bags_received
        self.lookup_bytes += step.lookup_bytes
        self.counts += step.counts
        self.ids += step.ids
        self.pooled += step.pooled
        self.pooled_grad += step.pooled_grad
        self.ids_across += step.ids_across
        self.pooled_across += step.pooled_across
        self.pooled_grad_across += step.pooled_grad_across
        self.buffers = max(self.buffers, step.buffers)

    @property
    def seconds(self) -> float:
        return self.lookup_seconds + self.moving_seconds + self.sync_seconds + self.remap_seconds

    @property
    def moved(self) -> int:
        """Bytes the planner prices for a rank's shards: ids in, pooled rows out,
        their gradients in."""
        return self.ids.received + self.pooled.sent + self.pooled_grad.received

    @property
    def moved_across(self) -> int:
        """The part of ``moved`` to or from other hosts."""
        return self.ids_across.received + self.pooled_across.sent + self.pooled_grad_across.received

    @property
    def across(self) -> Traffic:
        """Ids, pooled rows and their gradients sent to and received from other hosts."""
        return self.ids_across + self.pooled_across + self.pooled_grad_across

    @property
    def inside(self) -> Traffic:
        """Ids, pooled rows and their gradients sent and received inside the host."""
        return self.ids + self.pooled + self.pooled_grad - self.across


def host_of(rank: int, ranks_per_host: int) -> slice:
    """The ranks of ``rank``'s host, ``ranks_per_host`` a host in rank order."""
    first = rank - rank % ranks_per_host
    return slice(first, first + ranks_per_host)


def across_hosts(per_rank: Sequence[int], rank: int, ranks_per_host: int) -> int:
    """The sum of ``per_rank`` over the ranks on other hosts than ``rank``'s."""
    return sum(per_rank) - sum(per_rank[host_of(rank, ranks_per_host)])


def pooled_widths(routes: Routes) -> list[int]:
    """Every rank's pooled row: the sum of its slots' widths."""
    return [sum(routes.slot_dims(r)) for r in range(routes.world_size)]


def copies_looked_up(routes: Routes, batch: LocalBatch) -> list[int]:
    """Ids of a rank's own batch looked up in its copies (data-parallel tables, hot
    rows), per embedding of ``Routes.local_embeddings``."""
    ids = batch.values.split(batch.ids_per_feature.tolist())
    return [int((ids[e.feature] < e.replicated_rows).sum()) for e in routes.local_embeddings]


def step_report(
    routes: Routes,
    rank: int,
    batch_sizes: Sequence[int],
    widths: Sequence[int],
    slot_ids: Sequence[int],
    payload: Traffic,
    payload_across: Traffic,
    copies: Sequence[int],
    ranks_per_host: int,
) -> RankReport:
    """One step through ``rank``: every rank's batch size and pooled width
    (``pooled_widths``), the ids each of its slots received, the elements it sent and
    received in the ids all-to-all (``payload``; ``payload_across`` those to and from
    other hosts) and its own batch's ids in copies (``copies_looked_up``)."""
    world, local, dims = routes.world_size, batch_sizes[rank], routes.slot_dims(rank)

    def pooled(samples: int, width: int) -> Traffic:
        """The pooled rows this rank sends for ``samples`` of its peers' (its slots'
        widths) and gets for its own samples from peers of ``width`` in all."""
        return Traffic(samples * sum(dims) * _WEIGHT_BYTES, local * width * _WEIGHT_BYTES)

    pooled_all, pooled_away, counts = Traffic(), Traffic(), Traffic()  # on one rank none
    if world > 1:
        pooled_all = pooled(sum(batch_sizes), sum(widths))
        pooled_away = pooled(
            across_hosts(batch_sizes, rank, ranks_per_host),
            across_hosts(widths, rank, ranks_per_host),
        )
        counts = Traffic(world * _COUNTS_BYTES, world * _COUNTS_BYTES)
    local_dims = [e.dim for e in routes.local_embeddings]
    step = RankReport(
        rank,
        samples=local,
        ids_received=sum(slot_ids),
        ids_local=sum(copies),
        bags_received=sum(batch_sizes) * len(dims),
        lookup_bytes=sum(n * d for n, d in [*zip(slot_ids, dims), *zip(copies, local_dims)])
        * _WEIGHT_BYTES,
        counts=counts,
        ids=payload * routes.id_dtype.itemsize,
        pooled=pooled_all,
        pooled_grad=pooled_all.reversed,
        ids_across=payload_across * routes.id_dtype.itemsize,
        pooled_across=pooled_away,
        pooled_grad_across=pooled_away.reversed,
    )
    step.buffers = sum(t.both for t in (step.counts, step.ids, step.pooled, step.pooled_grad))
    return step
