"""Dynamic tables in a sharded EmbeddingCollection, against test_dynamic's plain reference
model with sequence outputs: every id's row as the reference holds it (zeros for an id
without a row: not admitted yet, or its bucket full), and plain SGD / Adagrad on
autograd's gradients of the global batch's loss over the world size."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_dynamic import (
    DIM,
    DYN_FEATURES,
    EXTREMES,
    STATIC_ROWS,
    TOL,
    Case,
    RefModel,
    _negative_raw_id,
    _overflow_without_eviction,
    _raises,
    check_negative_raw_ids_refused,
    check_overflow_raised_at_the_next_step,
    stream,
    tables_against,
)
from test_id_map import ref_key
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

import embshard
from embshard import (
    SGD,
    Adagrad,
    IdMapSpec,
    RowWiseAdagrad,
    ShardingPlan,
    column_wise,
    data_parallel,
    grid,
    row_wise,
    table_wise,
)

FEATURES = (*DYN_FEATURES, "f_s")


def configs(rows: int) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name="d", embedding_dim=DIM, num_embeddings=rows, feature_names=list(DYN_FEATURES)
        ),
        EmbeddingConfig(
            name="s", embedding_dim=DIM, num_embeddings=STATIC_ROWS, feature_names=["f_s"]
        ),
    ]


def sequence_stream(case: Case) -> list[list[tuple]]:
    """test_dynamic's stream, each rank's upstream gradient one row an id (its features'
    ids in order), drawn from ``case.seed``: the same on every rank."""
    generator = torch.Generator().manual_seed(case.seed + 1)
    steps = []
    for ranks in stream(case):
        steps.append([])
        for dyn, static, _ in ranks:
            ids = sum(len(bag) for feature in [*dyn, *static] for bag in feature)
            steps[-1].append((dyn, static, torch.randn(ids, DIM, generator=generator)))
    return steps


def kjt(dyn: list[list[list[int]]], static: list[list[list[int]]]) -> KeyedJaggedTensor:
    bags = [*dyn, *static]
    return KeyedJaggedTensor.from_lengths_sync(
        list(FEATURES),
        torch.tensor([i for feature in bags for bag in feature for i in bag], dtype=torch.int64),
        torch.tensor([len(bag) for feature in bags for bag in feature], dtype=torch.int64),
    )


def values(out: dict) -> torch.Tensor:
    """A sharded EmbeddingCollection's output as one tensor: every id's row, by feature."""
    return torch.cat([out[f].values() for f in FEATURES])


class SequenceRef(RefModel):
    """test_dynamic's reference, each id looked up alone: its row, or zeros without one."""

    def _outputs(self, ranks, row_of: dict, rows: dict, static: torch.Tensor) -> list:
        def dynamic_row(i: int) -> torch.Tensor:
            row = row_of[ref_key(i)]
            return rows[row] if row >= 0 else torch.zeros(DIM)

        outs = []
        for dyn, stat, _ in ranks:
            found = [dynamic_row(i) for feature in dyn for bag in feature for i in bag]
            found += [static[i] for bag in stat[0] for i in bag]
            outs.append(torch.stack(found) if found else torch.zeros(0, DIM))
        return outs


def _run_case(case: Case) -> dict:
    """On every rank: the sharded EmbeddingCollection and the reference side by side; the
    largest gaps of this rank's outputs and of every live row, and the stats."""
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=configs(case.rows))
    static = ec.embeddings["s"].weight.detach().clone()
    rank = torch.distributed.get_rank()
    sharded = embshard.shard(
        ec,
        ShardingPlan(case.plan),
        mesh=embshard.sharding_mesh(case.group) if case.group else None,
        optimizer=case.optimizer,
        dynamic={"d": case.spec},
    )
    ref = SequenceRef(case, static)
    out_gap, unfound = 0.0, 0
    steps = sequence_stream(case)
    for ranks, following in zip(steps, [*steps[1:], None]):
        dyn, stat, upstream = ranks[rank]
        out = values(sharded(kjt(dyn, stat)))
        (out * upstream).sum().backward()
        sharded.sync_replicas()
        expected = ref.forward_backward(ranks)[rank]
        out_gap = max(out_gap, (out.detach() - expected).abs().max().item() if out.numel() else 0)
        unfound += int((expected.abs().sum(1) == 0).sum())
        if case.evaluate and following is not None:  # ids not seen yet: looked up only
            dyn, stat, _ = following[rank]
            with torch.no_grad():
                out = values(sharded.eval()(kjt(dyn, stat)))
            sharded.train()
            expected = ref.evaluate(following)[rank]
            out_gap = max(out_gap, (out - expected).abs().max().item() if out.numel() else 0)
    return {"out_gap": out_gap, "unfound": unfound, **tables_against(sharded, ref)}


CASES = {
    "w1_table_wise_lru_sgd_evaluated": Case(
        1,
        {"d": table_wise(0), "s": table_wise(0)},
        IdMapSpec(4, 3, "lru"),
        SGD(lr=0.1),
        evaluate=True,
    ),
    "w2_row_wise_lru_admit2_adagrad_evaluated": Case(
        2,
        {"d": row_wise(), "s": table_wise(1)},
        IdMapSpec(4, 3, "lru", admit_after=2, seed=5),
        Adagrad(lr=0.1),
        evaluate=True,
    ),
    "w2_table_wise_lfu_admit2_sgd": Case(
        2,
        {"d": table_wise(1), "s": row_wise()},
        IdMapSpec(4, 3, "lfu", admit_after=2),
        SGD(lr=0.1),
        steps=16,
    ),
    # The static table in column blocks half as wide: a dynamic row travels as 2 blocks.
    "w3_uneven_row_wise_lru_adagrad_static_column_wise": Case(
        3,
        {"d": row_wise([6, 0, 6]), "s": column_wise([0, 2])},
        IdMapSpec(4, 3, "lru"),
        Adagrad(lr=0.1),
    ),
    "w3_row_wise_ttl_admit2_sgd": Case(
        3,
        {"d": row_wise([3, 6, 3]), "s": table_wise(2)},
        IdMapSpec(4, 3, "ttl", ttl_steps=2, admit_after=2),
        SGD(lr=0.1),
    ),
    "w4_two_groups_row_wise_lru_admit2_sgd_evaluated": Case(
        4,
        {"d": row_wise(), "s": table_wise(0)},
        IdMapSpec(4, 3, "lru", admit_after=2),
        SGD(lr=0.1),
        evaluate=True,
        group=2,
    ),
    "w4_uneven_row_wise_lfu_admit2_adagrad_static_row_wise": Case(
        4,
        {"d": row_wise([6, 3, 0, 3]), "s": row_wise()},
        IdMapSpec(4, 3, "lfu", admit_after=2, seed=3),
        Adagrad(lr=0.1),
    ),
    # Column blocks: each id's row comes back as its blocks, each block's map equal.
    "w2_column_wise_lru_admit2_rowwise_adagrad_evaluated": Case(
        2,
        {"d": column_wise([1, 0]), "s": row_wise()},
        IdMapSpec(4, 3, "lru", admit_after=2),
        RowWiseAdagrad(lr=0.1),
        evaluate=True,
    ),
    "w3_grid_lfu_sgd_static_column_wise": Case(
        3,
        {"d": grid(2, [[2, 0], [0, 1, 2]], [[6, 6], [3, 3, 6]]), "s": column_wise([1, 0])},
        IdMapSpec(4, 3, "lfu"),
        SGD(lr=0.1),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_dynamic_sequence_table_equals_the_reference(world, name: str) -> None:
    case = CASES[name]
    results = world(case.world).run(_run_case, case)
    for r in results:
        assert r["out_gap"] < TOL, r
        assert r["row_gap"] < TOL, r
        assert r["static_gap"] < TOL, r
        assert r["stats"] == r["ref"], r
    assert results[0]["ref"][1] > 0, "the stream must evict"
    assert sum(r["unfound"] for r in results) > 0, "some ids must find no row"


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@example(
    seed=1, world_size=1, policy="lfu", admit_after=2, pool=30, buckets=3, static="column_wise"
)
@example(
    seed=2, world_size=4, policy="ttl", admit_after=1, pool=60, buckets=6, static="column_wise"
)
@given(
    seed=st.integers(0, 2**31),
    world_size=st.sampled_from([1, 2, 3, 4]),
    policy=st.sampled_from(["lru", "lfu", "ttl"]),
    admit_after=st.integers(1, 3),
    pool=st.integers(len(EXTREMES), 60),
    buckets=st.sampled_from([1, 3, 6]),
    static=st.sampled_from(["table_wise", "row_wise", "column_wise"]),
)
def test_drawn_id_streams_equal_the_reference(
    world,
    seed: int,
    world_size: int,
    policy: str,
    admit_after: int,
    pool: int,
    buckets: int,
    static: str,
) -> None:
    """Any stream, any row-wise cut on bucket boundaries, the static table in any layout."""
    spec = IdMapSpec(
        buckets, 2, policy, ttl_steps=2 if policy == "ttl" else None, admit_after=admit_after
    )
    cuts = sorted(random.Random(seed).choices(range(buckets + 1), k=world_size - 1))
    sizes = [2 * (b - a) for a, b in zip([0, *cuts], [*cuts, buckets])]
    layouts = {
        "table_wise": table_wise(world_size - 1),
        "row_wise": row_wise(),
        "column_wise": column_wise([world_size - 1, 0]),
    }
    plan = {"d": row_wise(sizes), "s": layouts[static]}
    case = Case(world_size, plan, spec, SGD(lr=0.1), seed=seed, pool=pool)
    for result in world(world_size).run(_run_case, case):
        assert result["out_gap"] < TOL and result["row_gap"] < TOL, result
        assert result["static_gap"] < TOL, result
        assert result["stats"] == result["ref"], result


def _repeats() -> tuple[int, int]:
    """admit_after=2: over the world, 11 twice in one sample, 12 in two samples, 13
    once on each of two ranks (twice on the only rank), 14 once."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sharded = embshard.shard(
        EmbeddingCollection(tables=configs(12), device=torch.device("meta")),
        ShardingPlan({"d": row_wise(), "s": table_wise(0)}),
        dynamic={"d": IdMapSpec(4, 3, admit_after=2)},
    )
    samples = [[[11, 11, 12], [12, 13]], [[13, 14]]]
    mine = [bag for r, bags in enumerate(samples) if r % world == rank for bag in bags]
    sharded(kjt([mine, [[] for _ in mine]], [[[1] for _ in mine]]))
    stats = sharded.dynamic_stats()["d"]
    return stats.admitted, stats.live


def test_repeated_ids_count_every_sighting(world) -> None:
    """An id seen twice in one step gets its row in that step, wherever its two
    sightings were: the ids of a dynamic table travel with their repeats."""
    for world_size in (1, 2):
        for admitted_live in world(world_size).run(_repeats):
            assert admitted_live == (3, 3), (world_size, admitted_live)  # 11, 12, 13


def sequence_module(rows: int) -> EmbeddingCollection:
    """The cases' collection on meta, its dynamic table of ``rows`` rows."""
    return EmbeddingCollection(tables=configs(rows), device=torch.device("meta"))


def test_negative_raw_ids_are_refused_on_every_rank(world) -> None:
    check_negative_raw_ids_refused(world(2).run(_negative_raw_id, sequence_module))


def test_overflow_with_no_eviction_raises_on_every_rank_at_the_next_step(world) -> None:
    # The step that overflowed ran, its extra ids got zeros.
    results = world(2).run(_overflow_without_eviction, sequence_module)
    check_overflow_raised_at_the_next_step(results)


def _bad_plan() -> str:
    return _raises(
        lambda: embshard.shard(
            EmbeddingCollection(tables=configs(12), device=torch.device("meta")),
            ShardingPlan({"d": data_parallel(), "s": table_wise(0)}),
            dynamic={"d": IdMapSpec(4, 3)},
        )
    )


def test_a_data_parallel_dynamic_table_is_refused_on_every_rank(world) -> None:
    for message in world(2).run(_bad_plan):
        assert message.startswith("PlanError: dynamic table 'd': data-parallel is refused"), message


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=configs(12), device=torch.device("meta"))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return values(self.ec(features))


def _through_shard_model() -> object:
    plan = ShardingPlan({"d": row_wise(), "s": table_wise(0)})
    model = embshard.shard_model(
        _Model(), plan, dynamic={"d": IdMapSpec(4, 3)}, data_parallel_wrapper=lambda m: m
    )
    rank = torch.distributed.get_rank()
    model(kjt([[[rank, 7]], [[2**63 - 1]]], [[[1]]]))
    return model.ec.dynamic_stats()["d"]


def test_shard_model_takes_dynamic_sequence_tables(world) -> None:
    for stats in world(2).run(_through_shard_model):
        assert (stats.admitted, stats.live, stats.overflow) == (4, 4, 0)  # ids 0, 1, 7, 2**63-1
