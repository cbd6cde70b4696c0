"""Sharding planner: a cost model of embshard's data path and a balanced placement.

Costs are seconds per training step on the rank that owns a shard:

- lookup: the ids routed to the shard times its row bytes, read forward and read and
  written backward (3 passes), over the rank's gather bandwidth;
- communication, priced alpha-beta (bytes over the bandwidth of the links the
  all-to-alls cross): the ids and bag lengths it receives, and the pooled rows it
  sends forward and whose gradients it receives backward.

Every rank also pays the same base: four collectives' latency and its own batch's
ids and pooled rows; it is reported, not balanced. Memory is weights plus the fused
optimizer's state.

``plan_tables`` takes TorchRec's ``EmbeddingBagConfig``s with each feature's mean
pooling beside them (or embshard's config ``TableConfig``s, which carry their own).
It splits a table when it is too costly or too big for one rank
(column-wise or row-wise, whichever costs less in all, into as few pieces as needed),
then places pieces biggest first on the least-loaded rank with room (LPT).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embshard.config import TableConfig, TrainConfig
from embshard.plan import (
    ColumnWise,
    RowWise,
    ShardedTable,
    ShardingPlan,
    TableShard,
    TableWise,
    column_wise,
    plural,
    row_wise,
    table_wise,
)

GiB = 2**30
_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
}


class PlanningError(ValueError):
    """No plan fits; the message says how much memory is missing and where."""


def parse_bytes(text: str | int | float) -> int:
    """``80GiB``, ``512 MiB``, ``1.5TB`` or a number of bytes."""
    if isinstance(text, int | float):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (like 80GiB, 512MiB, 1.5TB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def format_bytes(size: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


@dataclass(frozen=True)
class Topology:
    """The machines: ranks, their memory, and the links between them (bytes/s, s)."""

    world_size: int
    ranks_per_host: int
    memory_per_rank: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    lookup_bandwidth: float

    @classmethod
    def cpu(cls, world_size: int, **overrides: Any) -> Topology:
        """Processes on CPU hosts: gloo over loopback inside a host, 10 GbE between."""
        base = cls(world_size, world_size, 8 * GiB, 5e9, 50e-6, 1.25e9, 100e-6, 10e9)
        return replace(base, **overrides)

    @classmethod
    def gpu(cls, world_size: int, **overrides: Any) -> Topology:
        """8 x 80 GiB GPUs per host (H100-like): NVLink inside, 400 Gb/s between."""
        base = cls(world_size, 8, 80 * GiB, 300e9, 5e-6, 50e9, 10e-6, 1e12)
        return replace(base, **overrides)

    def seconds_per_byte(self) -> float:
        """All-to-all traffic spread evenly over peers: some of it leaves the host."""
        if self.world_size <= 1:
            return 0.0
        local = min(self.ranks_per_host, self.world_size)
        leaving = (self.world_size - local) / (self.world_size - 1)
        return (1 - leaving) / self.intra_bandwidth + leaving / self.inter_bandwidth

    def collective_latency(self) -> float:
        if self.world_size <= 1:
            return 0.0
        inter = self.world_size > self.ranks_per_host
        return (self.world_size - 1) * (self.inter_latency if inter else self.intra_latency)


@dataclass(frozen=True)
class TableConstraint:
    """Limits on one table's sharding: allowed types (``table_wise``, ``row_wise``,
    ``column_wise``), the ranks its shards may use, a fixed number of column blocks."""

    types: tuple[str, ...] | None = None
    ranks: tuple[int, ...] | None = None
    column_blocks: int | None = None


@dataclass(frozen=True)
class PlannedTable:
    """What the cost model needs of a table: its shape, and per sample its bags (one
    per feature) and ids (the features' mean pooling, summed)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    bags_per_sample: int
    ids_per_sample: float


def _as_config(table: EmbeddingBagConfig | TableConfig) -> EmbeddingBagConfig:
    return table.embedding_bag_config() if isinstance(table, TableConfig) else table


def planned_tables(
    tables: Sequence[EmbeddingBagConfig | TableConfig],
    mean_pooling: Mapping[str, float] | None = None,
) -> list[PlannedTable]:
    """The tables as the cost model sees them. ``mean_pooling`` gives the mean ids per
    bag by feature or by table name (a feature's own entry wins); 1.0 where it says
    nothing, or a ``TableConfig``'s own ``mean_pooling``."""
    pooling = dict(mean_pooling or {})
    configs = [
        (_as_config(t), t.mean_pooling if isinstance(t, TableConfig) else 1.0) for t in tables
    ]
    known = {c.name for c, _ in configs} | {f for c, _ in configs for f in c.feature_names}
    unknown = sorted(set(pooling) - known)
    if unknown:
        raise PlanningError(f"mean_pooling names no table or feature of the model: {unknown}")
    bad = {k: v for k, v in pooling.items() if not isinstance(v, int | float) or v < 0}
    if bad:
        raise PlanningError(f"mean_pooling must be non-negative numbers, got {bad}")
    planned = []
    for config, default in configs:
        own = pooling.get(config.name, default)
        ids = sum(pooling.get(f, own) for f in config.feature_names)
        planned.append(
            PlannedTable(
                config.name,
                config.num_embeddings,
                config.embedding_dim,
                len(config.feature_names),
                float(ids),
            )
        )
    return planned


_ID_BYTES = 8  # ids and bag lengths travel as int64
_PASSES = 3  # forward read; backward read and write


@dataclass(frozen=True)
class CostModel:
    topology: Topology
    batch_size: int  # per rank
    optimizer: str = "rowwise_adagrad"

    def ids(self, table: PlannedTable) -> float:
        return self.topology.world_size * self.batch_size * table.ids_per_sample

    def bags(self, table: PlannedTable) -> float:
        return self.topology.world_size * self.batch_size * table.bags_per_sample

    def memory(self, rows: int, cols: int) -> int:
        state = {"rowwise_adagrad": rows, "adagrad": rows * cols}.get(self.optimizer, 0)
        return 4 * (rows * cols + state)

    def shard_cost(self, table: PlannedTable, kind: str, rows: int, cols: int) -> float:
        """Seconds per step the owner of a (rows x cols) shard of ``table`` spends."""
        share = rows / table.num_embeddings if kind == "row_wise" else 1.0
        ids, bags = self.ids(table) * share, self.bags(table)
        lookup = ids * cols * 4 * _PASSES / self.topology.lookup_bandwidth
        moved = (ids + bags) * _ID_BYTES + 2 * bags * cols * 4
        return lookup + moved * self.topology.seconds_per_byte()

    def base_cost(self, tables: Sequence[PlannedTable]) -> float:
        """What every rank pays alike: 4 collectives' latency, its own ids and rows."""
        world = self.topology.world_size
        ids = sum(self.ids(t) + self.bags(t) for t in tables) / world * _ID_BYTES
        rows = sum(self.bags(t) * t.embedding_dim for t in tables) / world * 4 * 2
        return (
            4 * self.topology.collective_latency() + (ids + rows) * self.topology.seconds_per_byte()
        )


@dataclass
class RankLoad:
    rank: int
    memory: int = 0
    cost: float = 0.0
    shards: list[str] = field(default_factory=list)


@dataclass
class TableChoice:
    table: str
    sharding: str
    pieces: int
    reason: str


@dataclass
class PlanReport:
    ranks: list[RankLoad]
    tables: list[TableChoice]
    base_cost: float
    lower_bound: float
    topology: Topology

    @property
    def slowest(self) -> float:
        return max(r.cost for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.topology.world_size,
            "memory_per_rank": self.topology.memory_per_rank,
            "base_cost_s": self.base_cost,
            "slowest_rank_cost_s": self.slowest,
            "lower_bound_s": self.lower_bound,
            "ranks": [vars(r) for r in self.ranks],
            "tables": [vars(t) for t in self.tables],
        }

    def to_text(self, max_ranks: int = 64) -> str:
        lines = [
            f"{'rank':>5} {'memory':>10} {'cost ms':>9}  shards",
        ]
        for load in self.ranks[:max_ranks]:
            shards = ", ".join(load.shards)
            if len(shards) > 70:
                shards = shards[:67] + "..."
            lines.append(
                f"{load.rank:>5} {format_bytes(load.memory):>10} {1e3 * load.cost:>9.3f}  {shards}"
            )
        if len(self.ranks) > max_ranks:
            lines.append(f"  ... {plural(len(self.ranks) - max_ranks, 'more rank')}")
        lines.append(
            f"slowest rank {1e3 * self.slowest:.3f} ms"
            f" + base {1e3 * self.base_cost:.3f} ms per step; "
            f"lower bound {1e3 * self.lower_bound:.3f} ms; "
            f"memory per rank {format_bytes(self.topology.memory_per_rank)}"
        )
        lines += [f"  {c.table}: {c.sharding} ({c.reason})" for c in self.tables]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Piece:
    table: str
    index: int
    rows: int
    cols: int
    cost: float
    memory: int
    ranks: tuple[int, ...] | None


def _split_counts(
    table: PlannedTable, kind: str, world: int, constraint: TableConstraint
) -> list[int]:
    """Piece counts worth trying: 2, 3, 4, 6, 8, 12, ... up to the ranks allowed."""
    limit = len(constraint.ranks) if constraint.ranks else world
    if kind == "column_wise" and constraint.column_blocks:
        return [constraint.column_blocks]
    counts, k = {limit}, 2
    while k < limit:
        counts |= {k, k + k // 2}
        k *= 2
    if kind == "column_wise":
        return sorted(k for k in counts if 2 <= k <= limit and table.embedding_dim % (4 * k) == 0)
    return sorted(k for k in counts if 2 <= k <= min(limit, table.num_embeddings))


def _shapes(table: PlannedTable, kind: str, blocks: int) -> list[tuple[int, int]]:
    if kind == "column_wise":
        return [(table.num_embeddings, table.embedding_dim // blocks)] * blocks
    if kind == "row_wise":
        base, extra = divmod(table.num_embeddings, blocks)
        return [(base + (i < extra), table.embedding_dim) for i in range(blocks)]
    return [(table.num_embeddings, table.embedding_dim)]


@dataclass(frozen=True)
class _Option:
    """One way to shard a table, priced by its biggest piece (pieces differ by a row)."""

    table: PlannedTable
    kind: str
    blocks: int
    piece_cost: float
    piece_memory: int
    ranks: tuple[int, ...] | None

    @property
    def total_cost(self) -> float:
        return self.piece_cost * self.blocks

    def pieces(self, model: CostModel) -> tuple[_Piece, ...]:
        return tuple(
            _Piece(
                self.table.name,
                i,
                rows,
                cols,
                model.shard_cost(self.table, self.kind, rows, cols),
                model.memory(rows, cols),
                self.ranks,
            )
            for i, (rows, cols) in enumerate(_shapes(self.table, self.kind, self.blocks))
        )


@dataclass(frozen=True)
class _Choice:
    kind: str
    pieces: tuple[_Piece, ...]
    reason: str


def _options(table: PlannedTable, model: CostModel, constraint: TableConstraint) -> list[_Option]:
    """Every allowed sharding of the table, fewest pieces first, cheapest in all first."""
    allowed = constraint.types or ("table_wise", "row_wise", "column_wise")
    if constraint.column_blocks:
        allowed = ("column_wise",)
    world = model.topology.world_size
    kinds = [("table_wise", [1])] if "table_wise" in allowed else []
    kinds += [
        (kind, _split_counts(table, kind, world, constraint))
        for kind in ("column_wise", "row_wise")
        if kind in allowed
    ]
    options = []
    for kind, counts in kinds:
        for blocks in counts:
            rows, cols = _shapes(table, kind, blocks)[0]
            options.append(
                _Option(
                    table,
                    kind,
                    blocks,
                    model.shard_cost(table, kind, rows, cols),
                    model.memory(rows, cols),
                    constraint.ranks,
                )
            )
    return sorted(options, key=lambda o: (o.blocks, o.total_cost))


def _first_choice(options: list[_Option], target: float, model: CostModel, name: str) -> _Choice:
    """Table-wise when it fits one rank's share of cost and memory, else the fewest
    pieces that each do, else the most pieces allowed."""
    if not options:
        raise PlanningError(f"table {name!r}: its constraints allow no sharding")
    memory = model.topology.memory_per_rank
    for option in options:
        if option.piece_cost <= target and option.piece_memory <= memory:
            why = (
                "fits one rank's share of cost and memory"
                if option.kind == "table_wise"
                else f"too costly or big for one rank: {plural(option.blocks, 'piece')}"
            )
            return _Choice(option.kind, option.pieces(model), why)
    last = options[-1]
    return _Choice(
        last.kind, last.pieces(model), f"as split as allowed: {plural(last.blocks, 'piece')}"
    )


def _place_all(
    choices: Mapping[str, _Choice], world: int, memory: int
) -> tuple[list[RankLoad], dict[str, list[tuple[int, _Piece]]]]:
    """Pieces biggest first, each on the least-loaded rank that may take it (LPT)."""
    loads = [RankLoad(r) for r in range(world)]
    heap = [(0.0, r) for r in range(world)]
    placed: dict[str, list[tuple[int, _Piece]]] = {name: [] for name in choices}
    pieces = [(c.kind, p) for c in choices.values() for p in c.pieces]
    for kind, piece in sorted(pieces, key=lambda kp: -kp[1].cost):
        taken = {r for r, _ in placed[piece.table]} if kind == "row_wise" else set()
        rank = _place(heap, loads, piece, taken, memory)
        if rank is None:
            freest = min(loads, key=lambda load: load.memory)
            free = memory - freest.memory
            raise PlanningError(
                f"table {piece.table!r}: a {kind} piece of {format_bytes(piece.memory)} "
                f"fits on no rank: the freest (rank {freest.rank}) has {format_bytes(free)} "
                f"free, {format_bytes(piece.memory - free)} missing"
            )
        load = loads[rank]
        load.memory += piece.memory
        load.cost += piece.cost
        load.shards.append(piece.table if kind == "table_wise" else f"{piece.table}[{piece.index}]")
        heapq.heappush(heap, (load.cost, rank))
        placed[piece.table].append((rank, piece))
    return loads, placed


def _place(
    heap: list, loads: list[RankLoad], piece: _Piece, taken: set[int], memory: int
) -> int | None:
    """The least-loaded rank that may take the piece and has room for it."""
    skipped, found = [], None
    while heap:
        cost, rank = heapq.heappop(heap)
        if cost != loads[rank].cost:
            continue  # stale: the rank's load changed since
        allowed = piece.ranks is None or rank in piece.ranks
        if allowed and rank not in taken and loads[rank].memory + piece.memory <= memory:
            found = rank
            break
        skipped.append((cost, rank))
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


def _lower_bound(choices: Mapping[str, _Choice], world: int) -> float:
    costs = [p.cost for c in choices.values() for p in c.pieces]
    return max(sum(costs) / world, max(costs))


def plan_tables(
    tables: Sequence[EmbeddingBagConfig | TableConfig],
    topology: Topology,
    batch_size: int,
    constraints: Mapping[str, TableConstraint] | None = None,
    optimizer: str = "rowwise_adagrad",
    max_rounds: int = 64,
    *,
    mean_pooling: Mapping[str, float] | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """A plan that fits every rank's memory and keeps the slowest rank's estimated
    step cost near the lower bound, with a report of per-rank memory and cost.

    ``tables`` are TorchRec's ``EmbeddingBagConfig``s, ``batch_size`` is per rank, and
    ``mean_pooling`` the mean ids per bag by feature or table (default 1.0; see
    ``planned_tables``); ``constraints`` limit tables by name.

    Round by round, while the slowest rank is more than 2 % above the lower bound, the
    costliest table that can be split further on each rank above that is split, and
    the pieces are placed again; the best placement seen wins.
    """
    tables = planned_tables(tables, mean_pooling)
    constraints = dict(constraints or {})
    unknown = set(constraints) - {t.name for t in tables}
    if unknown:
        raise PlanningError(f"constraints name tables the model does not have: {sorted(unknown)}")
    world, memory = topology.world_size, topology.memory_per_rank
    model = CostModel(topology, batch_size, optimizer)
    needed = sum(model.memory(t.num_embeddings, t.embedding_dim) for t in tables)
    if needed > world * memory:
        raise PlanningError(
            f"the tables need {format_bytes(needed)} but {plural(world, 'rank')} of "
            f"{format_bytes(memory)} {'holds' if world == 1 else 'hold'} "
            f"{format_bytes(world * memory)}: "
            f"{format_bytes(needed - world * memory)} missing"
        )
    whole = sum(
        model.shard_cost(t, "table_wise", t.num_embeddings, t.embedding_dim) for t in tables
    )
    options = {
        t.name: _options(t, model, constraints.get(t.name, TableConstraint())) for t in tables
    }
    choices = {n: _first_choice(o, whole / world, model, n) for n, o in options.items()}
    best = None
    for _ in range(max_rounds):
        loads, placed = _place_all(choices, world, memory)
        slowest, bound = max(r.cost for r in loads), _lower_bound(choices, world)
        if best is None or slowest < best[0]:
            best = (slowest, dict(choices), loads, placed)
        if slowest <= 1.02 * bound:
            break
        splits = dict(
            split
            for load in loads
            if load.cost > 1.02 * bound
            and (split := _split_one(load, choices, options, model)) is not None
        )
        if not splits:
            break
        choices.update(splits)
    _, choices, loads, placed = best
    specs = {t.name: _spec(choices[t.name].kind, placed[t.name], world) for t in tables}
    report = PlanReport(
        ranks=loads,
        tables=[
            TableChoice(t.name, choices[t.name].kind, len(placed[t.name]), choices[t.name].reason)
            for t in tables
        ],
        base_cost=model.base_cost(tables),
        lower_bound=_lower_bound(choices, world),
        topology=topology,
    )
    return ShardingPlan(specs), report


def _split_one(
    rank: RankLoad,
    choices: Mapping[str, _Choice],
    options: Mapping[str, list[_Option]],
    model: CostModel,
) -> tuple[str, _Choice] | None:
    """The costliest table on ``rank`` split into the next number of pieces it allows."""
    names = sorted(
        {s.split("[")[0] for s in rank.shards},
        key=lambda n: (-max(p.cost for p in choices[n].pieces), n),  # ties: by name
    )
    for name in names:
        more = [o for o in options[name] if o.blocks > len(choices[name].pieces)]
        if more:
            why = f"split to balance the ranks: {plural(more[0].blocks, 'piece')}"
            return name, _Choice(more[0].kind, more[0].pieces(model), why)
    return None


def _spec(kind: str, placed: list[tuple[int, _Piece]], world: int):
    if kind == "table_wise":
        return table_wise(placed[0][0])
    ordered = sorted(placed, key=lambda rp: rp[1].index)
    if kind == "column_wise":
        return column_wise([r for r, _ in ordered], [p.cols for _, p in ordered])
    # Row blocks go to their ranks in rank order, so block i is on the i-th smallest rank.
    sizes = [0] * world
    for rank, (_, piece) in zip(sorted(r for r, _ in ordered), ordered):
        sizes[rank] = piece.rows
    return row_wise(sizes)


def plan_loads(
    plan: ShardingPlan,
    tables: Sequence[EmbeddingBagConfig | TableConfig],
    topology: Topology,
    batch_size: int,
    optimizer: str = "rowwise_adagrad",
    *,
    mean_pooling: Mapping[str, float] | None = None,
) -> list[RankLoad]:
    """Per-rank memory and estimated cost of any plan, by the same cost model."""
    model = CostModel(topology, batch_size, optimizer)
    resolved: dict[str, ShardedTable] = plan.resolve(
        [_as_config(t) for t in tables], topology.world_size
    )
    loads = [RankLoad(r) for r in range(topology.world_size)]
    kinds = {TableWise: "table_wise", RowWise: "row_wise", ColumnWise: "column_wise"}
    for table in planned_tables(tables, mean_pooling):
        sharded = resolved[table.name]
        for shard in sharded.shards:
            if not (shard.rows and shard.cols):
                continue
            load = loads[shard.rank]
            load.memory += model.memory(shard.rows, shard.cols)
            load.cost += model.shard_cost(table, kinds[type(sharded.spec)], shard.rows, shard.cols)
            load.shards.append(shard_name(table.name, shard))
    return loads


def shard_name(name: str, shard: TableShard) -> str:
    """``table[row_offset:+rows, col_offset:+cols]``."""
    return f"{name}[{shard.row_offset}:+{shard.rows}, {shard.col_offset}:+{shard.cols}]"


def topology_for(
    config: TrainConfig, world_size: int, memory_per_rank: str | int | None = None
) -> Topology:
    """The config's topology (its kind's defaults, then its overrides) for a world."""
    t = config.topology
    overrides = {
        k: getattr(t, k)
        for k in (
            "ranks_per_host",
            "intra_bandwidth",
            "inter_bandwidth",
            "intra_latency",
            "inter_latency",
            "lookup_bandwidth",
        )
        if getattr(t, k) is not None
    }
    memory = memory_per_rank or t.memory_per_rank
    if memory is not None:
        overrides["memory_per_rank"] = parse_bytes(memory)
    kind = Topology.gpu if t.kind == "gpu" else Topology.cpu
    return kind(world_size, **overrides)


def plan_config(
    config: TrainConfig, world_size: int, memory_per_rank: str | int | None = None
) -> tuple[ShardingPlan, PlanReport]:
    """Plan a training config's tables, with its tables' constraints and optimizer."""
    constraints = {
        t.name: TableConstraint(
            tuple(t.shardings) if t.shardings else None,
            tuple(t.ranks) if t.ranks else None,
            t.column_blocks,
        )
        for t in config.tables
    }
    topology = topology_for(config, world_size, memory_per_rank)
    optimizer = config.sparse_optimizer.type
    return plan_tables(config.tables, topology, config.batch_size, constraints, optimizer)
