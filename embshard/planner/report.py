"""What a plan costs, rank by rank, and why each table is sharded as it is: the
planner's report, as text (``embshard plan``) and JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from embshard.plan.specs import Kind, plural
from embshard.planner.topology import Topology, format_bytes

UNCUT = (Kind.TABLE_WISE, Kind.DATA_PARALLEL)  # kinds that keep a table in one piece


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
    reason: str  # why: the report reads "sharding, because reason"
    sequence: bool = False  # an EmbeddingCollection's table

    def line(self) -> str:
        """What was done, then why: ``t: column_wise in 2 pieces, because ...``."""
        name = f"{self.table} (sequence)" if self.sequence else self.table
        cut = self.sharding not in UNCUT
        done = f"{self.sharding} in {plural(self.pieces, 'piece')}" if cut else self.sharding
        return f"{name}: {done}, because {self.reason}"


class ReportSection(Protocol):
    """A part a report carries for a kind of plan (a 2-D plan's sharding groups): its
    JSON and its lines of text."""

    def to_dict(self) -> dict[str, Any]: ...

    def lines(self) -> list[str]: ...


@dataclass
class PlanReport:
    ranks: list[RankLoad]
    tables: list[TableChoice]
    base_cost: float
    lower_bound: float
    topology: Topology  # a sharding group's, for a 2-D plan
    group: ReportSection | None = None  # a 2-D plan's groups (planner.groups.GroupChoice)

    @property
    def slowest(self) -> float:
        return max(r.cost for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.topology.world_size,
            "memory_per_rank": self.topology.memory_per_rank,
            "reserved_memory": self.topology.reserved_memory,
            "base_cost_s": self.base_cost,
            "slowest_rank_cost_s": self.slowest,
            "lower_bound_s": self.lower_bound,
            "ranks": [vars(r) for r in self.ranks],
            "tables": [vars(t) for t in self.tables],
        } | ({"sharding_group": self.group.to_dict()} if self.group else {})

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
            f"memory per rank {format_bytes(self.topology.memory_per_rank)}, "
            f"{format_bytes(self.topology.reserved_memory)} reserved"
        )
        lines += self.group.lines() if self.group else []
        lines += [f"  {c.line()}" for c in self.tables]
        return "\n".join(lines)
