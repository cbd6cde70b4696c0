"""Sharding planner: a balanced placement of the tables under the cost model
(``planner/cost.py``).

``plan_tables`` takes TorchRec's ``EmbeddingBagConfig``s and ``EmbeddingConfig``s
(sequence tables) with each feature's mean pooling beside them (or tables that carry
their own: ``DescribedTable``, as a training config's do).
Splitting a table adds traffic, so it splits only where that lowers the slowest rank.
A greedy packing places the tables (those kept to the fewest ranks first, then the
costliest first) each in its cheapest sharding whose pieces fit under a target cost
and in memory on the least-loaded ranks that may take them, else in row blocks cut
to the room ranks have. With no target that is LPT table-wise, the obvious plan;
bisection then finds the lowest target that packs, down to the lower bound. Last,
each split table is placed again in its cheapest sharding that fits under the
slowest rank: whole, where it can be. Across hosts, bytes to a rank's own host and to
others are priced apart (``Topology.seconds``), and with measured traffic the search
also tries grids whose column blocks are each row-split over one host's ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from embshard.errors import PlanningError
from embshard.plan.specs import (
    Kind,
    ShardedTable,
    ShardingPlan,
    TableShard,
    column_wise,
    data_parallel,
    grid,
    plural,
    row_wise,
    table_wise,
)
from embshard.planner.cost import ROW_SPLIT, CostModel
from embshard.planner.report import UNCUT, PlanReport, RankLoad, TableChoice
from embshard.planner.tables import (
    AnyTable,
    PlannedTable,
    TableConstraint,
    as_config,
    planned_tables,
)
from embshard.planner.topology import Topology, format_bytes
from embshard.planner.traffic import TableTraffic, TrafficStats, balanced_sizes, hot_rows
from embshard.storage.id_map import IdMapSpec
from embshard.storage.optimizers import FUSED_OPTIMIZERS

_KINDS = (Kind.TABLE_WISE, Kind.ROW_WISE, Kind.COLUMN_WISE)  # what the packing cuts tables into
_SHARDINGS = (*_KINDS, Kind.DATA_PARALLEL)
_COPY_ONLY = (Kind.DATA_PARALLEL,)
# A dynamic table's layouts: each row block a contiguous range of its buckets with their
# map; each column block has a map of its own (of all the rows), priced on its rank.
DYNAMIC_KINDS = (Kind.TABLE_WISE, Kind.ROW_WISE, Kind.COLUMN_WISE)


def _shapes(
    table: PlannedTable, kind: str, blocks: int, traffic: TableTraffic | None = None
) -> list[tuple[int, int]]:
    """Even pieces (row blocks differ by a bucket at most: a row, for a static table),
    in rank order; with measured ``traffic``, row blocks that each get an even share of
    the lookups."""
    if kind == Kind.COLUMN_WISE:
        return [(table.num_embeddings, table.embedding_dim // blocks)] * blocks
    if kind == Kind.DATA_PARALLEL:
        return [(table.num_embeddings, table.embedding_dim)] * blocks
    if kind == Kind.ROW_WISE and traffic is not None:
        sizes = balanced_sizes(traffic, blocks, multiple=table.rows_per_bucket)
        return [(rows, table.embedding_dim) for rows in sizes]
    if kind == Kind.ROW_WISE:
        return [(rows, table.embedding_dim) for rows in table.row_blocks(blocks)]
    return [(table.num_embeddings, table.embedding_dim)]


def _biggest(table: PlannedTable, kind: str, blocks: int) -> tuple[int, int]:
    """The shape of the biggest of ``_shapes``."""
    if kind == Kind.ROW_WISE:
        return table.row_blocks(blocks)[0], table.embedding_dim
    if kind == Kind.DATA_PARALLEL:
        return table.num_embeddings, table.embedding_dim
    return table.num_embeddings, table.embedding_dim // blocks


def _linear(table: PlannedTable, model: CostModel, kind: str) -> tuple[float, float]:
    """``(a, b)``: a piece with a share s of the table's rows (row_wise) or columns
    (column_wise) costs ``a s + b``, as ``shard_cost`` is linear in both; so k pieces
    cost ``a + b k`` in all, however unevenly cut. Table-wise is the one piece; a
    data-parallel table, a copy on each rank at ``replica_cost``."""
    whole = model.whole_cost(table)
    if kind == Kind.TABLE_WISE:
        return whole, 0.0
    if kind == Kind.DATA_PARALLEL:
        return 0.0, model.replica_cost(table)
    empty = (0, table.embedding_dim) if kind == Kind.ROW_WISE else (table.num_embeddings, 0)
    b = model.shard_cost(table, kind, *empty)
    return whole - b, b


@dataclass(slots=True)
class _Option:
    """One even sharding of a table, priced by its costliest and biggest piece."""

    kind: str
    blocks: int
    total: float
    piece_cost: float
    piece_memory: int
    waste: int  # the memory its pieces need beyond the table whole
    grid: _GridCut | None = None  # a grid's cut, for Kind.GRID


@dataclass(frozen=True)
class _GridCut:
    """A grid over whole hosts: ``columns`` column blocks, each row-split over the ranks
    of its own host in ``sizes`` (rows cut by the measured lookups); its pieces' cost
    and memory, in that row order, the same in every column block."""

    columns: int
    cols: int  # each column block's width
    sizes: tuple[int, ...]
    costs: tuple[float, ...]
    memory: tuple[int, ...]


@dataclass(frozen=True)
class _Table:
    """A table with everything the packing needs, worked out once."""

    spec: PlannedTable
    kinds: tuple[str, ...]
    linear: dict[str, tuple[float, float]]  # by kind, see _linear
    options: tuple[_Option, ...]  # cheapest in all first
    allowed: np.ndarray | None  # the ranks it may use, where its constraint says
    whole_cost: float
    whole_memory: int
    traffic: TableTraffic | None = None  # measured lookups per row, where given


@dataclass(slots=True)
class _Piece:
    rank: int
    rows: int
    cols: int
    cost: float
    memory: int
    block: int = 0  # a grid's column block


@dataclass
class _Packing:
    """Every table's kind and pieces, and what each rank carries; ``unplaced`` is the
    table that found no room, if one did not. ``slack`` is the memory all ranks have
    free beyond what the tables not yet placed need whole: column blocks each keep
    their rows' optimizer state, so splits that cost memory must stay within it."""

    cost: np.ndarray
    memory: np.ndarray
    slack: int
    layouts: dict[str, tuple[str, list[_Piece]]] = field(default_factory=dict)
    unplaced: _Table | None = None

    @property
    def slowest(self) -> float:
        return float(self.cost.max())

    def add(self, table: _Table, kind: str, pieces: list[_Piece]) -> None:
        self.layouts[table.spec.name] = (kind, pieces)
        for p in pieces:
            self.cost[p.rank] += p.cost
            self.memory[p.rank] += p.memory
        self.slack -= sum(p.memory for p in pieces) - table.whole_memory

    def remove(self, table: _Table) -> None:
        for p in self.layouts.pop(table.spec.name)[1]:
            self.cost[p.rank] -= p.cost
            self.memory[p.rank] -= p.memory
            self.slack += p.memory
        self.slack -= table.whole_memory


def _kinds(constraint: TableConstraint) -> tuple[str, ...]:
    if constraint.column_blocks:
        return (Kind.COLUMN_WISE,)
    return tuple(constraint.types or _SHARDINGS)


def _packed_kinds(kinds: Sequence[str], copies: bool) -> tuple[str, ...]:
    """The kinds the packing tries: data-parallel with ``copies``, or where nothing
    else is allowed (``plan_tables`` searches with and without copies)."""
    cut = tuple(k for k in kinds if k != Kind.DATA_PARALLEL)
    return tuple(kinds) if copies or not cut else cut


def _limit(constraint: TableConstraint, world: int) -> int:
    return len(set(constraint.ranks)) if constraint.ranks else world


def _split_counts(table: PlannedTable, kind: str, limit: int, constraint: TableConstraint):
    """Piece counts worth trying: 2, 3, 4, 6, 8, 12, ... up to the ranks allowed, and 1
    (as good as whole) where whole is not allowed."""
    if kind == Kind.TABLE_WISE:
        return [1]
    if kind == Kind.DATA_PARALLEL:
        return [limit]  # every rank: _table drops it where the constraint's ranks are fewer
    if kind == Kind.COLUMN_WISE and constraint.column_blocks:
        return [constraint.column_blocks]
    counts, k = {limit}, 2
    while k < limit:
        counts |= {k, k + k // 2}
        k *= 2
    least = 2 if Kind.TABLE_WISE in _kinds(constraint) else 1
    if kind == Kind.COLUMN_WISE:
        fit = [k for k in counts | {1} if k <= limit and table.embedding_dim % (4 * k) == 0]
    else:
        fit = [k for k in counts | {1} if k <= min(limit, table.buckets)]
    return sorted(k for k in fit if k >= least)


def _table(
    table: PlannedTable,
    model: CostModel,
    constraint: TableConstraint,
    world: int,
    traffic: TableTraffic | None = None,
    copies: bool = False,
) -> _Table:
    kinds, limit = _kinds(constraint), _limit(constraint, world)
    if limit < world:  # a data-parallel copy goes on every rank
        kinds = tuple(k for k in kinds if k != Kind.DATA_PARALLEL)
    whole = model.memory(table, table.num_embeddings, table.embedding_dim)
    linear = {kind: _linear(table, model, kind) for kind in kinds}
    options = []
    for kind in _packed_kinds(kinds, copies):
        a, b = linear[kind]
        for blocks in _split_counts(table, kind, limit, constraint):
            if kind == Kind.ROW_WISE and traffic is not None:
                sizes = [r for r, _ in _shapes(table, kind, blocks, traffic)]
                rows, cols = max(sizes), table.embedding_dim
                share = max(_row_shares(traffic, sizes))
            else:
                rows, cols = _biggest(table, kind, blocks)
                share = (
                    rows / table.num_embeddings
                    if kind == Kind.ROW_WISE
                    else cols / table.embedding_dim
                )
            memory = model.memory(table, rows, cols)
            waste = memory * blocks - whole if kind in (Kind.COLUMN_WISE, Kind.DATA_PARALLEL) else 0
            options.append(_Option(kind, blocks, a + b * blocks, a * share + b, memory, waste))
    if not options:
        raise PlanningError(f"table {table.name!r}: its constraints allow no sharding")
    allowed = None
    if constraint.ranks:
        allowed = np.zeros(world, dtype=bool)
        allowed[list(constraint.ranks)] = True
    options.sort(key=_cheapest_first)
    return _Table(
        table, kinds, linear, tuple(options), allowed, model.whole_cost(table), whole, traffic
    )


def _cheapest_first(option: _Option) -> tuple[float, int, str]:
    return option.total, option.blocks, option.kind


def _with_grids(
    tables: Sequence[_Table], model: CostModel, constraints: Mapping[str, TableConstraint]
) -> list[_Table] | None:
    """The tables with their host grids among their options, those no option of theirs
    matches or beats (``_undominated``); None where no table has one."""
    free, found, out = TableConstraint(), False, []
    for table in tables:
        spec, constraint = table.spec, constraints.get(table.spec.name, free)
        grids = []
        if _griddable(spec, model, constraint, table.traffic):
            grids = _grid_options(spec, model, table.traffic, table.whole_memory)
            grids = _undominated(grids, table.options)
        if grids:
            found = True
            options = tuple(sorted((*table.options, *grids), key=_cheapest_first))
            table = dataclasses.replace(table, options=options)
        out.append(table)
    return out if found else None


def _griddable(
    table: PlannedTable,
    model: CostModel,
    constraint: TableConstraint,
    traffic: TableTraffic | None,
) -> bool:
    """Whether the search tries host grids for ``table``: a pooled static table free of
    constraints, in a world of two whole hosts or more, with measured lookups to cut
    its rows by (an even cut of skewed ids would load each host's first rank)."""
    hosts = model.topology.world_size // model.topology.ranks_per_host
    return (
        hosts >= 2
        and traffic is not None
        and not table.sequence
        and not table.dynamic
        and constraint == TableConstraint()
        and table.num_embeddings >= model.topology.ranks_per_host
    )


def _grid_columns(table: PlannedTable, topology: Topology) -> list[int]:
    """Column block counts a host grid may have: 1 (row-wise over one host's ranks) up
    to one a whole host, each block a multiple of 4 columns wide."""
    hosts = topology.world_size // topology.ranks_per_host
    return [c for c in range(1, hosts + 1) if table.embedding_dim % (4 * c) == 0]


def _grid_options(
    table: PlannedTable, model: CostModel, traffic: TableTraffic, whole: int
) -> list[_Option]:
    """Host grids of ``table``: ``c`` column blocks, each row-wise over the ranks of
    its own host, rows cut so each gets an even share of the measured lookups."""
    per_host = model.topology.ranks_per_host
    sizes = tuple(balanced_sizes(traffic, per_host))
    if not all(sizes):  # too few rows, or too hot a row, for a block on every rank
        return []
    shares = _row_shares(traffic, sizes)
    options = []
    for columns in _grid_columns(table, model.topology):
        cols = table.embedding_dim // columns
        costs = tuple(
            model.shard_cost(table, Kind.GRID, share * table.num_embeddings, cols)
            for share in shares
        )
        memory = tuple(model.memory(table, rows, cols) for rows in sizes)
        cut = _GridCut(columns, cols, sizes, costs, memory)
        waste = columns * sum(memory) - whole
        options.append(
            _Option(
                Kind.GRID,
                columns * per_host,
                columns * sum(costs),
                max(costs),
                max(memory),
                max(waste, 0),
                cut,
            )
        )
    return options


def _undominated(candidates: list[_Option], options: Sequence[_Option]) -> list[_Option]:
    """The ``candidates`` that no option matches or beats in total, per piece, in
    memory a piece and in memory beyond the table whole: only those can help a packing."""
    return [
        c
        for c in candidates
        if not any(
            o.total <= c.total
            and o.piece_cost <= c.piece_cost
            and o.piece_memory <= c.piece_memory
            and o.waste <= c.waste
            for o in options
        )
    ]


def _grid_ways(table: PlannedTable, model: CostModel) -> list[tuple[float, float, int]]:
    """``_ways`` of the host grids: ``c`` column blocks over ``N`` ranks each, ``c N``
    pieces that cost ``c K + c N L`` in all (``K`` what a piece's cost grows by with
    all the rows, ``L`` the cost it has with none: ``shard_cost`` is linear in rows),
    on any number of ranks up to ``c N``, like a fixed number of column blocks."""
    per_host, ways = model.topology.ranks_per_host, []
    for columns in _grid_columns(table, model.topology):
        cols = table.embedding_dim / columns
        fixed = model.shard_cost(table, Kind.GRID, 0, cols)
        growing = model.shard_cost(table, Kind.GRID, table.num_embeddings, cols) - fixed
        ways.append((columns * (growing + per_host * fixed), 0.0, columns * per_host))
    return ways


def _row_shares(traffic: TableTraffic, sizes: Sequence[int]) -> list[float]:
    """The measured share of the lookups of each of consecutive row blocks."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return [traffic.share(int(o), int(n)) for o, n in zip(offsets, sizes)]


def _check_constraints(
    constraints: Mapping[str, TableConstraint], tables: Sequence[PlannedTable], world: int
) -> None:
    """Every problem with the constraints, at once, each naming its table."""
    known = {t.name: t for t in tables}
    dynamic = {t.name for t in tables if t.dynamic}
    unknown = set(constraints) - set(known)
    if unknown:
        raise PlanningError(f"constraints name tables the model does not have: {sorted(unknown)}")
    problems = []
    for name, c in constraints.items():
        where, dim = f"constraint on table {name!r}", known[name].embedding_dim
        bad_types = [t for t in c.types or () if t not in _SHARDINGS]
        if bad_types:
            known = [k.value for k in _SHARDINGS]
            problems.append(f"{where}: shardings {bad_types} are none of {known}")
        outside = [r for r in c.ranks or () if not (isinstance(r, int) and 0 <= r < world)]
        if outside:
            problems.append(
                f"{where}: ranks {outside} are outside a world of {plural(world, 'rank')} "
                f"(0 to {world - 1})"
            )
        blocks = c.column_blocks
        if blocks is not None and (blocks < 1 or dim % (4 * blocks)):
            problems.append(
                f"{where}: column_blocks {blocks} does not cut embedding_dim {dim} into "
                "widths that are multiples of 4"
            )
        elif blocks is not None and blocks > _limit(c, world):
            problems.append(
                f"{where}: column_blocks {blocks} is more than the "
                f"{plural(_limit(c, world), 'rank')} it may use"
            )
        if blocks is not None and c.types and Kind.COLUMN_WISE not in c.types:
            problems.append(f"{where}: column_blocks needs column_wise among its shardings")
        if name in dynamic and set(c.types or ()) - set(DYNAMIC_KINDS):
            problems.append(f"{where}: a dynamic table is table_wise, row_wise or column_wise only")
    if problems:
        raise PlanningError("; ".join(problems))


def _kept(
    tables: Sequence[PlannedTable], constraints: Mapping[str, TableConstraint]
) -> dict[str, TableConstraint]:
    """Every table's constraint, none where none is given; a dynamic table's shardings
    are ``DYNAMIC_KINDS``."""
    kept = {t.name: constraints.get(t.name, TableConstraint()) for t in tables}
    for t in tables:
        if t.dynamic and not kept[t.name].types:
            kept[t.name] = dataclasses.replace(kept[t.name], types=DYNAMIC_KINDS)
    return kept


def _check_memory(tables: Sequence[PlannedTable], model: CostModel) -> None:
    topology = model.topology
    world, usable = topology.world_size, topology.usable_memory
    needed = sum(model.memory(t, t.num_embeddings, t.embedding_dim) for t in tables)
    if needed > world * usable:
        raise PlanningError(
            f"the tables need {format_bytes(needed)} but {plural(world, 'rank')} of "
            f"{format_bytes(topology.memory_per_rank)}, "
            f"{format_bytes(topology.reserved_memory)} of each reserved, "
            f"{'holds' if world == 1 else 'hold'} {format_bytes(world * usable)}: "
            f"{format_bytes(needed - world * usable)} missing"
        )


def _ways(
    table: PlannedTable,
    model: CostModel,
    constraint: TableConstraint,
    copies: bool,
    grids: bool = False,
) -> list[tuple[float, float, int]]:
    """``(a, b, most)`` for each way the table may be cut: over m ranks, m from 1 to
    ``most``, its pieces cost at least ``a + b m`` in all and the busiest of those
    ranks at least a 1/m of that. For k pieces cost ``a + b k`` in all (``_linear``,
    ``b >= 0``), and the busiest of the m <= k ranks they are on carries at least
    ``(a + b k) / m >= (a + b m) / m``. Row blocks: one per rank, at most one a bucket
    (a row, for a static table);
    column blocks: at least 4 columns wide, ranks may repeat; a fixed number of
    column blocks costs what it costs on any number of ranks up to it. With ``grids``,
    host grids too (``_grid_ways``)."""
    limit = _limit(constraint, model.topology.world_size)
    if constraint.column_blocks:
        blocks = constraint.column_blocks
        a, b = _linear(table, model, Kind.COLUMN_WISE)
        return [(a + b * blocks, 0.0, min(blocks, limit))]
    most = {
        Kind.TABLE_WISE: 1,
        Kind.ROW_WISE: min(limit, table.buckets),
        Kind.COLUMN_WISE: min(limit, max(1, table.embedding_dim // 4)),
    }
    ways = [(*_linear(table, model, k), most[k]) for k in _kinds(constraint) if k in most]
    if _copied(table, model, constraint, copies):  # a copy costing less than 0: _bound_with
        world = model.topology.world_size  # one piece on each rank, like fixed column blocks
        ways.append((world * max(0.0, model.replica_cost(table)), 0.0, world))
    return ways + (_grid_ways(table, model) if grids else [])


def _copied(
    table: PlannedTable, model: CostModel, constraint: TableConstraint, copies: bool
) -> bool:
    """Whether plans may hold a data-parallel copy of ``table``: with ``copies`` where
    its constraint allows one, else where it allows nothing else."""
    kinds, world = _kinds(constraint), model.topology.world_size
    if Kind.DATA_PARALLEL not in kinds or _limit(constraint, world) < world:
        return False
    return copies or kinds == (Kind.DATA_PARALLEL,)


def _lower_bound(
    tables: Sequence[PlannedTable],
    constraints: Mapping[str, TableConstraint],
    model: CostModel,
    grids: frozenset[str] = frozenset(),
) -> float:
    """No plan's slowest rank costs less than this (the base apart): the lower of
    ``_bound_with`` plans without optional copies and with them; the tables named in
    ``grids`` may be host grids."""
    free = TableConstraint()
    kept = [constraints.get(t.name, free) for t in tables]
    plain = _bound_with(tables, kept, model, False, grids)
    if not any(
        _copied(t, model, c, True) != _copied(t, model, c, False) for t, c in zip(tables, kept)
    ):
        return plain
    return min(plain, _bound_with(tables, kept, model, True, grids))


def _bound_with(
    tables: Sequence[PlannedTable],
    kept: Sequence[TableConstraint],
    model: CostModel,
    copies: bool,
    grids: frozenset[str] = frozenset(),
) -> float:
    """``_copied_bound``, plus the copies' all-reduce latency where any may be copied."""
    copied = any(_copied(t, model, c, copies) for t, c in zip(tables, kept))
    latency = model.topology.collective_latency() if copied else 0.0
    return _copied_bound(tables, kept, model, copies, grids) + latency


def _copied_bound(
    tables: Sequence[PlannedTable],
    kept: Sequence[TableConstraint],
    model: CostModel,
    copies: bool,
    grids: frozenset[str] = frozenset(),
) -> float:
    """``_cut_bound`` less all that copies could save each rank (a copy's negative
    ``replica_cost``): no rank of a packing carries less, the all-reduce apart."""
    saving = sum(
        max(0.0, -model.replica_cost(t))
        for t, c in zip(tables, kept)
        if _copied(t, model, c, copies)
    )
    return _cut_bound(tables, kept, model, copies, grids) - saving


def _cut_bound(
    tables: Sequence[PlannedTable],
    kept: Sequence[TableConstraint],
    model: CostModel,
    copies: bool,
    grids: frozenset[str] = frozenset(),
) -> float:
    """A plan whose slowest rank costs S cuts every table some way (``_ways``) that puts
    no more than S on a rank, so each table costs at least its least total at S, and
    the ranks a set of tables is kept to carry at least the sum of those: all ranks
    all tables, each constraint's ranks the tables whose constraints keep them there,
    spread evenly. The least totals fall as S grows, so the S that just fails that is
    found by bisection, upward from the cheapest the costliest table can be cut to.
    """
    world = model.topology.world_size
    ways = [_ways(t, model, c, copies, t.name in grids) for t, c in zip(tables, kept)]
    widest = max(map(len, ways))
    padded = [w + [(0.0, 0.0, 0)] * (widest - len(w)) for w in ways]  # most 0: never
    a, b, most = np.array(padded, dtype=float).transpose(2, 0, 1)
    groups = [(world, np.ones(len(tables), dtype=bool))] + [
        (len(ranks), np.array([bool(c.ranks) and set(c.ranks) <= ranks for c in kept]))
        for ranks in {frozenset(c.ranks) for c in kept if c.ranks}
    ]

    def holds(slowest: float) -> bool:
        with np.errstate(divide="ignore", invalid="ignore"):
            m = np.maximum(1, np.where(a > 0, np.ceil(a / (slowest - b) - 1e-9), 1))
        fits = (slowest >= b) & (m <= most)
        least = np.where(fits, a + b * m, np.inf).min(axis=1)
        return all(least[members].sum() <= slowest * size for size, members in groups)

    low = max(min((a + b * m) / m for a, b, m in w) for w in ways)
    if low <= 0 or holds(low):
        return low
    high = 2 * low
    while not holds(high):
        low, high = high, 2 * high
    while high > low * (1 + 1e-9):
        middle = (low + high) / 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    return low


def _pieces(
    table: _Table, model: CostModel, kind: str, ranks: Sequence[int], shapes: list
) -> list[_Piece]:
    """Pieces of the given shapes on the given ranks, priced by ``_linear``: row
    blocks by their measured share of the lookups where the table has traffic."""
    a, b = table.linear[kind]
    n, dim = table.spec.num_embeddings, table.spec.embedding_dim
    if kind == Kind.ROW_WISE and table.traffic is not None:
        shares = _row_shares(table.traffic, [rows for rows, _ in shapes])
    else:
        shares = [rows / n if kind == Kind.ROW_WISE else cols / dim for rows, cols in shapes]
    return [
        _Piece(int(r), rows, cols, a * share + b, model.memory(table.spec, rows, cols))
        for r, (rows, cols), share in zip(ranks, shapes, shares)
    ]


def _place(
    table: _Table, packing: _Packing, model: CostModel, target: float
) -> tuple[str, list[_Piece]] | None:
    """The table in its cheapest sharding whose pieces fit under ``target`` and in
    memory on as many of the least-loaded ranks it may use; else row blocks cut to the
    room the ranks have (``_rows_to_room``)."""
    capacity = model.topology.usable_memory
    for option in table.options:
        if option.waste > packing.slack:
            continue
        ok = (packing.cost <= target - option.piece_cost) & (
            packing.memory <= capacity - option.piece_memory
        )
        if table.allowed is not None:
            ok &= table.allowed
        if option.grid is not None:
            pieces = _grid_pieces(option.grid, packing, ok, model.topology)
            if pieces is None:
                continue
            return option.kind, pieces
        if option.blocks == 1:
            ranks = [int(np.where(ok, packing.cost, np.inf).argmin())]
            if not ok[ranks[0]]:
                continue
        elif np.count_nonzero(ok) >= option.blocks:
            least = np.argsort(np.where(ok, packing.cost, np.inf), kind="stable")
            ranks = np.sort(least[: option.blocks])
        else:
            continue
        shapes = _shapes(table.spec, option.kind, option.blocks, table.traffic)
        return option.kind, _pieces(table, model, option.kind, ranks, shapes)
    if Kind.ROW_WISE in table.kinds:
        return _rows_to_room(table, packing, model, target)
    return None


def _grid_pieces(
    cut: _GridCut, packing: _Packing, ok: np.ndarray, topology: Topology
) -> list[_Piece] | None:
    """A grid's pieces on the least-loaded hosts whose every rank may take a piece
    (``ok``), one column block a host; None where too few hosts may."""
    per_host = topology.ranks_per_host
    hosts = topology.world_size // per_host
    whole = slice(0, hosts * per_host)
    fits = ok[whole].reshape(hosts, per_host).all(axis=1)
    if np.count_nonzero(fits) < cut.columns:
        return None
    busiest = packing.cost[whole].reshape(hosts, per_host).max(axis=1)
    chosen = np.sort(np.argsort(np.where(fits, busiest, np.inf), kind="stable")[: cut.columns])
    return [
        _Piece(rank, rows, cut.cols, cost, memory, block)
        for block, host in enumerate(chosen.tolist())
        for rank, rows, cost, memory in zip(
            topology.host_ranks(host), cut.sizes, cut.costs, cut.memory
        )
    ]


def _rows_to_room(
    table: _Table, packing: _Packing, model: CostModel, target: float
) -> tuple[str, list[_Piece]] | None:
    """Row blocks (of whole buckets) as big as the roomiest ranks have room for, under
    ``target`` and in memory: uneven blocks fill what even ones cannot, and a table
    that fits in the free memory of the ranks it may use, in all, always fits so with
    no target."""
    spec, capacity = table.spec, model.topology.usable_memory
    a, b = table.linear[Kind.ROW_WISE]
    room = (capacity - packing.memory) // model.memory(spec, 1, spec.embedding_dim)
    spare = target - packing.cost - b
    if a > 0:
        with np.errstate(invalid="ignore"):
            by_cost = np.floor(np.clip(spare * spec.num_embeddings / a, 0, spec.num_embeddings))
        room = np.minimum(room, by_cost.astype(np.int64))
    else:
        room = np.where(spare >= 0, room, 0)
    room -= room % spec.rows_per_bucket  # whole buckets
    if table.allowed is not None:
        room = np.where(table.allowed, room, 0)
    order = np.argsort(-room, kind="stable")
    filled = np.cumsum(room[order])
    if filled[-1] < spec.num_embeddings:
        return None
    count = int(np.searchsorted(filled, spec.num_embeddings)) + 1
    rows = room[order[:count]]
    rows[-1] -= filled[count - 1] - spec.num_embeddings
    blocks = sorted(zip(order[:count].tolist(), rows.tolist()))
    shapes = [(n, spec.embedding_dim) for _, n in blocks]
    pieces = _pieces(table, model, Kind.ROW_WISE, [r for r, _ in blocks], shapes)
    # the room is worked out as if lookups were even over rows; measured ones are not
    if table.traffic is not None and any(packing.cost[p.rank] + p.cost > target for p in pieces):
        return None
    return Kind.ROW_WISE, pieces


def _pack(tables: Sequence[_Table], model: CostModel, target: float) -> _Packing:
    """The tables in order, each placed by ``_place``, up to the first that finds no room."""
    world = model.topology.world_size
    slack = world * model.topology.usable_memory - sum(t.whole_memory for t in tables)
    packing = _Packing(np.zeros(world), np.zeros(world, dtype=np.int64), slack)
    for table in tables:
        placed = _place(table, packing, model, target)
        if placed is None:
            packing.unplaced = table
            break
        packing.add(table, *placed)
    return packing


_TOLERANCE = 0.01  # the search stops when the target is known within 1 %
_PROBES = 24  # and tries at most this many targets


def _search(tables: Sequence[_Table], model: CostModel, bound: float) -> _Packing:
    """The lowest target at which ``_pack`` succeeds, found by bisection (on a log
    scale) between the lower bound and the packing with no target, which keeps every
    table whole that fits a rank's memory: LPT table-wise, the obvious plan."""
    best = _pack(tables, model, math.inf)
    if best.unplaced is not None:
        raise _no_room(best, model)
    low, high = bound, best.slowest
    for _ in range(_PROBES):
        if high <= low * (1 + _TOLERANCE):
            break
        target = math.sqrt(low * high)
        packing = _pack(tables, model, target)
        if packing.unplaced is None:
            best, high = packing, packing.slowest
        else:
            low = target
    return best


def _no_room(packing: _Packing, model: CostModel) -> PlanningError:
    """Why the table that found no room found none, on the ranks it may use."""
    table = packing.unplaced
    start = f"table {table.spec.name!r}"
    free = model.topology.usable_memory - packing.memory
    ranks = np.arange(len(free)) if table.allowed is None else np.flatnonzero(table.allowed)
    theirs = "" if table.allowed is None else f" of its ranks {ranks.tolist()}"
    if Kind.ROW_WISE in table.kinds:
        have = int(free[ranks].sum())
        return PlanningError(
            f"{start} ({format_bytes(table.whole_memory)}) does not fit even in row blocks "
            f"cut to the free memory{theirs}: {format_bytes(have)} free, "
            f"{format_bytes(table.whole_memory - have)} missing"
        )
    spared = [o for o in table.options if o.waste <= packing.slack]
    if not spared:
        return PlanningError(
            f"{start}: its column blocks need {format_bytes(min(o.waste for o in table.options))}"
            " more than the table whole (each keeps its rows' optimizer state), and the "
            f"ranks have {format_bytes(packing.slack)} to spare"
        )
    option = min(spared, key=lambda o: (o.piece_memory, o.blocks))
    size = format_bytes(option.piece_memory)
    pieces = plural(option.blocks, f"{option.kind} piece")
    start += (
        f" whole ({size})"
        if option.blocks == 1
        else f" in its smallest pieces ({pieces} of {size})"
    )
    roomy = int((free[ranks] >= option.piece_memory).sum())
    if roomy:
        return PlanningError(
            f"{start} needs {option.blocks} ranks with room, and "
            f"{roomy}{theirs or ' ranks'} {'has' if roomy == 1 else 'have'} it"
        )
    freest = int(ranks[np.argmax(free[ranks])])
    return PlanningError(
        f"{start} fits on no rank{theirs}: the freest (rank {freest}) has "
        f"{format_bytes(free[freest])} free, "
        f"{format_bytes(option.piece_memory - free[freest])} missing"
    )


SAME_WITHIN = 1 + 1e-9  # totals this close are equal (sums in another order differ so much)


def _unsplit(packing: _Packing, tables: Sequence[_Table], model: CostModel) -> dict[str, str]:
    """Place each split table again (smallest first), in its cheapest sharding that
    fits under the slowest rank given the rest, until none changes: whole where it
    can be. Then why each table is sharded as it is."""
    target = packing.slowest
    split = sorted(
        (t for t in tables if packing.layouts[t.spec.name][0] not in UNCUT),
        key=lambda t: (t.whole_memory, t.spec.name),
    )
    changed = True
    while changed:
        changed = False
        for table in split:
            name = table.spec.name
            kind, pieces = packing.layouts[name]
            packing.remove(table)
            placed = _place(table, packing, model, target)
            cheaper = placed is not None and _total(placed[1]) < _total(pieces) / SAME_WITHIN
            packing.add(table, *(placed if cheaper else (kind, pieces)))
            changed |= cheaper
    return {t.spec.name: _why(t, packing, model) for t in tables}


def _total(pieces: list[_Piece]) -> float:
    return sum(p.cost for p in pieces)


def _why(table: _Table, packing: _Packing, model: CostModel) -> str:
    """Why the table is sharded as it is, once ``_unsplit`` found it no cheaper way:
    what follows "because" in the report's line for it."""
    kind, pieces = packing.layouts[table.spec.name]
    if kind == Kind.TABLE_WISE:
        return "whole, it fits without slowing the slowest rank"
    if kind == Kind.DATA_PARALLEL and table.kinds == (Kind.DATA_PARALLEL,):
        return "its constraints allow only data_parallel"
    if kind == Kind.DATA_PARALLEL:
        return "a copy on every rank costs less than any cut of it"
    capacity = model.topology.usable_memory
    if Kind.TABLE_WISE not in table.kinds:
        return "its constraints allow no table_wise"
    if table.whole_memory > capacity:
        return "it is too big for one rank"
    own = np.zeros_like(packing.memory)
    for p in pieces:
        own[p.rank] += p.memory
    room = packing.memory - own <= capacity - table.whole_memory
    if table.allowed is not None:
        room &= table.allowed
    if not room.any():
        return "no rank has room for it whole"
    return "kept whole, it would slow the slowest rank"


def _rank_loads(packing: _Packing, tables: Sequence[_Table]) -> list[RankLoad]:
    loads = [
        RankLoad(r, int(m), float(c)) for r, (m, c) in enumerate(zip(packing.memory, packing.cost))
    ]
    copies_last = sorted(
        tables, key=lambda t: packing.layouts[t.spec.name][0] == Kind.DATA_PARALLEL
    )
    for table in copies_last:
        kind, pieces = packing.layouts[table.spec.name]
        for i, p in enumerate(pieces):
            name = table.spec.name
            shown = {Kind.TABLE_WISE: name, Kind.DATA_PARALLEL: f"{name} (copy)"}
            loads[p.rank].shards.append(shown.get(kind, f"{name}[{i}]"))
    return loads


def _spec(kind: str, pieces: list[_Piece], world: int):
    if kind == Kind.TABLE_WISE:
        return table_wise(pieces[0].rank)
    if kind == Kind.GRID:
        blocks = range(pieces[-1].block + 1)
        ranks = [[p.rank for p in pieces if p.block == b] for b in blocks]
        return grid(len(ranks), ranks, [[p.rows for p in pieces if p.block == b] for b in blocks])
    if kind == Kind.DATA_PARALLEL:
        return data_parallel()
    if kind == Kind.COLUMN_WISE:
        return column_wise([p.rank for p in pieces], [p.cols for p in pieces])
    sizes = [0] * world  # pieces come in rank order: row block i on the i-th rank
    for p in pieces:
        sizes[p.rank] = p.rows
    return row_wise(sizes)


def _prepared(
    specs: Sequence[PlannedTable],
    constraints: Mapping[str, TableConstraint],
    model: CostModel,
    measured: Mapping[str, TableTraffic],
    copies: bool,
) -> list[_Table]:
    """Every table with its options (data-parallel copies among them with ``copies``),
    in the packing's order: those kept to the fewest ranks first, then costliest first."""
    world, free = model.topology.world_size, TableConstraint()
    return sorted(
        (
            _table(t, model, constraints.get(t.name, free), world, measured.get(t.name), copies)
            for t in specs
        ),
        key=lambda t: (
            _limit(constraints.get(t.spec.name, free), world),
            -t.whole_cost,
            t.whole_memory,
            t.spec.name,
        ),
    )


def _packed(
    prepared: list[_Table],
    specs: Sequence[PlannedTable],
    constraints: Mapping[str, TableConstraint],
    model: CostModel,
    copies: bool,
    grids: frozenset[str] = frozenset(),
) -> tuple[_Packing, list[_Table], dict[str, str]]:
    """The searched packing of the ``prepared`` tables (with data-parallel copies among
    their options with ``copies``; ``grids`` the tables with host grids among them),
    the tables and why each is sharded as it is. A packing with copies carries their
    all-reduce's latency on every rank."""
    free = TableConstraint()
    kept = [constraints.get(t.name, free) for t in specs]
    bound = _copied_bound(specs, kept, model, copies, grids)
    packing = _search(prepared, model, max(bound, 1e-12))
    reasons = _unsplit(packing, prepared, model)
    if any(kind == Kind.DATA_PARALLEL for kind, _ in packing.layouts.values()):
        packing.cost += model.topology.collective_latency()
    return packing, prepared, reasons


def _grid_tables(
    specs: Sequence[PlannedTable],
    constraints: Mapping[str, TableConstraint],
    model: CostModel,
    measured: Mapping[str, TableTraffic],
) -> frozenset[str]:
    """The tables the search may make host grids (``_griddable``)."""
    free = TableConstraint()
    return frozenset(
        t.name
        for t in specs
        if _griddable(t, model, constraints.get(t.name, free), measured.get(t.name))
    )


def plan_tables(
    tables: Sequence[AnyTable],
    topology: Topology,
    batch_size: int,
    constraints: Mapping[str, TableConstraint] | None = None,
    optimizer: str = "rowwise_adagrad",
    *,
    mean_pooling: Mapping[str, float] | None = None,
    stats: TrafficStats | None = None,
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """A plan that fits every rank's usable memory and keeps the slowest rank's
    estimated step cost low, with a report of per-rank memory and cost.

    ``tables`` are TorchRec's ``EmbeddingBagConfig``s and ``EmbeddingConfig``s,
    ``batch_size`` is per rank, and
    ``mean_pooling`` the mean ids per bag by feature or table (default 1.0; see
    ``planned_tables``); ``constraints`` limit tables by name. The slowest rank is
    never above that of LPT table-wise (every table whole, costliest first on the
    least-loaded rank that may take it, where memory allows), nor below the reported
    lower bound (``_lower_bound``). With measured ``stats`` (``embshard.planner.traffic``),
    tables are priced by their measured ids, row blocks are cut so each gets an even
    share of its table's lookups, and each is priced by the lookups landing in it; a
    row-wise table whose hottest rows no cut can balance gets them copied on every rank
    (``_copy_hot_rows``) where that lowers the slowest rank; and where the world spans
    two whole hosts or more, the search also tries host grids (``_grid_options``),
    kept where they lower the slowest rank. The ``dynamic`` tables (their id maps by
    table, as ``shard`` takes them) are table-wise, row-wise in whole buckets or
    column-wise, each rank holding its buckets' map (a column block's rank, the whole
    table's: it remaps every id), and never get hot rows, copies or host grids.
    """
    specs = planned_tables(tables, mean_pooling, stats, dynamic)
    measured = stats.tables if stats is not None else {}
    world = topology.world_size
    _check_constraints(constraints or {}, specs, world)
    constraints = _kept(specs, constraints or {})
    model = CostModel(topology, batch_size, optimizer)
    _check_memory(specs, model)
    free = TableConstraint()
    # Copies (data-parallel tables, hot rows) take a gradient in every row each step,
    # which only some fused optimizers leave alone where it is zero.
    copies = FUSED_OPTIMIZERS[optimizer].ZERO_GRADIENT_KEEPS
    only_copies = [t.name for t in specs if _kinds(constraints.get(t.name, free)) == _COPY_ONLY]
    if only_copies and not copies:
        raise PlanningError(
            f"tables {only_copies}: their constraints allow only data_parallel, which the "
            f"fused optimizer {optimizer} cannot update (a copy's rows not looked up take a "
            "zero gradient, and it moves them)"
        )
    # The search without copies, and again with copies, host grids or both among the
    # options where a table may have them: the best of them.
    searches = [(_prepared(specs, constraints, model, measured, False), False, frozenset())]
    if copies and any(Kind.DATA_PARALLEL in _kinds(constraints.get(t.name, free)) for t in specs):
        searches.append((_prepared(specs, constraints, model, measured, True), True, frozenset()))
    gridded = _grid_tables(specs, constraints, model, measured)
    if gridded:
        searches += [
            (with_grids, with_copies, gridded)
            for searched, with_copies, _ in searches
            if (with_grids := _with_grids(searched, model, constraints))
        ]
    packing, prepared, reasons = _packed(searches[0][0], specs, constraints, model, False)
    for searched, with_copies, grids in searches[1:]:
        try:
            found = _packed(searched, specs, constraints, model, with_copies, grids)
        except PlanningError:  # the copies or grids took the room some table needed
            continue
        if found[0].slowest < packing.slowest / SAME_WITHIN:
            packing, prepared, reasons = found
    layouts = packing.layouts
    report = PlanReport(
        ranks=_rank_loads(packing, prepared),
        tables=[
            TableChoice(
                t.name, layouts[t.name][0], len(layouts[t.name][1]), reasons[t.name], t.sequence
            )
            for t in specs
        ],
        base_cost=model.base_cost(specs),
        lower_bound=_lower_bound(specs, constraints, model, gridded),
        topology=topology,
    )
    plan = ShardingPlan({t.name: _spec(*layouts[t.name], world) for t in specs})
    if stats is None or not copies:
        return plan, report
    loads = functools.partial(
        plan_loads, tables=tables, topology=topology, batch_size=batch_size,
        optimizer=optimizer, mean_pooling=mean_pooling, stats=stats, dynamic=dynamic,
    )  # fmt: skip
    static = {n: t for n, t in measured.items() if n not in (dynamic or {})}
    return _copy_hot_rows(plan, report, static, loads)


def _copy_hot_rows(
    plan: ShardingPlan,
    report: PlanReport,
    measured: Mapping[str, TableTraffic],
    loads: Callable[[ShardingPlan], list[RankLoad]],
) -> tuple[ShardingPlan, PlanReport]:
    """Each row-wise table in turn, with the measured traffic: its ``hot_rows`` copied on
    every rank and the rest cut by ``balanced_sizes`` over the same ranks, kept where
    that lowers the slowest rank by the cost model (``loads``), every rank still has
    the memory, and the reported lower bound still holds (it prices no copies, whose
    ids stay home). The report then gives the plan's loads."""
    usable = report.topology.usable_memory
    best = max(load.cost for load in loads(plan))
    copied: dict[str, tuple[int, int]] = {}
    for name, spec in plan.tables.items():
        traffic = measured.get(name)
        given = spec.row_block_sizes
        if given is None or traffic is None:
            continue
        holders = [r for r, rows in enumerate(given) if rows]
        hot = hot_rows(traffic, len(holders))
        if not 0 < hot < traffic.num_embeddings:  # a whole copy is the search's to weigh
            continue
        sizes = [0] * len(given)
        for rank, rows in zip(holders, balanced_sizes(traffic, len(holders), hot)):
            sizes[rank] = rows
        candidate = ShardingPlan(plan.tables | {name: row_wise(sizes, hot_rows=hot)})
        found = loads(candidate)
        slowest = max(load.cost for load in found)
        fits = all(load.memory <= usable for load in found)
        if report.lower_bound <= slowest < best / SAME_WITHIN and fits:
            plan, best = candidate, slowest
            copied[name] = hot, sum(1 for rows in sizes if rows)
    if not copied:
        return plan, report
    tables = []
    for choice in report.tables:
        if choice.table in copied:
            hot, pieces = copied[choice.table]
            copies = f"copying its {hot} hot rows to every rank lowers the slowest rank"
            reason = f"{choice.reason}, and {copies}"
            choice = dataclasses.replace(choice, pieces=pieces, reason=reason)
        tables.append(choice)
    return plan, dataclasses.replace(report, ranks=loads(plan), tables=tables)


def plan_loads(
    plan: ShardingPlan,
    tables: Sequence[AnyTable],
    topology: Topology,
    batch_size: int,
    optimizer: str = "rowwise_adagrad",
    *,
    mean_pooling: Mapping[str, float] | None = None,
    stats: TrafficStats | None = None,
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> list[RankLoad]:
    """Per-rank memory and estimated cost of any plan, by the same cost model (row
    blocks priced by their measured lookups, with ``stats``; copies, data-parallel
    tables and hot rows, with their all-reduce's latency; the ``dynamic`` tables'
    id maps)."""
    model = CostModel(topology, batch_size, optimizer)
    resolved: dict[str, ShardedTable] = plan.resolve(
        [as_config(t) for t in tables], topology.world_size
    )
    loads = [RankLoad(r) for r in range(topology.world_size)]
    measured = stats.tables if stats is not None else {}
    specs = planned_tables(tables, mean_pooling, stats, dynamic)
    for table in specs:
        sharded, traffic = resolved[table.name], measured.get(table.name)
        for shard in sharded.shards:
            if not (shard.rows and shard.cols):
                continue
            load = loads[shard.rank]
            load.memory += model.memory(table, shard.rows, shard.cols)
            # Priced as the rows its measured lookups would fill.
            share = shard.rows / table.num_embeddings
            if traffic is not None and sharded.kind in ROW_SPLIT:
                share = traffic.share(shard.row_offset, shard.rows)
            if shard.replica and sharded.hot_rows:
                load.cost += model.copy_cost(table, shard.rows, share)
            else:
                rows = share * table.num_embeddings
                load.cost += model.shard_cost(table, sharded.kind, rows, shard.cols)
            load.shards.append(shard_name(table.name, shard))
    if any(t.replicated_rows for t in resolved.values()):  # the copies' gradient all-reduce
        for load in loads:
            load.cost += topology.collective_latency()
    return loads


def shard_name(name: str, shard: TableShard) -> str:
    """``table[row_offset:+rows, col_offset:+cols]``."""
    return f"{name}[{shard.row_offset}:+{shard.rows}, {shard.col_offset}:+{shard.cols}]"


def plan_report(
    plan: ShardingPlan,
    tables: Sequence[AnyTable],
    topology: Topology,
    batch_size: int,
    optimizer: str,
    reason: str,
    stats: TrafficStats | None = None,
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> PlanReport:
    """The report of a plan the planner did not make (a config's own, a lookup-balanced
    one): its loads (priced by ``stats`` where given, with the ``dynamic`` tables' id
    maps), each table's sharding for ``reason``, and the bound of any plan."""
    model = CostModel(topology, batch_size, optimizer)
    resolved = plan.resolve([as_config(t) for t in tables], topology.world_size)
    specs = planned_tables(tables, stats=stats, dynamic=dynamic)
    loads = plan_loads(plan, tables, topology, batch_size, optimizer, stats=stats, dynamic=dynamic)
    measured = stats.tables if stats is not None else {}
    return PlanReport(
        ranks=loads,
        tables=[  # the plan resolved in the tables' order
            TableChoice(
                t.name,
                r.kind,
                sum(bool(s.rows and s.cols) and not s.replica for s in r.shards) or len(r.shards),
                reason,
                t.sequence,
            )
            for r, t in zip(resolved.values(), specs)
        ],
        base_cost=model.base_cost(specs),
        lower_bound=_lower_bound(
            specs, _kept(specs, {}), model, _grid_tables(specs, {}, model, measured)
        ),
        topology=topology,
    )
