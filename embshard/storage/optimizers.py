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
    """How one of a fused optimizer's state tensors for one table reads as one 2-D tensor
    (its DTensor, its checkpoint entry): the global shape, and where each shard's state
    starts in it. A shard's own state is FBGEMM's, one row per shard row.

    ``BY_BLOCK``: the state is kept per column block, so a checkpoint saved under other
    blocks is converted on load."""

    BY_BLOCK: ClassVar[bool]

    def values(self, rows: int, cols: int) -> int:
        """How many float32 values a (rows x cols) shard keeps: what its memory costs."""
        ...

    def shape(self, table: ShardedTable) -> tuple[int, int]: ...

    def offset(self, table: ShardedTable, shard: TableShard) -> tuple[int, int]: ...


@dataclass(frozen=True)
class PerElement:
    """State shaped like the table, one value per element (Adagrad's accumulator,
    Adam's and LAMB's moments)."""

    BY_BLOCK: ClassVar[bool] = False

    def values(self, rows: int, cols: int) -> int:
        return rows * cols

    def shape(self, table: ShardedTable) -> tuple[int, int]:
        return table.num_embeddings, table.embedding_dim

    def offset(self, table: ShardedTable, shard: TableShard) -> tuple[int, int]:
        return shard.row_offset, shard.col_offset


@dataclass(frozen=True)
class PerRowBlock:
    """One value per row and column block (``column_blocks``): row-wise Adagrad's
    accumulator, which each column block of a table keeps for its own columns."""

    BY_BLOCK: ClassVar[bool] = True

    def values(self, rows: int, cols: int) -> int:
        return rows

    def shape(self, table: ShardedTable) -> tuple[int, int]:
        return table.num_embeddings, len(column_blocks(table))

    def offset(self, table: ShardedTable, shard: TableShard) -> tuple[int, int]:
        return shard.row_offset, column_blocks(table).index((shard.col_offset, shard.cols))


# Where FBGEMM's kernels run each optimizer: its CPU build has SGD and both Adagrads only.
_EVERYWHERE = frozenset({"cpu", "cuda"})
_CUDA_ONLY = frozenset({"cuda"})


@dataclass(frozen=True)
class SGD:
    """Plain SGD on the touched rows (FBGEMM's EXACT_SGD)."""

    lr: float = 0.01

    KIND: ClassVar[str] = "sgd"  # as configs, plans' reports and checkpoints name it
    # The state tensors, by the name their checkpoint keys end with, in FBGEMM's order.
    STATES: ClassVar[tuple[tuple[str, StateLayout], ...]] = ()
    DEVICES: ClassVar[frozenset[str]] = _EVERYWHERE  # device types with FBGEMM kernels
    # Whether the update reads the step count (bias correction): checkpoints keep it.
    COUNTS_STEPS: ClassVar[bool] = False
    # Whether a row looked up with a zero gradient keeps its weights and state: what
    # data-parallel copies need, every row of which takes a gradient each step.
    ZERO_GRADIENT_KEEPS: ClassVar[bool] = True

    def fbgemm_args(self) -> dict[str, Any]:
        return {"optimizer": _fbgemm_type("EXACT_SGD"), "learning_rate": self.lr}


@dataclass(frozen=True)
class RowWiseAdagrad:
    """Adagrad with one accumulator per row (EXACT_ROWWISE_ADAGRAD): the mean of the
    squared gradient over the row's columns *of this shard*."""

    lr: float = 0.01
    eps: float = 1e-8

    KIND: ClassVar[str] = "rowwise_adagrad"
    STATES: ClassVar[tuple[tuple[str, StateLayout], ...]] = (("momentum1", PerRowBlock()),)
    DEVICES: ClassVar[frozenset[str]] = _EVERYWHERE
    COUNTS_STEPS: ClassVar[bool] = False
    ZERO_GRADIENT_KEEPS: ClassVar[bool] = True

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
    STATES: ClassVar[tuple[tuple[str, StateLayout], ...]] = (("momentum1", PerElement()),)
    DEVICES: ClassVar[frozenset[str]] = _EVERYWHERE
    COUNTS_STEPS: ClassVar[bool] = False
    ZERO_GRADIENT_KEEPS: ClassVar[bool] = True

    def fbgemm_args(self) -> dict[str, Any]:
        return {
            "optimizer": _fbgemm_type("EXACT_ADAGRAD"),
            "learning_rate": self.lr,
            "eps": self.eps,
        }


# Adam's and LAMB's state: the first and second moments, per element.
_MOMENTS: tuple[tuple[str, StateLayout], ...] = (
    ("momentum1", PerElement()),
    ("momentum2", PerElement()),
)


def _moments_args(optimizer: Adam | Lamb, fbgemm_name: str) -> dict[str, Any]:
    return {
        "optimizer": _fbgemm_type(fbgemm_name),
        "learning_rate": optimizer.lr,
        "eps": optimizer.eps,
        "beta1": optimizer.beta1,
        "beta2": optimizer.beta2,
        "weight_decay": optimizer.weight_decay,
    }


@dataclass(frozen=True)
class Adam:
    """Adam on the touched rows (FBGEMM's ADAM), CUDA only: per element moments, bias
    corrected by the step count, ``weight_decay`` added to the step (L2, not AdamW's).
    Rows not looked up keep their moments (no decay)."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    KIND: ClassVar[str] = "adam"
    STATES: ClassVar[tuple[tuple[str, StateLayout], ...]] = _MOMENTS
    DEVICES: ClassVar[frozenset[str]] = _CUDA_ONLY
    COUNTS_STEPS: ClassVar[bool] = True
    ZERO_GRADIENT_KEEPS: ClassVar[bool] = False  # its moments still move the row

    def fbgemm_args(self) -> dict[str, Any]:
        return _moments_args(self, "ADAM")


@dataclass(frozen=True)
class Lamb:
    """LAMB on the touched rows (FBGEMM's LAMB), CUDA only: Adam's step, weight decay
    included, scaled per row by the trust ratio ||row|| / ||step||, both norms over the
    row's columns *of this shard* (each column block its own, like row-wise Adagrad's
    accumulator)."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    KIND: ClassVar[str] = "lamb"
    STATES: ClassVar[tuple[tuple[str, StateLayout], ...]] = _MOMENTS
    DEVICES: ClassVar[frozenset[str]] = _CUDA_ONLY
    COUNTS_STEPS: ClassVar[bool] = True
    ZERO_GRADIENT_KEEPS: ClassVar[bool] = False  # a zero step's trust ratio is NaN

    def fbgemm_args(self) -> dict[str, Any]:
        return _moments_args(self, "LAMB")


FusedOptimizer = SGD | RowWiseAdagrad | Adagrad | Adam | Lamb
# Every fused optimizer by its name.
FUSED_OPTIMIZERS: dict[str, type[FusedOptimizer]] = {
    cls.KIND: cls for cls in (SGD, RowWiseAdagrad, Adagrad, Adam, Lamb)
}


def device_problem(optimizer: type[FusedOptimizer], device_type: str) -> str | None:
    """Why ``optimizer`` cannot run on a ``device_type`` device, or None if it can."""
    if device_type in optimizer.DEVICES:
        return None
    where = ", ".join(sorted(optimizer.DEVICES))
    there = [k for k, cls in FUSED_OPTIMIZERS.items() if device_type in cls.DEVICES]
    instead = " or ".join([", ".join(there[:-1]), there[-1]] if len(there) > 1 else there)
    return (
        f"the fused optimizer {optimizer.KIND} runs on {where} only: FBGEMM's "
        f"{device_type.upper()} kernels lack it; on {device_type} use {instead}"
    )


def state_values(optimizer: str, rows: int, cols: int) -> int:
    """How many float32 state values the fused optimizer named ``optimizer`` keeps for a
    (rows x cols) shard."""
    return sum(layout.values(rows, cols) for _, layout in FUSED_OPTIMIZERS[optimizer].STATES)
