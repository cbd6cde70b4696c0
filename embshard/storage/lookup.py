"""The rank's lookup over all its local shards, and the backends that build it.

Every local shard is one table of the rank's lookup module, so a rank's whole lookup
(and its backward with the optimizer update) is a single kernel call, SUM pooled.
Storage builds it through a ``LookupBackend``; ``TrainingTBE``, FBGEMM's training TBE,
is the one embshard has, its tables where its ``location`` says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from embshard.storage.optimizers import FUSED_OPTIMIZERS, FusedOptimizer, device_problem


class LookupModule(Protocol):
    """A rank's built lookup, as storage and the forward use it (FBGEMM's TBE interface):
    table ``i`` is the ``i``-th shard shape it was built for."""

    def __call__(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The bags SUM pooled, [batch, every feature's dim side by side]; its backward
        applies the fused optimizer to the rows looked up."""
        ...

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Every table's weights, [rows, cols]: views, which the tables' DTensors wrap."""
        ...

    def split_optimizer_states(self) -> list[list[torch.Tensor]]:
        """Every table's optimizer state tensors (views), in the order of the optimizer's
        ``STATES``, each one row per table row."""
        ...

    # The steps counted (int64, one element; each forward adds one), which Adam's and
    # LAMB's bias correction reads; and FBGEMM's host copy of it, which it takes from
    # ``iter`` only while it is zero: restoring a count sets both.
    iter: torch.Tensor
    iter_cpu: torch.Tensor


class LookupBackend(Protocol):
    """What builds a rank's ``LookupModule`` from its shard shapes."""

    def check(self, optimizer: FusedOptimizer, device: torch.device) -> None:
        """Raise if this backend cannot run ``optimizer`` on ``device``. Storage calls it
        on every rank before it builds the rank's lookup, ranks with no shards too, so
        every rank refuses alike."""
        ...

    def build(
        self,
        shard_shapes: Sequence[tuple[int, int]],
        optimizer: FusedOptimizer,
        device: torch.device,
        feature_table_map: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> LookupModule:
        """One lookup holding a zero-filled (rows, cols) table per shard shape, with
        ``optimizer`` fused, its weights stored as ``dtype``; feature ``f`` looks up
        table ``feature_table_map[f]`` (default: one feature a table)."""
        ...


# The weight dtypes FBGEMM 1.8's CPU kernels run: BF16 and INT8 weights fail there
# ("split_embedding_cpu_forward_2" not implemented for 'BFloat16').
WEIGHT_PRECISIONS = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}


# FBGEMM's table locations by name: where the rows live, and the device type that
# computes on them.
_LOCATIONS: dict[str, tuple[EmbeddingLocation, str]] = {
    "device": (EmbeddingLocation.DEVICE, "cuda"),  # HBM
    "managed": (EmbeddingLocation.MANAGED, "cuda"),  # UVM
    "managed_caching": (EmbeddingLocation.MANAGED_CACHING, "cuda"),  # UVM, HBM cache
    "host": (EmbeddingLocation.HOST, "cpu"),
}
_COMPUTE = {"cuda": ComputeDevice.CUDA, "cpu": ComputeDevice.CPU}


def _placement(
    location: str | None, device: torch.device
) -> tuple[EmbeddingLocation, ComputeDevice]:
    """FBGEMM's location and compute device for ``location`` on ``device``; None is
    the device's own memory."""
    if location is None:
        if device.type == "cuda":
            return EmbeddingLocation.DEVICE, ComputeDevice.CUDA
        return EmbeddingLocation.HOST, ComputeDevice.CPU
    fbgemm_location, device_type = _LOCATIONS[location]
    if device.type != device_type:
        fits = [repr(n) for n, (_, t) in _LOCATIONS.items() if t == device.type]
        takes = ", ".join(fits) + " or None" if fits else "None"
        raise ValueError(
            f"TrainingTBE(location={location!r}) does not work on device {device}: "
            f"a {device.type} device takes location {takes}"
        )
    return fbgemm_location, _COMPUTE[device_type]


def check_optimizer(optimizer: FusedOptimizer, device: torch.device) -> None:
    """Raise, in one line, unless ``optimizer`` is a fused optimizer that FBGEMM runs on
    ``device`` (its CPU build refuses Adam and LAMB, with an AssertionError)."""
    if not isinstance(optimizer, tuple(FUSED_OPTIMIZERS.values())):
        *names, last = (cls.__name__ for cls in FUSED_OPTIMIZERS.values())
        raise TypeError(
            f"optimizer must be embshard.{', '.join(names)} or {last}, got {optimizer!r}"
        )
    if problem := device_problem(type(optimizer), device.type):
        raise ValueError(f"{problem} (device {device})")


def build_tbe(
    shard_shapes: Sequence[tuple[int, int]],
    optimizer: FusedOptimizer,
    device: torch.device,
    feature_table_map: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    location: str | None = None,
) -> SplitTableBatchedEmbeddingBagsCodegen:
    """One TBE holding a (rows, cols) table per local shard, optimizer fused, SUM
    pooled (an EmbeddingCollection's lookups give it one id a bag).

    Weights are stored as ``dtype`` (float32 or float16); either way the rows are summed
    in float32 into a float32 output, and the optimizer state is float32. Float16
    updates round to nearest, never stochastically, so runs repeat (FBGEMM's CPU SGD
    and Adagrad round the step to float16 before adding it).

    Its weights start at zero on CPU; callers write the real values through
    ``split_embedding_weights()``, whose tensors are views of the TBE's buffer.
    FBGEMM's own bounds check is off (it cost 20 % of the CPU forward): every id is
    checked against its table on the rank that sends it (``inputs.check_batch``),
    and row-wise ids are rebased into their block by FBGEMM's bucketizer.

    ``location`` is where the tables live (``TrainingTBE``'s field).
    """
    check_optimizer(optimizer, device)
    fbgemm_location, compute = _placement(location, device)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, cols, fbgemm_location, compute) for rows, cols in shard_shapes],
        feature_table_map=None if feature_table_map is None else list(feature_table_map),
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.NONE,
        device=device,
        weights_precision=WEIGHT_PRECISIONS[dtype],
        output_dtype=SparseType.FP32,
        stochastic_rounding=False,
        **optimizer.fbgemm_args(),
    )


@dataclass(frozen=True)
class TrainingTBE:
    """FBGEMM's training TBE (``SplitTableBatchedEmbeddingBagsCodegen``, see
    ``build_tbe``), the fused optimizer in its backward.

    ``location`` is where its tables live: None, the device's own memory (HBM on CUDA,
    host memory on CPU), or FBGEMM's ``EmbeddingLocation`` by name: ``"device"`` (HBM),
    ``"managed"`` (UVM) or ``"managed_caching"`` (UVM behind an HBM cache) on CUDA,
    ``"host"`` on CPU.
    """

    location: str | None = None

    def __post_init__(self) -> None:
        if self.location is not None and self.location not in _LOCATIONS:
            raise ValueError(
                f"TrainingTBE location must be None or one of {list(_LOCATIONS)}, "
                f"got {self.location!r}"
            )

    def check(self, optimizer: FusedOptimizer, device: torch.device) -> None:
        check_optimizer(optimizer, device)
        _placement(self.location, device)

    def build(
        self,
        shard_shapes: Sequence[tuple[int, int]],
        optimizer: FusedOptimizer,
        device: torch.device,
        feature_table_map: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> SplitTableBatchedEmbeddingBagsCodegen:
        return build_tbe(shard_shapes, optimizer, device, feature_table_map, dtype, self.location)
