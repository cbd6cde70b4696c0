"""``embshard simulate`` with dynamic tables: each rank's live ids, admissions and
evictions over the simulated batches, against test_id_map's plain reference map fed
the same batches (made by the job's data, whose raw ids are the input here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_id_map import Reference, ref_bucket, ref_key
from test_simulate import assert_the_modes_agree

from embshard.app.cli import main as cli
from embshard.app.config import load_config
from embshard.app.data import Feed, build_data
from embshard.app.sim_memory import MODES, MemoryNeed, input_need
from embshard.app.simulate import SimulationError, simulate
from embshard.planner.search import plan_loads
from embshard.planner.topology import Topology
from embshard.runtime.routes import build_routes

ROOT = Path(__file__).resolve().parents[1]
BATCHES = 6


def dynamic_config(tmp_path: Path, world: int, user_plan: dict | None = None) -> str:
    """configs/dynamic.yaml, small: buckets of 8 rows that fill within the batches,
    the user table row-wise with uneven bucket-aligned blocks (or as ``user_plan`` plans it),
    item table-wise on the last rank, evicting by LRU and by LFU after two sightings."""
    data = yaml.safe_load((ROOT / "configs" / "dynamic.yaml").read_text())
    data.update(batch_size=48)
    user, item = data["tables"][0], data["tables"][1]
    user.update(num_embeddings=256, dynamic={"buckets": 32, "policy": "lru"})
    item.update(num_embeddings=128, dynamic={"buckets": 16, "policy": "lfu", "admit_after": 2})
    data["data"]["drift"] = {"live_per_row": 2.0, "turnover_steps": 3}
    sizes = [64] * (world - 1) + [256 - 64 * (world - 1)]
    data["plan"] = {
        "user": user_plan or {"type": "row_wise", "sizes": sizes},
        "item": {"type": "table_wise", "rank": world - 1},
        **{t["name"]: {"type": "table_wise", "rank": 0} for t in data["tables"][2:]},
    }
    path = tmp_path / "dynamic.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def reference_counts(
    path: str, world: int, user: dict[int, tuple[int, int]] | None = None
) -> tuple[dict[tuple[int, str], tuple[int, int, int, int]], dict[tuple[int, str], int]]:
    """Per (rank, table held): admitted, evicted, overflow and live ids of plain
    reference maps of the rank's buckets (the user table's: ``user``, its rows
    ``[start, end)`` by rank, if given), fed every rank's ids of each batch; and the ids
    each remapped."""
    config = load_config(path, use="simulate")
    feeds = [Feed(build_data(config, rank, world)) for rank in range(world)]
    for feed in feeds:
        feed.next_epoch()
    batches = [[feed.take().sparse for _ in range(BATCHES)] for feed in feeds]
    starts = [64 * r for r in range(world)]
    blocks = {
        "user": user
        or {r: (s, 64 * (r + 1) if r < world - 1 else 256) for r, s in enumerate(starts)},
        "item": {world - 1: (0, 128)},
    }
    found, remapped = {}, {}
    for table in config.tables[:2]:
        spec = table.id_map(config.seed)
        rows = spec.rows_per_bucket
        maps = {
            r: Reference(spec, start // rows, end // rows)
            for r, (start, end) in blocks[table.name].items()
        }
        counts = {r: [0, 0, 0] for r in maps}
        for step in range(BATCHES):
            keys = [
                ref_key(raw)
                for rank in range(world)
                for feature in table.features
                for raw in batches[rank][step][feature].values().tolist()
            ]
            for r, ref in maps.items():
                mine = [k for k in keys if ref_bucket(k, spec.buckets) in ref.slots]
                remapped[(r, table.name)] = remapped.get((r, table.name), 0) + len(mine)
                _, admitted, evicted, overflow = ref.remap(mine, step)
                counts[r] = [a + b for a, b in zip(counts[r], (len(admitted), evicted, overflow))]
        for r, ref in maps.items():
            live = sum(e is not None for slots in ref.slots.values() for e in slots)
            found[(r, table.name)] = (*counts[r], live)
    return found, remapped


@pytest.mark.parametrize(
    ("world", "mode"), [(2, "full"), (3, "full"), (1, "streamed"), (3, "streamed")]
)
def test_ranks_report_their_dynamic_tables_as_the_reference_maps(tmp_path, world, mode):
    path = dynamic_config(tmp_path, world)
    result = simulate(path, world, batches=BATCHES, mode=mode)
    got = {
        (r.rank, name): (s.admitted, s.evicted, s.overflow, s.live)
        for r in result.ranks
        for name, s in r.dynamic.items()
        if name in r.dynamic_rows
    }
    expected, remapped = reference_counts(path, world)
    assert got == expected
    # Each rank's remaps are priced per id it remapped, the reference maps' ids.
    rate = Topology.cpu(world).remap_rate
    for r in result.ranks:
        ids = sum(remapped[(r.rank, name)] for name in r.dynamic_rows)
        assert r.remap_seconds == pytest.approx(ids / rate / BATCHES, rel=1e-12)
        assert r.remap_seconds > 0
    assert all(evicted for _, evicted, _, _ in expected.values())  # buckets filled
    report = result.to_dict()
    assert report["ranks"][world - 1]["dynamic_rows"] == {
        "item": 128,
        "user": 256 - 64 * (world - 1),
    }
    text = result.to_text()
    admitted, evicted, overflow, live = expected[(world - 1, "item")]
    row = rf"\n +{world - 1} item +{live} of 128 +{admitted} +{evicted} +{overflow} +10.2 KiB\n"
    assert re.search(row, text), text
    totals = [sum(v[i] for (r, n), v in expected.items() if n == "user") for i in range(4)]
    assert (
        f"table user: {totals[3]} ids live of 256 rows, {totals[0]} admitted, "
        f"{totals[1]} evicted, {totals[2]} overflowing"
    ) in text


# Column blocks of the user table at 3 ranks, each with the blocks every rank holds:
# (rank, first row, rows, columns), column block by column block.
COLUMN_WISE = {"type": "column_wise", "ranks": [1, 2, 1], "widths": [8, 4, 4]}
COLUMN_WISE_BLOCKS = [[(1, 0, 256, 8)], [(2, 0, 256, 4)], [(1, 0, 256, 4)]]
# Two column blocks, each row-wise over its own ranks, with other row cuts: rank 0 holds
# the first's top rows and the second's bottom ones, rank 2 the second's top 64 only.
GRID = {
    "type": "grid",
    "column_blocks": 2,
    "ranks": [[0, 1], [2, 0]],
    "sizes": [[128, 128], [64, 192]],
}
GRID_BLOCKS = [[(0, 0, 128, 8), (1, 128, 128, 8)], [(2, 0, 64, 8), (0, 64, 192, 8)]]


@pytest.mark.parametrize("mode", ["full", "streamed"])
@pytest.mark.parametrize(
    ("plan", "blocks"), [(COLUMN_WISE, COLUMN_WISE_BLOCKS), (GRID, GRID_BLOCKS)]
)
def test_every_rank_holding_a_column_block_reports_its_map_and_the_totals_count_once(
    tmp_path, mode, plan, blocks
):
    """Each rank's line is the map of the first column block it holds, equal to a
    reference map of that block's rows; a rank holding later blocks only is marked and
    left out of the totals, which are the first column block's."""
    path = dynamic_config(tmp_path, 3, plan)
    result = simulate(path, 3, batches=BATCHES, mode=mode)
    shown = {}  # rank: (first row, rows, whether a later block's)
    for column, held in enumerate(blocks):
        for rank, first, rows, _ in held:
            shown.setdefault(rank, (first, rows, column > 0))
    expected, remapped = reference_counts(
        path, 3, {r: (first, first + rows) for r, (first, rows, _) in shown.items()}
    )
    ranks = result.ranks
    assert {r.rank: r.dynamic_rows.get("user") for r in ranks if "user" in r.dynamic_rows} == {
        r: rows for r, (_, rows, _) in shown.items()
    }
    assert [r.dynamic_repeats for r in ranks] == [
        ["user"] if shown.get(r, (0, 0, False))[2] else [] for r in range(3)
    ]
    for r in ranks:
        if "user" in r.dynamic_rows:
            d = r.dynamic["user"]
            assert (d.admitted, d.evicted, d.overflow, d.live) == expected[(r.rank, "user")]
    text = result.to_text()
    for rank, (_, rows, later) in shown.items():
        admitted, evicted, overflow, live = expected[(rank, "user")]
        name = r"user\*" if later else "user "
        row = rf"\n +{rank} {name} +{live} of {rows} +{admitted} +{evicted} +{overflow} +"
        assert re.search(row, text), text
    first = [expected[(r, "user")] for r, (_, _, later) in shown.items() if not later]
    totals = [sum(v[i] for v in first) for i in range(4)]
    assert (
        f"table user: {totals[3]} ids live of 256 rows, {totals[0]} admitted, "
        f"{totals[1]} evicted, {totals[2]} overflowing"
    ) in text
    # Every block's map remaps its rows' keys: a rank's remaps price them all.
    ids = [remapped[(2, "item")] if r == 2 else 0 for r in range(3)]
    for held in blocks:
        _, column = reference_counts(path, 3, {r: (first, first + n) for r, first, n, _ in held})
        for rank, *_ in held:
            ids[rank] += column[(rank, "user")]
    rate = Topology.cpu(3).remap_rate
    for r in ranks:
        assert r.remap_seconds == pytest.approx(ids[r.rank] / rate / BATCHES, rel=1e-12)


def plain_memory(path: str, blocks: list[list[tuple[int, int, int, int]]]) -> list[int]:
    """Per rank of 3: 4 bytes a value of its blocks' weights, row-wise Adagrad's float a
    row, and an id map over each block's rows (the user table's 25 bytes a slot and 16
    an index entry; item's twice that, with probation), item whole on rank 2 and the
    static tables on rank 0."""
    static = [t for t in load_config(path, use="simulate").tables if not t.dynamic]
    held = [(r, rows, cols, 41) for column in blocks for r, _, rows, cols in column]
    held += [(2, 128, 16, 82)] + [(0, t.num_embeddings, t.embedding_dim, 0) for t in static]
    memory = [0, 0, 0]
    for rank, rows, cols, map_bytes in held:
        memory[rank] += 4 * rows * cols + 4 * rows + map_bytes * rows
    return memory


def simulation_need(path: str, mode: str) -> MemoryNeed:
    """``simulate``'s memory estimate for the config's plan at 3 ranks."""
    config = load_config(path, use="simulate")
    configs = config.embedding_bag_configs()
    tables = config.sharding_plan().resolve(configs, 3)
    buckets = {n: (s.buckets, s.rows_per_bucket) for n, s in config.id_maps().items()}
    routes = build_routes(configs, tables, 3, weighted=False, dynamic=buckets)
    return input_need(config, tables, routes, mode, BATCHES)


@pytest.mark.parametrize(
    ("plan", "blocks"), [(COLUMN_WISE, COLUMN_WISE_BLOCKS), (GRID, GRID_BLOCKS)]
)
def test_every_rank_holding_a_column_block_holds_a_map_of_its_rows(tmp_path, plan, blocks):
    """Each rank's memory, and the simulation's own estimate, count an id map on
    every rank that holds a block, over that block's rows; the planner prices the
    same bytes."""
    path = dynamic_config(tmp_path, 3, plan)
    result = simulate(path, 3, batches=1)
    memory = [r.weights + r.optimizer_state + sum(r.id_maps.values()) for r in result.ranks]
    assert memory == plain_memory(path, blocks)
    config = load_config(path, use="simulate")
    loads = plan_loads(
        config.sharding_plan(),
        config.tables,
        Topology.cpu(3),
        config.batch_size,
        config.sparse_optimizer.type,
        dynamic=config.id_maps(),
    )
    assert [load.memory for load in loads] == memory
    # Against the user table whole on one rank (one map of its 256 rows), the estimate
    # adds each further block's map, and as much again for the remap's sorts.
    (tmp_path / "whole").mkdir()
    whole = dynamic_config(tmp_path / "whole", 3, {"type": "table_wise", "rank": 0})
    maps = sum(41 * rows for column in blocks for _, _, rows, _ in column)
    for mode in MODES:
        added = simulation_need(path, mode).fixed - simulation_need(whole, mode).fixed
        assert added == 2 * (maps - 41 * 256), mode


def test_the_id_maps_are_priced_per_rank(tmp_path):
    result = simulate(dynamic_config(tmp_path, 2), 2, batches=1)
    # 25 bytes a slot and 16 a live key's index entry; twice with probation (admit_after 2)
    assert result.ranks[0].id_maps == {"user": 64 * 41}
    assert result.ranks[1].id_maps == {"user": 192 * 41, "item": 128 * 82}


@pytest.mark.parametrize("world", [2, 4])
def test_the_streamed_mode_reports_the_maps_as_the_full_mode(tmp_path, world):
    assert_the_modes_agree(dynamic_config(tmp_path, world), world)


@pytest.mark.parametrize("plan", [COLUMN_WISE, GRID])
def test_the_modes_agree_on_a_table_in_column_blocks(tmp_path, plan):
    assert_the_modes_agree(dynamic_config(tmp_path, 3, plan), 3)


def test_sharding_groups_are_refused_in_one_line(tmp_path):
    message = "dynamic tables (item, user) are simulated without sharding groups"
    with pytest.raises(SimulationError, match=re.escape(message)):
        simulate(dynamic_config(tmp_path, 2), 4, batches=1, group_size=2)


def test_check_is_refused_in_one_line(tmp_path):
    path = dynamic_config(tmp_path, 2)
    message = "dynamic tables (item, user) are simulated without --check"
    out = CliRunner().invoke(cli, ["simulate", path, "-w", "2", "--batches", "1", "--check"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert message in out.output and out.output.count("\n") == 1
    with pytest.raises(SimulationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate(path, 2, batches=1, check=True)
