"""Planning from measured traffic: lookup-balanced row cuts, and plans whose ranks
receive about the same number of lookups on power-law ids."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from embshard.config import load_config
from embshard.planner import PlanningError, plan_config
from embshard.traffic import TableTraffic, TrafficStats, balanced_sizes, measure_traffic
from embshard.train import build_data

ROOT = Path(__file__).resolve().parents[1]


def _lookups(counts: np.ndarray, sizes: list[int]) -> list[int]:
    edges = np.concatenate([[0], np.cumsum(sizes)])
    return [int(counts[lo:hi].sum()) for lo, hi in itertools.pairwise(edges)]


@pytest.mark.parametrize("pieces", [2, 3, 4, 7])
def test_cuts_equalize_lookups_within_a_row(pieces):
    rng = np.random.default_rng(0)
    rows = 1000
    dense = np.zeros(rows, dtype=np.int64)
    dense[:100] = rng.integers(1, 50, 100)  # every lookup in the first 10 % of rows
    ids = np.flatnonzero(dense)
    sizes = balanced_sizes(TableTraffic(rows, ids, dense[ids], 1, 1), pieces)
    assert sum(sizes) == rows and min(sizes) >= 0 and len(sizes) == pieces
    mean = dense.sum() / pieces
    for got in _lookups(dense, sizes):
        assert abs(got - mean) <= dense.max()  # within one row's lookups of even
    assert sizes[-1] >= rows - 100  # the cold rows go to the last block


def test_cuts_of_a_table_with_one_hot_row_and_without_lookups():
    hot = TableTraffic(10, np.array([0, 5]), np.array([900, 100]), 1, 1)
    sizes = balanced_sizes(hot, 4)
    assert sum(sizes) == 10 and min(sizes) >= 0
    # cuts nearest 250, 500, 750 of the 1000 lookups: before row 0, after it, after it
    assert sizes == [0, 1, 0, 9]
    cold = TableTraffic(10, np.zeros(0, np.int64), np.zeros(0, np.int64), 1, 1)
    assert balanced_sizes(cold, 4) == [3, 3, 2, 2]


def _row_wise_config(tmp_path):
    """One power-law table, row-wise, pooled enough that lookups outweigh the bags
    every row block receives: the planner splits it over all ranks."""
    config = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    config["tables"] = [
        {**t, "shardings": ["row_wise"], "mean_pooling": 40}
        for t in config["tables"]
        if t["name"] == "user"
    ]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return load_config(tmp_path / "c.yaml")


def _rank_lookups(plan, config, world: int, batches: int, ranks: int) -> np.ndarray:
    """Ids each rank receives, counted from the batches and the plan's shards."""
    shards = plan.resolve(config.embedding_bag_configs(), world)
    table_of = {f: t.name for t in config.tables for f in t.features}
    received = np.zeros(world)
    for rank in range(ranks):
        data = build_data(config, rank, world)
        for step in range(batches):
            for feature, jagged in data.batch(step).sparse.to_dict().items():
                ids = jagged.values()
                for s in shards[table_of[feature]].shards:
                    inside = (ids >= s.row_offset) & (ids < s.row_offset + s.rows)
                    received[s.rank] += int(inside.sum())
    return received


def test_a_plan_from_traffic_balances_the_lookups_ranks_receive(tmp_path):
    config, world = _row_wise_config(tmp_path), 8
    stats = measure_traffic(config, world, batches=2, ranks=2)
    even, _ = plan_config(config, world)
    aware, _ = plan_config(config, world, stats=stats)
    before = _rank_lookups(even, config, world, 2, 2)
    after = _rank_lookups(aware, config, world, 2, 2)
    assert after.sum() == before.sum() == sum(t.lookups for t in stats.tables.values())
    assert before.max() / before.mean() > 3  # power-law ids: an even cut is far off
    assert after.max() / after.mean() <= 1.1


def test_traffic_of_another_table_shape_is_refused(tmp_path):
    config = _row_wise_config(tmp_path)
    wrong = TableTraffic(7, np.array([1]), np.array([1]), 1, 1)
    with pytest.raises(PlanningError, match="traffic stats do not match the tables"):
        plan_config(config, 2, stats=TrafficStats({"user": wrong}))


def test_plan_command_cuts_hot_rows_from_measured_batches(tmp_path):
    from click.testing import CliRunner

    from embshard.cli import main as cli

    # The 40M-row table kept row-wise: the planner would rather cut it into columns.
    text = (Path(__file__).resolve().parents[1] / "configs" / "criteo_1tb.yaml").read_text()
    marker = "features: [cat_20], mean_pooling: 100"
    assert marker in text
    config = tmp_path / "criteo_1tb.yaml"
    config.write_text(text.replace(marker, marker + ", shardings: [row_wise]"))
    config = str(config)
    even = CliRunner().invoke(cli, ["plan", config, "-w", "8", "--json"])
    measured = CliRunner().invoke(cli, ["plan", config, "-w", "8", "--batches", "2", "--json"])
    assert even.exit_code == 0 and measured.exit_code == 0, measured.output
    even_spec = json.loads(even.output)["plan"]["tables"]["t_cat_20"]
    spec = json.loads(measured.output)["plan"]["tables"]["t_cat_20"]
    assert spec["type"] == "row_wise" and spec != even_spec
    # Low ids are hot: the first block holds far fewer rows than an even share.
    sizes = [s for s in spec["sizes"] if s]
    assert sizes[0] * 10 < sum(sizes) / len(sizes)
