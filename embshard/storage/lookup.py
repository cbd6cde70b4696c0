"""The rank's one FBGEMM TBE over all its local shards, and the fused optimizers it runs.

Every local shard is one TBE "table", so a rank's whole lookup (and its backward with
the optimizer update) is a single kernel call, SUM pooled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

from embshard.storage.optimizers import FUSED_OPTIMIZERS, FusedOptimizer

# The weight dtypes FBGEMM 1.8's CPU kernels run: BF16 and INT8 weights fail there
# ("split_embedding_cpu_forward_2" not implemented for 'BFloat16').
WEIGHT_PRECISIONS = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}


def _fbgemm_optimizer(optimizer: FusedOptimizer) -> dict[str, Any]:
    if not isinstance(optimizer, tuple(FUSED_OPTIMIZERS.values())):
        raise TypeError(
            f"optimizer must be embshard.SGD, RowWiseAdagrad or Adagrad, got {optimizer!r}"
        )
    return optimizer.fbgemm_args()


def build_tbe(
    shard_shapes: Sequence[tuple[int, int]],
    optimizer: FusedOptimizer,
    device: torch.device,
    feature_table_map: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
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
    """
    if device.type == "cuda":
        location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    else:
        location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, cols, location, compute) for rows, cols in shard_shapes],
        feature_table_map=None if feature_table_map is None else list(feature_table_map),
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.NONE,
        device=device,
        weights_precision=WEIGHT_PRECISIONS[dtype],
        output_dtype=SparseType.FP32,
        stochastic_rounding=False,
        **_fbgemm_optimizer(optimizer),
    )
