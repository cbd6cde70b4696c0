"""The planner's dynamic tables: row cuts on bucket boundaries at any world size (with
and without measured traffic, and for ``--balance-lookups``), table-wise, row-wise or
column-wise only, and each rank's memory with the id maps it holds, counted from real
maps (a whole map for each column block)."""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from torchrec import EmbeddingBagConfig

from embshard import ShardingPlan
from embshard.app.cli import main as cli
from embshard.app.config import load_config
from embshard.app.data import build_data
from embshard.app.planning import count_traffic, lookup_balanced_plan, plan_config, topology_for
from embshard.errors import ConfigError, PlanningError
from embshard.plan.specs import Kind, column_wise, row_wise, table_wise
from embshard.planner.search import plan_loads, plan_tables
from embshard.planner.tables import TableConstraint
from embshard.planner.topology import CPU_REMAP_RATE, GPU_REMAP_RATE, Topology
from embshard.planner.traffic import TableTraffic, TrafficStats, balanced_plan
from embshard.storage.id_map import IdMap, IdMapSpec

DIM = 16
WORLDS = (2, 3, 5, 7)
BUCKET_COUNTS = (10, 64, 1000)


def _config(buckets: int, rows_per_bucket: int, name: str = "items") -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name,
        embedding_dim=DIM,
        num_embeddings=buckets * rows_per_bucket,
        feature_names=[f"{name}_id"],
    )


def _map_bytes(spec: IdMapSpec, rows: int, offset: int = 0) -> int:
    """The bytes of the real map of a shard's buckets (rows ``[offset, +rows)``), full:
    its state and an index entry (key and slot, int64) per slot."""
    first = offset // spec.rows_per_bucket
    last = first + rows // spec.rows_per_bucket
    state = IdMap(spec, first, last).state_dict()
    slots = sum(t.numel() for name, t in state.items() if name.endswith("keys"))
    return sum(t.nbytes for t in state.values()) + 16 * slots


def _bytes(spec: IdMapSpec, rows: int, offset: int = 0) -> int:
    """A row-wise Adagrad shard of ``rows`` rows: fp32 weights, one fp32 of state a
    row, and its buckets' map."""
    return rows * DIM * 4 + rows * 4 + _map_bytes(spec, rows, offset)


def _sizes(plan: ShardingPlan, name: str, rows: int) -> list[int]:
    """A row-wise table's row blocks; a table-wise one's ``rows``, one block."""
    spec = plan.tables[name]
    if spec.row_block_sizes is None:
        assert spec.KIND == Kind.TABLE_WISE, spec
        return [rows]
    assert spec.KIND == Kind.ROW_WISE, spec
    return list(spec.row_block_sizes)


def _assert_whole_buckets(sizes: list[int], rows: int, rows_per_bucket: int) -> None:
    assert sum(sizes) == rows
    assert all(s % rows_per_bucket == 0 for s in sizes), sizes


def _traffic(rows: int, seed: int) -> TableTraffic:
    """Power-law lookups over a table's rows, the low rows hottest."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, 20_000) - 1, rows - 1)
    uniq, counts = np.unique(ids, return_counts=True)
    return TableTraffic(rows, uniq, counts, 1000, 1000)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("buckets", BUCKET_COUNTS)
def test_even_cuts_are_whole_buckets(world, buckets):
    """Memory for an even cut of whole buckets over every rank, no more: the plan cuts
    it so, every rank's share within a bucket of the others', each in its memory."""
    spec = IdMapSpec(buckets, 7, admit_after=2)
    config = _config(buckets, 7)
    largest = -(-buckets // world) * 7
    topology = Topology.cpu(world, memory_per_rank=_bytes(spec, largest), reserved_memory=0)
    plan, report = plan_tables([config], topology, 512, dynamic={"items": spec})
    sizes = _sizes(plan, "items", config.num_embeddings)
    _assert_whole_buckets(sizes, config.num_embeddings, 7)
    held = [s for s in sizes if s]
    assert max(held) - min(held) <= 7
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    real = [_bytes(spec, s, int(o)) if s else 0 for s, o in zip(sizes, offsets)]
    assert [load.memory for load in report.ranks] == real
    assert max(real) <= topology.usable_memory


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("buckets", BUCKET_COUNTS)
def test_cuts_by_measured_lookups_are_whole_buckets(world, buckets):
    """With measured (skewed) traffic the blocks balance lookups by whole buckets: each
    holder within a bucket's lookups of its even share; no hot rows copied."""
    rows_per_bucket = 5
    config = _config(buckets, rows_per_bucket)
    traffic = _traffic(config.num_embeddings, world)
    stats = TrafficStats({"items": traffic})
    spec = IdMapSpec(buckets, rows_per_bucket)
    plan, _ = plan_tables(
        [config],
        Topology.cpu(world),
        512,
        {"items": TableConstraint(types=("row_wise",))},
        stats=stats,
        dynamic={"items": spec},
    )
    assert plan.tables["items"].hot_rows == 0
    sizes = _sizes(plan, "items", config.num_embeddings)
    _assert_whole_buckets(sizes, config.num_embeddings, rows_per_bucket)
    dense = np.zeros(config.num_embeddings, dtype=np.int64)
    dense[traffic.ids] = traffic.counts
    per_bucket = dense.reshape(buckets, rows_per_bucket).sum(1)
    edges = np.concatenate([[0], np.cumsum([s for s in sizes if s])])
    got = [dense[lo:hi].sum() for lo, hi in itertools.pairwise(edges)]
    mean = dense.sum() / len(got)
    assert all(abs(g - mean) <= per_bucket.max() for g in got), (got, mean)


@pytest.mark.parametrize("world", WORLDS)
def test_a_hot_row_cuts_a_dynamic_table_in_whole_buckets_with_no_copies(world):
    """Traffic with a hot row: ``balanced_plan`` (``--balance-lookups``) copies the
    static twin's hot rows; the dynamic table is cut in whole buckets with none, by
    ``balanced_plan`` and by the planner."""
    buckets, rows_per_bucket = 60, 10
    config = _config(buckets, rows_per_bucket)
    rows = config.num_embeddings
    ids = np.arange(rows)
    counts = np.ones(rows, dtype=np.int64)
    counts[3] = 20 * rows  # far beyond a block's share
    stats = TrafficStats({"items": TableTraffic(rows, ids, counts, 100, 100)})
    spec = IdMapSpec(buckets, rows_per_bucket)
    free = {"items": TableConstraint(types=("row_wise",))}
    assert balanced_plan(stats, world).tables["items"].hot_rows > 0
    dynamic, _ = plan_tables(
        [config], Topology.cpu(world), 4096, free, stats=stats, dynamic={"items": spec}
    )
    balanced = balanced_plan(stats, world, rows_per_bucket={"items": rows_per_bucket})
    for plan in (dynamic, balanced):
        assert plan.tables["items"].hot_rows == 0
        _assert_whole_buckets(_sizes(plan, "items", rows), rows, rows_per_bucket)


@pytest.mark.parametrize("admit_after", [1, 3])
def test_a_plans_memory_is_weights_state_and_maps(admit_after):
    """Each rank's memory in the report: its shards' weights, their Adagrad state and
    the maps of their buckets, the maps counted from real ``IdMap`` tensors."""
    world, buckets, rows_per_bucket = 3, 100, 8
    spec = IdMapSpec(buckets, rows_per_bucket, policy="lfu", admit_after=admit_after)
    tables = [_config(buckets, rows_per_bucket), _config(4, 50, "static")]
    constraints = {"items": TableConstraint(types=("row_wise",), ranks=(0, 1, 2))}
    topology = Topology.cpu(world, memory_per_rank=_bytes(spec, 34 * 8) + 14_000, reserved_memory=0)
    plan, report = plan_tables(tables, topology, 256, constraints, dynamic={"items": spec})
    resolved = plan.resolve(tables, world)
    expected = [0] * world
    for shard in resolved["items"].shards:
        if shard.rows:
            expected[shard.rank] += _bytes(spec, shard.rows, shard.row_offset)
    for shard in resolved["static"].shards:
        expected[shard.rank] += shard.rows * shard.cols * 4 + shard.rows * 4
    assert [load.memory for load in report.ranks] == expected
    _assert_whole_buckets(
        _sizes(plan, "items", buckets * rows_per_bucket), buckets * rows_per_bucket, 8
    )


def test_a_dynamic_tables_blocks_cost_their_remaps_and_hold_their_maps():
    """The same plan priced with and without the dynamic table's map: each rank's
    memory differs by the maps it holds and its cost by remapping its block's share of
    the batch's ids (3 ranks x 64 samples x 1 id) at the topology's rate; the static
    table is priced as before."""
    buckets, rows_per_bucket = 90, 4
    tables = [_config(buckets, rows_per_bucket), _config(30, 10, "static")]
    spec = IdMapSpec(buckets, rows_per_bucket)
    plan = ShardingPlan({"items": row_wise([120, 0, 240]), "static": table_wise(1)})
    topology = Topology.cpu(3, remap_rate=2.5e5)
    plain = plan_loads(plan, tables, topology, 64)
    mapped = plan_loads(plan, tables, topology, 64, dynamic={"items": spec})
    maps = [_map_bytes(spec, 120, 0), 0, _map_bytes(spec, 240, 120)]
    assert [m.memory - p.memory for m, p in zip(mapped, plain)] == maps
    remaps = [3 * 64 * rows / 360 / 2.5e5 for rows in (120, 0, 240)]
    assert [m.cost - p.cost for m, p in zip(mapped, plain)] == pytest.approx(remaps, rel=1e-9)


def test_a_column_wise_dynamic_tables_blocks_each_hold_and_remap_the_whole_map():
    """Every column block's rank holds a map of all the table's buckets and remaps
    every id of the batch (3 ranks x 64 samples x 1 id): the map and its remap are
    priced once per block, two blocks on rank 0 twice."""
    buckets, rows_per_bucket = 90, 4
    tables = [_config(buckets, rows_per_bucket), _config(30, 10, "static")]
    spec = IdMapSpec(buckets, rows_per_bucket, admit_after=2)
    plan = ShardingPlan({"items": column_wise([0, 2, 0, 2], [4] * 4), "static": table_wise(1)})
    topology = Topology.cpu(3, remap_rate=2.5e5)
    plain = plan_loads(plan, tables, topology, 64)
    mapped = plan_loads(plan, tables, topology, 64, dynamic={"items": spec})
    whole = _map_bytes(spec, buckets * rows_per_bucket)
    assert [m.memory - p.memory for m, p in zip(mapped, plain)] == [2 * whole, 0, 2 * whole]
    remap = 3 * 64 / 2.5e5
    costs = [m.cost - p.cost for m, p in zip(mapped, plain)]
    assert costs == pytest.approx([2 * remap, 0, 2 * remap], rel=1e-9)


def test_the_planner_may_cut_a_dynamic_table_into_column_blocks():
    """Constrained to column blocks, the planner's plan of a dynamic table is
    column-wise (what ``shard`` takes), each rank's memory its block's weights and
    row-wise Adagrad state and a whole map, counted from a real ``IdMap``."""
    buckets, rows_per_bucket = 50, 8
    spec = IdMapSpec(buckets, rows_per_bucket)
    rows = buckets * rows_per_bucket
    constraint = TableConstraint(types=("column_wise",), column_blocks=2)
    plan, report = plan_tables(
        [_config(buckets, rows_per_bucket)],
        Topology.cpu(2),
        256,
        {"items": constraint},
        dynamic={"items": spec},
    )
    assert plan.tables["items"].KIND == Kind.COLUMN_WISE, plan.tables["items"]
    resolved = plan.resolve([_config(buckets, rows_per_bucket)], 2)["items"]
    expected = [0, 0]
    for shard in resolved.shards:
        expected[shard.rank] += rows * shard.cols * 4 + rows * 4 + _map_bytes(spec, rows)
    assert [load.memory for load in report.ranks] == expected


def test_a_configs_topology_sets_the_remap_rate(tmp_path):
    data = yaml.safe_load(Path("configs/dynamic.yaml").read_text())
    data["topology"] = {"remap_rate": 3e5}
    path = tmp_path / "dynamic.yaml"
    path.write_text(yaml.safe_dump(data))
    assert topology_for(load_config(path, use="plan"), 2).remap_rate == 3e5
    assert Topology.cpu(2).remap_rate == CPU_REMAP_RATE
    assert Topology.gpu(2).remap_rate == GPU_REMAP_RATE
    with pytest.raises(PlanningError, match="topology remap_rate: must be more than 0, got 0"):
        Topology.cpu(2, remap_rate=0)


@pytest.mark.parametrize("world", [2, 3])
def test_the_demo_plans_as_its_static_twin_where_memory_is_ample(world):
    """Where every table fits whole anyway and remapping costs nothing, the maps
    change no choice: the demo's plan (its dynamic tables and its static ones) is its
    static twin's."""
    config = load_config("configs/dynamic.yaml", use="plan")
    free_remaps = dataclasses.replace(config.topology, remap_rate=1e30)
    config = dataclasses.replace(config, topology=free_remaps)
    twin = dataclasses.replace(
        config, tables=[dataclasses.replace(t, dynamic=None) for t in config.tables]
    )
    assert plan_config(config, world)[0] == plan_config(twin, world)[0]


@pytest.mark.parametrize(("world", "memory"), [(3, "7MiB"), (7, "3.5MiB")])
def test_the_demos_cuts_by_its_traffic_are_whole_buckets(world, memory):
    """The demo's measured traffic (raw ids counted on their buckets): the planner's
    plan and the lookup-balanced one cut its dynamic tables on bucket boundaries."""
    config = load_config("configs/dynamic.yaml", use="plan")
    config = dataclasses.replace(config, batch_size=256)
    stats = count_traffic(config, itertools.islice(build_data(config, 0, world).epoch_batches(), 2))
    maps = config.id_maps()
    planned, _ = plan_config(config, world, memory_per_rank=memory, stats=stats)
    balanced, _ = lookup_balanced_plan(config, world, stats, memory_per_rank=memory)
    for plan in (planned, balanced):
        for name, spec in maps.items():
            rows = spec.buckets * spec.rows_per_bucket
            _assert_whole_buckets(_sizes(plan, name, rows), rows, spec.rows_per_bucket)
            assert plan.tables[name].hot_rows == 0


def test_bad_dynamic_input_is_refused_in_one_line():
    config = _config(10, 4)
    topology = Topology.cpu(2)
    cases = {
        "dynamic names no table of the model: ['other']": {"other": IdMapSpec(10, 4)},
        "num_embeddings is not buckets x rows_per_bucket": {"items": IdMapSpec(10, 5)},
    }
    for message, dynamic in cases.items():
        with pytest.raises(PlanningError, match=message.replace("[", r"\[")):
            plan_tables([config], topology, 64, dynamic=dynamic)
    only = "a dynamic table is table_wise, row_wise or column_wise only"
    with pytest.raises(PlanningError, match=only):
        plan_tables(
            [config],
            topology,
            64,
            {"items": TableConstraint(types=("data_parallel",))},
            dynamic={"items": IdMapSpec(10, 4)},
        )


@pytest.mark.parametrize("admit_after", [1, 2])
def test_bytes_per_row_is_the_real_maps_when_full(admit_after):
    """A map of 3 buckets of 5 rows with every slot live (probation's too): its state
    and its indexes of live keys."""
    spec = IdMapSpec(6, 5, policy="ttl", ttl_steps=3, admit_after=admit_after)
    idmap = IdMap(spec, 1, 4)
    state = idmap.state_dict()
    width = -(-(2**63) // 6)
    for name, tensor in state.items():
        if name.endswith("keys"):
            buckets = torch.arange(1, 4).unsqueeze(1) * width
            tensor.copy_(buckets + torch.arange(5) + (100 if "probation" in name else 0))
        elif name.endswith("occupied"):
            tensor.fill_(True)
    idmap.load_state_dict(state)
    tables = [idmap.slots] + ([idmap.probation] if idmap.probation is not None else [])
    index = sum(t.index_keys.nbytes + t.index_slots.nbytes for t in tables)
    assert all(len(t.index_keys) == 15 for t in tables)
    assert spec.bytes_per_row() * 3 * 5 == sum(t.nbytes for t in state.values()) + index


def test_planning_md_shows_the_commands_output():
    """docs/planning.md's dynamic plan: its lines appear in the command's output, in
    order (the page leaves some out)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text()
    command = "embshard plan configs/dynamic.yaml -w 7 --memory-per-rank 6MiB"
    shown = page.split(f"`{command}`", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    result = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    output = iter(result.output.splitlines())
    lines = [line for line in shown.splitlines() if line != "..."]
    assert len(lines) > 10
    for line in lines:
        assert any(line == out for out in output), f"not in the output, in order: {line!r}"


@pytest.mark.parametrize(("text", "rate"), [("1.2e6", 1.2e6), ("3e5", 3e5), ("2.5E+4", 2.5e4)])
def test_a_rate_written_with_an_exponent_is_a_number(tmp_path, text: str, rate: float):
    """PyYAML (YAML 1.1) reads ``1.2e6`` as a string; a float field takes it."""
    path = tmp_path / "dynamic.yaml"
    path.write_text(
        Path("configs/dynamic.yaml").read_text() + f"topology: {{remap_rate: {text}}}\n"
    )
    assert topology_for(load_config(path, use="plan"), 2).remap_rate == rate


def test_a_rate_that_is_no_number_is_refused(tmp_path):
    path = tmp_path / "dynamic.yaml"
    path.write_text(Path("configs/dynamic.yaml").read_text() + "topology: {remap_rate: fast}\n")
    with pytest.raises(ConfigError, match="remap_rate: expected float, got 'fast'"):
        load_config(path, use="plan")
