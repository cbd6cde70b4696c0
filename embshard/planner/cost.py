"""The planner's cost model: seconds per training step on the rank that owns a shard.

- lookup: the ids routed to the shard times its row bytes, read forward and read and
  written backward (3 passes), over the rank's gather bandwidth;
- communication, priced alpha-beta (bytes over the bandwidth of the links the
  all-to-alls cross): the ids and bag lengths it receives, and the pooled rows it
  sends forward and whose gradients it receives backward: one per bag, or for a
  sequence table (an EmbeddingCollection's) one per id it received;
- a dynamic table's remap of each id it receives.

Every rank also pays the same base: four collectives' latency and its own batch's
ids and pooled rows; it is reported, not balanced. Memory is weights plus the fused
optimizer's state and a dynamic table's id map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embshard.errors import PlanningError
from embshard.plan.specs import Kind
from embshard.planner.tables import PlannedTable
from embshard.planner.topology import Topology
from embshard.storage.optimizers import FUSED_OPTIMIZERS, state_values

ROW_SPLIT = (Kind.ROW_WISE, Kind.GRID)  # kinds whose pieces get the ids of their rows only
_ID_BYTES = 8  # ids and bag lengths travel as int64
LOOKUP_PASSES = 3  # forward read; backward read and write


@dataclass(frozen=True)
class CostModel:
    topology: Topology
    batch_size: int  # per rank
    optimizer: str = "rowwise_adagrad"  # the fused optimizer, whose state it prices

    def __post_init__(self) -> None:
        if self.optimizer not in FUSED_OPTIMIZERS:
            raise PlanningError(
                f"optimizer must be one of {list(FUSED_OPTIMIZERS)}, got {self.optimizer!r}"
            )

    def ids(self, table: PlannedTable) -> float:
        return self.topology.world_size * self.batch_size * table.ids_per_sample

    def bags(self, table: PlannedTable) -> float:
        return self.topology.world_size * self.batch_size * table.bags_per_sample

    def outputs(self, table: PlannedTable) -> float:
        """The rows the lookups return: one per bag, or per id for a sequence table."""
        return self.ids(table) if table.sequence else self.bags(table)

    def memory(self, table: PlannedTable, rows: int, cols: int) -> int:
        """Bytes of a (rows x cols) shard of ``table``: its weights, the optimizer's
        state, fp32 whatever the weights' type, and a dynamic table's id map (whose
        shards are whole rows)."""
        state = state_values(self.optimizer, rows, cols)
        return table.weight_bytes * rows * cols + 4 * state + table.map_bytes * rows

    def shard_cost(self, table: PlannedTable, kind: str, rows: float, cols: float) -> float:
        """Seconds per step the owner of a (rows x cols) shard of ``table`` spends.

        Linear in ``rows`` and ``cols``, so k pieces of a table cost ``A + B k`` in all
        however they are cut: a row piece (row-wise, or a grid's) gets its share of the
        ids but every bag's length, a column piece every id and bag. A pooled piece
        sends a row back for every bag (a partial sum, for a row piece); a sequence
        piece one for each id it got; a dynamic table's piece remaps each id it gets
        (``Topology.remap_rate``). A data-parallel copy: ``replica_cost``."""
        if kind == Kind.DATA_PARALLEL:
            return self.replica_cost(table)
        share = rows / table.num_embeddings if kind in ROW_SPLIT else 1.0
        ids, bags = self.ids(table) * share, self.bags(table)
        out = ids if table.sequence else bags
        lookup = ids * cols * table.weight_bytes * LOOKUP_PASSES / self.topology.lookup_bandwidth
        remap = ids / self.topology.remap_rate if table.dynamic else 0.0
        moved = (ids + bags) * _ID_BYTES + 2 * out * cols * 4
        return lookup + remap + moved * self.topology.seconds_per_byte()

    def whole_cost(self, table: PlannedTable) -> float:
        return self.shard_cost(table, Kind.TABLE_WISE, table.num_embeddings, table.embedding_dim)

    def requester_cost(self, table: PlannedTable) -> float:
        """What each rank pays to have ``table`` served by others: its own ids out, its
        rows (``outputs``) back and their gradient out."""
        world = self.topology.world_size
        ids = (self.ids(table) + self.bags(table)) / world * _ID_BYTES
        rows = self.outputs(table) * table.embedding_dim / world * 4 * 2
        return (ids + rows) * self.topology.seconds_per_byte()

    def replica_cost(self, table: PlannedTable) -> float:
        """What a data-parallel copy of ``table`` adds to each rank, net of the
        ``requester_cost`` it saves (so it may be negative)."""
        return self.copy_cost(table, table.num_embeddings, 1.0) - self.requester_cost(table)

    def copy_cost(self, table: PlannedTable, rows: int, share: float) -> float:
        """What a copy of ``table``'s first ``rows`` rows, which ``share`` of its ids
        fall in, adds to each rank: looking up its own batch's ids of them, reading and
        updating every copied row through the TBE each step, and their gradient
        all-reduced (a ring: twice the bytes)."""
        world = self.topology.world_size
        looked_up = rows + self.batch_size * table.ids_per_sample * share
        lookup = looked_up * table.embedding_dim * table.weight_bytes * LOOKUP_PASSES
        gradient = rows * table.embedding_dim * 4  # fp32, all-reduced
        reduce = 2 * (world - 1) / world * gradient * self.topology.seconds_per_byte()
        return lookup / self.topology.lookup_bandwidth + reduce

    def base_cost(self, tables: Sequence[PlannedTable]) -> float:
        """What every rank pays alike: 4 collectives' latency, its own ids and rows (a
        plan with data-parallel copies adds its all-reduce's latency to every rank's
        own cost, and each copy its ``replica_cost``)."""
        return 4 * self.topology.collective_latency() + sum(self.requester_cost(t) for t in tables)
