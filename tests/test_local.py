"""One rank is local: no collective runs, and everything else behaves as on many ranks.

The oracle tests run every plan at world size 1 too (tests/test_forward.py,
tests/test_sequence.py); these check what is particular to one rank: no collective in
a step, its input distribution ahead or its end, and no collective for the copies;
bad input raises the same InputError; one host read a forward; and the pipeline.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from oracle import Case, Table, local_batches, run_case, run_sequence_case, unsharded
from test_device_path import TABLES as DEVICE_TABLES
from test_device_path import count_syncs
from test_forward import (
    ALL_PLANS,
    bad_batches,
    gloo_collectives,
    plans,
    random_cases,
    tables_for,
)
from test_pipeline import TABLES as PIPELINE_TABLES
from test_pipeline import (
    Batch,
    pipeline_and_plain_loop,
    sharded_ranker,
    uneven_batch_counts,
)
from test_sequence import TABLES as SEQUENCE_TABLES
from test_sequence import plans as sequence_plans
from test_simulate import BATCHES, KINDS, criteo_config
from torchrec import KeyedJaggedTensor

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, row_wise, table_wise
from embshard.app.simulate import Traffic, simulate
from embshard.modules.pipeline import TrainPipeline

TOL = 1e-5


def _loss(out) -> torch.Tensor:
    if isinstance(out, dict):  # an EmbeddingCollection's rows
        return sum(jt.values().sum() for jt in out.values())
    return out.values().sum()


def collectives_on_one_rank(case: Case) -> dict[str, object]:
    """Collectives while the module is sharded (copies broadcast from given weights),
    in two training steps, in a step whose input distribution was started ahead, and
    in ``signal_end`` (with the ranks it says ran out)."""
    module, sharded = unsharded(case), []
    found: dict[str, object] = {}

    def build() -> None:
        sharded.append(embshard.shard(module, case.plan, comm_precision=case.comm_precision))

    def train(batch: KeyedJaggedTensor) -> None:
        _loss(sharded[0](batch)).backward()

    def end() -> None:
        found["ended"] = sharded[0].signal_end()

    found["shard"] = gloo_collectives(build)
    for step in range(2):
        found[f"step {step}"] = gloo_collectives(lambda s=step: train(local_batches(case, s)[0]))
    batch = local_batches(case, 2)[0]
    found["prefetch"] = gloo_collectives(lambda: sharded[0].prefetch(batch))
    found["prefetched step"] = gloo_collectives(lambda: train(batch))
    found["signal_end"] = gloo_collectives(end)
    return found


def expected_on_one_rank() -> dict[str, object]:
    steps = ("shard", "step 0", "step 1", "prefetch", "prefetched step", "signal_end")
    return {**dict.fromkeys(steps, 0), "ended": (0,)}


@pytest.mark.parametrize("plan", ALL_PLANS)
def test_no_collective_runs_on_one_rank(world, plan):
    case = Case(tables_for(plan), plans(1)[plan], (4,))
    assert world(1).run(collectives_on_one_rank, case) == [expected_on_one_rank()]


@pytest.mark.parametrize("plan", ["mixed", "hot_rows"])
def test_weighted_and_compressed_lookups_run_no_collective_on_one_rank(world, plan):
    # A weighted module's batches carry weights: SUM tables only.
    tables = tuple(Table(t.name, t.rows, t.dim, t.features) for t in tables_for(plan))
    case = Case(tables, plans(1)[plan], (4,), weighted=True, comm_precision="fp16")
    assert world(1).run(collectives_on_one_rank, case) == [expected_on_one_rank()]
    for worst in world(1).run(run_case, case):  # nothing travels, so nothing is rounded
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


@pytest.mark.parametrize("plan", list(sequence_plans(1)))
def test_no_collective_runs_on_one_rank_for_an_embedding_collection(world, plan):
    case = Case(SEQUENCE_TABLES, sequence_plans(1)[plan], (4,), sequence=True)
    assert world(1).run(collectives_on_one_rank, case) == [expected_on_one_rank()]


def test_random_plans_tables_and_batches_on_one_rank(world):
    """Plans whose output on one rank is not the TBE's as it is (column blocks of
    tables with several features, grids, copies) go through stage 3's column placement
    with nothing travelling."""

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(random_cases(1), random_cases(1, sequence=True))
    def check(pooled, sequence):
        for run, case in ((run_case, pooled), (run_sequence_case, sequence)):
            for worst in world(1).run(run, case):
                assert worst["forward"] < TOL and worst["weights"] < TOL, worst

    check()


def bad_input_on_one_rank(case: Case) -> dict[str, tuple[str, str]]:
    """Each bad batch's InputError, given to the forward and given to ``prefetch``
    (raised by the forward that uses it)."""
    sharded = embshard.shard(unsharded(case), case.plan)
    # bad_batches spoils the batch of a second rank's size: only its batch is used.
    two = dataclasses.replace(case, batch_sizes=(*case.batch_sizes, 3))
    errors = {}
    for expected, bad in bad_batches(two).items():
        found = []
        for ahead in (False, True):
            if ahead:
                sharded.prefetch(bad)
            with pytest.raises(embshard.InputError) as raised:
                sharded(bad)
            found.append(str(raised.value))
        errors[expected] = tuple(found)
    _loss(sharded(local_batches(case, 0)[0])).backward()  # the module still trains
    return errors


def test_bad_input_on_one_rank_raises_the_same_input_error(world):
    case = Case(tables_for("mixed"), plans(1)["mixed"], (4,))
    (errors,) = world(1).run(bad_input_on_one_rank, case)
    assert errors.keys() == bad_batches(dataclasses.replace(case, batch_sizes=(4, 3))).keys()
    for expected, (direct, ahead) in errors.items():
        assert direct == ahead, (direct, ahead)
        assert direct.startswith("bad input batch:\n  rank 0: ") and expected in direct, direct
        assert direct.count("\n") == 1, direct
    assert "feature 'f_c' (table 'c')" in errors["id 25 is outside [0, 25)"][0]


DEVICE_CASES = {
    # One slot a feature, in the batch's order: the TBE takes the batch as it is.
    "tbe_takes_the_batch": (
        (
            Table("a", 40, 8, ("f_a",)),
            Table("b", 30, 12, ("f_b",), mean=True),
            Table("c", 20, 16, ("f_c",)),
        ),
        ShardingPlan({"a": table_wise(0), "b": row_wise(), "c": column_wise([0])}),
    ),
    # Features feeding several tables, column blocks, hot rows and copies.
    "gathered_bags_and_placed_columns": (
        DEVICE_TABLES,
        ShardingPlan(
            {
                "tw": table_wise(0),
                "rw": row_wise(),
                "uneven": row_wise(hot_rows=10),
                "cw": column_wise([0, 0, 0, 0]),
                "dp": data_parallel(),
            }
        ),
    ),
}


@pytest.mark.parametrize("plan", list(DEVICE_CASES))
def test_a_step_on_one_rank_reads_back_from_the_device_once(world, plan):
    tables, sharding = DEVICE_CASES[plan]
    (report,) = world(1).run(count_syncs, Case(tables, sharding, (5,)))
    assert len(report["forward_reads"]) == 1, report["forward_reads"]
    assert report["forward_ops"] == [], report["forward_ops"]
    assert report["backward_reads"] == [] and report["backward_ops"] == [], report
    torch.testing.assert_close(report["out"], report["expected"])


PIPELINE_PLAN = ShardingPlan(
    {"a": table_wise(0), "b": row_wise(), "c": column_wise([0, 0, 0, 0]), "s": row_wise()}
)


def test_pipeline_on_one_rank_is_bit_exact_with_the_plain_loop(world):
    (result,) = world(1).run(pipeline_and_plain_loop, Case(PIPELINE_TABLES, PIPELINE_PLAN, (5,)))
    (plain_out, plain_tables, plain_head) = result["plain"]
    (piped_out, piped_tables, piped_head) = result["pipeline"]
    assert len(piped_out) == len(plain_out) and all(result["ahead"])
    assert all(torch.equal(a, b) for a, b in zip(plain_out, piped_out))
    assert all(torch.equal(plain_tables[k], piped_tables[k]) for k in plain_tables)
    assert torch.equal(plain_head, piped_head)
    assert not torch.equal(plain_out[0], plain_out[-1])


def test_pipeline_on_one_rank_stops_at_its_last_batch_without_a_warning(world):
    case = Case(PIPELINE_TABLES, PIPELINE_PLAN, (5,))
    assert world(1).run(uneven_batch_counts, case, (2,)) == [{"steps": 2, "warnings": []}]


def bad_next_batch_on_one_rank(case: Case) -> dict:
    model = sharded_ranker(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = []
    for step in range(4):
        features = local_batches(case, step)[0]
        if step == 2:
            ids = features.values().clone()
            ids[0] = 10_000
            features = KeyedJaggedTensor(features.keys(), ids, lengths=features.lengths())
        labels = torch.rand(len(features.lengths()) // len(features.keys())).round()
        data.append(Batch(features, labels))
    pipeline = TrainPipeline(model, optimizer, data)
    steps, error = 0, None
    try:
        while True:
            pipeline.progress()
            steps += 1
    except embshard.InputError as e:
        error = str(e)
    return {"steps": steps, "error": error, "world": dist.get_world_size()}


def test_a_bad_next_batch_on_one_rank_raises_at_the_step_that_uses_it(world):
    (report,) = world(1).run(bad_next_batch_on_one_rank, Case(PIPELINE_TABLES, PIPELINE_PLAN, (5,)))
    assert report["steps"] == 2 and report["world"] == 1
    assert report["error"].startswith("bad input batch:\n  rank 0: feature 'f_a'")
    assert "id 10000 is outside" in report["error"]


def test_simulate_on_one_rank_reports_that_nothing_travels(tmp_path):
    (rank,) = simulate(criteo_config(tmp_path, 1), 1, batches=BATCHES).ranks
    assert {kind: getattr(rank, kind) for kind in KINDS} == dict.fromkeys(KINDS, Traffic())
    assert rank.ids_received > 0 and rank.buffers == 0
