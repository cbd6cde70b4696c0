"""The fused optimizers FBGEMM's TBE runs in its backward, their names and the layout
of their state. Light to import (FBGEMM loads only when a TBE is built), so configs
can name them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # annotations only: importing the plan loads torch and TorchRec
    from embshard.plan.specs import ShardedTable, TableShard


def _fbgemm_type(name: str) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # heavy: only for a TBE

    return EmbOptimType[name]


def column_blocks(table: ShardedTable) -> list[tuple[int, int]]:
    """The table's distinct column ranges (offset, width): its blocks for row-wise
    optimizer state, one per column-wise block, else one for the whole row."""
    return sorted({(s.col_offset, s.cols) for s in table.shards})


class StateLayout(Protocol):
    """How a fused optimizer's state for one table reads as one 2-D tensor (its DTensor,
    its checkpoint entry): the global shape, and where each shard's state starts in it.
    A shard's own state is FBGEMM's, one row per shard row."""

    def shape(self, table: ShardedTable) -> tuple[int, int]: ...

    def offset(self, table: ShardedTable, shard: TableShard) -> tuple[int, int]: ...


@dataclass(frozen=True)
class PerElement:
    """State shaped like the table, one value per element (Adagrad's accumulator)."""

    def shape(self, table: ShardedTable) -> tuple[int, int]:
        return table.num_embeddings, table.embedding_dim

    def offset(self, table: ShardedTable, shard: TableShard) -> tuple[int, int]:
        return shard.row_offset, shard.col_offset


@dataclass(frozen=True)
class PerRowBlock:
    """One value per row and column block (``column_blocks``): row-wise Adagrad's
    accumulator, which each column block of a table keeps for its own columns."""

    def shape(self, table: ShardedTable) -> tuple[int, int]:
        return table.num_embeddings, len(column_blocks(table))

    def offset(self, table: ShardedTable, shard: TableShard) -> tuple[int, int]:
        return shard.row_offset, column_blocks(table).index((shard.col_offset, shard.cols))


@dataclass(frozen=True)
class SGD:
    """Plain SGD on the touched rows (FBGEMM's EXACT_SGD)."""

    lr: float = 0.01

    KIND: ClassVar[str] = "sgd"  # as configs, plans' reports and checkpoints name it
    STATE: ClassVar[StateLayout | None] = None  # stateless

    def fbgemm_args(self) -> dict[str, Any]:
        return {"optimizer": _fbgemm_type("EXACT_SGD"), "learning_rate": self.lr}


@dataclass(frozen=True)
class RowWiseAdagrad:
    """Adagrad with one accumulator per row (EXACT_ROWWISE_ADAGRAD): the mean of the
    squared gradient over the row's columns *of this shard*."""

    lr: float = 0.01
    eps: float = 1e-8

    KIND: ClassVar[str] = "rowwise_adagrad"
    STATE: ClassVar[StateLayout | None] = PerRowBlock()

    def fbgemm_args(self) -> dict[str, Any]:
        return {
            "optimizer": _fbgemm_type("EXACT_ROWWISE_ADAGRAD"),
            "learning_rate": self.lr,
            "eps": self.eps,
        }


@dataclass(frozen=True)
class Adagrad:
    """Adagrad with one accumulator per element (EXACT_ADAGRAD)."""

    lr: float = 0.01
    eps: float = 1e-8

    KIND: ClassVar[str] = "adagrad"
    STATE: ClassVar[StateLayout | None] = PerElement()

    def fbgemm_args(self) -> dict[str, Any]:
        return {
            "optimizer": _fbgemm_type("EXACT_ADAGRAD"),
            "learning_rate": self.lr,
            "eps": self.eps,
        }


FusedOptimizer = SGD | RowWiseAdagrad | Adagrad
# Every fused optimizer by its name.
FUSED_OPTIMIZERS: dict[str, type[FusedOptimizer]] = {
    cls.KIND: cls for cls in (SGD, RowWiseAdagrad, Adagrad)
}
