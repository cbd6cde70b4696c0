"""The options of the CUDA path against the same oracles as on the CPU: FP16 tables,
compressed all-to-alls, and tables in managed memory (UVM) or behind an HBM cache."""

from __future__ import annotations

import pytest
from oracle import Case, run_case
from test_cuda import EVERY_LAYOUT_TABLES, OPTIMIZERS, TOL
from test_forward import batch_sizes
from test_precision import TABLES, check_fp16_training, check_rounded_once, fp32, mixed_plan

import embshard
from embshard import ShardingPlan, column_wise, row_wise, table_wise

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fp16_tables_train_like_the_float32_oracle_rounded(cuda_world, optimizer):
    """Two ranks on the GPU, one of them with an empty batch: at most one float16 ulp a
    step from the oracle (FBGEMM's CUDA update may round once more, or stochastically)."""
    case = Case(
        TABLES, mixed_plan(2), batch_sizes(2), optimizer=OPTIMIZERS[optimizer], device="cuda"
    )
    check_fp16_training(cuda_world(2).run(run_case, case), case, 1e-4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_compressed_all_to_alls_err_by_rounding_only_on_the_gpu(cuda_world, precision):
    """As on the CPU (test_precision): each pooled partial and gradient rounded once."""
    case = Case(fp32(TABLES), mixed_plan(2), (5, 3), comm_precision=precision, device="cuda")
    check_rounded_once(cuda_world(2).run(run_case, case), precision)


# Table-wise, row-wise and column-wise shards in one TBE, outside the GPU's own memory.
MANAGED_PLAN = ShardingPlan(
    {
        "tw": table_wise(0),
        "rw": row_wise(),
        "uneven": row_wise(),
        "cw": column_wise([0, 0]),
        "dp": table_wise(0),
        "grid": row_wise(),
    }
)


@pytest.mark.parametrize("location", ["managed", "managed_caching"])
def test_tables_in_managed_memory_train_like_unsharded(cuda_world, location):
    case = Case(
        EVERY_LAYOUT_TABLES,
        MANAGED_PLAN,
        (6,),
        optimizer=embshard.RowWiseAdagrad(lr=0.1, eps=1e-4),
        device="cuda",
        lookup=embshard.TrainingTBE(location=location),
    )
    [worst] = cuda_world(1).run(run_case, case)
    assert worst["forward"] < TOL and worst["weights"] < TOL, worst
    assert worst["output"] > 0.1 and worst["update"] > 1e-3, worst
