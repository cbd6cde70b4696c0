"""Sharded forward, backward and fused optimizers against the unsharded TorchRec module."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import (
    Case,
    Table,
    global_batch,
    local_batches,
    oracle_step,
    run_case,
    weight_gap,
)
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, grid, row_wise, table_wise
from embshard.runtime.columns import ColumnPlacement
from embshard.runtime.routes import build_routes
from embshard.runtime.scratch import Scratch

TOL = 1e-5

TABLES = (
    Table("a", 40, 8, ("f_a",)),
    Table("b", 30, 12, ("f_b1", "f_b2")),  # two features share a table
    Table("c", 25, 16, ("f_c",), mean=True),
    Table("d", 20, 16, ("f_a", "f_d")),  # f_a feeds two tables
)
# Table-wise beside the grid tables of plan "grid_mixed", sharing a grid table's feature.
E = Table("e", 15, 8, ("f_b1",))


def tables_for(plan: str) -> tuple[Table, ...]:
    return (*TABLES, E) if plan == "grid_mixed" else TABLES


def plans(world: int) -> dict[str, ShardingPlan]:
    last = world - 1
    uneven = [25] if world == 1 else [10] + [0] * (world - 2) + [15]
    everyone, ends = list(range(world)), sorted({0, last})
    return {
        "table_wise": ShardingPlan({t.name: table_wise(i % world) for i, t in enumerate(TABLES)}),
        "row_wise": ShardingPlan({t.name: row_wise() for t in TABLES}),
        "column_wise": ShardingPlan(
            {
                "a": column_wise([last, 0]),
                "b": column_wise([0, last, 0], [4, 4, 4]),
                "c": column_wise([last, 0, last, 0]),
                "d": column_wise([0, last]),
            }
        ),
        "mixed": ShardingPlan(
            {
                "a": table_wise(last),
                "b": row_wise(ranks=everyone[::-1]),  # row blocks out of rank order
                "c": row_wise(uneven),  # an empty rank in the middle
                "d": column_wise([last, 0, last, 0]),  # two blocks per rank, out of order
            }
        ),
        "data_parallel": ShardingPlan({t.name: data_parallel() for t in TABLES}),
        "mixed_data_parallel": ShardingPlan(
            {
                "a": data_parallel(),  # f_a feeds two data-parallel tables
                "b": row_wise(),
                "c": table_wise(last),
                "d": data_parallel(),
            }
        ),
        "hot_rows": ShardingPlan(
            {
                "a": table_wise(last),
                # f_b1 and f_b2: two features, one hot table, row blocks out of rank order.
                "b": row_wise(hot_rows=7, ranks=everyone[1:] + everyone[:1]),
                "c": row_wise([s * 4 // 5 for s in uneven], hot_rows=5),  # MEAN, uneven
                "d": data_parallel(),  # its all-reduce also carries the hot rows'
            }
        ),
        "grid": ShardingPlan(
            {
                "a": grid(2, [ends, [last]]),
                "b": grid([4, 8], [everyone, [0]]),  # one block row-wise, one whole
                # Uneven, an empty rank in block 1: ranks hold different rows per block.
                # Block 1's rows in reverse rank order.
                "c": grid(2, [ends, ends[::-1]], [[10, 15], [25, 0]] if world > 1 else None),
                "d": grid(4, [everyone, [last], ends, everyone]),  # f_a: a's and d's splits
            }
        ),
        "grid_mixed": ShardingPlan(
            {
                "a": row_wise(),  # f_a also feeds grid table d
                "b": grid([8, 4], [ends, [last]], [[10, 20], [30]] if world > 1 else None),
                "c": column_wise([last, 0, last, 0]),
                "d": grid(2, [everyone, [0]]),
                "e": table_wise(last),  # f_b1 also feeds grid table b
            }
        ),
    }


def batch_sizes(world: int) -> tuple[int, ...]:
    # Different local batch sizes, and an empty batch on rank 1.
    return tuple([5, 0, 3, 6][:world]) if world > 1 else (4,)


ALL_PLANS = [
    "table_wise",
    "row_wise",
    "column_wise",
    "mixed",
    "grid",
    "grid_mixed",
    "data_parallel",
    "mixed_data_parallel",
    "hot_rows",
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("plan", ALL_PLANS)
def test_training_matches_unsharded(world, world_size, plan):
    case = Case(tables_for(plan), plans(world_size)[plan], batch_sizes(world_size), seed=world_size)
    for worst in world(world_size).run(run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("plan", ["mixed", "mixed_data_parallel", "grid", "hot_rows"])
@pytest.mark.parametrize(
    "optimizer",
    [embshard.RowWiseAdagrad(lr=0.1, eps=1e-4), embshard.Adagrad(lr=0.1, eps=1e-4)],
    ids=["rowwise_adagrad", "adagrad"],
)
def test_adagrad_matches_unsharded(world, world_size, plan, optimizer):
    # Column-wise and grid row-wise Adagrad keep one accumulator per row of each column
    # block; the oracle does the same (tests/oracle.py), every other layout per whole row.
    case = Case(TABLES, plans(world_size)[plan], batch_sizes(world_size), optimizer=optimizer)
    for worst in world(world_size).run(run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("plan", ["mixed", "mixed_data_parallel", "grid", "hot_rows"])
def test_weighted_features(world, world_size, plan):
    tables = tuple(Table(t.name, t.rows, t.dim, t.features) for t in TABLES)  # SUM only
    case = Case(tables, plans(world_size)[plan], batch_sizes(world_size), weighted=True)
    for worst in world(world_size).run(run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


def gloo_collectives(fn: Callable[[], object]) -> int:
    """Backend collectives (gloo's own profiler events) while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name.startswith("gloo:") for e in prof.events())


def count_collectives(case: Case) -> list[int]:
    """Backend collectives of each forward plus backward."""
    rank = dist.get_rank()
    torch.manual_seed(case.seed)
    ebc = EmbeddingBagCollection(tables=[t.config() for t in case.tables])
    sharded = embshard.shard(ebc, case.plan)
    return [
        gloo_collectives(
            lambda s=step: sharded(local_batches(case, s)[rank]).values().sum().backward()
        )
        for step in range(2)
    ]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "plan",
    ["table_wise", "mixed", "grid_mixed", "mixed_data_parallel", "data_parallel", "hot_rows"],
)
def test_collectives_per_step(world, world_size, plan):
    # Counts, ids and pooled all-to-alls, the pooled rows' gradient all-to-all; and one
    # all-reduce for all copies' gradients (data-parallel tables and hot rows).
    case = Case(tables_for(plan), plans(world_size)[plan], batch_sizes(world_size))
    expected = 5 if "data_parallel" in plan or plan == "hot_rows" else 4
    for counts in world(world_size).run(count_collectives, case):
        assert counts == [expected, expected]


def placement(configs, plan: ShardingPlan, world_size: int = 2) -> ColumnPlacement:
    routes = build_routes(configs, plan.resolve(configs, world_size), world_size, weighted=False)
    return ColumnPlacement(routes.column_targets(), routes.output_dim)


_METADATA_OPS = frozenset({"aten::new_empty", "aten::set_"})


class WorkingOps(TorchDispatchMode):
    """Every op that does work: views and new tensors' metadata left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._schema.name not in _METADATA_OPS:
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("plan", ALL_PLANS)
def test_every_block_lands_in_the_output_in_one_kernel_each_way(world_size, plan):
    """Forward, every rank's pooled block and the local lookup's land in their output
    columns in one kernel: an index_select, or an embedding_bag where several land in
    one output column and are summed (row-wise partials, hot rows); backward, every
    block takes its columns' gradient in one index_select; none when the blocks are
    the output as they are. Both against a plain loop over the columns."""
    configs = [t.config() for t in tables_for(plan)]
    place = placement(configs, plans(world_size)[plan], world_size)
    batch, dims = 5, place.block_dims
    blocks = [torch.randn(batch, d) for d in dims]
    sources = torch.cat([b.flatten() for b in blocks])
    grad = torch.randn(batch, place.output_dim)
    expected, expected_grad = torch.zeros_like(grad), []
    for block, columns in zip(blocks, place.targets):
        for column, target in enumerate(columns):
            expected[:, target] += block[:, column]
        expected_grad.append(grad[:, list(columns)].flatten())
    scratch = Scratch()
    place.place(sources, batch, scratch)  # the first use of a batch size builds its indices
    with WorkingOps() as forward:
        out = place.place(sources, batch, scratch)
    with WorkingOps() as backward:
        gradients = place.gradients(grad, scratch)
    if plan == "data_parallel":  # the local lookup's block is the output as it is
        assert forward.ops == backward.ops == []
    else:
        summed = plan not in ("table_wise", "column_wise")
        gather = "aten::_embedding_bag_forward_only" if summed else "aten::index_select"
        assert forward.ops == [gather]
        assert backward.ops == ["aten::index_select"]
    torch.testing.assert_close(out, expected)
    assert torch.equal(gradients, torch.cat(expected_grad))


def test_tables_dealt_round_robin_land_in_runs_a_table_wide():
    """The indices name runs of columns, not single values: equal tables dealt round
    robin move a table at a time."""
    configs = [Table(f"t{i}", 10, 8, (f"f{i}",)).config() for i in range(6)]
    plan = ShardingPlan({c.name: table_wise(i % 2) for i, c in enumerate(configs)})
    assert placement(configs, plan).width == 8


def test_column_blocks_rotated_over_ranks_land_in_runs_a_block_wide():
    configs = [Table(f"t{i}", 10, 8, (f"f{i}",)).config() for i in range(6)]
    plan = ShardingPlan({c.name: column_wise([i % 2, (i + 1) % 2]) for i, c in enumerate(configs)})
    assert placement(configs, plan).width == 4


def test_row_wise_tables_of_mixed_widths_land_in_one_run_a_sample():
    """Every rank's block of consecutive row-wise tables is the output's columns in
    order, whatever the tables' widths: each sample's row moves as one run."""
    configs = [Table(f"t{i}", 10, 8 * (1 + i % 3), (f"f{i}",)).config() for i in range(6)]
    plan = ShardingPlan({c.name: row_wise() for c in configs})
    assert placement(configs, plan).width == sum(c.embedding_dim for c in configs)


def _copies_of_per_rank_modules(sequence: bool) -> dict[str, bool]:
    """Shard a module whose weights differ on every rank (seeded by rank); report
    whether each table's rows match rank 0's module (copies) or this rank's (row
    blocks), and whether a lookup of copied rows gives the same on every rank."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    if sequence:
        configs = [
            EmbeddingConfig(name="a", num_embeddings=30, embedding_dim=8, feature_names=["f"])
        ]
        module, plan = EmbeddingCollection(tables=configs), {"a": data_parallel()}
    else:
        configs = [
            EmbeddingBagConfig(name="a", num_embeddings=30, embedding_dim=8, feature_names=["f"]),
            EmbeddingBagConfig(name="b", num_embeddings=40, embedding_dim=8, feature_names=["g"]),
        ]
        module = EmbeddingBagCollection(tables=configs)
        plan = {"a": data_parallel(), "b": row_wise(hot_rows=10)}
    tables = module.embeddings if sequence else module.embedding_bags
    mine = {n: t.weight.detach().clone() for n, t in tables.items()}
    rank0 = {n: w.clone() for n, w in mine.items()}
    for w in rank0.values():
        dist.broadcast(w, src=0)
    sharded = embshard.shard(module, ShardingPlan(plan))
    found = {}
    for name, weight in sharded.weights.items():
        local = weight.to_local()
        for shard, (row, col) in zip(local.local_shards(), local.local_offsets()):
            rows = slice(row, row + shard.shape[0])
            copied = name == "a" or row < 10
            expected = (rank0 if copied else mine)[name][rows, col : col + shard.shape[1]]
            found[f"{name}@{row} {'copy' if copied else 'block'}"] = torch.equal(shard, expected)
    ids = torch.tensor([0, 3, 7] if sequence else [0, 3, 7, 1, 9])
    keys = ["f"] if sequence else ["f", "g"]
    batch = KeyedJaggedTensor(keys, ids, lengths=torch.tensor([3] if sequence else [3, 2]))
    out = sharded(batch)
    looked_up = out["f"].values() if sequence else out.values()
    everyone = [torch.empty_like(looked_up) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, looked_up.detach().contiguous())
    found["same lookup on every rank"] = all(torch.equal(everyone[0], e) for e in everyone)
    return found


@pytest.mark.parametrize("sequence", [False, True], ids=["bags", "sequence"])
def test_copies_take_rank_0s_weights_from_modules_that_differ_per_rank(world, sequence):
    for found in world(2).run(_copies_of_per_rank_modules, sequence):
        assert found and all(found.values()), found


def test_hot_rows_need_their_features_to_feed_no_other_table():
    # f_a feeds tables a and d: d's lookups would lose a's hot ids.
    configs = [t.config() for t in TABLES]
    plan = ShardingPlan(
        {"a": row_wise(hot_rows=4), "b": row_wise(), "c": row_wise(), "d": row_wise()}
    )
    with pytest.raises(ValueError, match=r"table 'a': hot_rows needs its features to feed no "
                       r"other table, but feature 'f_a' also feeds \['d'\]"):  # fmt: skip
        build_routes(configs, plan.resolve(configs, 2), 2, weighted=False)


def bucket_passes(plan: ShardingPlan, world: int) -> list[tuple[tuple[int, ...], ...]]:
    configs = [Table("t", 10, 8, ("f",)).config()]
    return list(build_routes(configs, plan.resolve(configs, world), world, False).bucket_passes)


def test_grid_blocks_bucketize_once_per_distinct_row_split():
    """Each grid block's ids are cut by its own row blocks (bucket k for its k-th block,
    empty buckets last); blocks split alike share one pass, whichever ranks hold them."""
    assert bucket_passes(ShardingPlan({"t": grid(2, [[0, 1], [2, 3]])}), 4) == [
        ((0, 5, 10, 10, 10),)
    ]
    assert bucket_passes(ShardingPlan({"t": grid(2, [[1, 3], [1, 3]])}), 4) == [
        ((0, 5, 10, 10, 10),)
    ]
    assert bucket_passes(ShardingPlan({"t": grid(2, [[0, 1], [2, 3]], [[5, 5], [3, 7]])}), 4) == [
        ((0, 5, 10, 10, 10),),
        ((0, 3, 10, 10, 10),),
    ]


def test_row_blocks_out_of_rank_order_bucketize_in_row_order():
    """Bucket k holds the k-th row block's ids, whichever rank holds it."""
    plan = ShardingPlan({"t": row_wise([2, 3, 5], ranks=[2, 0, 1])})
    configs = [Table("t", 10, 8, ("f",)).config()]
    routes = build_routes(configs, plan.resolve(configs, 3), 3, False)
    assert routes.bucket_passes == (((0, 2, 5, 10),),)
    assert [[s.bucket for s in slots] for slots in routes.slots] == [[1], [2], [0]]


def test_scratch_hands_out_a_buffer_again_only_when_nothing_holds_it():
    scratch, like = Scratch(), torch.zeros(1)
    step_1 = scratch.take("out", (10, 10), like)
    assert step_1.untyped_storage().nbytes() == 400  # no room while sizes hold still
    # The caller (or autograd) still holds step 1's buffer: step 2 gets another one.
    step_2 = scratch.take("out", (10, 10), like)
    a, b = step_1.data_ptr(), step_2.data_ptr()
    assert a != b
    # Having let go of step 1's, the caller holds step 2's: the two alternate.
    del step_1
    step_3 = scratch.take("out", (10, 10), like)
    assert step_3.data_ptr() == a
    del step_2
    assert scratch.take("out", (100,), like).data_ptr() == b
    grown = scratch.take("out", (1000,), like)
    assert grown.shape == (1000,) and grown.untyped_storage().nbytes() == 5000
    assert scratch.take("ids", (100,), torch.zeros(1, dtype=torch.int32)).dtype == torch.int32


def two_forwards_one_backward(case: Case) -> dict[str, float]:
    """Two batches through the module, both outputs held, then one backward (one
    graph, as when accumulating gradients); the largest differences from the oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(case.seed)
    oracle = EmbeddingBagCollection(tables=[t.config() for t in case.tables])
    sharded = embshard.shard(copy.deepcopy(oracle), case.plan, optimizer=case.optimizer)
    batches = [local_batches(case, step) for step in range(2)]
    mine = [sharded(b[rank]).values() for b in batches]
    mine[0].mul_(1.0)  # an ordinary tensor: in place is allowed, as for TorchRec's output
    expected = [oracle(global_batch(b)).values() for b in batches]
    (mine[0].sum() + 2 * mine[1].sum()).backward()
    ((expected[0].sum() + 2 * expected[1].sum()) / world).backward()
    oracle_step(oracle, case, {}, {})
    start = sum(case.batch_sizes[:rank])
    rows = slice(start, start + case.batch_sizes[rank])
    return {
        "forward": max(float((m - e[rows]).abs().max()) for m, e in zip(mine, expected)),
        "weights": weight_gap(sharded, oracle),
    }


@pytest.mark.parametrize("plan", ["row_wise", "mixed"])
def test_two_forwards_then_one_backward_match_unsharded(world, plan):
    # SUM only: the output is then the module's own buffer, not a division's result.
    tables = tuple(Table(t.name, t.rows, t.dim, t.features) for t in TABLES)
    case = Case(tables, plans(2)[plan], (5, 3))
    for worst in world(2).run(two_forwards_one_backward, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


def forward_without_grad(case: Case) -> dict[str, float]:
    """Forwards under ``torch.no_grad()`` (evaluation, inference) then one with grad:
    the largest differences from the oracle, and whether any no-grad output joined
    an autograd graph."""
    rank = dist.get_rank()
    torch.manual_seed(case.seed)
    oracle = EmbeddingBagCollection(tables=[t.config() for t in case.tables])
    sharded = embshard.shard(copy.deepcopy(oracle), case.plan, optimizer=case.optimizer)
    start = sum(case.batch_sizes[:rank])
    rows = slice(start, start + case.batch_sizes[rank])
    gaps, graphs = [], []
    for step in range(3):
        batches = local_batches(case, step)
        expected = oracle(global_batch(batches)).values()[rows].detach()
        if step < 2:
            with torch.no_grad():
                out = sharded(batches[rank]).values()
            graphs.append(out.requires_grad or out.grad_fn is not None)
        else:
            out = sharded(batches[rank]).values()
            graphs.append(not out.requires_grad)  # with grad, the output must need it
        gaps.append(float((out - expected).abs().max()) if out.numel() else 0.0)
    return {"forward": max(gaps), "graphs": any(graphs)}


@pytest.mark.parametrize("plan", ["mixed", "hot_rows"])
def test_forward_without_grad_matches_unsharded_and_builds_no_graph(world, plan):
    case = Case(TABLES, plans(2)[plan], (5, 3))
    for found in world(2).run(forward_without_grad, case):
        assert found["forward"] < TOL and not found["graphs"], found


ID_DTYPES = [(i, n) for i in (torch.int32, torch.int64) for n in (torch.int32, torch.int64)]


def forward_in_every_id_dtype(case: Case) -> dict[str, object]:
    """The forward of every (ids, lengths) dtype pair against the oracle's, and the
    error of an id one past its table in each pair, on rank 1's batch."""
    rank = dist.get_rank()
    torch.manual_seed(case.seed)
    oracle = EmbeddingBagCollection(tables=[t.config() for t in case.tables])
    sharded = embshard.shard(copy.deepcopy(oracle), case.plan)
    start = sum(case.batch_sizes[:rank])
    rows = slice(start, start + case.batch_sizes[rank])
    batches = local_batches(case, 0)
    expected = oracle(global_batch(batches)).values()[rows].detach()
    mine = batches[rank]
    found: dict[str, object] = {}
    for ids, lengths in ID_DTYPES:
        values = mine.values().to(ids)
        batch = KeyedJaggedTensor(mine.keys(), values, lengths=mine.lengths().to(lengths))
        with torch.no_grad():
            found[f"{ids} {lengths}"] = float((sharded(batch).values() - expected).abs().max())
        if rank == 1:
            values = values.clone()
            values[-1] = 40  # past every table
            batch = KeyedJaggedTensor(mine.keys(), values, lengths=mine.lengths().to(lengths))
        try:
            sharded(batch)
            found[f"bad {ids} {lengths}"] = None
        except embshard.InputError as e:
            found[f"bad {ids} {lengths}"] = str(e)
    return found


def test_ids_and_lengths_of_either_index_dtype_match_unsharded_and_are_checked(world):
    check_either_index_dtype(world)


def check_either_index_dtype(world) -> None:
    """Every (ids, lengths) dtype pair on ``world(2)``: the oracle's forward, and an id
    past its table refused on every rank."""
    case = Case(TABLES, plans(2)["mixed"], (5, 3))
    for found in world(2).run(forward_in_every_id_dtype, case):
        for ids, lengths in ID_DTYPES:
            assert found[f"{ids} {lengths}"] < TOL, (ids, lengths, found)
            error = found[f"bad {ids} {lengths}"]
            assert error is not None and "rank 1: feature " in error, error
            assert "id 40 is outside [0, " in error, error


def shard_over_meshes_it_cannot_use() -> list[str]:
    """The error of ``shard()`` over a 2-D mesh and over a mesh smaller than the world."""
    from torch.distributed.device_mesh import DeviceMesh

    module = EmbeddingBagCollection(tables=[t.config() for t in TABLES], device="meta")
    plan = ShardingPlan({t.name: table_wise(0) for t in TABLES})
    meshes = [
        DeviceMesh("cpu", torch.arange(2).view(1, 1, 2), _init_backend=False),
        DeviceMesh("cpu", torch.arange(1), _init_backend=False),
    ]
    errors = []
    for mesh in meshes:
        with pytest.raises(ValueError) as raised:
            embshard.shard(module, plan, mesh=mesh)
        errors.append(str(raised.value))
    return errors


def test_a_mesh_that_is_not_the_whole_world_in_one_or_two_dimensions_is_refused(world):
    for errors in world(2).run(shard_over_meshes_it_cannot_use):
        assert errors == [
            "embshard shards over a 1-D mesh or a 2-D (replicate, shard) mesh, got a 3-D mesh",
            "the mesh has 1 ranks but the world has 2; embshard needs a mesh over the whole world",
        ]


def bad_batches(case: Case) -> dict[str, KeyedJaggedTensor]:
    good = local_batches(case, 0)[1]
    keys, lengths, values = good.keys(), good.lengths(), good.values()
    out_of_range = values.clone()
    first_c = int(lengths.view(len(keys), -1)[: keys.index("f_c")].sum())
    out_of_range[first_c] = 25
    negative = values.clone()
    negative[0] = -3
    pruned = values.clone()  # FBGEMM's mark of a pruned row, which its own check skips
    pruned[0] = -1
    # A negative length whose total still matches the ids: only the sign gives it away.
    negative_length = lengths.clone()
    negative_length[0] -= lengths[0] + 1
    negative_length[1] += lengths[0] + 1
    return {
        "feature 'f_a' has a negative length -1": KeyedJaggedTensor(
            keys, values, lengths=negative_length
        ),
        f"the batch has no bags but {len(values)} ids": KeyedJaggedTensor(
            keys, values, lengths=lengths[:0]
        ),
        "id 25 is outside [0, 25)": KeyedJaggedTensor(keys, out_of_range, lengths=lengths),
        "id -3 is outside [0, 20)": KeyedJaggedTensor(keys, negative, lengths=lengths),
        "id -1 is outside [0, 20)": KeyedJaggedTensor(keys, pruned, lengths=lengths),
        "missing: ['f_d'], repeated: []": KeyedJaggedTensor(
            [*keys[:-1], "f_x"], values, lengths=lengths
        ),
        f"lengths add up to {int(lengths.sum())} but there are {len(values) - 1} ids": (
            KeyedJaggedTensor(keys, values[:-1], lengths=lengths)
        ),
        "ids and lengths must be int32 or int64, got torch.float32": KeyedJaggedTensor(
            keys, values.float(), lengths=lengths
        ),
    }


def forward_with_bad_input_on_rank_1(case: Case):
    rank = dist.get_rank()
    sharded = embshard.shard(
        EmbeddingBagCollection(tables=[t.config() for t in case.tables], device="meta"), case.plan
    )
    good = local_batches(case, 0)[rank]
    reports = {}
    for expected, bad in bad_batches(case).items():
        start = time.monotonic()
        try:
            sharded(bad if rank == 1 else good)
            reports[expected] = None
        except embshard.InputError as e:
            reports[expected] = (str(e), time.monotonic() - start)
    sharded(good).values().sum().backward()  # the world is still in step
    return reports


def test_bad_input_on_one_rank_raises_on_every_rank(world):
    check_bad_input_raises_on_every_rank(world)


def check_bad_input_raises_on_every_rank(world) -> None:
    """Each bad batch of ``bad_batches`` on rank 1 of ``world(3)``: the same error on
    every rank, naming rank 1 and what was wrong, within 30 s."""
    case = Case(TABLES, plans(3)["mixed"], (4, 5, 3))
    reports = world(3).run(forward_with_bad_input_on_rank_1, case, timeout=120)
    for expected in bad_batches(case):
        messages = {r[expected][0] for r in reports}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert "rank 1: " in message and expected in message, message
        assert all(r[expected][1] < 30 for r in reports)
    out_of_range = reports[0]["id 25 is outside [0, 25)"][0]
    assert "feature 'f_c' (table 'c')" in out_of_range
    assert "feature 'f_a' (table 'd')" in reports[0]["id -3 is outside [0, 20)"][0]


@st.composite
def grids(draw, world_size: int, rows: int, widths: list[int]):
    """A grid of blocks ``widths`` wide, each over a random ascending group, even or cut
    at random rows."""
    ranks = st.integers(0, world_size - 1)
    groups = [sorted(draw(st.sets(ranks, min_size=1))) for _ in widths]
    sizes = None
    if draw(st.booleans()):
        sizes = []
        for group in groups:
            bound = st.integers(0, rows)
            cuts = sorted(draw(st.lists(bound, min_size=len(group) - 1, max_size=len(group) - 1)))
            sizes.append([b - a for a, b in zip([0, *cuts], [*cuts, rows])])
    equal = len(set(widths)) == 1 and draw(st.booleans())
    return grid(len(widths) if equal else widths, groups, sizes)


@st.composite
def random_cases(draw, world_size: int, sequence: bool = False) -> Case:
    """Random tables, plans and batches. For an EmbeddingCollection (``sequence``) every
    table is 8 wide (TorchRec's takes one dim)."""
    feature_pool = [f"f{i}" for i in range(5)]
    tables, specs = [], {}
    kinds = ["tw", "rw", "uneven", "cw", "grid", "dp"]
    for i in range(draw(st.integers(1, 4))):
        name = f"t{i}"
        features = tuple(
            draw(st.lists(st.sampled_from(feature_pool), min_size=1, max_size=2, unique=True))
        )
        rows = draw(st.integers(1, 30))
        blocks = draw(
            st.lists(st.integers(0, world_size - 1), min_size=1, max_size=2 if sequence else 3)
        )
        widths = (
            [2 // len(blocks)] * len(blocks)
            if sequence
            else draw(st.lists(st.integers(1, 2), min_size=len(blocks), max_size=len(blocks)))
        )
        cuts = sorted(
            draw(st.lists(st.integers(0, rows), min_size=world_size - 1, max_size=world_size - 1))
        )
        kind = draw(st.sampled_from(kinds))
        dim = 4 * sum(widths) if kind in ("cw", "grid") or sequence else 4 * draw(st.integers(1, 3))
        tables.append(Table(name, rows, dim, features, mean=draw(st.booleans())))
        if kind == "grid":
            specs[name] = draw(grids(world_size, rows, [4 * w for w in widths]))
            continue
        specs[name] = {
            "tw": table_wise(draw(st.integers(0, world_size - 1))),
            "rw": row_wise(),
            "uneven": row_wise([b - a for a, b in zip([0, *cuts], [*cuts, rows])]),
            "cw": column_wise(blocks, [4 * w for w in widths]),
            "dp": data_parallel(),
        }[kind]
    sizes = tuple(draw(st.lists(st.integers(0, 4), min_size=world_size, max_size=world_size)))
    if sequence and not any(sizes):  # TorchRec's EmbeddingCollection fails on no samples
        sizes = (1, *sizes[1:])
    seed = draw(st.integers(0, 999))
    return Case(tuple(tables), ShardingPlan(specs), sizes, steps=2, seed=seed, sequence=sequence)


@pytest.mark.parametrize("world_size", [2, 3])
def test_random_plans_tables_and_batches(world, world_size):
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(random_cases(world_size))
    def check(case):
        for worst in world(world_size).run(run_case, case):
            assert worst["forward"] < TOL and worst["weights"] < TOL, worst

    check()
