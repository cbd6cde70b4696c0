"""The fused optimizers FBGEMM's TBE runs in its backward, and their names. Light to
import (FBGEMM loads only when a TBE is built), so configs can name them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


def _fbgemm_type(name: str) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # heavy: only for a TBE

    return EmbOptimType[name]


@dataclass(frozen=True)
class SGD:
    """Plain SGD on the touched rows (FBGEMM's EXACT_SGD)."""

    lr: float = 0.01

    KIND: ClassVar[str] = "sgd"  # as configs, plans' reports and checkpoints name it

    def fbgemm_args(self) -> dict[str, Any]:
        return {"optimizer": _fbgemm_type("EXACT_SGD"), "learning_rate": self.lr}


@dataclass(frozen=True)
class RowWiseAdagrad:
    """Adagrad with one accumulator per row (EXACT_ROWWISE_ADAGRAD): the mean of the
    squared gradient over the row's columns *of this shard*."""

    lr: float = 0.01
    eps: float = 1e-8

    KIND: ClassVar[str] = "rowwise_adagrad"

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
