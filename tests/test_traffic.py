"""Planning from measured traffic: lookup-balanced row cuts, the hot rows no cut can
balance, and plans whose ranks receive about the same number of lookups on power-law
ids."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torchrec import EmbeddingBagConfig

from embshard import ShardingPlan, row_wise
from embshard.app.config import load_config
from embshard.app.data import build_data, power_law_ids
from embshard.app.planning import measure_traffic, plan_config
from embshard.app.simulate import simulate
from embshard.errors import PlanningError
from embshard.planner.search import plan_loads, plan_tables
from embshard.planner.tables import TableConstraint
from embshard.planner.topology import Topology
from embshard.planner.traffic import (
    TableTraffic,
    TrafficStats,
    balanced_plan,
    balanced_sizes,
    hot_rows,
    spread_blocks,
)

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

    from embshard.app.cli import main as cli

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


def _power_law_stats(name: str, rows: int, ids: int, samples: int) -> TrafficStats:
    drawn = power_law_ids(rows, ids, torch.Generator().manual_seed(0)).numpy()
    found, counts = np.unique(drawn, return_counts=True)
    return TrafficStats({name: TableTraffic(rows, found, counts, samples, samples)})


def test_hot_rows_are_the_fewest_that_let_a_cut_balance_the_rest():
    traffic = _power_law_stats("t", 7_000_000, 400_000, 4096).tables["t"]
    hot = hot_rows(traffic, 64)
    assert 0 < hot < 100  # a handful of rows hold a quarter of the lookups
    sizes = balanced_sizes(traffic, 64, hot)
    assert sum(sizes) == traffic.num_embeddings - hot
    shares = [traffic.share(o, n) for o, n in zip(hot + np.cumsum([0, *sizes[:-1]]), sizes)]
    assert max(shares) / np.mean(shares) <= 1.1
    plain = balanced_sizes(traffic, 64)
    shares = [traffic.share(o, n) for o, n in zip(np.cumsum([0, *plain[:-1]]), plain)]
    assert max(shares) / np.mean(shares) > 2  # row 1 alone is 4 % of the lookups
    # One row fewer leaves a row too hot for a 64th of the rest.
    left = traffic.share(hot - 1, traffic.num_embeddings - hot + 1)
    assert traffic.share(hot - 1, 1) > 0.1 * left / 64
    assert hot_rows(traffic, 1) == 0
    tiny = _power_law_stats("t", 10, 10_000, 100).tables["t"]
    assert hot_rows(tiny, 64) == 10  # only a whole copy balances 10 rows over 64 ranks


def test_the_planner_copies_hot_rows_where_that_lowers_the_slowest_rank():
    # 1M rows, 50 ids a bag, row-wise over 64 CPU ranks: no cut balances the hot rows.
    world, batch = 64, 1024
    config = EmbeddingBagConfig(name="t", num_embeddings=1_000_000, embedding_dim=64,
                                feature_names=["f"])  # fmt: skip
    stats = _power_law_stats("t", config.num_embeddings, world * batch * 50 // 8, world * 128)
    topology = Topology.cpu(world)
    only_row_wise = {"t": TableConstraint(("row_wise",))}
    plan, report = plan_tables([config], topology, batch, only_row_wise, stats=stats)
    spec = plan.tables["t"]
    assert 0 < spec.hot_rows < 100
    assert report.tables[0].reason.endswith(
        f", and copying its {spec.hot_rows} hot rows to every rank lowers the slowest rank"
    )
    loads = plan_loads(plan, [config], topology, batch, stats=stats)
    assert [r.cost for r in report.ranks] == [r.cost for r in loads]
    assert report.tables[0].pieces == sum(1 for rows in spec.sizes if rows)
    assert report.lower_bound <= report.slowest
    traffic = stats.tables["t"]
    uncopied = ShardingPlan({"t": row_wise(balanced_sizes(traffic, world))})
    assert report.slowest < max(r.cost for r in plan_loads(uncopied, [config], topology, batch,
                                                           stats=stats))  # fmt: skip


@pytest.mark.parametrize("world_size", [8, 64])
def test_a_balanced_plan_gives_every_rank_its_share_of_the_lookups(tmp_path, world_size):
    # Criteo 1TB's tables on the synthetic power-law ids, simulated: the lookups each
    # rank makes (ids received, and its own batch's in the copies) within 10 % of the
    # mean rank's. Cut by traffic without copies, that holds at 8 ranks, but at 64 the
    # ranks holding the hottest rows get far more.
    path = str(ROOT / "configs" / "criteo_1tb.yaml")
    stats = measure_traffic(load_config(path), world_size, batches=2)
    plans = {
        "balanced": balanced_plan(stats, world_size),
        "cut": ShardingPlan(
            {n: row_wise(balanced_sizes(t, world_size)) for n, t in stats.tables.items()}
        ),
    }
    spread = {}
    for name, plan in plans.items():
        plan.save(tmp_path / f"{name}.yaml")
        ranks = simulate(path, world_size, str(tmp_path / f"{name}.yaml"), batches=1).ranks
        lookups = np.array([r.ids_received + r.ids_local for r in ranks])
        spread[name] = lookups.max() / lookups.mean()
    assert spread["balanced"] <= 1.1, spread
    assert spread["cut"] > (1.5 if world_size == 64 else 1.0), spread


def test_blocks_spread_largest_first_onto_the_ranks_holding_least():
    held = [0.0, 5.0, 0.0]
    assert spread_blocks([1.0, 2.0, 10.0], held) == [1, 2, 0]
    assert held == [10.0, 6.0, 2.0]
    assert spread_blocks([5.0, 1.0], [0.0, 0.0]) is None  # rank order


def test_plan_command_balances_lookups_where_the_plan_fits(tmp_path):
    from click.testing import CliRunner

    from embshard.app.cli import main as cli

    config = str(ROOT / "configs" / "criteo_1tb.yaml")
    args = ["plan", config, "-w", "64", "--batches", "2", "--balance-lookups", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    specs = out["plan"]["tables"].values()
    assert {s["type"] for s in specs} == {"row_wise", "data_parallel"}
    assert any(s.get("hot_rows") for s in specs)
    reasons = {t["reason"] for t in out["report"]["tables"]}
    assert reasons == {"--balance-lookups balances every rank's lookups"}
    # At 8 ranks the cold rows of the five 40M-row tables make five blocks of 16 GiB:
    # in rank order all on rank 7 (84.5 GiB), spread they fit.
    result = CliRunner().invoke(cli, [*args[:3], "8", *args[4:]])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["report"]
    usable = report["memory_per_rank"] - report["reserved_memory"]
    assert max(r["memory"] for r in report["ranks"]) < usable / 3
    result = CliRunner().invoke(cli, [*args[:3], "8", *args[4:], "--memory-per-rank", "16GiB"])
    assert result.exit_code == 1
    assert (
        "the lookup-balanced plan does not fit: rank 0 needs 16.6 GiB of 12.0 GiB" in result.output
    )
    result = CliRunner().invoke(cli, ["plan", config, "-w", "8", "--balance-lookups"])
    assert result.exit_code == 1 and "--balance-lookups needs the traffic" in result.output
