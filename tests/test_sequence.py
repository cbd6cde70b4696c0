"""Sharded EmbeddingCollection (one row per id) against the unsharded TorchRec module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from oracle import Case, Table, global_batch, local_batches, run_sequence_case, unsharded
from test_device_path import HostReads, SizeReads
from test_forward import gloo_collectives, random_cases
from torch.distributed.tensor import DTensor
from torchrec import EmbeddingCollection, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, grid, row_wise, table_wise
from embshard import checkpoint as ckpt
from embshard.modules.sequence import ShardedEmbeddingCollection

TOL = 1e-5

# TorchRec's EmbeddingCollection needs one embedding_dim for all its tables.
TABLES = (
    Table("a", 40, 8, ("f_a",)),
    Table("b", 30, 8, ("f_b1", "f_b2")),  # two features share a table
    Table("c", 25, 8, ("f_c",)),
    Table("d", 20, 8, ("f_a", "f_d")),  # f_a feeds two tables: keys f_a@a, f_a@d
)


def plans(world: int) -> dict[str, ShardingPlan]:
    last = world - 1
    uneven = [25] if world == 1 else [10] + [0] * (world - 2) + [15]
    everyone, ends = list(range(world)), sorted({0, last})
    return {
        "table_wise": ShardingPlan({t.name: table_wise(i % world) for i, t in enumerate(TABLES)}),
        "row_wise": ShardingPlan({t.name: row_wise() for t in TABLES}),
        "row_wise_uneven": ShardingPlan(
            {"a": row_wise(), "b": row_wise(), "c": row_wise(uneven), "d": row_wise()}
        ),
        # Two blocks 4 wide, on neighbouring ranks.
        "column_wise": ShardingPlan(
            {t.name: column_wise([i % world, (i + 1) % world]) for i, t in enumerate(TABLES)}
        ),
        "mixed": ShardingPlan(
            {
                "a": table_wise(last),
                "b": row_wise(ranks=everyone[::-1]),  # row blocks out of rank order
                "c": row_wise(uneven),  # an empty rank in the middle
                "d": table_wise(0),  # f_a is whole for d, bucketized for nothing
            }
        ),
        # Shards 8 and 4 wide on one rank.
        "mixed_widths": ShardingPlan(
            {
                "a": table_wise(0),
                "b": column_wise([0, last]),
                "c": row_wise(uneven),
                "d": grid(2, [everyone, [last]]),
            }
        ),
        # Copies on every rank beside shards; f_a feeds a copy (a) and a shard (d).
        "data_parallel": ShardingPlan(
            {"a": data_parallel(), "b": row_wise(), "c": data_parallel(), "d": table_wise(last)}
        ),
        "mixed_row_wise": ShardingPlan(
            {"a": row_wise(), "b": table_wise(0), "c": row_wise(uneven), "d": row_wise()}
        ),
        # Two column blocks 4 wide each, each row-wise over its own group of ranks.
        "grid": ShardingPlan(
            {
                "a": grid(2, [ends, [last]]),
                "b": grid(2, [everyone, [0]]),
                # Uneven, an empty rank in block 1: ranks hold different rows per block.
                "c": grid(2, [ends, ends], [[10, 15], [25, 0]] if world > 1 else None),
                "d": grid(2, [everyone, ends]),  # f_a: a's and d's row splits
            }
        ),
    }


def batch_sizes(world: int) -> tuple[int, ...]:
    # Different local batch sizes, and an empty batch on rank 1.
    return tuple([5, 0, 3, 6][:world]) if world > 1 else (4,)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("plan", list(plans(1)))
def test_training_matches_unsharded(world, world_size, plan):
    case = Case(
        TABLES, plans(world_size)[plan], batch_sizes(world_size), seed=world_size, sequence=True
    )
    results = world(world_size).run(run_sequence_case, case)
    for worst in results:
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst
    assert max(worst["output"] for worst in results) > 0.1  # the rows compared are real


def test_column_blocks_of_different_widths_match_unsharded(world):
    """Rank 0 holds the tables' first 8 columns, rank 1 their last 4: rows come home
    in runs of 4 columns, two runs a row for rank 0's shards."""
    tables = (Table("a", 40, 12, ("f_a",)), Table("b", 30, 12, ("f_b", "f_c")))
    plan = ShardingPlan({t.name: column_wise([0, 1], [8, 4]) for t in tables})
    case = Case(tables, plan, batch_sizes(2), sequence=True)
    results = world(2).run(run_sequence_case, case)
    for worst in results:
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst
    assert max(worst["output"] for worst in results) > 0.1


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("plan", ["mixed_row_wise", "column_wise", "grid"])
@pytest.mark.parametrize(
    "optimizer",
    [embshard.RowWiseAdagrad(lr=0.1, eps=1e-4), embshard.Adagrad(lr=0.1, eps=1e-4)],
    ids=["rowwise_adagrad", "adagrad"],
)
def test_adagrad_matches_unsharded(world, world_size, plan, optimizer):
    case = Case(TABLES, plans(world_size)[plan], batch_sizes(world_size), optimizer, sequence=True)
    for worst in world(world_size).run(run_sequence_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


@pytest.mark.parametrize("world_size", [2, 3])
def test_random_plans_tables_and_batches(world, world_size):
    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(random_cases(world_size, sequence=True))
    def check(case):
        for worst in world(world_size).run(run_sequence_case, case):
            assert worst["forward"] < TOL and worst["weights"] < TOL, worst

    check()


def count_syncs(case: Case) -> dict:
    rank = dist.get_rank()
    sharded = embshard.shard(unsharded(case), case.plan)
    batches = local_batches(case, 0)
    out = sharded(batches[rank])
    sum(jt.values().sum() for jt in out.values()).backward()  # warm
    reads, sizes = HostReads(), SizeReads()
    with reads, sizes:
        out = sharded(batches[rank])
    forward = list(reads.reads), list(sizes.ops)
    with reads, sizes:
        sum(jt.values().sum() for jt in out.values()).backward()
    backward = reads.reads[len(forward[0]) :], sizes.ops[len(forward[1]) :]
    return {"forward": forward, "backward": backward}


def test_a_step_reads_back_from_the_device_once(world):
    case = Case(TABLES, plans(2)["mixed_row_wise"], (5, 3), sequence=True)
    for report in world(2).run(count_syncs, case):
        assert report["forward"] == (["tolist"], []), report
        assert report["backward"] == ([], []), report


def looked_up_ids(case: Case) -> dict:
    """How many ids this rank's TBE looked up in one forward, and how many distinct ids
    of each table's features the ranks' batches hold for it (table-wise plans)."""
    rank = dist.get_rank()
    sharded = embshard.shard(unsharded(case), case.plan)
    seen = []
    if sharded._storage.tbe is not None:
        sharded._storage.tbe.register_forward_pre_hook(lambda _, args: seen.append(len(args[0])))
    batches = local_batches(case, 0)
    sharded(batches[rank])
    tables = [t for t in case.tables if case.plan.tables[t.name].rank == rank]
    served = [
        batch[feature].values() for batch in batches for t in tables for feature in t.features
    ]
    return {
        "looked_up": sum(seen),
        "distinct": sum(len(ids.unique()) for ids in served),
        "ids": sum(len(ids) for ids in served),
    }


def test_each_distinct_id_travels_and_is_looked_up_once(world):
    plan = plans(2)["table_wise"]
    case = Case(TABLES, plan, (6, 4), max_pooling=6, sequence=True)
    for report in world(2).run(looked_up_ids, case):
        assert report["looked_up"] == report["distinct"], report
        # The batches repeat ids (tables of 20 to 40 rows): far fewer lookups than ids.
        assert report["looked_up"] < 0.8 * report["ids"], report


def state_dict_round_trip(case: Case) -> dict:
    """The sharded module's state dict, and a TorchRec state dict loaded into it."""
    module = unsharded(case)
    sharded = embshard.shard(module, case.plan)
    state = sharded.state_dict()
    gathered = {
        k: torch.equal(embshard.gather_table(v), module.state_dict()[k]) for k, v in state.items()
    }
    other = Case(case.tables, case.plan, case.batch_sizes, seed=case.seed + 1, sequence=True)
    source = unsharded(other)
    sharded.load_state_dict(source.state_dict())
    batches = local_batches(case, 0)
    out = sharded(batches[dist.get_rank()])
    expected = source(global_batch(batches))
    offsets = {
        name: [int(n.sum()) for n in jt.lengths().split(case.batch_sizes)]
        for name, jt in expected.items()
    }
    rank = dist.get_rank()
    return {
        "keys": sorted(state),
        "dtensors": all(isinstance(v, DTensor) for v in state.values()),
        "gathered": gathered,
        "loaded": max(
            float((out[name].values() - jt.values().split(offsets[name])[rank]).abs().max())
            if offsets[name][rank]
            else 0.0
            for name, jt in expected.items()
        ),
    }


def test_state_dict_has_torchrec_keys_and_loads_torchrec_weights(world):
    case = Case(TABLES, plans(2)["mixed"], (4, 3), sequence=True)
    for report in world(2).run(state_dict_round_trip, case):
        assert report["keys"] == [f"embeddings.{t.name}.weight" for t in TABLES]
        assert report["dtensors"] and all(report["gathered"].values()), report
        assert report["loaded"] == 0.0


def shard_error(case: Case, comm_precision: str | None) -> str:
    with pytest.raises((ValueError, TypeError)) as caught:
        embshard.shard(unsharded(case), case.plan, comm_precision=comm_precision)
    return str(caught.value)


@pytest.mark.parametrize(
    ("plan", "comm_precision", "message"),
    [
        (
            ShardingPlan({t.name: table_wise(0) for t in TABLES}),
            "fp16",
            "comm_precision 'fp16' is not supported for an EmbeddingCollection yet",
        ),
        (
            ShardingPlan(
                {t.name: row_wise(hot_rows=2) if t.name in "bc" else table_wise(0) for t in TABLES}
            ),
            None,
            "tables ['b', 'c']: row_wise hot_rows is not supported for an EmbeddingCollection yet",
        ),
    ],
    ids=["comm_precision", "hot_rows"],
)
def test_what_is_not_supported_says_so(world, plan, comm_precision, message):
    case = Case(TABLES, plan, (2,), sequence=True)
    for error in world(1).run(shard_error, case, comm_precision):
        assert message in error


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "optimizer",
    [embshard.SGD(lr=0.1), embshard.RowWiseAdagrad(lr=0.1, eps=1e-4)],
    ids=["sgd", "rowwise_adagrad"],
)
def test_fp16_tables_train_like_the_float32_oracle_rounded(world, world_size, optimizer):
    # The oracle holds the float16 values in float32, updates in float32 and rounds to
    # float16 after each step (oracle.float32_twin); FBGEMM's SGD also rounds its step,
    # so a weight may end one float16 ulp (2**-10 of it at most) a step away. A row is
    # not summed: the forward is off by what its weights are.
    tables = tuple(dataclasses.replace(t, data_type=DataType.FP16) for t in TABLES)
    case = Case(
        tables,
        plans(world_size)["mixed_widths"],
        batch_sizes(world_size),
        optimizer=optimizer,
        sequence=True,
    )
    for worst in world(world_size).run(run_sequence_case, case):
        weights = case.steps * 2.0**-10 * worst["weight"]
        assert worst["weights"] <= weights, (worst, weights)
        assert worst["forward"] <= 1e-6 + weights, worst
        assert worst["update"] > 100 * weights, worst  # the updates are far above that


def need_indices_error(case: Case) -> str:
    module = EmbeddingCollection([t.config(True) for t in case.tables], need_indices=True)
    with pytest.raises(ValueError) as caught:
        embshard.shard(module, case.plan)
    return str(caught.value)


def test_need_indices_is_not_supported_yet(world):
    case = Case(TABLES, plans(1)["table_wise"], (2,), sequence=True)
    for error in world(1).run(need_indices_error, case):
        assert "need_indices=True is not supported for an EmbeddingCollection yet" in error


def sharded_type(case: Case) -> str:
    return type(embshard.shard(unsharded(case), case.plan)).__name__


def test_shard_returns_a_sharded_embedding_collection(world):
    case = Case(TABLES, plans(1)["table_wise"], (2,), sequence=True)
    assert world(1).run(sharded_type, case) == [ShardedEmbeddingCollection.__name__]


def tables_and_state(sharded) -> dict[str, torch.Tensor]:
    both = {**sharded.state_dict(), **sharded.optimizer_state()}
    return {key: embshard.gather_table(value) for key, value in both.items()}


def save_trained(case: Case, root: str) -> dict[str, torch.Tensor]:
    sharded = embshard.shard(unsharded(case), case.plan, optimizer=case.optimizer)
    for step in range(2):
        out = sharded(local_batches(case, step)[dist.get_rank()])
        sum(jt.values().sum() for jt in out.values()).backward()
    ckpt.save(root, sharded, step=2)
    return tables_and_state(sharded)


def load_into(case: Case, root: str) -> tuple[int, dict[str, torch.Tensor]]:
    other = Case(case.tables, case.plan, case.batch_sizes, seed=case.seed + 1, sequence=True)
    sharded = embshard.shard(unsharded(other), case.plan, optimizer=case.optimizer)
    return ckpt.load(root, sharded), tables_and_state(sharded)


@pytest.mark.parametrize(
    ("saved_as", "loaded_as"),
    [
        ("column_wise", "row_wise_uneven"),
        ("mixed", "column_wise"),
        ("data_parallel", "mixed"),  # copies saved once, loaded as shards
        ("mixed", "data_parallel"),  # and shards loaded as copies
    ],
)
def test_checkpoint_reshards_from_4_ranks_to_2(world, tmp_path, saved_as, loaded_as):
    optimizer = embshard.Adagrad(lr=0.1)  # per element: exact under any resharding
    saved_case = Case(TABLES, plans(4)[saved_as], batch_sizes(4), optimizer, sequence=True)
    saved = world(4).run(save_trained, saved_case, str(tmp_path))[0]
    assert sorted(saved) == sorted(
        f"embeddings.{t.name}.{kind}" for t in TABLES for kind in ("weight", "momentum1")
    )
    assert all(saved[f"embeddings.{t.name}.momentum1"].abs().sum() > 0 for t in TABLES)
    loaded_case = Case(TABLES, plans(2)[loaded_as], (2, 2), optimizer, sequence=True)
    for step, loaded in world(2).run(load_into, loaded_case, str(tmp_path)):
        assert step == 2
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
    exported = tmp_path / "exported.pt"
    ckpt.export(tmp_path, exported)
    module = unsharded(saved_case)  # a TorchRec EmbeddingCollection takes the export
    module.load_state_dict(torch.load(exported))
    for key, value in module.state_dict().items():
        assert torch.equal(value, saved[key]), key


def count_collectives(case: Case) -> list[int]:
    """Backend collectives (gloo's own profiler events) of each forward plus backward."""
    sharded = embshard.shard(unsharded(case), case.plan)
    rank = dist.get_rank()

    def step(batch) -> None:
        sum(jt.values().sum() for jt in sharded(batch).values()).backward()

    return [gloo_collectives(lambda s=s: step(local_batches(case, s)[rank])) for s in range(2)]


def test_four_collectives_per_step(world):
    # Counts, ids and rows all-to-alls, and the rows' gradient all-to-all.
    case = Case(TABLES, plans(3)["mixed_row_wise"], batch_sizes(3), sequence=True)
    assert world(3).run(count_collectives, case) == [[4, 4]] * 3


def test_data_parallel_tables_add_one_all_reduce(world):
    case = Case(TABLES, plans(3)["data_parallel"], batch_sizes(3), sequence=True)
    assert world(3).run(count_collectives, case) == [[5, 5]] * 3


def bad_batch(case: Case) -> str:
    sharded = embshard.shard(unsharded(case), case.plan)
    batch = local_batches(case, 0)[dist.get_rank()]
    if dist.get_rank() == 0:
        values = batch.values().clone()
        values[0] = 1000
        batch = KeyedJaggedTensor(keys=batch.keys(), values=values, lengths=batch.lengths())
    with pytest.raises(embshard.InputError) as caught:
        sharded(batch)
    return str(caught.value)


def test_a_bad_batch_raises_the_same_error_on_every_rank(world):
    case = Case(TABLES, plans(2)["mixed"], (3, 2), sequence=True, max_pooling=2)
    errors = world(2).run(bad_batch, case)
    assert errors[0] == errors[1]
    assert "rank 0: feature 'f_a' (table 'd'): id 1000 is outside [0, 20)" in errors[0]
