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
from embshard.app.simulate import SimulationError, simulate
from embshard.planner.search import Topology

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
    path: str, world: int, user: list[int] | None = None
) -> tuple[dict[tuple[int, str], tuple[int, int, int, int]], dict[tuple[int, str], int]]:
    """Per (rank, table held): admitted, evicted, overflow and live ids of plain
    reference maps of the rank's buckets (the user table's: ``user``, its rows a rank,
    if given), fed every rank's ids of each batch; and the ids each remapped."""
    config = load_config(path, use="simulate")
    feeds = [Feed(build_data(config, rank, world)) for rank in range(world)]
    for feed in feeds:
        feed.next_epoch()
    batches = [[feed.take().sparse for _ in range(BATCHES)] for feed in feeds]
    blocks = {"user": user or [64] * (world - 1) + [256 - 64 * (world - 1)], "item": None}
    found, remapped = {}, {}
    for table in config.tables[:2]:
        spec = table.id_map(config.seed)
        rows = spec.rows_per_bucket
        sizes = blocks[table.name] or [0] * (world - 1) + [table.num_embeddings]
        starts = [sum(sizes[:r]) for r in range(world)]
        maps = {
            r: Reference(spec, starts[r] // rows, (starts[r] + sizes[r]) // rows)
            for r in range(world)
            if sizes[r]
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


def test_a_column_wise_table_counts_once_and_holds_a_map_a_block(tmp_path):
    """The user table in column blocks on ranks 1 and 0: rank 1's (the first block's)
    counts are those of one reference map of every bucket; each rank holds and
    remaps a whole map."""
    user = {"type": "column_wise", "ranks": [1, 0]}
    result = simulate(dynamic_config(tmp_path, 2, user), 2, batches=BATCHES)
    expected, remapped = reference_counts(dynamic_config(tmp_path, 2, user), 2, [0, 256])
    ranks = result.ranks
    assert [r.dynamic_rows for r in ranks] == [{}, {"user": 256, "item": 128}]
    counted = ranks[1].dynamic["user"]
    assert (counted.admitted, counted.evicted, counted.overflow, counted.live) == expected[
        (1, "user")
    ]
    assert ranks[0].dynamic["user"].live == 0  # its equal map counts nothing
    assert [r.id_maps["user"] for r in ranks] == [256 * 41, 256 * 41]
    rate = Topology.cpu(2).remap_rate
    assert ranks[0].remap_seconds == pytest.approx(
        remapped[(1, "user")] / rate / BATCHES, rel=1e-12
    )
    live = expected[(1, "user")][3]
    assert f"table user: {live} ids live of 256 rows" in result.to_text()


def test_the_id_maps_are_priced_per_rank(tmp_path):
    result = simulate(dynamic_config(tmp_path, 2), 2, batches=1)
    # 25 bytes a slot and 16 a live key's index entry; twice with probation (admit_after 2)
    assert result.ranks[0].id_maps == {"user": 64 * 41}
    assert result.ranks[1].id_maps == {"user": 192 * 41, "item": 128 * 82}


@pytest.mark.parametrize("world", [2, 4])
def test_the_streamed_mode_reports_the_maps_as_the_full_mode(tmp_path, world):
    assert_the_modes_agree(dynamic_config(tmp_path, world), world)


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
