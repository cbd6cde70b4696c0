"""Plans: resolution against TorchRec's own shard computation, validation, YAML, conversion."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import sharding_plan as tr
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.distributed.types import ShardingPlan as TorchRecPlan

import embshard
from embshard import PlanError, ShardingPlan, column_wise, data_parallel, grid, row_wise, table_wise


def config(name: str, rows: int, dim: int) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, num_embeddings=rows, embedding_dim=dim, feature_names=[name]
    )


TABLES = [config("a", 10, 16), config("b", 5, 8), config("c", 7, 12)]


def torchrec_shards(tables, generators, world_size, local_size=None):
    """TorchRec's shards for ``generators`` (table -> torchrec.distributed.sharding_plan
    generator), as {table: sorted [(rank, row_offset, rows, col_offset, cols)]};
    ``local_size`` ranks a host (default: one host)."""
    ebc = EmbeddingBagCollection(tables=tables, device="meta")
    plan = tr.construct_module_sharding_plan(
        ebc,
        generators,
        world_size=world_size,
        local_size=local_size or world_size,
        device_type="cpu",
    )
    return {
        name: sorted(
            (
                s.placement.rank(),
                s.shard_offsets[0],
                s.shard_sizes[0],
                s.shard_offsets[1],
                s.shard_sizes[1],
            )
            for s in p.sharding_spec.shards
        )
        for name, p in plan.items()
    }


def our_shards(plan, tables, world_size):
    return {
        name: sorted((s.rank, s.row_offset, s.rows, s.col_offset, s.cols) for s in t.shards)
        for name, t in plan.resolve(tables, world_size).items()
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_resolution_matches_torchrec(world_size):
    last = world_size - 1
    cw_ranks = [last, 0, last, 0]
    ours = ShardingPlan({"a": column_wise(cw_ranks), "b": row_wise(), "c": table_wise(last)})
    theirs = {
        "a": tr.column_wise(ranks=cw_ranks),
        "b": tr.row_wise(),
        "c": tr.table_wise(rank=last),
    }
    assert our_shards(ours, TABLES, world_size) == torchrec_shards(TABLES, theirs, world_size)


def test_uneven_row_wise_matches_torchrec_offsets():
    sizes = [0, 3, 4, 0]
    ours = our_shards(ShardingPlan({"c": row_wise(sizes)}), [TABLES[2]], 4)["c"]
    # TorchRec's uneven row-wise helper is for inference and places every block on rank
    # 0; its offsets and sizes are the oracle, block i belongs to rank i.
    plan = tr.construct_module_sharding_plan(
        EmbeddingBagCollection(tables=[TABLES[2]], device="meta"),
        {"c": tr.row_wise((sizes, "cpu"))},
        world_size=4,
        local_size=4,
        device_type="cpu",
    )
    theirs = [
        (i, s.shard_offsets[0], s.shard_sizes[0], s.shard_offsets[1], s.shard_sizes[1])
        for i, s in enumerate(plan["c"].sharding_spec.shards)
    ]
    assert ours == sorted(theirs)


def test_column_wise_explicit_widths_in_column_order():
    shards = ShardingPlan({"a": column_wise([1, 0, 1], [4, 8, 4])}).resolve([TABLES[0]], 2)["a"]
    assert [(s.rank, s.col_offset, s.cols) for s in shards.shards] == [
        (1, 0, 4),
        (0, 4, 8),
        (1, 12, 4),
    ]
    assert shards.ranks == (0, 1)
    assert [s.cols for s in shards.shards_on(1)] == [4, 4]


# TorchRec's grid cuts columns into blocks of at least 128: a 256-wide table has two.
WIDE = [config("g", 10, 256), config("h", 5, 16)]


@pytest.mark.parametrize("local_size", [1, 2, 4])
def test_grid_resolution_matches_torchrec_grid_and_table_row_wise(local_size):
    hosts = [list(range(h * local_size, (h + 1) * local_size)) for h in range(4 // local_size)]
    ours = ShardingPlan({"g": grid(2, [hosts[-1], hosts[0]]), "h": grid(1, [hosts[-1]])})
    theirs = {
        "g": tr.grid_shard(host_indexes=[len(hosts) - 1, 0]),
        "h": tr.table_row_wise(host_index=len(hosts) - 1),
    }
    assert our_shards(ours, WIDE, 4) == torchrec_shards(WIDE, theirs, 4, local_size)


def test_grid_blocks_split_rows_over_their_own_groups():
    # Widths 4 and 12; block 0 evenly over ranks 0 and 2, block 1 unevenly over 1, 2, 3
    # (none on 2): rank 2 holds rows of both blocks, different rows in each.
    spec = grid([4, 12], [[0, 2], [1, 2, 3]], [[5, 5], [3, 0, 7]])
    table = ShardingPlan({"a": spec}).resolve([TABLES[0]], 4)["a"]
    assert [(s.rank, s.row_offset, s.rows, s.col_offset, s.cols) for s in table.shards] == [
        (0, 0, 5, 0, 4),
        (2, 5, 5, 0, 4),
        (1, 0, 3, 4, 12),
        (2, 3, 0, 4, 12),
        (3, 3, 7, 4, 12),
    ]
    assert table.ranks == (0, 1, 2, 3)
    assert [(s.row_offset, s.cols) for s in table.shards_on(2)] == [(5, 4), (3, 12)]
    even = ShardingPlan({"b": grid(2, [[3], [0, 1, 2]])}).resolve([TABLES[1]], 4)["b"]
    assert [(s.rank, s.row_offset, s.rows, s.col_offset) for s in even.shards] == [
        (3, 0, 5, 0),
        (0, 0, 2, 4),
        (1, 2, 2, 4),
        (2, 4, 1, 4),
    ]


@pytest.mark.parametrize(
    ("spec", "table", "message"),
    [
        (table_wise(4), TABLES[0], "table 'a': rank 4 is outside the world of 4 ranks"),
        (row_wise([3, 3, 3]), TABLES[0], "table 'a': row_wise gives 3 sizes for a world of 4"),
        (
            row_wise([3, 3, 3, 2]),
            TABLES[0],
            "table 'a': row_wise sizes [3, 3, 3, 2] sum to 11, not 10",
        ),
        (column_wise([0, 5]), TABLES[0], "table 'a': rank 5 is outside the world of 4 ranks"),
        (
            column_wise([0, 1], [8, 4]),
            TABLES[0],
            "table 'a': column_wise widths [8, 4] sum to 12, not 16",
        ),
        (column_wise([0, 1, 2]), TABLES[0], "table 'a': embedding_dim 16 does not split into 3"),
        (column_wise([0, 1], [6, 10]), TABLES[0], "column block width 6 is not a multiple of 4"),
        (
            column_wise([0, 1]),
            config("d", 5, 8 + 4 + 2),
            "column block width 7 is not a multiple of 4",
        ),
        (table_wise(0), config("d", 5, 6), "table 'd': embedding_dim 6 is not a multiple of 4"),
        (grid(2, [[0], [3, 4]]), TABLES[0], "table 'a': rank 4 is outside the world of 4 ranks"),
        (grid(3, [[0], [1], [2]]), TABLES[0], "table 'a': embedding_dim 16 does not split into 3"),
        (grid([8, 4], [[0], [1]]), TABLES[0], "table 'a': grid widths [8, 4] sum to 12, not 16"),
        (grid([6, 10], [[0], [1]]), TABLES[0], "column block width 6 is not a multiple of 4"),
        (
            grid(2, [[0, 1], [2]], [[3, 3], [10]]),
            TABLES[0],
            "table 'a': grid block 0 sizes [3, 3] sum to 6, not 10 rows",
        ),
        (
            row_wise([3, 3, 3, 1], hot_rows=2),
            TABLES[0],
            "table 'a': row_wise sizes [3, 3, 3, 1] sum to 10, not 8 rows, the rows left after "
            "2 hot ones",
        ),
        (
            row_wise(hot_rows=10),
            TABLES[0],
            "table 'a': row_wise hot_rows 10 leaves none of the table's 10 rows to split",
        ),
        (
            row_wise(ranks=[0, 1, 4, 2]),
            TABLES[0],
            "table 'a': row_wise ranks [0, 1, 4, 2] are not an order of the world's 4 ranks",
        ),
        (
            row_wise(ranks=[2, 1, 0]),
            TABLES[0],
            "table 'a': row_wise ranks [2, 1, 0] are not an order of the world's 4 ranks",
        ),
    ],
)
def test_validation_names_table_and_problem(spec, table, message):
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ShardingPlan({table.name: spec}).resolve([table], 4)


def test_validation_reports_missing_and_unknown_tables_together():
    plan = ShardingPlan({"a": table_wise(0), "zzz": table_wise(0)})
    with pytest.raises(PlanError) as err:
        plan.resolve(TABLES, 2)
    text = str(err.value)
    assert "table 'b': no entry in the plan" in text
    assert "table 'c': no entry in the plan" in text
    assert "table 'zzz': the plan names it but the model has no such table" in text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (table_wise(-1), "rank must be a non-negative int"),
        (row_wise([2, -1]), "row_wise sizes must be non-negative ints"),
        (row_wise(hot_rows=-3), "row_wise hot_rows must be a non-negative int, got -3"),
        (row_wise(hot_rows=2.5), "row_wise hot_rows must be a non-negative int, got 2.5"),
        (row_wise(ranks=[0, -1]), r"row_wise ranks must be non-negative ints, got \[0, -1\]"),
        (
            row_wise(ranks=[1, 0, 1]),
            r"row_wise ranks \[1, 0, 1\] repeat a rank \(one block a rank\)",
        ),
        (row_wise([5, 5], ranks=[1, 0, 2]), "row_wise gives 2 sizes for 3 ranks"),
        (column_wise([]), "column_wise needs at least one rank"),
        (column_wise([0, 1], [8]), "column_wise gives 1 width for 2 ranks"),
        (column_wise([0], [0]), "column_wise widths must be positive ints"),
        ("row_wise", "expected table_wise"),
        (grid(2, [[0, 1]]), "grid has 2 column blocks but 1 group of ranks"),
        (grid([8, 8, 0], [[0], [1], [2]]), "grid column_blocks must be a positive int or a list"),
        (grid(0, []), "grid column_blocks must be a positive int or a list"),
        (grid(1, []), "grid needs a group of ranks for every column block, got none"),
        (grid(2, [[0], []]), "grid block 1 has an empty group of ranks"),
        (grid(1, [[0, -1]]), r"grid block 0: ranks must be non-negative ints, got \[0, -1\]"),
        (
            grid(2, [[0, 1], [3, 2, 3]]),
            r"grid block 1: ranks \[3, 2, 3\] repeat a rank \(one block a rank\)",
        ),
        (grid(2, [[0], [1]], [[5]]), "grid gives 1 list of sizes for 2 groups of ranks"),
        (grid(1, [[0, 1]], [[5]]), "grid block 0 gives 1 size for 2 ranks"),
        (grid(1, [[0, 1]], [[5, -1]]), "grid block 0: sizes must be non-negative ints"),
    ],
)
def test_malformed_specs_fail_at_construction(spec, message):
    with pytest.raises(PlanError, match=f"table 't': {message}"):
        ShardingPlan({"t": spec})


@pytest.mark.parametrize(
    ("spec", "rows", "message"),
    [
        (table_wise(1), 10, "rank 1 is outside the world of 1 rank$"),
        (row_wise([4, 6]), 10, "row_wise gives 2 sizes for a world of 1 rank$"),
        (row_wise([2]), 1, r"row_wise sizes \[2\] sum to 2, not 1 row$"),
    ],
)
def test_counts_in_messages_are_pluralized(spec, rows, message):
    with pytest.raises(PlanError, match=message):
        ShardingPlan({"a": spec}).resolve([config("a", rows, 16)], 1)


MIXED = """
tables:
  a: {type: column_wise}
  b: {type: row_wise, sizes: [3, 3]}
  c: {type: table_wise, rank: 5}
  zzz: {type: diagonal}
  y: {type: table_wise, rank: 0}
"""


def test_yaml_plan_checked_against_the_model_lists_every_problem_at_once():
    with pytest.raises(PlanError) as err:
        ShardingPlan.from_yaml(MIXED, TABLES, 4)
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid sharding plan:"
    assert sorted(lines[1:]) == sorted(
        [
            "  table 'a': column_wise needs ranks",
            "  table 'b': row_wise gives 2 sizes for a world of 4 ranks",
            "  table 'b': row_wise sizes [3, 3] sum to 6, not 5 rows",
            "  table 'c': rank 5 is outside the world of 4 ranks",
            "  table 'zzz': expected a mapping with type one of "
            "['table_wise', 'row_wise', 'column_wise', 'grid', 'data_parallel'], "
            "got {'type': 'diagonal'}",
            "  table 'zzz': the plan names it but the model has no such table "
            "(tables: ['a', 'b', 'c'])",
            "  table 'y': the plan names it but the model has no such table "
            "(tables: ['a', 'b', 'c'])",
        ]
    )


def test_yaml_plan_without_a_world_size_leaves_world_checks_to_resolve(tmp_path):
    (tmp_path / "plan.yaml").write_text(MIXED)
    with pytest.raises(PlanError) as err:
        ShardingPlan.load(tmp_path / "plan.yaml", TABLES)
    text = str(err.value).removeprefix(f"{tmp_path / 'plan.yaml'}: ")
    assert "table 'b': row_wise sizes [3, 3] sum to 6, not 5 rows" in text
    assert "table 'a': column_wise needs ranks" in text and "table 'y': the plan names" in text
    assert "world" not in text
    fitting = "tables: {a: {type: table_wise, rank: 5}, b: {type: row_wise}, c: {type: row_wise}}"
    plan = ShardingPlan.from_yaml(fitting, TABLES)
    with pytest.raises(PlanError, match="table 'a': rank 5 is outside the world of 2 ranks"):
        plan.resolve(TABLES, 2)
    assert ShardingPlan.from_yaml(fitting, TABLES, 6) == plan


def test_world_size_must_be_positive():
    with pytest.raises(PlanError, match="world size must be a positive int"):
        ShardingPlan({"a": table_wise(0)}).resolve([TABLES[0]], 0)
    with pytest.raises(PlanError, match="world size must be a positive int"):
        ShardingPlan.from_yaml("tables: {a: {type: table_wise, rank: 0}}", TABLES[:1], 0)


specs = st.one_of(
    st.builds(table_wise, st.integers(0, 7)),
    st.builds(data_parallel),
    st.builds(
        row_wise,
        st.none() | st.lists(st.integers(0, 100), min_size=1, max_size=8),
        st.integers(0, 50),
    ),
    st.integers(1, 8).flatmap(
        lambda n: st.builds(
            row_wise,
            st.none() | st.lists(st.integers(0, 100), min_size=n, max_size=n),
            st.integers(0, 50),
            st.permutations(range(n)),
        )
    ),
    st.builds(
        column_wise,
        st.lists(st.integers(0, 7), min_size=1, max_size=6),
    ),
    st.integers(1, 6).flatmap(
        lambda n: st.builds(
            column_wise,
            st.lists(st.integers(0, 7), min_size=n, max_size=n),
            st.lists(st.integers(1, 64).map(lambda w: 4 * w), min_size=n, max_size=n),
        )
    ),
    st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), min_size=1).flatmap(
        lambda groups: st.builds(
            grid,
            st.just(len(groups)) | st.just([4 * (i + 1) for i in range(len(groups))]),
            st.just(groups),
            st.none()
            | st.tuples(
                *[st.lists(st.integers(0, 50), min_size=len(g), max_size=len(g)) for g in groups]
            ),
        )
    ),
)
plans = st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), specs, max_size=6)


@settings(max_examples=100, deadline=None)
@given(plans)
def test_yaml_round_trip(tables):
    plan = ShardingPlan(tables)
    assert ShardingPlan.from_yaml(plan.to_yaml()) == plan


def test_save_and_load_file(tmp_path):
    plan = ShardingPlan(
        {"a": column_wise([1, 0, 1], [4, 8, 4]), "b": row_wise([5, 0]), "c": table_wise(1)}
    )
    plan.save(tmp_path / "plan.yaml")
    assert ShardingPlan.load(tmp_path / "plan.yaml") == plan
    assert plan.resolve(TABLES, 2) == ShardingPlan.load(tmp_path / "plan.yaml").resolve(TABLES, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tables: [", "sharding plan:1:10: invalid YAML"),
        ("a: 1", "one key, 'tables'"),
        ("tables:\n  a: {type: diagonal}", "table 'a': expected a mapping with type one of"),
        ("tables:\n  a: {type: table_wise}", "table 'a': table_wise needs a rank"),
        (
            "tables:\n  a: {type: row_wise, size: [1]}",
            r"table 'a': unknown keys \['size'\] for row_wise",
        ),
        (
            "tables:\n  a: {type: column_wise, ranks: 3}",
            "table 'a': column_wise ranks must be a list",
        ),
        ("tables:\n  a: {type: column_wise}", "table 'a': column_wise needs ranks"),
        ("tables:\n  a: {type: grid}", "table 'a': grid needs column_blocks and ranks"),
        ("tables:\n  a: {type: grid, column_blocks: 2}", "table 'a': grid needs ranks$"),
        (
            "tables:\n  a: {type: grid, column_blocks: '2', ranks: [[0], [1]]}",
            "table 'a': grid column_blocks must be a count or a list of widths, got '2'",
        ),
        (
            "tables:\n  a: {type: grid, column_blocks: 2, ranks: [0, 1]}",
            r"table 'a': grid ranks must be a list of lists, one per column block, got \[0, 1\]",
        ),
        (
            "tables:\n  a: {type: grid, column_blocks: 1, ranks: [[0, 1]], sizes: [5, 5]}",
            "table 'a': grid sizes must be a list of lists",
        ),
        (
            "tables:\n  a: {type: grid, column_blocks: 1, ranks: [[0]], widths: [16]}",
            r"table 'a': unknown keys \['widths'\] for grid",
        ),
        (
            "tables:\n  a: {type: table_wise, rank: -2}",
            "table 'a': rank must be a non-negative int",
        ),
    ],
)
def test_from_yaml_errors(text, message):
    with pytest.raises(PlanError, match=message):
        ShardingPlan.from_yaml(text)


def test_to_torchrec_matches_torchrec_helpers():
    plan = ShardingPlan(
        {"a": column_wise([2, 0, 2, 1]), "b": row_wise(), "c": table_wise(3), "d": data_parallel()}
    )
    tables = [*TABLES, config("d", 6, 8)]
    converted = embshard.to_torchrec_plan(plan, tables, 4)
    oracle = tr.construct_module_sharding_plan(
        EmbeddingBagCollection(tables=tables, device="meta"),
        {
            "a": tr.column_wise(ranks=[2, 0, 2, 1]),
            "b": tr.row_wise(),
            "c": tr.table_wise(rank=3),
            "d": tr.data_parallel(),
        },
        world_size=4,
        local_size=4,
        device_type="cpu",
    )
    for name in ("a", "b", "c", "d"):
        ours, theirs = converted[name], oracle[name]
        assert ours.sharding_type == theirs.sharding_type
        assert ours.ranks == theirs.ranks
        assert ours.compute_kernel == ("dense" if name == "d" else "fused")
        assert ours.sharding_spec == theirs.sharding_spec


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_torchrec_round_trip(world_size):
    last = world_size - 1
    plan = ShardingPlan(
        {
            "a": column_wise([last, 0, last, 0]),
            "b": row_wise([0] * last + [5]),
            "c": table_wise(last),
        }
    )
    back = embshard.from_torchrec_plan(embshard.to_torchrec_plan(plan, TABLES, world_size))
    assert our_shards(back, TABLES, world_size) == our_shards(plan, TABLES, world_size)
    even = ShardingPlan({"a": column_wise([0, last], [4, 12]), "b": row_wise(), "c": row_wise()})
    assert embshard.from_torchrec_plan(embshard.to_torchrec_plan(even, TABLES, world_size)) == even


@pytest.mark.parametrize("local_size", [1, 2, 4])
def test_grid_converts_to_torchrec_grid_and_table_row_wise_and_back(local_size):
    hosts = [list(range(h * local_size, (h + 1) * local_size)) for h in range(4 // local_size)]
    plan = ShardingPlan({"g": grid(2, [hosts[-1], hosts[0]]), "h": grid(1, [hosts[0]])})
    converted = embshard.to_torchrec_plan(plan, WIDE, 4, local_size=local_size)
    oracle = tr.construct_module_sharding_plan(
        EmbeddingBagCollection(tables=WIDE, device="meta"),
        {"g": tr.grid_shard(host_indexes=[len(hosts) - 1, 0]), "h": tr.table_row_wise(0)},
        world_size=4,
        local_size=local_size,
        device_type="cpu",
    )
    assert converted["g"].sharding_type == ShardingType.GRID_SHARD.value
    assert converted["h"].sharding_type == ShardingType.TABLE_ROW_WISE.value
    for name in ("g", "h"):
        ours, theirs = converted[name], oracle[name]
        assert ours.sharding_type == theirs.sharding_type
        assert ours.ranks == theirs.ranks
        assert ours.sharding_spec == theirs.sharding_spec
    assert embshard.from_torchrec_plan(oracle) == plan


def torchrec_and_embshard_pool(plan: ShardingPlan) -> tuple[float, float]:
    """The largest difference between TorchRec, sharding by the converted plan, and
    embshard, both holding the same full tables, on this rank's batch; and embshard's
    largest output."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = EmbeddingBagCollection(tables=WIDE)
    ours = embshard.shard(copy.deepcopy(full), plan)
    theirs = DistributedModelParallel(
        copy.deepcopy(full),
        device=torch.device("cpu"),
        plan=TorchRecPlan({"": embshard.to_torchrec_plan(plan, WIDE, world)}),
        sharders=[EmbeddingBagCollectionSharder()],
    )
    with torch.no_grad():
        for key, table in theirs.state_dict().items():
            weight = full.embedding_bags[key.split(".")[-2]].weight
            for shard in table.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(weight[row : row + rows, col : col + cols])
    generator = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 4, (10,), generator=generator)
    ids = [torch.randint(0, t.num_embeddings, (int(n),), generator=generator) for t, n in
           zip(WIDE, lengths.view(2, 5).sum(1))]  # fmt: skip
    batch = KeyedJaggedTensor(keys=["g", "h"], values=torch.cat(ids), lengths=lengths)
    expected = theirs(batch)
    expected = expected.wait() if hasattr(expected, "wait") else expected
    pooled = ours(batch).values()
    return float((pooled - expected.values()).abs().max()), float(pooled.abs().max())


def test_torchrec_shards_converted_grids_and_pools_as_embshard(world):
    plan = ShardingPlan({"g": grid(2, [[0, 1], [0, 1]]), "h": grid(1, [[0, 1]])})
    for difference, largest in world(2).run(torchrec_and_embshard_pool, plan):
        assert difference == 0.0 and largest > 0


def test_uneven_torchrec_grid_reads_back_with_its_sizes_and_widths():
    shards = [  # (rank, row_offset, rows, col_offset, cols), listed out of order
        (3, 0, 10, 128, 128),
        (1, 3, 7, 0, 128),
        (0, 0, 3, 0, 128),
    ]
    sharding = ParameterSharding(
        sharding_type=ShardingType.GRID_SHARD.value,
        compute_kernel="fused",
        ranks=[r for r, *_ in shards],
        sharding_spec=EnumerableShardingSpec(
            [
                ShardMetadata([row, col], [rows, cols], f"rank:{r}/cpu")
                for r, row, rows, col, cols in shards
            ]
        ),
    )
    assert embshard.from_torchrec_plan({"g": sharding}) == ShardingPlan(
        {"g": grid(2, [[0, 1], [3]], [[3, 7], [10]])}
    )
    sharding.sharding_spec.shards[0].shard_sizes[1] = 64  # the second block narrower
    sharding.sharding_spec.shards[0].shard_offsets[1] = 192
    assert embshard.from_torchrec_plan({"g": sharding}).tables["g"].column_blocks == (128, 64)


def test_grids_torchrec_cannot_shard_are_refused_naming_table_and_block():
    plan = ShardingPlan(
        {"g": grid([64, 192], [[0, 1], [2, 3]]), "h": grid(1, [[1, 2]]), "i": row_wise()}
    )
    with pytest.raises(PlanError) as err:
        embshard.to_torchrec_plan(plan, [*WIDE, config("i", 4, 8)], 4, local_size=2)
    assert str(err.value).splitlines() == [
        "cannot convert to a TorchRec plan:",
        "  table 'g': TorchRec's grid sharding needs column blocks of equal widths",
        "  table 'h': TorchRec's grid sharding splits each column block evenly over the 2 "
        "ranks of one host; the block at column 0 has rows [3, 2] on ranks [1, 2]",
    ]


def test_hot_rows_resolve_to_a_copy_on_every_rank_then_row_blocks():
    table = config("t", 100, 16)
    plan = ShardingPlan({"t": row_wise([0, 30, 50], hot_rows=20)})
    shards = plan.resolve([table], 3)["t"].shards
    assert [(s.rank, s.row_offset, s.rows, s.replica) for s in shards] == [
        (0, 0, 20, True),
        (1, 0, 20, True),
        (2, 0, 20, True),
        (0, 20, 0, False),
        (1, 20, 30, False),
        (2, 50, 50, False),
    ]
    even = ShardingPlan({"t": row_wise(hot_rows=10)}).resolve([table], 4)["t"]
    assert [s.rows for s in even.shards if not s.replica] == [23, 23, 23, 21]
    assert even.replicated_rows == 10 and not even.replicated
    assert ShardingPlan.from_yaml(plan.to_yaml(), [table], 3) == plan
    assert "hot_rows: 20" in plan.to_yaml()


def test_row_blocks_go_to_their_ranks_in_row_order():
    table = config("t", 100, 16)
    plan = ShardingPlan({"t": row_wise([10, 30, 60], hot_rows=0, ranks=[2, 0, 1])})
    shards = plan.resolve([table], 3)["t"].shards
    assert [(s.rank, s.row_offset, s.rows) for s in shards] == [
        (2, 0, 10),
        (0, 10, 30),
        (1, 40, 60),
    ]
    even = ShardingPlan({"t": row_wise(hot_rows=10, ranks=[3, 2, 1, 0])}).resolve([table], 4)["t"]
    assert [(s.rank, s.row_offset, s.rows) for s in even.shards if not s.replica] == [
        (3, 10, 23),
        (2, 33, 23),
        (1, 56, 23),
        (0, 79, 21),
    ]
    assert ShardingPlan.from_yaml(plan.to_yaml(), [table], 3) == plan
    assert "ranks: [2, 0, 1]" in plan.to_yaml()


def test_row_blocks_out_of_rank_order_convert_from_torchrec_but_not_to_it():
    """TorchRec's row-wise sharding gives rank r the r-th row block whatever the plan's
    placements say: embshard reads such a plan by its placements, and never writes one."""
    tables = [config("t", 40, 8)]
    plan = ShardingPlan({"t": row_wise([10, 30], ranks=[1, 0])})
    with pytest.raises(PlanError) as err:
        embshard.to_torchrec_plan(plan, tables, 2)
    assert str(err.value).splitlines() == [
        "cannot convert to a TorchRec plan:",
        "  table 't': TorchRec's row-wise sharding puts row block r on rank r; "
        "these are on ranks [1, 0]",
    ]
    in_order = embshard.to_torchrec_plan(ShardingPlan({"t": row_wise([10, 30])}), tables, 2)
    spec = in_order["t"].sharding_spec
    spec.shards = [
        dataclasses.replace(shard, placement=tr.placement("cpu", rank, 2))
        for shard, rank in zip(spec.shards, [1, 0])
    ]
    assert embshard.from_torchrec_plan(in_order) == plan


def test_hot_rows_have_no_torchrec_plan():
    plan = ShardingPlan({"t": row_wise(hot_rows=5), "u": row_wise()})
    with pytest.raises(PlanError) as err:
        embshard.to_torchrec_plan(plan, [config("t", 40, 8), config("u", 40, 8)], 2)
    assert str(err.value).splitlines() == [
        "cannot convert to a TorchRec plan:",
        "  table 't': TorchRec has no row-wise sharding with hot rows copied on every rank",
    ]


def test_from_torchrec_refuses_unknown_sharding_types():
    plan = tr.construct_module_sharding_plan(
        EmbeddingBagCollection(tables=TABLES[1:2], device="meta"),
        {"b": tr.table_wise(rank=0)},
        world_size=2,
        local_size=2,
        device_type="cpu",
    )
    plan["a"] = ParameterSharding(
        sharding_type=ShardingType.TABLE_COLUMN_WISE.value, compute_kernel="fused", ranks=[0, 1]
    )
    with pytest.raises(PlanError, match="table 'a': TorchRec sharding type 'table_column_wise'"):
        embshard.from_torchrec_plan(plan)


def test_plan_files_name_themselves_in_every_error(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("tables:\n  a: {type: row_wise\n  b: {type: table_wise, rank: 0}\n")
    with pytest.raises(PlanError, match=rf"^{re.escape(str(broken))}:3:\d+: invalid YAML"):
        ShardingPlan.load(broken)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("tables:\n  a: {type: diagonal}\n")
    with pytest.raises(
        PlanError, match=rf"^{re.escape(str(wrong))}: invalid sharding plan:\n  table 'a'"
    ):
        ShardingPlan.load(wrong)
    with pytest.raises(PlanError, match=r"absent\.yaml: cannot read the plan"):
        ShardingPlan.load(tmp_path / "absent.yaml")


def test_specs_name_the_ranks_they_place_blocks_on():
    assert table_wise(3).named_ranks == (3,)
    assert row_wise([5, 5]).named_ranks == ()
    assert row_wise(ranks=[2, 0, 1]).named_ranks == (2, 0, 1)
    assert column_wise([1, 1, 0]).named_ranks == (1, 1, 0)
    assert grid(2, [[0, 2], [1]]).named_ranks == (0, 2, 1)
    assert data_parallel().named_ranks == ()


def test_only_a_row_wise_spec_with_sizes_or_ranks_names_a_world_size():
    assert row_wise([3, 0, 7]).named_world_size == 3
    assert row_wise(ranks=[1, 0]).named_world_size == 2
    assert row_wise([4, 6], hot_rows=2, ranks=[1, 0]).named_world_size == 2
    assert row_wise().named_world_size is None
    assert row_wise(hot_rows=5).named_world_size is None
    for spec in (table_wise(3), column_wise([0, 1]), grid(1, [[0, 1]]), data_parallel()):
        assert spec.named_world_size is None, spec


def test_only_row_wise_has_a_row_block_on_every_rank_of_any_world():
    assert row_wise().ROW_BLOCK_ON_EVERY_RANK
    for spec in (table_wise(0), column_wise([0, 1]), grid(1, [[0, 1]]), data_parallel()):
        assert not spec.ROW_BLOCK_ON_EVERY_RANK, spec
    for world_size in (2, 5):
        resolved = ShardingPlan({"a": row_wise(hot_rows=2)}).resolve(TABLES[:1], world_size)
        blocks = [s.rank for s in resolved["a"].shards if not s.replica]
        assert blocks == list(range(world_size))


def test_column_wise_and_grid_split_columns():
    assert column_wise([0, 1]).SPLITS_COLUMNS and grid(2, [[0], [1]]).SPLITS_COLUMNS
    for spec in (table_wise(0), row_wise(), data_parallel()):
        assert not spec.SPLITS_COLUMNS, spec


def test_row_block_sizes_are_a_row_wise_specs_given_sizes():
    assert row_wise([3, 0, 7]).row_block_sizes == (3, 0, 7)
    assert row_wise([3, 7], hot_rows=4).row_block_sizes == (3, 7)
    assert row_wise().row_block_sizes is None
    sized_grid = grid(2, [[0, 1], [1]], [[5, 5], [10]])
    for spec in (table_wise(0), column_wise([0, 1]), sized_grid, data_parallel()):
        assert spec.row_block_sizes is None, spec


def test_row_groups_are_a_grids_groups_of_ranks():
    assert grid(2, [[0, 2], [1]]).row_groups == ((0, 2), (1,))
    assert grid([4, 12], [[3, 1, 0]]).row_groups == ((3, 1, 0),)
    for spec in (table_wise(0), row_wise(ranks=[1, 0]), column_wise([0, 1]), data_parallel()):
        assert spec.row_groups is None, spec


def test_a_shrunk_spec_keeps_its_row_blocks_shares():
    assert row_wise([10, 0, 30, 60]).shrunk(100, 20) == row_wise([2, 0, 6, 12])
    assert row_wise().shrunk(100, 20) == row_wise()
    hot = row_wise([10, 20, 30], hot_rows=40, ranks=[1, 2, 0]).shrunk(100, 20)
    assert hot == row_wise([2, 4, 6], hot_rows=8, ranks=[1, 2, 0])
    assert row_wise(hot_rows=99).shrunk(100, 20) == row_wise(hot_rows=19)
    assert row_wise(hot_rows=2).shrunk(100, 20) == row_wise(hot_rows=1)
    cut = grid(2, [[0, 2], [1]], [[10, 90], [100]]).shrunk(100, 20)
    assert cut == grid(2, [[0, 2], [1]], [[2, 18], [20]])
    unchanged = (table_wise(1), column_wise([0, 1], [4, 12]), grid(2, [[0, 1], [1]]))
    for spec in (*unchanged, data_parallel()):
        assert spec.shrunk(100, 20) == spec, spec
