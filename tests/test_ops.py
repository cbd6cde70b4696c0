"""embshard's training step stays within its budget of working ops, plan by plan.

On a GPU every working op is a kernel launch, paid in host time on every step; a
count, unlike a time, is exact, so a new kernel in the step fails here. The counter
is tools/bench/ops.py (what counts is defined there and in docs/performance.md);
``tools/op_count.py --by-op`` shows where a step's ops go, and TorchRec's beside them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tools import bench
from tools.bench.ops import StepOps, Tally, count_case, count_step

# Small, multi-hot, mixed dimensions: each plan kind twice in the mixed plan, and at
# W = 2 every column-wise table cut into 2 blocks. Fixed bags: every draw of ids has
# the same sizes, so the counts of different draws must agree.
POOLED = {
    "tables": [(40, 8, 3), (100, 16, 1), (30, 16, 5), (60, 32, 2), (25, 8, 4), (50, 32, 2)],
    "bags": "fixed",
    "batch": 8,
}
SEQUENCE = {
    "tables": [(40, 16, 3), (100, 16, 1), (30, 16, 5), (60, 16, 2)],
    "bags": "fixed",
    "batch": 8,
    "sequence": True,
}
CELLS = [(POOLED, plan) for plan in bench.PLANS] + [(SEQUENCE, "table_wise"), (SEQUENCE, "mixed")]

# Working ops a step (forward, backward with the fused update), rank by rank: today's
# counts. A change that saves ops lowers its cells here; one that adds ops fails. On
# CPU with embshard's kernels (runtime/native.py), whose batch check is one op that
# also gives routable lengths, and whose pack and unpack of the ids are one op each.
# Without them (CUDA, or the kernels off) FBGEMM's check takes the ids less one, the
# bags' offsets (at W > 1 for it alone) and, where ids are bucketized, a validity flag
# and stand-in lengths (up to 5 ops more), and at W > 1 packing and unpacking take
# FBGEMM's permutes, cats and cumsum (4 more): tests/test_fbgemm_path.py's budget.
BUDGET = {
    1: {
        ("pooled", "table_wise"): [5],
        ("pooled", "row_wise"): [5],
        ("pooled", "column_wise"): [5],
        ("pooled", "mixed"): [5],
        ("sequence", "table_wise"): [96],
        ("sequence", "mixed"): [96],
    },
    2: {
        ("pooled", "table_wise"): [16, 16],
        ("pooled", "row_wise"): [17, 17],
        ("pooled", "column_wise"): [16, 16],
        ("pooled", "mixed"): [17, 17],
        ("sequence", "table_wise"): [107, 107],
        ("sequence", "mixed"): [148, 148],
    },
}


def name_of(workload: dict) -> str:
    return "sequence" if workload.get("sequence") else "pooled"


def counted_steps() -> dict[tuple[str, str], list[StepOps]]:
    """Every cell's steps counted on this rank: two draws of each id law after a
    warm-up step, all of the same sizes."""
    world, rank = dist.get_world_size(), dist.get_rank()
    counts = {}
    for workload, plan_name in CELLS:
        configs = bench.table_configs(workload)
        plan = bench.make_plan(plan_name, configs, world)
        model = bench.build("embshard", configs, plan, world)
        steps = []
        for ids in bench.ID_LAWS:
            batches = bench.make_inputs(workload, rank, 3, ids)
            bench.loss(model, batches[0]).backward()  # first-use work is not a step's
            steps += [count_step(model, batch) for batch in batches[1:]]
        counts[(name_of(workload), plan_name)] = steps
    return counts


def check_op_budget(world, size: int, budget: dict[tuple[str, str], list[int]]) -> None:
    """Every cell's steps on every rank of ``world(size)`` within ``budget``, each
    counting the same, with one host sync a forward."""
    ranks = world(size).run(counted_steps)
    ops = {}
    for cell in budget:
        for rank, counts in enumerate(ranks):
            first, *others = counts[cell]
            # The same sizes give the same ops, whatever the ids (and in every step).
            assert all(s == first for s in others), (cell, rank, first, others)
            # One host sync a forward, the counts exchange (none needed at W = 1), and
            # none in the backward.
            syncs = (first.forward_syncs, first.backward_syncs)
            assert syncs == (1, 0) or (size == 1 and syncs == (0, 0)), (cell, rank, syncs)
        ops[cell] = [counts[cell][0].ops for counts in ranks]
    over = {c: o for c, o in ops.items() if any(a > b for a, b in zip(o, budget[c]))}
    assert not over, f"W={size}, working ops a step over budget: {over}, budget {budget}"


@pytest.mark.parametrize("size", [1, 2])
def test_a_step_stays_within_its_op_budget(world, size):
    check_op_budget(world, size, BUDGET[size])


TBE_FORWARD = "fbgemm.split_embedding_codegen_forward_unweighted_pt2_wrapper.default"


def test_the_tool_counts_both_libraries_on_the_same_cell(world):
    """tools/op_count.py's cell: TorchRec's DistributedModelParallel counted beside
    embshard, on the same plan and inputs, on every rank."""
    record = world(2).run(count_case, POOLED, "mixed", "power-law", 2)[0]
    assert record["embshard_steps_agree"] and record["torchrec_steps_agree"]
    assert 0 < max(c.ops for c in record["embshard"]) <= min(BUDGET[2][("pooled", "mixed")])
    for ours, theirs in zip(record["embshard"], record["torchrec"]):
        # One TBE a rank in embshard; TorchRec groups a rank's tables by sharding kind.
        assert (ours.forward[TBE_FORWARD], theirs.forward[TBE_FORWARD]) == (1, 3)
        assert theirs.backward["c10d.alltoall_base_.default"] >= 1 and theirs.forward_syncs > 1


def test_the_counter_counts_work_and_host_reads_not_metadata():
    x = torch.arange(6.0)
    with Tally() as tally:
        y = x.view(2, 3)[0].expand(2, 3).t()  # views
        torch.empty(3), x.new_empty(2), torch.empty_like(x)  # allocations
        with torch.profiler.record_function("a marker"):
            total = (y + 1).sum()  # two kernels
        total.item(), bool(total), y.tolist()  # three host reads
        torch.tensor([1, 2])  # made from Python data: a copy from the host on a GPU
    assert tally.ops == {"aten.add.Tensor": 1, "aten.sum.default": 1, "aten.lift_fresh.default": 1}
    assert tally.syncs == 3
