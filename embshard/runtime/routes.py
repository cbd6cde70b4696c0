"""Static routing of a sharded EmbeddingBagCollection, the same on every rank.

Built once from the resolved plan. An *embedding* is one output key: a feature looked
up in a table (TorchRec's names: the feature, or ``feature@table`` when a feature
feeds several tables). A *slot* is one TBE feature on a rank: an embedding looked up
in one local shard. Every rank sends every other rank, for each of its slots in
order, the bags of its local batch: the raw ids for table-wise and column-wise
shards, the rebased ids of that rank's row block for row-wise and grid shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from embshard.plan.specs import ShardedTable, TableShard, local_shards
from embshard.runtime.keys import KEY_LIMIT


@dataclass(frozen=True)
class EmbeddingRoute:
    """One output embedding of the module (a feature looked up in a table, a key of
    its output): where its columns go in the output, how its table is laid out, and
    which of its ids travel."""

    name: str
    feature: int
    table: str
    dim: int
    mean: bool
    out_offset: int
    row_wise: bool  # its table's column blocks are split by rows: row-wise or grid
    # Looked up in this rank's own copy of its table: none of its ids travel.
    data_parallel: bool = False
    # Ids below this are looked up in this rank's copy of those rows (all of a
    # data-parallel table's, a row-wise table's hot rows); the others travel.
    replicated_rows: int = 0


@dataclass(frozen=True)
class Slot:
    """One shard's share of an embedding's lookups: the ids of embedding ``embedding``
    that go to ``shard``'s rank, looked up in that rank's TBE table ``tbe_table``."""

    embedding: int
    shard: TableShard
    tbe_table: int
    bucket_pass: int  # the pass whose buckets carry its ids (see Routes.bucket_passes)
    # The bucket of that pass its ids are in: its row block's place in row order for a
    # row-wise or grid shard, 0 (the whole feature) for the others.
    bucket: int = 0


@dataclass(frozen=True)
class Routes:
    """Who sends what where, fixed at sharding: the module's features and output
    embeddings, every rank's slots in TBE order, and how ids are bucketized."""

    features: tuple[str, ...]
    embeddings: tuple[EmbeddingRoute, ...]
    slots: tuple[tuple[Slot, ...], ...]
    # Ids are bucketized by owner before sending, all features at once, when any table
    # is row-wise or grid: pass k splits each feature by one set of row boundaries
    # (world_size + 1 of them, bucket k for the k-th row block: ``Slot.bucket``), the
    # row blocks of a row-wise table or of one grid column block (empty buckets last,
    # for ranks outside its group), or (0, rows, ..., rows), which keeps the feature
    # whole in bucket 0. When a table has hot rows, every pass has one more bucket
    # first, never sent: its hot ids (the others' is empty), and bucket k + 1 is the
    # k-th block's. No passes: the batch's own lengths are sent.
    bucket_passes: tuple[tuple[tuple[int, ...], ...], ...]
    # Per feature: the smallest table it feeds, whose rows bound its ids.
    feature_rows: tuple[int, ...]
    feature_table: tuple[str, ...]
    weighted: bool
    # Per feature: its ids below this stay home (a row-wise table's hot rows), 0 for
    # none. Such a feature feeds no other table.
    feature_hot_rows: tuple[int, ...] = ()
    # Per feature: (buckets, rows per bucket) of the dynamic table it feeds (which it
    # alone feeds), or None. Its raw ids travel as keys (``hash_ids``), routed by bucket.
    feature_buckets: tuple[tuple[int, int] | None, ...] = ()
    # Per feature: (input size, first row of each row block in row order) of the
    # managed-collision table it feeds (storage.managed_collision), or None. Its raw ids
    # travel as they are, routed by input range: with ``n`` blocks, ids
    # ``[k * ceil(size / n), +ceil(size / n))`` to the k-th block, whatever its rows.
    feature_ranges: tuple[tuple[int, tuple[int, ...]] | None, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.slots)

    @property
    def home_bucket(self) -> int:
        """1 when the passes' bucket 0 holds the hot ids that stay home, else 0."""
        return int(any(self.feature_hot_rows))

    @property
    def buckets(self) -> int:
        """Buckets a pass splits each feature into."""
        return self.world_size + self.home_bucket

    @property
    def id_dtype(self) -> torch.dtype:
        """What ids and lengths travel as: int32, half the bytes of int64, unless a
        table has 2**31 rows or more or is dynamic (its keys are 63 bits)."""
        return torch.int32 if max(self.id_limits, default=0) < 2**31 else torch.int64

    @cached_property
    def id_limits(self) -> tuple[int, ...]:
        """Per feature, the bound its ids are checked against: its rows, 2**63 for the
        raw ids of a dynamic table, the input size for a managed-collision table's."""
        return tuple(
            KEY_LIMIT if buckets is not None else given[0] if given is not None else rows
            for rows, buckets, given in zip(
                self.feature_rows, self.buckets_or_none, self.ranges_or_none
            )
        )

    @property
    def buckets_or_none(self) -> tuple[tuple[int, int] | None, ...]:
        """``feature_buckets`` for every feature (None where no table is dynamic)."""
        return self.feature_buckets or (None,) * len(self.features)

    @property
    def ranges_or_none(self) -> tuple[tuple[int, tuple[int, ...]] | None, ...]:
        """``feature_ranges`` for every feature (None where no table is managed)."""
        return self.feature_ranges or (None,) * len(self.features)

    @property
    def output_dim(self) -> int:
        return sum(e.dim for e in self.embeddings)

    def send_rows(self) -> torch.Tensor:
        """For every (destination, slot) in destination order, the row of the sender's
        lengths table (pass, bucket, feature) that holds its bags: the slot's bucket,
        one further with a home bucket."""
        num_features, rows = len(self.features), []
        for slots in self.slots:
            for slot in slots:
                bucket = slot.bucket_pass * self.buckets + slot.bucket + self.home_bucket
                rows.append(bucket * num_features + self.embeddings[slot.embedding].feature)
        return torch.tensor(rows, dtype=torch.long)

    def slot_dims(self, rank: int) -> list[int]:
        return [s.shard.cols for s in self.slots[rank]]

    @property
    def local_embeddings(self) -> tuple[EmbeddingRoute, ...]:
        """The embeddings looked up in copies, in output order: the local lookup's
        columns."""
        return tuple(e for e in self.embeddings if e.replicated_rows)

    def column_targets(self) -> tuple[tuple[int, ...], ...]:
        """The output column of every column of every pooled block: each rank's block
        (its slots in order), then the local lookup's (its embeddings in output order).
        Columns that land in the same output column are summed there, in this order:
        the row blocks of a row-wise table (or of one grid column block) on several
        ranks, and a table's hot rows looked up locally."""
        blocks = []
        for slots in self.slots:
            columns: list[int] = []
            for slot in slots:
                start = self.embeddings[slot.embedding].out_offset + slot.shard.col_offset
                columns += range(start, start + slot.shard.cols)
            blocks.append(tuple(columns))
        local = [
            c for e in self.local_embeddings for c in range(e.out_offset, e.out_offset + e.dim)
        ]
        return (*blocks, tuple(local))

    def mean_feature_by_column(self) -> torch.Tensor | None:
        """Per output column: 1 + the feature whose bag lengths divide it (MEAN), or 0
        (SUM); None when no table pools by MEAN."""
        if not any(e.mean for e in self.embeddings):
            return None
        return torch.tensor(
            [e.feature + 1 if e.mean else 0 for e in self.embeddings for _ in range(e.dim)]
        )


def _block_order(table: ShardedTable, col_offset: int, world_size: int) -> tuple[int, ...]:
    """Every rank, in the row order of its block of the column block at ``col_offset``
    (ranks that hold none last): bucket k of the pass that splits that column block
    holds the rows of rank ``order[k]``."""
    start = {
        s.rank: s.row_offset for s in table.shards if s.col_offset == col_offset and not s.replica
    }
    return tuple(sorted(range(world_size), key=lambda r: (start.get(r, table.num_embeddings), r)))


def _block_orders(
    tables: dict[str, ShardedTable], world_size: int
) -> dict[tuple[str, int], tuple[int, ...]]:
    """``_block_order`` of every column block (table, column offset) of every row-wise
    and grid table: both the boundaries and each slot's bucket come from here."""
    return {
        (name, col): _block_order(table, col, world_size)
        for name, table in tables.items()
        if table.spec.SPLITS_ROWS
        for col in {s.col_offset for s in table.shards}
    }


def _row_boundaries(
    table: ShardedTable, col_offset: int, order: tuple[int, ...]
) -> tuple[int, ...]:
    """Bucket k, rows ``[b[k], b[k + 1])``, is the row block of rank ``order[k]`` in the
    column block at ``col_offset`` (empty for ranks that hold none), after the hot
    rows, which no bucket holds."""
    rows = [0] * len(order)
    for s in table.shards:
        if s.col_offset == col_offset and not s.replica:
            rows[s.rank] += s.rows
    return tuple(accumulate((rows[r] for r in order), initial=table.replicated_rows))


def _bucket_passes(
    embeddings: Sequence[EmbeddingRoute],
    tables: dict[str, ShardedTable],
    feature_rows: Sequence[int],
    world_size: int,
    orders: dict[tuple[str, int], tuple[int, ...]],
) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], dict[tuple[int, int], int]]:
    """Each feature's distinct row boundaries (whole for its table-wise and column-wise
    tables, the row blocks of each row-wise table and of each grid column block),
    dealt one to a pass; and the pass of each (embedding, column offset). One pass
    when every feature feeds at most one row-split block and nothing else; none when
    no table is row-wise or grid."""
    wholes = [(0, *[rows] * world_size) for rows in feature_rows]
    bounds: dict[tuple[int, int], tuple[int, ...]] = {}
    for i, e in enumerate(embeddings):
        if e.data_parallel:  # looked up where it is
            continue
        table = tables[e.table]
        for col in sorted({s.col_offset for s in table.shards}):
            if e.row_wise:
                bounds[i, col] = _row_boundaries(table, col, orders[e.table, col])
            else:
                bounds[i, col] = wholes[e.feature]
    needed: list[list[tuple[int, ...]]] = [[] for _ in feature_rows]
    # Wholes first: a feature's whole boundaries, where it needs them, are pass 0's.
    for (i, _), b in sorted(bounds.items(), key=lambda item: embeddings[item[0][0]].row_wise):
        feature = embeddings[i].feature
        if b not in needed[feature]:
            needed[feature].append(b)
    block_pass = {key: needed[embeddings[key[0]].feature].index(b) for key, b in bounds.items()}
    if not any(e.row_wise for e in embeddings):
        return (), block_pass
    count = max(len(n) for n in needed)
    passes = tuple(
        tuple(n[k] if k < len(n) else whole for n, whole in zip(needed, wholes))
        for k in range(count)
    )
    return passes, block_pass


def build_routes(
    configs: Sequence[BaseEmbeddingConfig],
    tables: dict[str, ShardedTable],
    world_size: int,
    weighted: bool,
    dynamic: Mapping[str, tuple[int, int]] | None = None,
    ranges: Mapping[str, tuple[int, tuple[int, ...]]] | None = None,
) -> Routes:
    """The routes of ``configs`` sharded as ``tables``; ``dynamic``: the dynamic tables'
    (buckets, rows per bucket), their plans checked (``storage.dynamic.check_dynamic``);
    ``ranges``: the managed-collision tables' (``Routes.feature_ranges``)."""
    features: list[str] = []
    for config in configs:
        features += [f for f in config.feature_names if f not in features]
    embeddings, offset = [], 0
    for config, names in zip(configs, get_embedding_names_by_table(configs)):
        for feature, name in zip(config.feature_names, names):
            embeddings.append(
                EmbeddingRoute(
                    name=name,
                    feature=features.index(feature),
                    table=config.name,
                    dim=config.embedding_dim,
                    mean=isinstance(config, EmbeddingBagConfig)
                    and config.pooling == PoolingType.MEAN,
                    out_offset=offset,
                    row_wise=tables[config.name].spec.SPLITS_ROWS,
                    data_parallel=tables[config.name].replicated,
                    replicated_rows=tables[config.name].replicated_rows,
                )
            )
            offset += config.embedding_dim
    hot_rows = _feature_hot_rows(embeddings, features)
    rows = {c.name: c.num_embeddings for c in configs}
    smallest = [
        min((c.name for c in configs if f in c.feature_names), key=rows.__getitem__)
        for f in features
    ]
    feature_rows = [rows[t] for t in smallest]
    orders = _block_orders(tables, world_size)
    passes, block_pass = _bucket_passes(embeddings, tables, feature_rows, world_size, orders)
    if any(hot_rows):  # bucket 0 first: [0, hot) for a hot feature, empty for the others
        passes = tuple(tuple((0, *bounds) for bounds in p) for p in passes)
    row_bucket = {  # (table, column offset, rank): the bucket of its row block
        (name, col, rank): k
        for (name, col), order in orders.items()
        for k, rank in enumerate(order)
    }
    slots = []
    for rank in range(world_size):
        shards = local_shards(tables, rank)
        # Grouped by shard: FBGEMM's CPU row-wise Adagrad needs each table's features
        # to be contiguous in the TBE.
        slots.append(
            tuple(
                Slot(
                    e,
                    shard,
                    index,
                    block_pass[e, shard.col_offset],
                    row_bucket.get((table, shard.col_offset, rank), 0),
                )
                for index, (table, shard) in enumerate(shards)
                for e, emb in enumerate(embeddings)
                if table == emb.table
            )
        )
    return Routes(
        features=tuple(features),
        embeddings=tuple(embeddings),
        slots=tuple(slots),
        bucket_passes=passes,
        feature_rows=tuple(feature_rows),
        feature_table=tuple(smallest),
        weighted=weighted,
        feature_hot_rows=hot_rows,
        feature_buckets=_per_feature(configs, features, dynamic or {}),
        feature_ranges=_per_feature(configs, features, ranges or {}),
    )


def _per_feature(
    configs: Sequence[BaseEmbeddingConfig],
    features: Sequence[str],
    by_table: Mapping[str, tuple],
) -> tuple:
    """Per feature, its table's entry in ``by_table`` or None (``Routes.feature_buckets``,
    ``feature_ranges``); empty when ``by_table`` is."""
    if not by_table:
        return ()
    of = {f: by_table[c.name] for c in configs if c.name in by_table for f in c.feature_names}
    return tuple(of.get(f) for f in features)


def _feature_hot_rows(
    embeddings: Sequence[EmbeddingRoute], features: Sequence[str]
) -> tuple[int, ...]:
    """Each feature's hot rows (``Routes.feature_hot_rows``); a ValueError when a
    feature of a table with hot rows feeds another table too, whose lookups would
    lose those ids."""
    hot = [0] * len(features)
    for e in embeddings:
        if e.replicated_rows and not e.data_parallel:
            others = [o.table for o in embeddings if o.feature == e.feature and o is not e]
            if others:
                raise ValueError(
                    f"table {e.table!r}: hot_rows needs its features to feed no other table, "
                    f"but feature {features[e.feature]!r} also feeds {others}"
                )
            hot[e.feature] = e.replicated_rows
    return tuple(hot)
