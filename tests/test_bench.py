"""The benchmark runs, checks both libraries agree, and reports every figure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingConfig

import embshard
from tools import bench
from tools.bench import Options, run

ROOT = Path(__file__).resolve().parents[1]


def test_bench_smoke(tmp_path, capfd):
    out = tmp_path / "bench.json"
    run(Options(world_sizes=(2,), workloads=("a", "d"), plans=("mixed",), ids="power-law",
                steps=2, warmup=1, json=str(out)))  # fmt: skip
    printed = capfd.readouterr()
    # The workers' lines and nothing else: no kineto USDT lines, no FutureWarnings.
    lines = printed.out.splitlines()[1:]
    assert [line.split()[:3] for line in lines] == [["W=2", "a", "mixed"], ["W=2", "d", "mixed"]]
    assert printed.err == f"wrote {out}\n"
    data = json.loads(out.read_text())
    assert data["gather_gbps"] > 0
    assert [r["workload"] for r in data["results"]] == ["a", "d"]
    for record, line in zip(data["results"], lines):
        assert record["outputs_equal"] and record["ids"] == "power-law"
        assert record["embshard"]["collectives_per_step"] == 4
        assert record["torchrec"]["collectives_per_step"] > 4
        # One more step of each library counted, after the timed ones: ops beside times.
        assert record["embshard"]["host_syncs_per_step"] == 1
        for library in ("embshard", "torchrec"):
            figures = record[library]
            assert figures["p10_ms"] <= figures["median_ms"] <= figures["p90_ms"]
            assert figures["bytes_sent_per_rank"] > 0 and figures["samples_per_s"] > 0
            assert figures["ops_per_step"] == max(figures["ops_per_step_per_rank"]) > 0
            assert len(figures["ops_per_step_per_rank"]) == 2
            assert f"MiB {figures['ops_per_step']} ops |" in line
        assert record["bare_tbe_ms"] > 0 and record["throughput_ratio"] > 0
        assert 0 < record["collectives_alone_ms"] < record["floor_ms"]
        assert record["floor_ms"] >= record["bare_tbe_ms"] and record["step_over_floor"] > 0
        assert record["pipelined_median_ms"] > 0 and record["pipeline_gain"] > 0
        assert all(0 < f < 1 for f in record["duplicate_id_fraction_per_rank"])


@pytest.mark.parametrize(
    "workload, values, ids",
    [("a", 8192752860, 163325), ("b", 1637243206, 327595), ("c", 2846184787, 26624)],
)
def test_old_workloads_keep_their_inputs(workload, values, ids):
    """Workloads (a) to (c) draw the same ids as when docs/bench.json was measured."""
    (batch,) = bench.make_inputs(workload, 0, 1)
    assert (int(batch.values().sum()), int(batch.lengths().sum())) == (values, ids)


def test_workload_d_is_criteo_shaped_with_mlperf_bags():
    configs = bench.table_configs("d")
    assert [c.num_embeddings for c in configs] == [
        min(r, 400_000) for r in bench.CRITEO_KAGGLE_ROWS
    ]
    assert {c.embedding_dim for c in configs} == {16, 32, 64}
    uniform, power = (bench.make_inputs("d", 1, 1, ids)[0] for ids in bench.ID_LAWS)
    for batch in (uniform, power):
        assert batch.lengths().view(26, 512).unique(dim=1).flatten().tolist() == (
            bench.MLPERF_MULTI_HOT_SIZES
        )
        for config, jagged in zip(configs, batch.split([1] * 26)):
            assert jagged.values().min() >= 0 and jagged.values().max() < config.num_embeddings
    hot = power.to_dict()["f2"].values()  # 400,000 rows: a power law puts half below 632
    assert (hot < 632).float().mean() > 0.45
    assert (uniform.to_dict()["f2"].values() < 632).float().mean() < 0.01
    with pytest.raises(ValueError, match="ids must be one of"):
        bench.make_inputs("d", 0, 1, "zipf")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("plan_name", bench.PLANS)
def test_every_plan_fits_workload_d(world, plan_name):
    """The mixed dimensions (16, 32, 64) shard under every plan, in both libraries."""
    configs = bench.table_configs("d")
    plan = bench.make_plan(plan_name, configs, world)
    tables = plan.resolve(configs, world)
    assert {s.rank for t in tables.values() for s in t.shards} == set(range(world))
    assert len(embshard.to_torchrec_plan(plan, configs, world)) == len(configs)


def test_duplicate_fraction_counts_repeats_within_each_shard():
    # Two shards, two bags each: shard 0 gets [1, 1, 2] and [1], shard 1 [1] and [3].
    indices = torch.tensor([1, 1, 2, 1, 1, 3])
    offsets = torch.tensor([0, 3, 4, 5, 6])
    assert bench.duplicate_fraction(indices, offsets, 2) == 2 / 6


def test_workload_e_is_sequences_of_one_dim():
    configs = bench.table_configs("e")
    assert all(isinstance(c, EmbeddingConfig) for c in configs)
    assert [c.num_embeddings for c in configs] == bench.SEQUENCE_ROWS
    assert {c.embedding_dim for c in configs} == {64}
    (batch,) = bench.make_inputs("e", 0, 1)
    lengths = batch.lengths().view(8, 512)
    assert lengths.min() >= 1
    assert (lengths.max(1).values < 2 * torch.tensor(bench.SEQUENCE_MEANS)).all()
    assert 140 < lengths.sum() / 512 < 160  # ids a sample: the means sum to 150


def sequence_gaps(plan_name: str) -> tuple[float, float]:
    """The largest difference of embshard's and TorchRec's sharded EmbeddingCollections
    on workload (e), id for id: with TorchRec's weights copied from embshard's, and
    after every TorchRec weight of table t0 moved by 1."""
    world = dist.get_world_size()
    configs = bench.table_configs("e")
    plan = bench.make_plan(plan_name, configs, world)
    ours, theirs = (bench.build(library, configs, plan, world) for library in bench.LIBRARIES)
    bench.copy_weights(ours, theirs)
    (batch,) = bench.make_inputs("e", dist.get_rank(), 1)
    same, _ = bench.difference(ours, theirs, batch)
    with torch.no_grad():
        for shard in theirs.state_dict()["tables.embeddings.t0.weight"].local_shards():
            shard.tensor.add_(1.0)
    moved, _ = bench.difference(ours, theirs, batch)
    return same, moved


def test_sequence_outputs_are_compared_id_for_id(world):
    for same, moved in world(2).run(sequence_gaps, "row_wise"):
        assert same == 0.0 and moved == pytest.approx(1.0)


def test_sequence_cells_time_both_libraries_or_say_why_not(world):
    timed = world(2).run(bench.bench_case, "e", "mixed", 2, 1)[0]
    assert timed["outputs_equal"] and "skipped" not in timed
    assert timed["embshard"]["collectives_per_step"] == 4
    assert timed["torchrec"]["collectives_per_step"] > 4
    for library in bench.LIBRARIES:
        assert timed[library]["median_ms"] > 0 and timed[library]["bytes_sent_per_rank"] > 0
    assert timed["throughput_ratio"] > 0 and timed["bare_tbe_ms"] > 0
    compressed = world(2).run(bench.bench_case, "e", "table_wise", 2, 1, "fp16")[0]
    assert "comm_precision 'fp16' is not supported" in compressed["skipped"]
    assert "outputs_equal" not in compressed
    assert "skipped: embshard refuses it" in bench.summary_line(compressed)


def embshard_command(site: Path, *args: str) -> subprocess.CompletedProcess:
    """``embshard ARGS`` with the embshard package that ``site`` holds, run from another
    folder, as an installed package runs."""
    script = "from embshard.app.cli import main; main(prog_name='embshard')"
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=site.parent,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_embshard_bench_runs_the_checkouts_tools_from_anywhere(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "embshard").symlink_to(ROOT / "embshard")  # as an editable install finds it
    result = embshard_command(site, "bench", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: embshard bench [OPTIONS]\n")
    assert "--world-sizes N..." in result.stdout


def test_embshard_bench_without_a_checkout_says_so_in_one_line(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(ROOT / "embshard", site / "embshard")  # installed: no tools/ beside it
    result = embshard_command(site, "bench", "--world-sizes", "2", "--workloads", "a")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "Error: embshard bench runs tools/bench.py from a source checkout of embshard; "
        f"{site} is not one (clone the repository, pip install -e it, run it there)\n"
    )
