"""The step a GPU runs, checked on CPU: embshard's CPU kernels off
(``EMBSHARD_NATIVE=0``), so the batch check, routing, packing and unpacking are FBGEMM's
and torch's operations, as on CUDA, where the kernels do not run. The rest of the
suite steps with the kernels; these tests keep the GPU's path to the same oracles (the
unsharded TorchRec module, the dynamic tables' reference) and to its own op and
host-read budgets.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from oracle import Case, Table, run_case, run_sequence_case
from test_device_path import PLAN as DEVICE_PLAN
from test_device_path import TABLES as DEVICE_TABLES
from test_device_path import count_syncs
from test_dynamic import CASES as DYNAMIC_CASES
from test_dynamic import _check as check_dynamic
from test_dynamic import _run_case as run_dynamic_case
from test_forward import (
    ALL_PLANS,
    TABLES,
    bad_batches,
    batch_sizes,
    forward_in_every_id_dtype,
    forward_with_bad_input_on_rank_1,
    plans,
    random_cases,
    tables_for,
)
from test_ops import CELLS, counted_steps, name_of
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
    """FBGEMM's check and the stand-in lengths that keep routing in bounds."""
    case = Case(TABLES, plans(3)["mixed"], (4, 5, 3))
    reports = fbgemm_world(3).run(forward_with_bad_input_on_rank_1, case, timeout=120)
    for expected in bad_batches(case):
        messages = {r[expected][0] for r in reports}
        assert len(messages) == 1, messages
        assert "rank 1: " in (message := messages.pop()) and expected in message, message


def test_ids_and_lengths_of_either_index_dtype(fbgemm_world):
    case = Case(TABLES, plans(2)["mixed"], (5, 3))
    for found in fbgemm_world(2).run(forward_in_every_id_dtype, case):
        for key, value in found.items():
            if key.startswith("bad "):
                assert value is not None and "id 40 is outside [0, " in value, (key, value)
            else:
                assert value < TOL, (key, found)


def test_a_step_reads_back_from_the_device_once(fbgemm_world):
    case = Case(DEVICE_TABLES, DEVICE_PLAN, (5, 3))
    for report in fbgemm_world(2).run(count_syncs, case):
        assert report["forward_reads"] == ["tolist"], report["forward_reads"]
        assert report["forward_ops"] == [], report["forward_ops"]
        assert report["backward_reads"] == [] and report["backward_ops"] == [], report
        torch.testing.assert_close(report["out"], report["expected"])


# Working ops a step on this path, in tests/test_ops.py's cells (its BUDGET is the CPU
# kernels'). Pooled, W > 1: FBGEMM's check takes the bags' offsets and the ids less one
# besides the check (2 more), packing a permute and a cat (1 more), unpacking two cats,
# a permute and a cumsum (3 more), and where ids are bucketized before the counts say
# the batch is good, a validity flag and stand-in lengths (3 more). At W = 1 the
# check's offsets are the TBE's: 1 more.
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
    ranks = fbgemm_world(size).run(counted_steps)
    found = {}
    for workload, plan in CELLS:
        cell = (name_of(workload), plan)
        for counts in ranks:
            first, *others = counts[cell]
            assert all(s == first for s in others), (cell, first, others)
            syncs = (first.forward_syncs, first.backward_syncs)
            assert syncs == (1, 0) or (size == 1 and syncs == (0, 0)), (cell, syncs)
        found[cell] = [counts[cell][0].ops for counts in ranks]
    budget = FBGEMM_BUDGET[size]
    over = {c: o for c, o in found.items() if any(a > b for a, b in zip(o, budget[c]))}
    assert not over, f"W={size}, working ops a step over budget: {over}, budget {budget}"
