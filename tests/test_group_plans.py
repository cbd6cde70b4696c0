"""The planner on sharding groups (2-D): each rank's all-reduce over the replicas
priced in its cost, the memory of its float32 buffer, the group size it chooses, and
the ``plan`` command's and the config's ``sharding_group_size``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml
from click.testing import CliRunner
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import embshard
from embshard import (
    ShardingPlan,
    Topology,
    column_wise,
    data_parallel,
    plan_tables,
    row_wise,
    table_wise,
)
from embshard import checkpoint as ckpt
from embshard.app.cli import main as cli
from embshard.app.config import load_config
from embshard.app.planning import plan_config, plan_job, topology_for
from embshard.app.train import train
from embshard.errors import ConfigError, PlanningError
from embshard.modules.mesh import sharding_mesh
from embshard.planner.groups import group_topology, replicated, sync_bytes
from embshard.planner.search import plan_report

ROOT = Path(__file__).resolve().parent.parent


def bag(name: str, rows: int, dim: int) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=name,
                              feature_names=[f"f_{name}"])  # fmt: skip


def write_config(tmp_path: Path, rows: int, topology: dict, **extra) -> Path:
    """4 tables of ``rows`` x 16, row-wise Adagrad, 64 samples a rank."""
    data = {
        "tables": [
            {"name": f"t{i}", "num_embeddings": rows, "embedding_dim": 16, "features": [f"f{i}"]}
            for i in range(4)
        ],
        "batch_size": 64,
        "topology": {"kind": "cpu", **topology},
    } | extra
    path = tmp_path / "groups.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("ranks_per_host", "across"), [(2, True), (4, True), (8, False)], ids=["2", "4", "8"]
)
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad"])
def test_each_rank_pays_a_ring_all_reduce_of_its_shards_and_state(
    ranks_per_host, across, optimizer
):
    """8 ranks as 4 groups of 2: each rank's cost is its cost in the group's plan plus
    a ring all-reduce over 4 replicas of its shards' weights and optimizer state as
    float32, across hosts where a replica is on another host."""
    tables = [bag("a", 300, 16), bag("b", 1001, 8), bag("c", 40, 12)]
    plan = ShardingPlan({"a": table_wise(0), "b": row_wise(), "c": data_parallel()})
    job = Topology.cpu(8, ranks_per_host=ranks_per_host, inter_bandwidth=1e8)
    group = group_topology(job, 2)
    alone = plan_report(plan, tables, group, 64, optimizer, "given")
    report = replicated(plan, alone, tables, job, optimizer)

    def state(rows: int, cols: int) -> int:  # float32 values the optimizer keeps
        return rows if optimizer == "rowwise_adagrad" else rows * cols

    shards = {  # rank: (rows, cols) of each shard it holds
        0: [(300, 16), (501, 8), (40, 12)],
        1: [(500, 8), (40, 12)],
    }
    bandwidth, latency = (
        (job.inter_bandwidth, job.inter_latency)
        if across
        else (job.intra_bandwidth, job.intra_latency)
    )
    for rank, held in shards.items():
        nbytes = sum(4 * (rows * cols + state(rows, cols)) for rows, cols in held)
        sync = 2 * 3 / 4 * nbytes / bandwidth + 2 * 3 * latency
        assert report.group.sync_bytes[rank] == nbytes
        assert report.group.sync[rank] == pytest.approx(sync, rel=1e-12)
        assert report.ranks[rank].cost == pytest.approx(alone.ranks[rank].cost + sync, rel=1e-12)
        assert report.ranks[rank].memory == alone.ranks[rank].memory
    assert report.group.across_hosts is across
    assert (report.group.size, report.group.replicas) == (2, 4)
    assert "all-reduce" in report.to_text()


def test_auto_picks_a_host_where_the_tables_are_small_and_links_across_hosts_slow(tmp_path):
    """Small tables, a slow link across hosts: a host's group keeps the all-to-alls
    inside it, and averaging its few rows over the link costs less."""
    path = write_config(tmp_path, 50, {"ranks_per_host": 2, "inter_bandwidth": 1e6})
    config = load_config(path, use="plan")
    plan, report = plan_job(config, 8, group_size="auto")
    assert report.group.size == 2
    assert [c.size for c in report.group.candidates] == [8, 4, 2]  # the world, whole hosts
    steps = {c.size: c.step for c in report.group.candidates}
    flat = plan_config(config, 8)[1]
    assert steps[8] == pytest.approx(flat.slowest + flat.base_cost, rel=1e-12)
    assert steps[2] == pytest.approx(report.slowest + report.base_cost, rel=1e-12)
    assert steps[2] < min(steps[4], steps[8])
    # the group's plan is the planner's for 2 ranks on one host
    alone = plan_tables(config.tables, group_topology(topology_for(config, 8), 2), 64)[0]
    assert plan.to_yaml() == alone.to_yaml()


def test_auto_keeps_one_group_where_averaging_the_tables_costs_more(tmp_path):
    """Big tables: their all-reduce costs more than the all-to-alls it would save, and
    the plan is the 1-D one, byte for byte."""
    path = write_config(tmp_path, 2_000_000, {"ranks_per_host": 2, "inter_bandwidth": 1e9})
    config = load_config(path, use="plan")
    plan, report = plan_job(config, 8, group_size="auto")
    flat_plan, flat = plan_config(config, 8)
    assert report.group.size == 8 and report.group.replicas == 1
    assert plan.to_yaml() == flat_plan.to_yaml()
    assert report.slowest == flat.slowest
    steps = {c.size: c.step for c in report.group.candidates}
    assert min(steps, key=steps.get) == 8
    # one group of every rank, asked for or the config's, is plan_config's own
    for size in (None, 8):
        assert plan_job(config, 8, group_size=size)[0].to_yaml() == flat_plan.to_yaml()
        assert plan_job(config, 8, group_size=size)[1].group is None


def test_a_group_whose_copies_and_buffer_do_not_fit_is_refused(tmp_path):
    """4 tables of 4M x 16 (256 MB of weights and 16 MB of state each) on 1 GiB ranks
    (896 MiB usable): in groups of 8 or 4 they fit; in groups of 2 a rank's two tables
    (518.8 MiB) fit, but not with the float32 buffer the all-reduce copies them into."""
    path = write_config(tmp_path, 4_000_000, {"ranks_per_host": 2, "memory_per_rank": "1GiB"})
    config = load_config(path, use="plan")
    message = (
        r"sharding groups of 2: rank \d needs 518.8 MiB of shards and state and 518.8 MiB "
        r"of float32 all-reduce buffer, more than its 896.0 MiB usable"
    )
    with pytest.raises(PlanningError, match=message):
        plan_job(config, 8, group_size=2)
    report = plan_job(config, 8, group_size="auto")[1]
    refused = {c.size: c.problem for c in report.group.candidates if c.step is None}
    assert list(refused) == [2] and re.match(message, refused[2])
    assert "G=2: does not fit" in report.to_text()


def test_plan_command_prints_and_writes_the_choice(tmp_path):
    path = write_config(tmp_path, 50, {"ranks_per_host": 2, "inter_bandwidth": 1e6})
    out = tmp_path / "plan.yaml"
    args = ["plan", str(path), "-w", "8", "--sharding-group-size", "auto"]
    result = CliRunner().invoke(cli, [*args, "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    group = json.loads(result.output)["report"]["sharding_group"]
    assert (group["size"], group["replicas"], group["sync_across_hosts"]) == (2, 4, True)
    assert [c["size"] for c in group["candidates"]] == [8, 4, 2]
    assert len(group["sync_s"]) == 2
    config = load_config(path, use="plan")
    assert out.read_text() == plan_job(config, 8, group_size="auto")[0].to_yaml()
    text = CliRunner().invoke(cli, args).output
    assert "4 sharding groups of 2 in 8 ranks" in text
    assert "chosen as the lowest step (slowest rank + base) of G=8: " in text
    # the config's own sharding_group_size, when the command gives none
    own = write_config(
        tmp_path, 50, {"ranks_per_host": 2, "inter_bandwidth": 1e6}, sharding_group_size=4
    )
    assert (
        "2 sharding groups of 4 in 8 ranks"
        in CliRunner().invoke(cli, ["plan", str(own), "-w", "8"]).output
    )


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("0", "'0' is neither a whole number of at least 1 nor auto"),
        ("two", "'two' is neither a whole number of at least 1 nor auto"),
        ("3", "sharding group size 3 does not divide the 8 ranks"),
    ],
)
def test_plan_command_refuses_bad_group_sizes_in_one_line(tmp_path, value, problem):
    path = write_config(tmp_path, 50, {})
    result = CliRunner().invoke(cli, ["plan", str(path), "-w", "8", "--sharding-group-size", value])
    assert result.exit_code != 0
    assert problem in result.output and "Traceback" not in result.output


def test_plan_command_names_the_configs_group_size_the_world_cannot_take(tmp_path):
    path = write_config(tmp_path, 50, {}, sharding_group_size=4)
    result = CliRunner().invoke(cli, ["plan", str(path), "-w", "6"])
    assert result.exit_code != 0
    assert f"{path}.sharding_group_size: 4 does not divide the job's 6 ranks" in result.output


@pytest.mark.parametrize(
    ("value", "problem"),
    [("many", "expected int or 'auto', got 'many'"), (0, "must be at least 1")],
)
def test_config_group_size_is_a_number_or_auto(tmp_path, value, problem):
    path = write_config(tmp_path, 50, {}, sharding_group_size=value)
    with pytest.raises(ConfigError, match=re.escape(f"{path}.sharding_group_size: {problem}")):
        load_config(path, use="plan")
    path = write_config(tmp_path, 50, {}, sharding_group_size="auto")
    assert load_config(path, use="plan").sharding_group_size == "auto"


def train_auto(tmp: str) -> tuple[int, dict]:
    """``configs/small.yaml`` with tiny tables on 2 hosts of 2 with a slow link, its
    group size the planner's, a few SGD steps, checkpointed."""
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    for table in data["tables"]:
        table["num_embeddings"] = 40
    data.update(steps=2, batch_size=32, sharding_group_size="auto")
    data["topology"] = {"kind": "cpu", "ranks_per_host": 2, "inter_bandwidth": 1e6}
    data["sparse_optimizer"] = {"type": "sgd", "lr": 1.0}
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": f"{tmp}/auto", "every": 2}
    path = Path(tmp) / "auto.yaml"
    if dist.get_rank() == 0:
        path.write_text(yaml.safe_dump(data))
    dist.barrier()
    config = load_config(path)
    chosen = plan_job(config, dist.get_world_size())[1].group.size
    return chosen, train(config)


def test_training_takes_the_planners_group_size(world, tmp_path):
    results = world(4).run(train_auto, str(tmp_path))
    chosen = {size for size, _ in results}
    assert chosen == {2}
    described = ckpt.describe(ckpt.latest(tmp_path / "auto"))
    assert (described["sharding_group_size"], described["replicas"]) == (2, 2)


SYNCED_TABLES = [bag("tw", 30, 8), bag("rw", 41, 8), bag("cw", 24, 12), bag("dp", 16, 4),
                 bag("hot", 36, 8)]  # fmt: skip
SYNCED_PLAN = ShardingPlan(
    {
        "tw": table_wise(1),
        "rw": row_wise(),
        "cw": column_wise([1, 0, 1]),
        "dp": data_parallel(),
        "hot": row_wise(hot_rows=6),
    }
)


def all_reduced_bytes(optimizer) -> list[int]:
    """The bytes of each all-reduce ``sync_replicas`` runs on this rank, tables
    sharded over groups of 2."""
    ebc = EmbeddingBagCollection(tables=SYNCED_TABLES, device="meta")
    sharded = embshard.shard(ebc, SYNCED_PLAN, mesh=sharding_mesh(2), optimizer=optimizer)
    seen, original = [], dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        sharded.sync_replicas()
    finally:
        dist.all_reduce = original
    return seen


@pytest.mark.parametrize(
    "optimizer",
    [embshard.RowWiseAdagrad(lr=0.1, eps=1e-4), embshard.Adagrad(lr=0.1, eps=1e-4)],
    ids=["rowwise_adagrad", "adagrad"],
)
def test_the_priced_buffer_is_the_one_sync_replicas_all_reduces(world, optimizer):
    """Every layout, copies included: the planner's bytes for a group rank are those of
    the one all-reduce that rank runs over its replicas."""
    seen = world(4).run(all_reduced_bytes, optimizer)
    job = Topology.cpu(4, ranks_per_host=2)
    priced = sync_bytes(SYNCED_PLAN, SYNCED_TABLES, group_topology(job, 2), optimizer.KIND)
    assert seen == [[priced[rank % 2]] for rank in range(4)]


@pytest.mark.parametrize("command", ["plan", "train"])
def test_both_commands_take_auto_and_refuse_what_is_not_a_group_size(tmp_path, command):
    """``train`` checks its options, then its config, before any process starts: this
    tables-only config stops it there, after ``auto`` passed."""
    path = write_config(tmp_path, 50, {})
    world = ["-w", "8"] if command == "plan" else ["--nproc", "2"]
    bad = CliRunner().invoke(cli, [command, str(path), *world, "--sharding-group-size", "two"])
    assert bad.exit_code != 0
    assert "'two' is neither a whole number of at least 1 nor auto" in bad.output
    auto = CliRunner().invoke(cli, [command, str(path), *world, "--sharding-group-size", "auto"])
    assert "Traceback" not in auto.output and "neither a whole number" not in auto.output
    if command == "train":
        assert auto.exit_code != 0 and "missing keys" in auto.output
    else:
        assert auto.exit_code == 0, auto.output


@pytest.mark.parametrize(
    ("option", "configured"), [(["--sharding-group-size", "4"], None), ([], 4)]
)
def test_balance_lookups_refuses_sharding_groups_given_either_way(tmp_path, option, configured):
    extra = {} if configured is None else {"sharding_group_size": configured}
    path = write_config(tmp_path, 50, {}, **extra)
    args = ["plan", str(path), "-w", "8", "--batches", "1", "--balance-lookups", *option]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    assert "--balance-lookups plans one group of every rank" in result.output
