"""Plans across hosts: traffic priced by where it goes, host grids, the job's ranks per
host, and simulate's bytes inside and across hosts."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from torchrec import EmbeddingBagConfig

from embshard import ShardingPlan, Topology, grid, plan_tables
from embshard.app.config import load_config
from embshard.app.data import Feed, build_data
from embshard.app.simulate import simulate
from embshard.planner.cost import CostModel
from embshard.planner.search import plan_loads, plan_report
from embshard.planner.tables import PlannedTable
from embshard.planner.traffic import TableTraffic, TrafficStats

ROOT = Path(__file__).resolve().parent.parent


def test_bytes_are_priced_by_the_host_they_go_to():
    """Two hosts of 4: a shard's bytes go to every rank alike, half of them (its own
    host's 4 ranks, itself among them) inside, the rest across; one message to each
    other rank."""
    topology = Topology.gpu(8, ranks_per_host=4)
    assert topology.seconds_per_byte() == pytest.approx(0.5 / 370e9 + 0.5 / 45e9)
    assert topology.collective_latency() == pytest.approx(3 * 5e-6 + 4 * 10e-6)
    # A whole table: every rank's 64 samples send 3 ids and a bag length, and get a
    # 32-float row back and send its gradient.
    table = PlannedTable("t", 1000, 32, bags_per_sample=1, ids_per_sample=3.0)
    moved = 8 * 64 * (3 * 8 + 8 + 2 * 32 * 4)  # every rank's, one eighth each
    lookup = 8 * 64 * 3 * 32 * 4 * 3 / 1e12
    inside, across = moved * 4 / 8, moved * 4 / 8
    expected = lookup + inside / 370e9 + across / 45e9
    assert CostModel(topology, 64).whole_cost(table) == pytest.approx(expected)


@pytest.mark.parametrize("make", [Topology.cpu, Topology.gpu])
def test_one_host_prices_as_before(make):
    """A world on one host: every byte inside at the intra bandwidth."""
    topology = make(8, ranks_per_host=8)
    assert topology.host_ranks(0) == range(8)
    assert topology.seconds_per_byte() == 1 / topology.intra_bandwidth
    assert topology.collective_latency() == 7 * topology.intra_latency


def power_law_traffic(rows: int, ids: int, samples: int, seed: int = 0) -> TableTraffic:
    """Ids drawn as the synthetic data draws them: ``floor(rows ** u)``, low ids hot."""
    drawn = np.floor(rows ** np.random.default_rng(seed).random(ids)).astype(np.int64) - 1
    found, counts = np.unique(np.clip(drawn, 0, rows - 1), return_counts=True)
    return TableTraffic(rows, found, counts, samples, samples)


def heavy_tables() -> tuple[list[EmbeddingBagConfig], TrafficStats]:
    """A t_cat_20-like table (100 ids a bag, skewed) and some small ones."""
    tables = [EmbeddingBagConfig(num_embeddings=2_000_000, embedding_dim=128, name="heavy",
                                 feature_names=["h"])]  # fmt: skip
    tables += [
        EmbeddingBagConfig(num_embeddings=5000 * (i + 1), embedding_dim=128, name=f"s{i}",
                           feature_names=[f"f{i}"])
        for i in range(6)
    ]  # fmt: skip
    samples = 2048
    stats = {"heavy": power_law_traffic(2_000_000, 100 * samples, samples)}
    for i, t in enumerate(tables[1:]):
        stats[t.name] = power_law_traffic(t.num_embeddings, 2 * samples, samples, seed=i + 1)
    return tables, TrafficStats(stats)


def test_two_hosts_get_a_host_grid_priced_below_the_flat_plan():
    """On 2 hosts of 8 the planner cuts the heavy table into column blocks each
    row-split over one host's ranks by its measured lookups, and that plan's slowest
    rank is below the one the planner makes for the same ranks as one host."""
    tables, stats = heavy_tables()
    hosts = Topology.gpu(16, ranks_per_host=8)
    plan, report = plan_tables(tables, hosts, 1024, stats=stats)
    spec = plan.tables["heavy"]
    assert spec.KIND == "grid"
    for group in spec.ranks:
        assert len(group) == 8 and len({rank // 8 for rank in group}) == 1
    # the rows cut so each block gets an eighth of the measured lookups
    traffic = stats.tables["heavy"]
    for sizes in spec.sizes:
        edges = np.cumsum([0, *sizes])
        shares = [traffic.share(int(a), int(b - a)) for a, b in itertools.pairwise(edges)]
        assert max(shares) < 0.25
    assert report.lower_bound * (1 - 1e-9) <= report.slowest
    flat, _ = plan_tables(tables, Topology.gpu(16, ranks_per_host=16), 1024, stats=stats)
    assert "grid" not in {s.KIND for s in flat.tables.values()}

    def slowest(p: ShardingPlan) -> float:
        return max(load.cost for load in plan_loads(p, tables, hosts, 1024, stats=stats))

    assert slowest(plan) == pytest.approx(report.slowest, rel=1e-9)
    assert slowest(plan) < slowest(flat)
    given = plan_report(plan, tables, hosts, 1024, "rowwise_adagrad", "given", stats)
    assert given.lower_bound * (1 - 1e-9) <= given.slowest
    # An even grid of the same blocks loads each host's first rank with the hot rows.
    even = ShardingPlan(plan.tables | {"heavy": grid(spec.column_blocks, spec.ranks)})
    assert slowest(even) > slowest(plan)


def test_one_host_or_no_measured_traffic_proposes_no_grid():
    tables, stats = heavy_tables()
    one_host = plan_tables(tables, Topology.gpu(8), 1024, stats=stats)[0]
    unmeasured = plan_tables(tables, Topology.gpu(16), 1024)[0]
    for plan in (one_host, unmeasured):
        assert "grid" not in {s.KIND for s in plan.tables.values()}


def local_world_size_from_rank() -> str:
    """Rank 0 says its host has 2 ranks, rank 1 that its has 1."""
    import torch.distributed as dist

    from embshard.app.train import TrainingError, job_ranks_per_host

    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(2 - dist.get_rank())
    try:
        job_ranks_per_host()
    except TrainingError as e:
        return str(e)
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before
    return "no error"


def same_local_world_size() -> int | None:
    from embshard.app.train import job_ranks_per_host

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        return job_ranks_per_host()
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def test_local_world_size_must_agree_on_every_rank(world):
    expected = (
        "LOCAL_WORLD_SIZE must be the same on every host (the planner's ranks per host), "
        "got 2 on ranks [0]; 1 on ranks [1]"
    )
    assert world(2).run(local_world_size_from_rank) == [expected, expected]
    assert world(2).run(same_local_world_size) == [2, 2]


def test_ranks_per_host_from_the_command_line_then_the_config_then_the_kind(tmp_path):
    from embshard.app.planning import topology_for

    small = load_config(ROOT / "configs" / "small.yaml")  # kind: cpu, no ranks_per_host
    assert topology_for(small, 8).ranks_per_host == 8
    assert topology_for(small, 8, ranks_per_host=4).ranks_per_host == 4
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data["topology"] = {"kind": "cpu", "ranks_per_host": 2}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert topology_for(load_config(path), 8).ranks_per_host == 2
    assert topology_for(load_config(path), 8, ranks_per_host=4).ranks_per_host == 4


def test_simulate_splits_bytes_by_host(tmp_path):
    """4 ranks as 2 hosts of 2, every table whole: each rank's ids, pooled rows and
    gradients to and from the other host, counted here from every rank's batches and
    the plan (a rank sends an owner, for each feature of its table, its bags' lengths
    and ids, int32 under 2**31 rows; the owner sends back a row of the table's width a
    bag)."""
    world, batches = 4, 2
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(batch_size=16)
    owners = {t["name"]: i % world for i, t in enumerate(data["tables"])}
    data["plan"] = {name: {"type": "table_wise", "rank": r} for name, r in owners.items()}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    result = simulate(str(path), world, batches=batches, ranks_per_host=2)
    assert result.ranks_per_host == 2
    config = load_config(path)
    feeds = [Feed(build_data(config, r, world)) for r in range(world)]
    for feed in feeds:
        feed.next_epoch()
    ids_sent, ids_received = [0] * world, [0] * world
    pooled_sent, pooled_received = [0] * world, [0] * world
    for _ in range(batches):
        sparse = [feed.take().sparse for feed in feeds]
        for t in config.tables:
            owner = owners[t.name]
            for q in range(world):
                if q // 2 == owner // 2:
                    continue
                for feature in t.features:
                    jagged = sparse[q][feature]
                    payload = 4 * (jagged.lengths().numel() + jagged.values().numel())
                    ids_sent[q] += payload
                    ids_received[owner] += payload
                    rows = 4 * jagged.lengths().numel() * t.embedding_dim
                    pooled_sent[owner] += rows
                    pooled_received[q] += rows
    for r, report in enumerate(result.ranks):
        assert (report.ids_across.sent, report.ids_across.received) == (
            ids_sent[r],
            ids_received[r],
        )
        assert report.pooled_across.sent == pooled_sent[r]
        assert report.pooled_across.received == pooled_received[r]
        assert report.across.sent == ids_sent[r] + pooled_sent[r] + pooled_received[r]
        assert report.inside.both + report.across.both == (
            report.ids.both + report.pooled.both + report.pooled_grad.both
        )
    text = result.to_text()
    assert "4 ranks, 2 hosts of 2" in text and "across hosts" in text
    assert set(result.to_dict()["ranks"][0]) >= {"inside", "across"}
