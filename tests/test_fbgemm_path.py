"""The step a GPU runs, checked on CPU: embshard's CPU kernels off
(``EMBSHARD_NATIVE=0``), so the batch check, routing, packing and unpacking are FBGEMM's
and torch's operations, as on CUDA, where the kernels do not run. The rest of the
suite steps with the kernels; these tests keep the GPU's path to the same oracles (the
unsharded TorchRec module, the dynamic tables' reference) and to its own op and
host-read budgets.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from oracle import Case, Table, run_case, run_sequence_case
from test_device_path import check_one_read_a_step
from test_dynamic import CASES as DYNAMIC_CASES
from test_dynamic import _check as check_dynamic
from test_dynamic import _run_case as run_dynamic_case
from test_forward import (
    ALL_PLANS,
    TABLES,
    batch_sizes,
    check_bad_input_raises_on_every_rank,
    check_either_index_dtype,
    plans,
    random_cases,
    tables_for,
)
from test_ops import check_op_budget
from test_pipeline import check_bad_next_batch, check_pipeline_bit_exact
from test_sequence import TABLES as SEQUENCE_TABLES
from test_sequence import plans as sequence_plans

TOL = 1e-5


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("plan", ALL_PLANS)
def test_training_matches_unsharded(fbgemm_world, world_size, plan):
    case = Case(tables_for(plan), plans(world_size)[plan], batch_sizes(world_size), seed=world_size)
    for worst in fbgemm_world(world_size).run(run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


@pytest.mark.parametrize("plan", ["mixed", "hot_rows"])
def test_weighted_features(fbgemm_world, plan):
    tables = tuple(Table(t.name, t.rows, t.dim, t.features) for t in TABLES)  # SUM only
    case = Case(tables, plans(2)[plan], batch_sizes(2), weighted=True)
    for worst in fbgemm_world(2).run(run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


def test_random_plans_tables_and_batches(fbgemm_world):
    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(random_cases(2))
    def check(case):
        for worst in fbgemm_world(2).run(run_case, case):
            assert worst["forward"] < TOL and worst["weights"] < TOL, worst

    check()


@pytest.mark.parametrize("plan", ["mixed_row_wise", "grid"])
def test_sequence_training_matches_unsharded(fbgemm_world, plan):
    case = Case(SEQUENCE_TABLES, sequence_plans(3)[plan], batch_sizes(3), sequence=True)
    results = fbgemm_world(3).run(run_sequence_case, case)
    for worst in results:
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst
    assert max(worst["output"] for worst in results) > 0.1


@pytest.mark.parametrize(
    "name", ["w2_row_wise_lru_admit2_rowwise_adagrad", "w4_weighted_grid_ttl_adagrad"]
)
def test_dynamic_tables_equal_the_reference(fbgemm_world, name):
    case = DYNAMIC_CASES[name]
    check_dynamic(fbgemm_world(case.world).run(run_dynamic_case, case))


def test_bad_input_on_one_rank_raises_on_every_rank(fbgemm_world):
    """FBGEMM's check, and the stand-in lengths that keep routing in bounds."""
    check_bad_input_raises_on_every_rank(fbgemm_world)


def test_ids_and_lengths_of_either_index_dtype(fbgemm_world):
    check_either_index_dtype(fbgemm_world)


def test_a_step_reads_back_from_the_device_once(fbgemm_world):
    check_one_read_a_step(fbgemm_world)


def test_pipeline_is_bit_exact_with_the_plain_loop(fbgemm_world):
    """The next batch's check, routing and packing run a step ahead."""
    check_pipeline_bit_exact(fbgemm_world)


def test_a_bad_next_batch_raises_at_the_step_that_uses_it(fbgemm_world):
    check_bad_next_batch(fbgemm_world)


# Working ops a step on this path, in tests/test_ops.py's cells (its BUDGET is the CPU
# kernels'). Pooled, W > 1: FBGEMM's check takes the bags' offsets and the ids less one
# besides the check (2 more), packing a permute and a cat (1 more), unpacking two cats,
# a permute and a cumsum (3 more), and where ids are bucketized before the counts say
# the batch is good, a validity flag and stand-in lengths (3 more). At W = 1 the
# check's offsets serve the TBE too: 1 more in all.
FBGEMM_BUDGET = {
    1: {
        ("pooled", "table_wise"): [6],
        ("pooled", "row_wise"): [6],
        ("pooled", "column_wise"): [6],
        ("pooled", "mixed"): [6],
        ("sequence", "table_wise"): [101],
        ("sequence", "mixed"): [101],
    },
    2: {
        ("pooled", "table_wise"): [22, 22],
        ("pooled", "row_wise"): [26, 26],
        ("pooled", "column_wise"): [22, 22],
        ("pooled", "mixed"): [26, 26],
        ("sequence", "table_wise"): [113, 113],
        ("sequence", "mixed"): [154, 154],
    },
}


@pytest.mark.parametrize("size", [1, 2])
def test_a_step_stays_within_its_op_budget(fbgemm_world, size):
    check_op_budget(fbgemm_world, size, FBGEMM_BUDGET[size])
