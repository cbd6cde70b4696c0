"""``embshard simulate``: N ranks as threads of one process, against real gloo runs,
the batches themselves, and the unsharded oracle."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from oracle import Case, Table, run_case
from test_forward import TABLES, TOL, plans, tables_for
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor

import embshard
from embshard import LocalShardsWrapper
from embshard.app.config import load_config
from embshard.app.data import Feed, build_data
from embshard.app.sim_memory import (
    MODES,
    MemoryNeed,
    available_memory,
    default_mode,
    ranks_that_fit,
)
from embshard.app.simulate import (
    SimulationError,
    Traffic,
    run_ranks,
    simulate,
)
from embshard.app.train import fused_optimizer
from embshard.errors import ConfigError, PlanError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from make_criteo_sample import sample_lines

ROOT = Path(__file__).resolve().parents[1]
BATCHES = 3


def write_config(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def synthetic_config(tmp_path: Path, world: int) -> str:
    """configs/small.yaml, small batches, every kind of sharding (row-wise and grid
    uneven too, row-wise with hot rows and with its blocks out of rank order)."""
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    last = world - 1
    data.update(batch_size=32)
    data["plan"] = {
        "user": {"type": "row_wise", "hot_rows": 40},
        "item": {"type": "column_wise", "ranks": [last, 0, last, 0]},
        "category": {"type": "table_wise", "rank": last},
        "city": {  # blocks out of rank order
            "type": "row_wise",
            "sizes": [1000] + [0] * (world - 2) + [4000],
            "ranks": list(range(world))[::-1],
        },
        "device": {
            "type": "grid",
            "column_blocks": 2,
            "ranks": [[0, last], [last]],
            "sizes": [[50, 150], [200]],
        },
    }
    return write_config(tmp_path, data)


def criteo_config(tmp_path: Path, world: int) -> str:
    """configs/criteo_sample.yaml on a file too short for whole batches on every rank."""
    data = yaml.safe_load((ROOT / "configs" / "criteo_sample.yaml").read_text())
    train = tmp_path / "train.tsv"
    train.write_text("\n".join(sample_lines(40, seed=0)) + "\n")
    data.update(batch_size=8)
    data["data"] = {"type": "criteo", "path": str(train)}
    data["plan"]["t1"] = {"type": "column_wise", "ranks": [world - 1, 0]}
    return write_config(tmp_path, data)


KINDS = ("counts", "ids", "pooled", "pooled_grad")  # a step's all-to-alls, in order


def real_steps(config_path: str, batches: int) -> dict:
    """The real sharded module, forward and backward on this rank's own batches: the
    bytes in and out of each all-to-all, and its tables' and optimizer state's bytes."""
    config = load_config(config_path)
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc = EmbeddingBagCollection(tables=config.embedding_bag_configs(), device="meta")
    optimizer = fused_optimizer(config.sparse_optimizer)
    sharded = embshard.shard(ebc, config.sharding_plan(), optimizer=optimizer)
    feed = Feed(build_data(config, rank, world))
    feed.next_epoch()
    calls, all_to_all = [], dist.all_to_all_single

    def recorded(output, input, *args, **kwargs):
        calls.append((input.numel() * input.element_size(), output.numel() * output.element_size()))
        return all_to_all(output, input, *args, **kwargs)

    dist.all_to_all_single = recorded
    try:
        for _ in range(batches):
            sharded(feed.take().sparse).values().sum().backward()
    finally:
        dist.all_to_all_single = all_to_all
    assert len(calls) == len(KINDS) * batches
    every = len(KINDS)
    return {
        "traffic": {
            kind: Traffic(sum(c[0] for c in calls[i::every]), sum(c[1] for c in calls[i::every]))
            for i, kind in enumerate(KINDS)
        },
        "weights": local_bytes(sharded.weights.values()),
        "optimizer_state": local_bytes(sharded.optimizer_state().values()),
    }


def local_bytes(tables) -> int:
    """Bytes of this rank's shards of ``tables`` (DTensors)."""
    total = 0
    for table in tables:
        local = table.to_local()  # an empty tensor where the rank holds none of it
        shards = local.local_shards() if isinstance(local, LocalShardsWrapper) else [local]
        total += sum(s.numel() * s.element_size() for s in shards)
    return total


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("make_config", [synthetic_config, criteo_config])
def test_simulated_traffic_and_memory_match_real_gloo_runs(
    world, tmp_path, world_size, make_config
):
    config = make_config(tmp_path, world_size)
    real = world(world_size).run(real_steps, config, BATCHES)
    for mode in MODES:
        simulated = simulate(config, world_size, batches=BATCHES, mode=mode).ranks
        for rank, (r, s) in enumerate(zip(real, simulated)):
            assert {kind: getattr(s, kind) for kind in KINDS} == r["traffic"], (mode, rank)
            assert (s.weights, s.optimizer_state) == (r["weights"], r["optimizer_state"]), mode


def assert_the_modes_agree(config: str, world_size: int) -> None:
    steps = []
    runs = {
        mode: simulate(
            config, world_size, batches=BATCHES, ranks_per_host=3, mode=mode, progress=steps.append
        )
        for mode in MODES
    }
    full, streamed = runs["full"].to_dict(), runs["streamed"].to_dict()
    assert (full.pop("mode"), streamed.pop("mode")) == MODES
    assert full.pop("seconds_taken") > 0 and streamed.pop("seconds_taken") > 0
    assert streamed == full  # every rank's every field, inside and across hosts
    assert any(r["across"]["sent"] for r in full["ranks"]) == (world_size > 3)
    # Each mode told of every rank's every step.
    assert sum(steps) == 2 * world_size * BATCHES


@pytest.mark.parametrize("world_size", range(2, 9))
@pytest.mark.parametrize("make_config", [synthetic_config, criteo_config])
def test_the_streamed_mode_reports_what_the_full_mode_does(tmp_path, world_size, make_config):
    assert_the_modes_agree(make_config(tmp_path, world_size), world_size)


def test_the_streamed_mode_on_one_rank_moves_nothing_as_the_full_mode(tmp_path):
    assert_the_modes_agree(criteo_config(tmp_path, 1), 1)


def lookups_from_batches(config_path: str, world: int, batches: int) -> list[list[int]]:
    """Per rank [ids, bags, bytes looked up], counted on every rank's batches: each
    non-empty shard gets, for each feature of its table, every sample's bag and the
    ids that fall in its rows, and reads its columns of their rows; a copy (hot rows)
    reads those of its own rank's ids only, and gets none."""
    config = load_config(config_path)
    tables = config.sharding_plan().resolve(config.embedding_bag_configs(), world)
    feeds = [Feed(build_data(config, r, world)) for r in range(world)]
    for feed in feeds:
        feed.next_epoch()
    counted = [[0, 0, 0] for _ in range(world)]
    for _ in range(batches):
        sparse = [feed.take().sparse for feed in feeds]
        samples = sum(s.lengths().numel() // len(s.keys()) for s in sparse)
        for t in config.tables:
            for shard in tables[t.name].shards:
                if not (shard.rows and shard.cols):
                    continue
                for feature in t.features:
                    mine = [sparse[shard.rank]] if shard.replica else sparse
                    ids = torch.cat([s[feature].values() for s in mine])
                    inside = (ids >= shard.row_offset) & (ids < shard.row_offset + shard.rows)
                    n = int(inside.sum())
                    got = (0, 0) if shard.replica else (n, samples)
                    for i, add in enumerate((*got, n * shard.cols * 4)):
                        counted[shard.rank][i] += add
    return counted


@pytest.mark.parametrize("world_size", [3, 5])
@pytest.mark.parametrize("make_config", [synthetic_config, criteo_config])
def test_ids_bags_and_lookups_match_the_batches(tmp_path, world_size, make_config):
    config = make_config(tmp_path, world_size)
    simulated = simulate(config, world_size, batches=BATCHES).ranks
    expected = lookups_from_batches(config, world_size, BATCHES)
    assert [[r.ids_received, r.bags_received, r.lookup_bytes] for r in simulated] == expected


def test_the_slowest_rank_is_the_one_holding_the_tables(tmp_path):
    config = synthetic_config(tmp_path, 3)
    plan = tmp_path / "plan.yaml"
    placed = {"user": 1, "item": 1, "category": 1, "city": 1, "device": 0}
    embshard.ShardingPlan({t: embshard.table_wise(r) for t, r in placed.items()}).save(plan)
    result = simulate(config, 3, plan_path=str(plan), batches=2)
    assert result.plan_source == str(plan)
    assert result.slowest.rank == 1
    idle = result.ranks[2]
    assert (idle.ids_received, idle.weights, idle.pooled.sent) == (0, 0, 0)
    why = result.why_slowest()
    assert why.startswith("rank 1,") and "looks up" in why and "(the most)" in why
    assert why.endswith("it holds " + ", ".join(result.ranks[1].shards))
    text = result.to_text()
    assert "slowest: rank 1," in text and len(text.splitlines()) == 3 + 3 + 2
    report = json.loads(json.dumps(result.to_dict()))
    assert report["slowest"]["rank"] == 1 and len(report["ranks"]) == 3


@pytest.mark.parametrize("world_size", [5, 6, 7, 8])
@pytest.mark.parametrize(
    "plan", ["table_wise", "row_wise", "column_wise", "mixed", "grid_mixed", "hot_rows"]
)
def test_oracle_cases_at_up_to_8_ranks_in_one_process(world_size, plan):
    batch_sizes = tuple([5, 0, 3, 6, 2, 7, 1, 4][:world_size])
    case = Case(tables_for(plan), plans(world_size)[plan], batch_sizes, seed=world_size)
    for worst in run_ranks(world_size, run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


@pytest.mark.parametrize(
    "optimizer",
    [embshard.RowWiseAdagrad(lr=0.1, eps=1e-4), embshard.Adagrad(lr=0.1, eps=1e-4)],
    ids=["rowwise_adagrad", "adagrad"],
)
def test_adagrad_and_weighted_features_at_7_ranks(optimizer):
    sums = tuple(Table(t.name, t.rows, t.dim, t.features) for t in TABLES)  # weighted: SUM
    for case in (
        Case(TABLES, plans(7)["mixed"], (5, 0, 3, 6, 2, 7, 1), optimizer=optimizer),
        Case(sums, plans(7)["mixed"], (5, 0, 3, 6, 2, 7, 1), weighted=True),
    ):
        for worst in run_ranks(7, run_case, case):
            assert worst["forward"] < TOL and worst["weights"] < TOL, worst


def test_check_runs_the_config_model_against_the_oracle(tmp_path):
    config = synthetic_config(tmp_path, 6)
    check = simulate(config, 6, batches=2, check=True).check
    assert check.passed and check.steps == 2, check


def fail_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 failed")
    dist.barrier()  # the others wait for rank 1, which never comes
    return dist.get_rank()


def test_an_error_on_one_rank_stops_every_rank():
    with pytest.raises(ValueError, match="rank 1 failed"):
        run_ranks(3, fail_on_rank_1)
    assert run_ranks(2, dist.get_rank) == [0, 1]  # the next world starts clean


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_every_rank_tears_down_cleanly_without_the_threaded_worlds_comms(monkeypatch):
    # torch 2.11's threaded world has no ``comms``, which destroy_process_group reads.
    from torch.testing._internal.distributed import multi_threaded_pg

    monkeypatch.delattr(multi_threaded_pg.ThreadLocalWorld, "comms", raising=False)
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    assert run_ranks(3, rank_and_world) == [(0, 3), (1, 3), (2, 3)]
    assert [args.exc_value for args in raised] == []
    assert run_ranks(2, rank_and_world) == [(0, 2), (1, 2)]  # and the next world starts


def test_bad_requests_say_what_is_wrong(tmp_path):
    config = synthetic_config(tmp_path, 3)
    with pytest.raises(SimulationError, match="at least 1 rank"):
        simulate(config, 0)
    with pytest.raises(ConfigError, match="cannot read config"):
        simulate(str(tmp_path / "missing.yaml"), 2)
    with pytest.raises(PlanError, match="category"):
        simulate(config, 2)  # its plan puts a table on rank 2
    with pytest.raises(PlanError, match="cannot read the plan"):
        simulate(config, 3, plan_path=str(tmp_path / "missing.yaml"))


def test_a_bad_batch_is_named_alike_in_both_modes(tmp_path, monkeypatch):
    from embshard.app import simulate as simulate_module
    from embshard.app import streamed as streamed_module
    from embshard.app.data import Batch
    from embshard.errors import InputError

    def with_a_bad_id_on_rank_1(config, rank, world):
        source = build_data(config, rank, world)
        if rank == 1:  # the full mode reads batches, the streamed one only their features
            batch, features = source.batch, source.epoch_features

            def bad(good: KeyedJaggedTensor) -> KeyedJaggedTensor:
                values = good.values().clone()
                values[0] = 10**9  # beyond every table
                return KeyedJaggedTensor(good.keys(), values, lengths=good.lengths())

            def bad_batch(step, split="train"):
                good = batch(step, split)
                return Batch(good.dense, bad(good.sparse), good.labels)

            source.batch = bad_batch
            source.epoch_features = lambda: map(bad, features())
        return source

    for module in (simulate_module, streamed_module):
        monkeypatch.setattr(module, "build_data", with_a_bad_id_on_rank_1)
    config = synthetic_config(tmp_path, 3)
    messages = []
    for mode in MODES:
        with pytest.raises(InputError) as raised:
            simulate(config, 3, batches=1, mode=mode)
        messages.append(str(raised.value))
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("bad input batch:\n  rank 1: ") and "1000000000" in messages[0]


def test_the_streamed_mode_is_the_default_above_16_ranks(tmp_path):
    assert [default_mode(n) for n in (1, 16, 17, 1024)] == ["full", "full", "streamed", "streamed"]
    assert simulate(synthetic_config(tmp_path, 3), 3, batches=1).mode == "full"


def test_a_simulation_that_cannot_fit_is_refused_before_it_starts(tmp_path):
    config = synthetic_config(tmp_path, 8)
    with pytest.raises(SimulationError) as full:
        simulate(config, 8, mode="full", memory_limit=1 << 20)
    message = str(full.value)
    assert (
        message.startswith("simulating 8 ranks in full mode needs about ") and "\n" not in message
    )
    assert "more than the 1.0 MiB available" in message and "--mode streamed" in message
    with pytest.raises(SimulationError, match="8 ranks in streamed mode needs about"):
        simulate(config, 8, mode="streamed", memory_limit=1 << 20)
    # The streamed input stage fits in 600 MiB; --check's 8 threads do not.
    assert simulate(config, 8, batches=1, mode="streamed", memory_limit=600 << 20).ranks
    with pytest.raises(
        SimulationError,
        match=r"--check runs the small model on 8 threads .* it fits about [0-9]+ ranks",
    ):
        simulate(config, 8, batches=1, check=True, mode="streamed", memory_limit=600 << 20)
    with pytest.raises(SimulationError, match="mode must be one of full, streamed, got 'fast'"):
        simulate(config, 8, mode="fast")


def test_ranks_that_fit_are_the_most_whose_need_fits():
    def need(ranks: int) -> MemoryNeed:  # each rank's share grows with the ranks
        return MemoryNeed(fixed=10, per_rank=3 + ranks, world_size=ranks)

    assert [ranks_that_fit(need, available, 100) for available in (13, 14, 28, 100)] == [0, 1, 3, 8]
    assert ranks_that_fit(need, 10**9, 8) == 7  # fewer than asked, always


def test_available_memory_is_the_kernels_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1234 kB\n")
    assert available_memory(str(meminfo)) == 1234 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_memory(str(meminfo)) is None
    assert available_memory(str(tmp_path / "missing")) is None


def test_the_command_refuses_what_cannot_fit_in_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from embshard.app import simulate as simulate_module
    from embshard.app.cli import main as cli

    config = synthetic_config(tmp_path, 3)
    monkeypatch.setattr(simulate_module, "available_memory", lambda: 1 << 20)
    result = CliRunner().invoke(cli, ["simulate", config, "-w", "3", "--mode", "full"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: simulating 3 ranks in full mode needs about ")
    assert len(result.output.splitlines()) == 1


@pytest.mark.parametrize("mode", MODES)
def test_sharding_groups_simulate_one_group_and_price_its_all_reduce(tmp_path, mode):
    """4 ranks as 2 groups of 2 on hosts of 2: the group's ranks get what a 2-rank job
    of the same plan gets, and each all-reduces 2 (R - 1) / R of its shards' weights and
    row-wise Adagrad state (one float a row) as float32, across hosts."""
    config = synthetic_config(tmp_path, 2)
    one_group = simulate(config, 2, batches=2, ranks_per_host=2, mode=mode).to_dict()
    grouped = simulate(config, 4, batches=2, ranks_per_host=2, mode=mode, group_size=2)
    assert grouped.group_size == 2 and len(grouped.ranks) == 2
    loaded = load_config(config, use="simulate")
    assert loaded.sparse_optimizer.type == "rowwise_adagrad"
    plan, tables = loaded.sharding_plan(), loaded.embedding_bag_configs()
    held = [0, 0]
    for table in plan.resolve(tables, 2).values():
        for shard in table.shards:
            held[shard.rank] += 4 * (shard.rows * shard.cols + shard.rows)
    for rank, report in enumerate(grouped.ranks):
        assert report.sync_bytes == held[rank]  # 2 (R - 1) / R = 1 with R = 2
        assert report.sync_across and report.sync_seconds > 0
        alone = one_group["ranks"][rank]
        for field in ("ids_received", "bags_received", "lookup_bytes", "ids", "pooled"):
            assert asdict(report)[field] == alone[field], field
    assert "as 2 sharding groups of 2" in grouped.to_text()
    with pytest.raises(SimulationError, match="sharding group size 3 does not divide the 4"):
        simulate(config, 4, batches=1, group_size=3)
