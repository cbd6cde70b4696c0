"""Sharding plans: which rank holds which rows and columns of every table.

A plan maps table names to specs (table-wise, row-wise, column-wise, grid,
data-parallel). Resolving it
against the tables' ``EmbeddingBagConfig``s and a world size gives every table's
concrete shards. Every problem is reported at once, each naming its table: a plan
read from YAML with the tables (and world size) at hand lists its malformed entries
and its misfits in one PlanError.

Each spec owns its meaning: ``problems()`` (its own), ``table_problems(rows, dim,
world_size)`` (fitting a table), ``shards(rows, dim, world_size)``, ``placement(shards)``
(the plan ranks of its DTensor's mesh, None for the whole mesh, and its placement),
``to_dict``/``from_dict`` (plan files name it by ``KIND``), what the data path
asks of it: ``SPLITS_ROWS`` (ids are bucketized by row block), ``REPLICATED`` (a
whole copy on every rank), ``hot_rows``; and what the tools around it read:
``SPLITS_COLUMNS``, ``ROW_BLOCK_ON_EVERY_RANK``, ``named_ranks``,
``named_world_size``, ``row_block_sizes``, ``row_groups``, ``shrunk(rows, kept)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import accumulate
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embshard.errors import PlanError

T = TypeVar("T")


class Kind(StrEnum):
    """The sharding kinds by the names plan files, configs and the planner use."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    DATA_PARALLEL = "data_parallel"
    GRID = "grid"


# FBGEMM's TBE kernels take only embedding dims that are multiples of 4.
FBGEMM_DIM_MULTIPLE = 4


@dataclass(frozen=True)
class TableWise:
    """The whole table on one rank."""

    rank: int

    KIND: ClassVar[Kind] = Kind.TABLE_WISE
    FIELDS: ClassVar[frozenset[str]] = frozenset({"rank"})
    SPLITS_ROWS: ClassVar[bool] = False  # ids are bucketized by row for it
    SPLITS_COLUMNS: ClassVar[bool] = False  # its blocks hold parts of the columns
    REPLICATED: ClassVar[bool] = False  # a whole copy on every rank
    # One row block on each rank of the world, however many: the world's size shapes it.
    ROW_BLOCK_ON_EVERY_RANK: ClassVar[bool] = False
    hot_rows: ClassVar[int] = 0
    # The world size its entries name, one a rank (a row-wise spec's sizes or ranks).
    named_world_size: ClassVar[None] = None
    # Its row blocks' sizes over every rank where the plan gives them (row_wise(sizes)).
    row_block_sizes: ClassVar[None] = None
    # The groups of ranks its column blocks' rows are split over (a grid's).
    row_groups: ClassVar[None] = None

    @property
    def named_ranks(self) -> tuple[int, ...]:
        """The ranks the spec places blocks on by name: its one rank."""
        return (self.rank,)

    def problems(self) -> list[str]:
        if not _is_int(self.rank) or self.rank < 0:
            return [f"rank must be a non-negative int, got {self.rank!r}"]
        return []

    def table_problems(self, rows: int, dim: int, world_size: int | None) -> list[str]:
        return _out_of_world(self.named_ranks, world_size) + _fbgemm_dim(dim, "embedding_dim")

    def shards(self, rows: int, dim: int, world_size: int) -> tuple[TableShard, ...]:
        return (TableShard(self.rank, 0, rows, 0, dim),)

    def shrunk(self, rows: int, kept: int) -> TableWise:
        """The spec for its table cut to its first ``kept`` of ``rows`` rows: itself."""
        return self

    def placement(self, shards: Sequence[TableShard]) -> tuple[tuple[int, ...] | None, Placement]:
        return self.named_ranks, Replicate()

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.KIND.value, "rank": self.rank}

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> TableWise:
        if "rank" not in entry:
            raise PlanError("table_wise needs a rank")
        return table_wise(entry["rank"])


@dataclass(frozen=True)
class RowWise:
    """One row block per rank, in row order: block ``i`` on ``ranks[i]`` (rank ``i``
    when ``ranks`` is None), even (``sizes=None``) or ``sizes[i]`` rows. With
    ``hot_rows``, the first ``hot_rows`` rows are copied on every rank instead and the
    blocks split the rest."""

    sizes: tuple[int, ...] | None = None
    hot_rows: int = 0
    ranks: tuple[int, ...] | None = None

    KIND: ClassVar[Kind] = Kind.ROW_WISE
    FIELDS: ClassVar[frozenset[str]] = frozenset({"sizes", "hot_rows", "ranks"})
    SPLITS_ROWS: ClassVar[bool] = True
    SPLITS_COLUMNS: ClassVar[bool] = False
    REPLICATED: ClassVar[bool] = False
    ROW_BLOCK_ON_EVERY_RANK: ClassVar[bool] = True
    row_groups: ClassVar[None] = None

    @property
    def named_ranks(self) -> tuple[int, ...]:
        """The ranks the spec places blocks on by name: ``ranks``, or none (rank order)."""
        return self.ranks or ()

    @property
    def named_world_size(self) -> int | None:
        """The world size its ``sizes`` (else its ``ranks``) name, one entry a rank of the
        world; None when it gives neither and fits any world."""
        named = self.sizes or self.ranks
        return None if named is None else len(named)

    @property
    def row_block_sizes(self) -> tuple[int, ...] | None:
        """Its row blocks' sizes in row order, one block a rank, where the plan gives them
        (``sizes``); None for even blocks."""
        return self.sizes

    def problems(self) -> list[str]:
        problems = []
        if self.sizes is not None and not all(_is_int(s) and s >= 0 for s in self.sizes):
            problems.append(f"row_wise sizes must be non-negative ints, got {list(self.sizes)}")
        if not _is_int(self.hot_rows) or self.hot_rows < 0:
            problems.append(f"row_wise hot_rows must be a non-negative int, got {self.hot_rows!r}")
        if self.ranks is not None:
            if not all(_is_int(r) and r >= 0 for r in self.ranks):
                problems.append(f"row_wise ranks must be non-negative ints, got {list(self.ranks)}")
            elif len(set(self.ranks)) != len(self.ranks):
                problems.append(
                    f"row_wise ranks {list(self.ranks)} repeat a rank (one block a rank)"
                )
            if self.sizes is not None and len(self.sizes) != len(self.ranks):
                problems.append(
                    f"row_wise gives {plural(len(self.sizes), 'size')} "
                    f"for {plural(len(self.ranks), 'rank')}"
                )
        return problems

    def table_problems(self, rows: int, dim: int, world_size: int | None) -> list[str]:
        problems = _fbgemm_dim(dim, "embedding_dim")
        sizes = self.sizes
        if sizes is not None and world_size is not None and len(sizes) != world_size:
            problems.append(
                f"row_wise gives {plural(len(sizes), 'size')} "
                f"for a world of {plural(world_size, 'rank')}"
            )
        world = None if world_size is None else list(range(world_size))
        if self.ranks is not None and world is not None and sorted(self.ranks) != world:
            problems.append(
                f"row_wise ranks {list(self.ranks)} are not an order of the world's "
                f"{plural(world_size, 'rank')} (each rank once)"
            )
        split = rows - self.hot_rows
        if self.hot_rows and split <= 0:
            problems.append(
                f"row_wise hot_rows {self.hot_rows} leaves none of the table's "
                f"{plural(rows, 'row')} to split (data_parallel() copies a whole table)"
            )
        elif sizes is not None and sum(sizes) != split:
            left = f", the rows left after {self.hot_rows} hot ones" if self.hot_rows else ""
            problems.append(
                f"row_wise sizes {list(sizes)} sum to {sum(sizes)}, not {plural(split, 'row')}"
                + left
            )
        return problems

    def shards(self, rows: int, dim: int, world_size: int) -> tuple[TableShard, ...]:
        hot, split = self.hot_rows, rows - self.hot_rows
        sizes = self.sizes if self.sizes is not None else even_row_sizes(split, world_size)
        ranks = self.ranks if self.ranks is not None else range(world_size)
        offsets = accumulate(sizes, initial=hot)
        copies = tuple(TableShard(r, 0, hot, 0, dim, replica=True) for r in range(world_size))
        blocks = tuple(TableShard(r, o, n, 0, dim) for r, o, n in zip(ranks, offsets, sizes))
        return (copies if hot else ()) + blocks

    def shrunk(self, rows: int, kept: int) -> RowWise:
        """The spec for its table cut to its first ``kept`` of ``rows`` rows: hot rows (one
        at least) and row blocks keep their shares, blocks their ranks."""
        hot = max(1, self.hot_rows * kept // rows) if self.hot_rows else 0
        sizes = self.sizes and _shrunk_sizes(self.sizes, rows - self.hot_rows, kept - hot)
        return replace(self, sizes=sizes, hot_rows=hot)

    def placement(self, shards: Sequence[TableShard]) -> tuple[tuple[int, ...] | None, Placement]:
        return None, Shard(0)

    def to_dict(self) -> dict[str, Any]:
        sizes = {} if self.sizes is None else {"sizes": list(self.sizes)}
        hot = {"hot_rows": self.hot_rows} if self.hot_rows else {}
        ranks = {} if self.ranks is None else {"ranks": list(self.ranks)}
        return {"type": self.KIND.value} | sizes | hot | ranks

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> RowWise:
        return row_wise(entry.get("sizes"), entry.get("hot_rows", 0), entry.get("ranks"))


@dataclass(frozen=True)
class ColumnWise:
    """Column blocks in column order; ``ranks[i]`` holds block ``i`` (ranks may repeat)."""

    ranks: tuple[int, ...]
    widths: tuple[int, ...] | None = None

    KIND: ClassVar[Kind] = Kind.COLUMN_WISE
    FIELDS: ClassVar[frozenset[str]] = frozenset({"ranks", "widths"})
    SPLITS_ROWS: ClassVar[bool] = False
    SPLITS_COLUMNS: ClassVar[bool] = True
    REPLICATED: ClassVar[bool] = False
    ROW_BLOCK_ON_EVERY_RANK: ClassVar[bool] = False
    hot_rows: ClassVar[int] = 0
    named_world_size: ClassVar[None] = None
    row_block_sizes: ClassVar[None] = None
    row_groups: ClassVar[None] = None

    @property
    def named_ranks(self) -> tuple[int, ...]:
        """The ranks the spec places blocks on by name: its column blocks' ranks."""
        return self.ranks

    def problems(self) -> list[str]:
        problems = []
        if not self.ranks:
            problems.append("column_wise needs at least one rank")
        if not all(_is_int(r) and r >= 0 for r in self.ranks):
            problems.append(f"column_wise ranks must be non-negative ints, got {list(self.ranks)}")
        if self.widths is not None:
            if len(self.widths) != len(self.ranks):
                problems.append(
                    f"column_wise gives {plural(len(self.widths), 'width')} "
                    f"for {plural(len(self.ranks), 'rank')}"
                )
            if not all(_is_int(w) and w > 0 for w in self.widths):
                problems.append(
                    f"column_wise widths must be positive ints, got {list(self.widths)}"
                )
        return problems

    def table_problems(self, rows: int, dim: int, world_size: int | None) -> list[str]:
        widths = self.column_widths(dim)
        return _column_problems(
            self.KIND, self.named_ranks, len(self.ranks), widths, dim, world_size
        )

    def column_widths(self, dim: int) -> tuple[int, ...] | None:
        """The column blocks' widths; None when equal widths do not split ``dim``."""
        return _widths(self.widths, len(self.ranks), dim)

    def shards(self, rows: int, dim: int, world_size: int) -> tuple[TableShard, ...]:
        widths = self.column_widths(dim)
        offsets = accumulate(widths, initial=0)
        return tuple(TableShard(r, 0, rows, o, w) for r, o, w in zip(self.ranks, offsets, widths))

    def shrunk(self, rows: int, kept: int) -> ColumnWise:
        """The spec for its table cut to its first ``kept`` of ``rows`` rows: itself."""
        return self

    def placement(self, shards: Sequence[TableShard]) -> tuple[tuple[int, ...] | None, Placement]:
        return tuple(sorted({s.rank for s in shards})), Shard(1)

    def to_dict(self) -> dict[str, Any]:
        widths = {} if self.widths is None else {"widths": list(self.widths)}
        return {"type": self.KIND.value, "ranks": list(self.ranks)} | widths

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> ColumnWise:
        if "ranks" not in entry:
            raise PlanError("column_wise needs ranks")
        return column_wise(entry["ranks"], entry.get("widths"))


@dataclass(frozen=True)
class DataParallel:
    """A full copy of the table on every rank, looked up locally: no ids or pooled rows
    travel for it, and its gradient is averaged over the ranks, as DDP's are."""

    KIND: ClassVar[Kind] = Kind.DATA_PARALLEL
    FIELDS: ClassVar[frozenset[str]] = frozenset()
    SPLITS_ROWS: ClassVar[bool] = False
    SPLITS_COLUMNS: ClassVar[bool] = False
    REPLICATED: ClassVar[bool] = True
    ROW_BLOCK_ON_EVERY_RANK: ClassVar[bool] = False
    hot_rows: ClassVar[int] = 0
    named_ranks: ClassVar[tuple[int, ...]] = ()  # a copy on every rank, none by name
    named_world_size: ClassVar[None] = None
    row_block_sizes: ClassVar[None] = None
    row_groups: ClassVar[None] = None

    def problems(self) -> list[str]:
        return []

    def table_problems(self, rows: int, dim: int, world_size: int | None) -> list[str]:
        return _fbgemm_dim(dim, "embedding_dim")

    def shards(self, rows: int, dim: int, world_size: int) -> tuple[TableShard, ...]:
        return tuple(TableShard(r, 0, rows, 0, dim, replica=True) for r in range(world_size))

    def shrunk(self, rows: int, kept: int) -> DataParallel:
        """The spec for its table cut to its first ``kept`` of ``rows`` rows: itself."""
        return self

    def placement(self, shards: Sequence[TableShard]) -> tuple[tuple[int, ...] | None, Placement]:
        return None, Replicate()

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.KIND.value}

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> DataParallel:
        return data_parallel()


@dataclass(frozen=True)
class Grid:
    """Column blocks in column order, block ``i`` row-wise over the ranks ``ranks[i]``
    (its row blocks in row order on those ranks in the order given), even or
    ``sizes[i]``. ``column_blocks`` is the number of equal-width blocks, or their
    widths."""

    column_blocks: int | tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]
    sizes: tuple[tuple[int, ...], ...] | None = None

    KIND: ClassVar[Kind] = Kind.GRID
    FIELDS: ClassVar[frozenset[str]] = frozenset({"column_blocks", "ranks", "sizes"})
    SPLITS_ROWS: ClassVar[bool] = True
    SPLITS_COLUMNS: ClassVar[bool] = True
    REPLICATED: ClassVar[bool] = False
    ROW_BLOCK_ON_EVERY_RANK: ClassVar[bool] = False
    hot_rows: ClassVar[int] = 0
    named_world_size: ClassVar[None] = None
    row_block_sizes: ClassVar[None] = None

    @property
    def named_ranks(self) -> tuple[int, ...]:
        """The ranks the spec places blocks on by name: every group's, block by block."""
        return tuple(r for group in self.ranks for r in group)

    @property
    def row_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups of ranks its column blocks' rows are split over, in column order."""
        return self.ranks

    def problems(self) -> list[str]:
        """Its blocks, its groups of ranks and their sizes."""
        problems, blocks, groups = [], self.column_blocks, self.ranks
        count = None
        if _is_int(blocks) and blocks > 0:
            count = blocks
        elif isinstance(blocks, tuple) and blocks and all(_is_int(w) and w > 0 for w in blocks):
            count = len(blocks)
        else:
            problems.append(
                f"grid column_blocks must be a positive int or a list of positive widths, "
                f"got {blocks!r}"
            )
        if not groups:
            problems.append("grid needs a group of ranks for every column block, got none")
        for i, group in enumerate(groups):
            if not group:
                problems.append(f"grid block {i} has an empty group of ranks")
            elif not all(_is_int(r) and r >= 0 for r in group):
                problems.append(
                    f"grid block {i}: ranks must be non-negative ints, got {list(group)}"
                )
            elif len(set(group)) != len(group):
                problems.append(
                    f"grid block {i}: ranks {list(group)} repeat a rank (one block a rank)"
                )
        if count is not None and groups and count != len(groups):
            problems.append(
                f"grid has {plural(count, 'column block')} but "
                f"{plural(len(groups), 'group')} of ranks"
            )
        if self.sizes is not None:
            if len(self.sizes) != len(groups):
                problems.append(
                    f"grid gives {plural(len(self.sizes), 'list')} of sizes "
                    f"for {plural(len(groups), 'group')} of ranks"
                )
            for i, (group, sizes) in enumerate(zip(groups, self.sizes)):
                if not all(_is_int(n) and n >= 0 for n in sizes):
                    problems.append(
                        f"grid block {i}: sizes must be non-negative ints, got {list(sizes)}"
                    )
                elif len(sizes) != len(group):
                    problems.append(
                        f"grid block {i} gives {plural(len(sizes), 'size')} "
                        f"for {plural(len(group), 'rank')}"
                    )
        return problems

    def table_problems(self, rows: int, dim: int, world_size: int | None) -> list[str]:
        widths = self.column_widths(dim)
        problems = _column_problems(
            self.KIND, self.named_ranks, len(self.ranks), widths, dim, world_size
        )
        return problems + [
            f"grid block {i} sizes {list(sizes)} sum to {sum(sizes)}, not {plural(rows, 'row')}"
            for i, sizes in enumerate(self.group_sizes(rows))
            if sum(sizes) != rows
        ]

    def column_widths(self, dim: int) -> tuple[int, ...] | None:
        """The column blocks' widths; None when equal widths do not split ``dim``."""
        blocks = self.column_blocks
        if isinstance(blocks, int):
            return _widths(None, blocks, dim)
        return _widths(blocks, len(blocks), dim)

    def group_sizes(self, rows: int) -> tuple[tuple[int, ...], ...]:
        """Each column block's row sizes over its group: given, or even over the group."""
        if self.sizes is not None:
            return self.sizes
        return tuple(even_row_sizes(rows, len(group)) for group in self.ranks)

    def shards(self, rows: int, dim: int, world_size: int) -> tuple[TableShard, ...]:
        widths = self.column_widths(dim)
        offsets = accumulate(widths, initial=0)
        return tuple(
            TableShard(rank, row, size, col, width)
            for group, sizes, col, width in zip(self.ranks, self.group_sizes(rows), offsets, widths)
            for rank, row, size in zip(group, accumulate(sizes, initial=0), sizes)
        )

    def shrunk(self, rows: int, kept: int) -> Grid:
        """The spec for its table cut to its first ``kept`` of ``rows`` rows: given row
        sizes keep their shares of each column block, blocks their ranks."""
        if self.sizes is None:
            return self
        return replace(self, sizes=tuple(_shrunk_sizes(s, rows, kept) for s in self.sizes))

    def placement(self, shards: Sequence[TableShard]) -> tuple[tuple[int, ...] | None, Placement]:
        return tuple(sorted({s.rank for s in shards})), Shard(1)

    def to_dict(self) -> dict[str, Any]:
        blocks = self.column_blocks
        return {
            "type": self.KIND.value,
            "column_blocks": blocks if isinstance(blocks, int) else list(blocks),
            "ranks": [list(group) for group in self.ranks],
        } | ({} if self.sizes is None else {"sizes": [list(s) for s in self.sizes]})

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> Grid:
        missing = [key for key in ("column_blocks", "ranks") if key not in entry]
        if missing:
            raise PlanError(f"grid needs {' and '.join(missing)}")
        blocks = entry["column_blocks"]
        if not isinstance(blocks, int | list):
            raise PlanError(
                f"grid column_blocks must be a count or a list of widths, got {blocks!r}"
            )
        for key in ("ranks", "sizes"):
            value = entry.get(key)
            if value is not None and not all(isinstance(v, list) for v in value):
                raise PlanError(
                    f"grid {key} must be a list of lists, one per column block, got {value!r}"
                )
        return grid(blocks, entry["ranks"], entry.get("sizes"))


TableSpec = TableWise | RowWise | ColumnWise | Grid | DataParallel
# Every spec by the name plan files give it.
SPECS: dict[Kind, type[TableSpec]] = {
    cls.KIND: cls for cls in (TableWise, RowWise, ColumnWise, Grid, DataParallel)
}


def table_wise(rank: int) -> TableWise:
    """Place the whole table on ``rank``."""
    return TableWise(rank=rank)


def row_wise(
    sizes: Sequence[int] | None = None,
    hot_rows: int = 0,
    ranks: Sequence[int] | None = None,
) -> RowWise:
    """Split rows over all ranks: even blocks (as TorchRec: ceil-sized, the last ones
    smaller or empty) or ``sizes[i]`` rows in block ``i`` (zeros allowed), blocks in
    row order on ranks ``0, 1, ...`` (as TorchRec places them) or on ``ranks``, an
    order of all the world's ranks. An order other than the ranks' own spreads the
    tables' last (with ids numbered hottest first, their largest) blocks over the
    ranks instead of piling them on the last rank.

    ``hot_rows``: copy the table's first ``hot_rows`` rows to every rank and split only
    the rest (``sizes`` then sum to the rows left). Each rank looks its own batch's ids
    of those rows up in its copy, so the ids skewed traffic sends most often travel
    nowhere and load no one rank; their gradient is averaged over the ranks in the
    data-parallel tables' all-reduce. For ids numbered hottest first, as frequency
    remapping numbers them. EmbeddingBagCollections only."""
    return RowWise(
        sizes=None if sizes is None else tuple(sizes),
        hot_rows=hot_rows,
        ranks=None if ranks is None else tuple(ranks),
    )


def column_wise(ranks: Sequence[int], widths: Sequence[int] | None = None) -> ColumnWise:
    """Split columns into ``len(ranks)`` blocks, block ``i`` on ``ranks[i]``; equal
    widths unless ``widths`` gives them."""
    return ColumnWise(ranks=tuple(ranks), widths=None if widths is None else tuple(widths))


def data_parallel() -> DataParallel:
    """Replicate the table on every rank (TorchRec's data-parallel sharding)."""
    return DataParallel()


def grid(
    column_blocks: int | Sequence[int],
    ranks: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]] | None = None,
) -> Grid:
    """Split columns into ``column_blocks`` blocks (a count: equal widths; or the
    widths), block ``i`` row-wise over the ranks ``ranks[i]``, in that order: even
    blocks as ``row_wise()`` cuts them over the group, or ``sizes[i][j]`` rows on
    ``ranks[i][j]`` (zeros allowed). With one host's ranks as every group, this is
    TorchRec's grid sharding (table-row-wise with one block)."""
    blocks = column_blocks if isinstance(column_blocks, int) else tuple(column_blocks)
    return Grid(
        column_blocks=blocks,
        ranks=tuple(tuple(group) for group in ranks),
        sizes=None if sizes is None else tuple(tuple(group) for group in sizes),
    )


@dataclass(frozen=True)
class TableShard:
    """The rectangle ``[row_offset:row_offset+rows, col_offset:col_offset+cols]`` on ``rank``.

    A ``replica`` is one of identical rectangles on every rank (a data-parallel table,
    or a row-wise table's hot rows): looked up where the batch is, never sent ids."""

    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    replica: bool = False


@dataclass(frozen=True)
class ShardedTable:
    """A table with its resolved shards: column blocks in column order, each block's
    row blocks in row order."""

    name: str
    num_embeddings: int
    embedding_dim: int
    spec: TableSpec
    shards: tuple[TableShard, ...]

    def shards_on(self, rank: int) -> tuple[TableShard, ...]:
        return tuple(s for s in self.shards if s.rank == rank)

    @property
    def kind(self) -> str:
        """The spec's type as plan files name it: ``table_wise``, ``grid``, ..."""
        return self.spec.KIND

    @property
    def replicated(self) -> bool:
        """Data-parallel: every rank holds the whole table (one shard a rank)."""
        return self.spec.REPLICATED

    @property
    def hot_rows(self) -> int:
        """A row-wise table's rows copied on every rank (``row_wise(hot_rows=...)``), else 0."""
        return self.spec.hot_rows

    @property
    def replicated_rows(self) -> int:
        """Rows ``[0, replicated_rows)`` are copied on every rank: all of a data-parallel
        table's, a row-wise table's hot rows, else none."""
        return next((s.rows for s in self.shards if s.replica), 0)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Ranks that hold a non-empty part of the table, ascending."""
        return tuple(sorted({s.rank for s in self.shards if s.rows and s.cols}))


def local_shards(tables: Mapping[str, ShardedTable], rank: int) -> list[tuple[str, TableShard]]:
    """The non-empty shards on ``rank`` that the all-to-alls serve, in table then column
    order: its TBE's tables. Copies are not among them."""
    return [
        (n, s)
        for n, t in tables.items()
        for s in t.shards_on(rank)
        if s.rows and s.cols and not s.replica
    ]


def even_row_sizes(num_embeddings: int, world_size: int) -> tuple[int, ...]:
    """TorchRec's even row split: ceil-sized blocks, then the remainder, then zeros."""
    block = math.ceil(num_embeddings / world_size) if num_embeddings else 0
    sizes = []
    left = num_embeddings
    for _ in range(world_size):
        sizes.append(min(block, left))
        left -= sizes[-1]
    return tuple(sizes)


def yaml_problem(error: yaml.YAMLError, source: str) -> str:
    """PyYAML's error in one line, at its line and column: PyYAML's own text names the
    source "<unicode string>" and spans several lines."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"{source}: invalid YAML: {' '.join(str(error).split())}"
    start, context = getattr(error, "context_mark", None), getattr(error, "context", None)
    during = f" ({context} at line {start.line + 1})" if context and start else ""
    return f"{source}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {error.problem}{during}"


def plural(count: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``: counts in messages."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def raise_problems(heading: str, problems: Sequence[str]) -> None:
    if problems:
        raise PlanError(f"{heading}:\n  " + "\n  ".join(problems))


def _parse_entries(
    entries: Mapping[str, T], parse: Callable[[T], TableSpec]
) -> tuple[dict[str, TableSpec], list[str]]:
    """The entries that parse into well-formed specs, and every problem of the others,
    each naming its table."""
    specs, problems = {}, []
    for name, entry in entries.items():
        try:
            spec = parse(entry)
        except PlanError as e:
            problems.append(f"table {name!r}: {e}")
            continue
        own = _spec_problems(spec)
        problems += [f"table {name!r}: {p}" for p in own]
        if not own:
            specs[name] = spec
    return specs, problems


def plan_from_entries(
    entries: Mapping[str, T], parse: Callable[[T], TableSpec], heading: str
) -> ShardingPlan:
    """A plan of ``parse(entry)`` per table; every table's PlanError is reported together."""
    specs, problems = _parse_entries(entries, parse)
    raise_problems(heading, problems)
    return ShardingPlan(specs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _spec_problems(spec: Any) -> list[str]:
    """Problems a spec has on its own, before any table or world is known."""
    if not isinstance(spec, tuple(SPECS.values())):
        return [
            "expected table_wise(...), row_wise(...), column_wise(...), grid(...) or "
            f"data_parallel(), got {spec!r}"
        ]
    return spec.problems()


def _out_of_world(ranks: Sequence[int], world_size: int | None) -> list[str]:
    bad = sorted({r for r in ranks if world_size is not None and r >= world_size})
    return [f"rank {r} is outside the world of {plural(world_size, 'rank')}" for r in bad]


def _fbgemm_dim(width: int, what: str) -> list[str]:
    if width % FBGEMM_DIM_MULTIPLE:
        return [f"{what} {width} is not a multiple of {FBGEMM_DIM_MULTIPLE}, which FBGEMM needs"]
    return []


def _widths(given: Sequence[int] | None, count: int, dim: int) -> tuple[int, ...] | None:
    """Column widths: ``given``, or ``count`` equal ones (None when they do not split
    ``dim``)."""
    if given is not None:
        return tuple(given)
    if dim % count:
        return None
    return (dim // count,) * count


def _column_problems(
    kind: str,
    ranks: Sequence[int],
    blocks: int,
    widths: tuple[int, ...] | None,
    dim: int,
    world_size: int | None,
) -> list[str]:
    """What keeps ``blocks`` column blocks on ``ranks`` from splitting a table."""
    problems = _out_of_world(ranks, world_size)
    if widths is None:
        problems.append(f"embedding_dim {dim} does not split into {blocks} equal widths")
    elif sum(widths) != dim:
        problems.append(f"{kind} widths {list(widths)} sum to {sum(widths)}, not {dim}")
    for width in sorted(set(widths or ())):
        problems += _fbgemm_dim(width, "column block width")
    return problems


def _shrunk_sizes(sizes: tuple[int, ...], rows: int, kept: int) -> tuple[int, ...]:
    """``sizes`` of blocks splitting ``rows`` rows, cut to ``kept`` rows in their shares."""
    ends, total = [], 0
    for size in sizes:
        total += size
        ends.append(total * kept // rows)
    return tuple(b - a for a, b in zip([0, *ends], ends))


def _check_world_size(world_size: Any) -> None:
    if not _is_int(world_size) or world_size < 1:
        raise PlanError(f"world size must be a positive int, got {world_size!r}")


def _fit_problems(
    specs: Mapping[str, TableSpec],
    named: Collection[str],
    tables: Sequence[EmbeddingBagConfig],
    world_size: int | None,
) -> list[str]:
    """Tables missing from the plan, plan entries (``named``, well-formed or not) for
    tables the model lacks, and what keeps each spec from sharding its table."""
    names = [t.name for t in tables]
    problems = [f"table {n!r}: no entry in the plan" for n in names if n not in named]
    problems += [
        f"table {n!r}: the plan names it but the model has no such table (tables: {names})"
        for n in named
        if n not in names
    ]
    for config in tables:
        if config.name in specs:
            spec, rows, dim = specs[config.name], config.num_embeddings, config.embedding_dim
            found = spec.table_problems(rows, dim, world_size)
            problems += [f"table {config.name!r}: {p}" for p in found]
    return problems


@dataclass(frozen=True)
class ShardingPlan:
    """How every table of a model is sharded: a mapping of table name to spec."""

    tables: Mapping[str, TableSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", dict(self.tables))
        problems = [
            f"table {name!r}: {p}"
            for name, spec in self.tables.items()
            for p in _spec_problems(spec)
        ]
        raise_problems("invalid sharding plan", problems)

    def resolve(
        self, tables: Sequence[EmbeddingBagConfig], world_size: int
    ) -> dict[str, ShardedTable]:
        """Every table's shards on a world of ``world_size`` ranks, in the tables' order."""
        _check_world_size(world_size)
        problems = _fit_problems(self.tables, self.tables, tables, world_size)
        raise_problems("sharding plan does not fit the model", problems)
        return {
            t.name: ShardedTable(
                t.name,
                t.num_embeddings,
                t.embedding_dim,
                self.tables[t.name],
                self.tables[t.name].shards(t.num_embeddings, t.embedding_dim, world_size),
            )
            for t in tables
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            {"tables": {name: spec.to_dict() for name, spec in self.tables.items()}},
            sort_keys=False,
            default_flow_style=None,
        )

    @classmethod
    def from_dict(
        cls,
        data: Any,
        tables: Sequence[EmbeddingBagConfig] | None = None,
        world_size: int | None = None,
    ) -> ShardingPlan:
        """A plan from its YAML form, ``{"tables": {name: {"type": ..., ...}}}``. Given
        the model's ``tables`` (and ``world_size``), it is checked against them too:
        every problem of every table, malformed entries and misfits alike, comes in one
        PlanError (without ``world_size``, the checks that need it wait for ``resolve``)."""
        if (
            not isinstance(data, dict)
            or set(data) != {"tables"}
            or not isinstance(data["tables"], dict)
        ):
            raise PlanError("a sharding plan file is a mapping with one key, 'tables'")
        if world_size is not None:
            _check_world_size(world_size)
        specs, problems = _parse_entries(data["tables"], _spec_from_dict)
        if tables is not None:
            problems += _fit_problems(specs, data["tables"], tables, world_size)
        raise_problems("invalid sharding plan", problems)
        return cls(specs)

    @classmethod
    def from_yaml(
        cls,
        text: str,
        tables: Sequence[EmbeddingBagConfig] | None = None,
        world_size: int | None = None,
    ) -> ShardingPlan:
        """A plan from YAML text; ``tables`` and ``world_size`` as in ``from_dict``."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PlanError(yaml_problem(e, "sharding plan")) from None
        return cls.from_dict(data, tables, world_size)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def load(
        cls,
        path: str | Path,
        tables: Sequence[EmbeddingBagConfig] | None = None,
        world_size: int | None = None,
    ) -> ShardingPlan:
        """A plan from a YAML file; ``tables`` and ``world_size`` as in ``from_dict``.
        Every problem is a PlanError naming the file."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"{path}: cannot read the plan: {e}") from None
        except yaml.YAMLError as e:
            raise PlanError(yaml_problem(e, str(path))) from None
        try:
            return cls.from_dict(data, tables, world_size)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None


def _spec_from_dict(entry: Any) -> TableSpec:
    if not isinstance(entry, dict) or entry.get("type") not in SPECS:
        raise PlanError(
            f"expected a mapping with type one of {[k.value for k in SPECS]}, got {entry!r}"
        )
    spec = SPECS[entry["type"]]
    unknown = set(entry) - spec.FIELDS - {"type"}
    if unknown:
        raise PlanError(f"unknown keys {sorted(unknown)} for {spec.KIND}")
    for key in ("sizes", "ranks", "widths"):
        if entry.get(key) is not None and not isinstance(entry[key], list):
            raise PlanError(f"{spec.KIND} {key} must be a list, got {entry[key]!r}")
    return spec.from_dict(entry)
