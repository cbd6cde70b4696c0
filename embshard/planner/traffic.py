"""Measured traffic: how many lookups each table's rows get, and plans cut by it.

The planner otherwise assumes ids are uniform over a table's rows; real ids are
skewed (low ids are hot in the synthetic data and in Criteo), so an even row-wise
split sends most of a table's lookups to its first rank. ``TrafficStats`` holds the
lookups of every row that got any (a histogram with one-row buckets, kept sparse),
and the bags and ids per sample, counted from data by the application;
``balanced_sizes`` cuts a table's rows where its cumulative lookups divide evenly,
after the ``hot_rows`` that no cut could balance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from embshard.plan.specs import ShardingPlan, data_parallel, row_wise


@dataclass(frozen=True)
class TableTraffic:
    """One table's measured lookups: ``ids`` the distinct rows looked up (sorted),
    ``counts`` how often each was, over ``samples`` samples in ``bags`` bags."""

    num_embeddings: int
    ids: np.ndarray
    counts: np.ndarray
    samples: int
    bags: int

    @property
    def lookups(self) -> int:
        return int(self.counts.sum())

    def share(self, offset: int, rows: int) -> float:
        """The fraction of the lookups that land in rows ``[offset, offset + rows)``."""
        if not self.lookups:
            return rows / self.num_embeddings
        lo, hi = np.searchsorted(self.ids, [offset, offset + rows])
        return float(self.counts[lo:hi].sum()) / self.lookups


@dataclass(frozen=True)
class TrafficStats:
    """Every table's measured traffic, by table name."""

    tables: dict[str, TableTraffic]


def balanced_sizes(
    traffic: TableTraffic, pieces: int, first_row: int = 0, multiple: int = 1
) -> list[int]:
    """Row block sizes for rows ``[first_row, rows)`` (summing to their count, each at
    least 0) that give every block about ``1 / pieces`` of their lookups: each cut
    falls between the rows where the cumulative lookups cross ``k / pieces`` of them,
    on the side nearer it. Rows with no lookups measured are split evenly. With a
    ``multiple`` (a dynamic table's rows a bucket, dividing the rows and ``first_row``)
    the same is done over groups of that many rows: every cut falls on a multiple."""
    if multiple > 1:
        groups, at = np.unique(traffic.ids // multiple, return_index=True)
        grouped = TableTraffic(
            traffic.num_embeddings // multiple,
            groups,
            np.add.reduceat(traffic.counts, at) if len(at) else traffic.counts,
            traffic.samples,
            traffic.bags,
        )
        sizes = balanced_sizes(grouped, pieces, first_row // multiple)
        return [size * multiple for size in sizes]
    n = traffic.num_embeddings
    start = int(np.searchsorted(traffic.ids, first_row))
    ids, counts = traffic.ids[start:], traffic.counts[start:]
    if not counts.sum():
        base, extra = divmod(n - first_row, pieces)
        return [base + (i < extra) for i in range(pieces)]
    cumulative = np.cumsum(counts)
    targets = cumulative[-1] * np.arange(1, pieces) / pieces
    j = np.searchsorted(cumulative, targets)  # the row where the target is crossed
    before = cumulative[j] - counts[j]
    nearer_before = targets - before < cumulative[j] - targets
    cuts = np.where(nearer_before, ids[j], ids[j] + 1)
    cuts = np.maximum.accumulate(np.clip(cuts, first_row, n))
    edges = np.concatenate([[first_row], cuts, [n]])
    return np.diff(edges).astype(int).tolist()


def hot_rows(traffic: TableTraffic, pieces: int, tolerance: float = 0.1) -> int:
    """The fewest leading rows to copy on every rank (``row_wise(hot_rows=...)``) so that
    no row left holds more than ``tolerance`` of a block's even share (``1 / pieces``)
    of the lookups left: ``balanced_sizes`` then cuts those rows into blocks within
    about ``tolerance`` of even. 0 where no row is that hot; every row (the table's
    ``num_embeddings``: copy it whole) where no cut of fewer would do."""
    if pieces < 2 or not traffic.lookups:
        return 0
    counts = traffic.counts
    left = np.cumsum(counts[::-1])[::-1]  # lookups of row i and every row after it
    hottest = np.maximum.accumulate(counts[::-1])[::-1]  # the most any of them got
    fine = np.flatnonzero(hottest * pieces <= tolerance * left)
    if not len(fine):
        return traffic.num_embeddings
    return int(traffic.ids[fine[0]]) if fine[0] else 0


def balanced_plan(
    stats: TrafficStats,
    world_size: int,
    row_bytes: Mapping[str, float] | None = None,
    rows_per_bucket: Mapping[str, int] | None = None,
) -> ShardingPlan:
    """Every table row-wise over all ranks, its lookups balanced: its ``hot_rows``
    copied on every rank and the rest cut by ``balanced_sizes``; a table no cut can
    balance (a few rows over many ranks) copied whole. Each rank then receives about
    as many lookups as any other, whatever that costs in ids and pooled rows moved
    (the planner weighs those). ``shard`` refuses hot rows on a table whose features
    feed another table too. A dynamic table (``rows_per_bucket``: its rows a bucket, by
    table) is cut in whole buckets, with no hot rows and never copied.

    A table's blocks get about equal lookups whichever ranks hold them, so they go
    where they even out memory (``spread_blocks``; ``row_bytes``: the bytes of a row
    of each table, 1 where not given): in rank order, every table's coldest and
    largest block would land on the last rank."""
    weight, buckets = row_bytes or {}, rows_per_bucket or {}
    specs, cuts = {}, {}
    for name, traffic in stats.tables.items():
        hot = 0 if name in buckets else hot_rows(traffic, world_size)
        if hot == traffic.num_embeddings:
            specs[name] = data_parallel()
        else:
            cuts[name] = hot, balanced_sizes(traffic, world_size, hot, buckets.get(name, 1))
    held = [0.0] * world_size
    largest_first = sorted(cuts, key=lambda n: -weight.get(n, 1) * sum(cuts[n][1]))
    for name in largest_first:
        hot, sizes = cuts[name]
        ranks = spread_blocks([weight.get(name, 1) * rows for rows in sizes], held)
        specs[name] = row_wise(sizes, hot_rows=hot, ranks=ranks)
    return ShardingPlan({name: specs[name] for name in stats.tables})


def spread_blocks(blocks: Sequence[float], held: list[float]) -> list[int] | None:
    """Ranks for a table's row blocks of ``blocks`` bytes each: the largest to the rank
    that ``held`` least so far, and so on, ``held`` updated; None for rank order."""
    ranks = [0] * len(blocks)
    by_size = sorted(range(len(blocks)), key=lambda i: -blocks[i])
    for i, rank in zip(by_size, sorted(range(len(held)), key=held.__getitem__)):
        ranks[i] = rank
        held[rank] += blocks[i]
    return None if ranks == sorted(ranks) else ranks
