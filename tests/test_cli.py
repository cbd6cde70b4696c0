"""The command line's edges: quick help, bad output paths and bad YAML reported in one
line before any work, and plan pictures that fit any world size and scale."""

from __future__ import annotations

import json
import re
import string
import subprocess
import sys
import typing
from itertools import groupby
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embshard.app.cli import main as cli
from embshard.app.config import Device, load_config
from embshard.app.planning import topology_for
from embshard.app.show import draw_table, summary
from embshard.plan.specs import ShardingPlan, row_wise
from embshard.planner.cost import CostModel
from embshard.planner.search import plan_loads
from embshard.planner.tables import planned_tables
from embshard.planner.topology import format_bytes, parse_bytes

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "configs" / "small.yaml"
HEAVY = ("torch", "torchrec", "fbgemm_gpu", "matplotlib")


def test_help_imports_no_heavy_library():
    commands = [[], ["plan"], ["show"], ["simulate"], ["train"], ["bench"], ["ckpt"]]
    commands += [["ckpt", "export"], ["ckpt", "verify"], ["export"], ["predict"]]
    script = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from embshard.app.cli import main\n"
        f"for command in {commands!r}:\n"
        "    result = CliRunner().invoke(main, [*command, '--help'])\n"
        "    assert result.exit_code == 0 and 'usage' in result.output.lower(), result.output\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_bench_help_names_the_command():
    result = CliRunner().invoke(cli, ["bench", "--help"], prog_name="embshard")
    assert result.exit_code == 0
    assert result.output.startswith("Usage: embshard bench [OPTIONS]\n")
    script = subprocess.run(
        [sys.executable, "tools/bench.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert script.stdout.startswith("Usage: tools/bench.py [OPTIONS]\n")
    assert "--world-sizes N..." in script.stdout


def test_bench_list_options_take_several_values_after_one_flag(monkeypatch):
    from tools.bench import launch

    ran = []
    monkeypatch.setattr(launch, "run", ran.append)
    args = ["--world-sizes", "2", "4", "--steps", "3", "--plans", "mixed", "--workloads=a", "d"]
    result = CliRunner().invoke(cli, ["bench", *args, "--plans", "row_wise"])
    assert result.exit_code == 0, result.output
    (options,) = ran
    assert (options.world_sizes, options.workloads, options.plans) == (
        (2, 4),
        ("a", "d"),
        ("mixed", "row_wise"),
    )
    assert (options.steps, options.warmup, options.json) == (3, 5, "bench.json")
    bad = CliRunner().invoke(cli, ["bench", "--world-sizes", "2", "0"])
    assert bad.exit_code == 2 and "'--world-sizes': 0 is not in the range x>=1" in bad.output


def plan_file(tmp_path: Path) -> Path:
    """All of small.yaml's tables on rank 0, a table a line."""
    path = tmp_path / "plan.yaml"
    names = [t["name"] for t in yaml.safe_load(SMALL.read_text())["tables"]]
    path.write_text("tables:\n" + "".join(f"  {n}: {{type: table_wise, rank: 0}}\n" for n in names))
    return path


@pytest.mark.parametrize(
    ("command", "out", "message"),
    [
        (lambda t: ["plan", str(SMALL), "-w", "2", "--out"], "no/plan.yaml", "does not exist"),
        (
            lambda t: ["show", str(plan_file(t)), "--config", str(SMALL), "--png"],
            "no/x.png",
            "does not exist",
        ),
        (
            lambda t: ["show", str(plan_file(t)), "--config", str(SMALL), "--png"],
            "x.txt",
            "cannot write .txt files; supported: .png",
        ),
        # Any directory will do: OUT is checked while the arguments are read.
        (lambda t: ["ckpt", "export", str(t)], "no/x.pt", "does not exist"),
        (lambda t: ["bench", "--json"], "no/b.json", "does not exist"),
        (lambda t: ["bench", "--png"], "b.txt", "cannot write .txt files; supported: .png"),
    ],
    ids=["plan", "show-dir", "show-format", "ckpt-export", "bench-dir", "bench-format"],
)
def test_unwritable_outputs_fail_before_the_work(tmp_path, command, out, message):
    path = tmp_path / out
    result = CliRunner().invoke(cli, [*command(tmp_path), str(path)])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    error = result.output.strip().splitlines()[-1]
    assert str(path) in error and message in error
    assert "Traceback" not in result.output and "most memory" not in result.output
    assert not path.exists()


def broken_yaml(path: Path, text: str, line: int) -> Path:
    """``text`` with an unclosed flow mapping at ``line`` (1-based)."""
    lines = text.splitlines()
    lines[line - 1] = lines[line - 1].replace("}", "")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_yaml_syntax_errors_name_the_file_and_line(tmp_path):
    text = SMALL.read_text()
    line = 1 + text.splitlines().index(next(s for s in text.splitlines() if "name: user" in s))
    config = broken_yaml(tmp_path / "config.yaml", text, line)
    result = CliRunner().invoke(cli, ["plan", str(config), "-w", "2"])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {config}:{line + 1}:"), result.output
    assert "invalid YAML" in result.output and "<unicode string>" not in result.output

    plan = broken_yaml(tmp_path / "bad_plan.yaml", plan_file(tmp_path).read_text(), 2)
    result = CliRunner().invoke(cli, ["show", str(plan), "--config", str(SMALL)])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {plan}:3:"), result.output
    assert "<unicode string>" not in result.output


def test_show_draws_row_blocks_out_of_rank_order_and_reads_the_world_from_them(tmp_path):
    plan = plan_file(tmp_path)
    plan.write_text(
        plan.read_text().replace(
            "device: {type: table_wise, rank: 0}", "device: {type: row_wise, ranks: [2, 0, 1]}"
        )
    )
    result = CliRunner().invoke(cli, ["show", str(plan), "--config", str(SMALL), "--width", "30"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    at = lines.index("device (200 x 16) RowWise")
    assert lines[at + 1 : at + 5] == [
        f"  rows |{'2' * 10}{'0' * 10}{'1' * 10}|",
        "    rank 2: rows 0:67, cols 0:16",
        "    rank 0: rows 67:134, cols 0:16",
        "    rank 1: rows 134:200, cols 0:16",
    ]


def bar(sizes: list[int], width: int) -> str:
    """The text bar of a row-wise table split into ``sizes`` rows per rank."""
    config = EmbeddingBagConfig(
        name="t", num_embeddings=sum(sizes), embedding_dim=4, feature_names=["f"]
    )
    table = ShardingPlan({"t": row_wise(sizes)}).resolve([config], len(sizes))["t"]
    line = draw_table(table, width)[1]
    return line[line.index("|") + 1 : -1]


def test_bars_scale_to_256_ranks():
    symbols = string.digits + string.ascii_lowercase + string.ascii_uppercase
    sizes = [1, 3] * 128  # 256 ranks; at width 1024 each row is two characters
    runs = [(s, len(list(run))) for s, run in groupby(bar(sizes, 1024))]
    assert runs == [(symbols[r % 62], 2 * size) for r, size in enumerate(sizes)]

    # Fewer characters than ranks: rank 0 holds half the rows, so half the bar.
    drawn = bar([255, *[1] * 255], 60)
    assert len(drawn) == 60 and "#" not in drawn
    assert drawn[:30] == "0" * 30 and drawn[30] != "0"


MIXED_3 = {
    "user": {"type": "row_wise", "ranks": [2, 0, 1]},
    "item": {"type": "column_wise", "ranks": [1, 2]},
    "category": {"type": "data_parallel"},
    "city": {"type": "table_wise", "rank": 0},
    "device": {"type": "table_wise", "rank": 2},
}
ROW_WISE_40 = {name: {"type": "row_wise"} for name in MIXED_3}


@pytest.mark.parametrize(
    ("tables", "world", "memory"),
    [(MIXED_3, 3, "12MiB"), (MIXED_3, 3, "2MiB"), (MIXED_3, 3, None), (ROW_WISE_40, 40, "1MiB")],
    ids=["3-ranks", "3-ranks-over-capacity", "3-ranks-capacity-off-the-scale", "40-ranks"],
)
def test_show_png_stacks_each_ranks_shards_against_its_memory(
    tmp_path, monkeypatch, tables, world, memory
):
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "close", lambda figure: None)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"tables": tables}))
    png = tmp_path / "plan.png"
    args = ["show", str(plan), "--config", str(SMALL), "-w", str(world), "--png", str(png)]
    result = CliRunner().invoke(cli, [*args, *(["--memory-per-rank", memory] if memory else [])])
    assert result.exit_code == 0, result.output
    figure = plt.gcf()
    memory_axes = next(a for a in figure.axes if a.get_ylabel().startswith("memory"))
    cost_axes = next(a for a in figure.axes if a.get_xlabel() == "rank")

    # Each shard's bytes: its weights and its rows' row-wise Adagrad state, fp32.
    config = load_config(SMALL, use="plan")
    resolved = ShardingPlan.load(plan).resolve(config.torchrec_configs(), world)
    expected = {rank: [] for rank in range(world)}
    for table in resolved.values():
        for s in table.shards:
            if s.rows and s.cols:
                expected[s.rank].append((table.name, 4 * s.rows * s.cols + 4 * s.rows, s.replica))
    mib = 2**20  # every case's axis: its largest size, the capacity or the fullest rank, in MiB
    assert memory_axes.get_ylabel() == "memory (MiB)"
    drawn = {rank: [] for rank in range(world)}
    colours = {}
    for patch in memory_axes.patches:
        rank = round(patch.get_x() + patch.get_width() / 2)
        size = round(patch.get_height() * mib)
        name = next(n for n, b, _ in expected[rank] if b == size)  # KeyError: no such shard
        colours.setdefault(name, patch.get_facecolor())
        assert patch.get_facecolor() == colours[name]  # a table's colour on every rank
        drawn[rank].append((name, size, bool(patch.get_hatch())))
    assert {r: sorted(d) for r, d in drawn.items()} == {r: sorted(e) for r, e in expected.items()}
    assert len(set(colours.values())) == len(resolved)

    usable = 7 * parse_bytes(memory) / 8 if memory else 7 * 2**30  # an eighth reserved on CPU
    lines = sorted(line.get_ydata()[0] * mib for line in memory_axes.lines)
    texts = [t.get_text() for t in memory_axes.texts]
    if memory in ("12MiB", "2MiB"):
        assert lines == [usable, parse_bytes(memory)]
    elif memory is None:
        assert lines == [] and "capacity off the scale: 7.0 GiB usable a rank" in texts
    tops = [sum(size for _, size, _ in shards) for shards in expected.values()]
    assert memory_axes.get_ylim()[1] * mib >= max(tops)  # a rank over capacity shows whole
    if world == 3:
        assert {"user", "item"} <= set(texts)  # names where they fit

    ticks = cost_axes.get_xticks()
    assert all(t == int(t) for t in ticks) and set(ticks) >= ({0, 1, 2} if world == 3 else {0})
    model = CostModel(topology_for(config, world, memory), config.batch_size)
    base = 1e3 * model.base_cost(planned_tables(config.tables))
    loads = plan_loads(ShardingPlan.load(plan), config.tables, model.topology, config.batch_size)
    bars = sorted(
        (round(p.get_x() + p.get_width() / 2), p.get_y(), p.get_height()) for p in cost_axes.patches
    )
    stacked = [(r, 0, base) for r in range(world)]
    stacked += [(load.rank, base, 1e3 * load.cost) for load in loads]
    assert [v for bar in bars for v in bar] == pytest.approx(
        [v for b in sorted(stacked) for v in b]
    )
    plt.close(figure)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_reports_every_rank_and_the_slowest():
    result = CliRunner().invoke(cli, ["simulate", str(SMALL), "-w", "2", "--batches", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.split()[:1] == ["0"] for line in lines)
    assert any(line.split()[:1] == ["1"] for line in lines)
    assert "slowest: rank " in result.output
    bad = CliRunner().invoke(cli, ["simulate", str(SMALL), "-w", "0"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def sequence_config(tmp_path: Path, plan: dict | None = None) -> Path:
    """small.yaml with two sequence tables (``pooling: none``), one kept to 2 column
    blocks, and ``plan`` as its own."""
    data = yaml.safe_load(SMALL.read_text())
    data["tables"] += [
        {"name": "history", "num_embeddings": 5000, "embedding_dim": 16, "features": ["h"]}
        | {"pooling": "none", "mean_pooling": 20},
        {"name": "query", "num_embeddings": 800, "embedding_dim": 16, "features": ["q"]}
        | {"pooling": "none", "column_blocks": 2},
    ]
    if plan is not None:
        data["plan"] = plan
    path = tmp_path / "sequence.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_and_show_mark_and_price_sequence_tables(tmp_path):
    config, out = sequence_config(tmp_path), tmp_path / "plan.yaml"
    result = CliRunner().invoke(cli, ["plan", str(config), "-w", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    # A table's reason: "  name: sharding[ in N pieces], because why".
    lines = result.output.splitlines()
    reasons = [line for line in lines if re.match(r"  [a-z].*: [a-z_]+( in .*)?, because ", line)]
    assert [line.split(":")[0] for line in reasons] == [
        "  user",
        "  item",
        "  category",
        "  city",
        "  device",
        "  history (sequence)",
        "  query (sequence)",
    ]
    as_json = CliRunner().invoke(cli, ["plan", str(config), "-w", "2", "--json"])
    tables = json.loads(as_json.output)["report"]["tables"]
    assert [t["table"] for t in tables if t["sequence"]] == ["history", "query"]

    shown = CliRunner().invoke(cli, ["show", str(out), "--config", str(config), "-w", "2"])
    assert shown.exit_code == 0, shown.output
    assert "history (sequence) (5000 x 16) " in shown.output
    assert shown.output.startswith("user (100000 x 16) TableWise\n")
    model = load_config(config, use="plan")
    loads = plan_loads(
        ShardingPlan.load(out), model.tables, topology_for(model, 2), model.batch_size
    )
    assert shown.output.splitlines()[-1] == summary(loads)

    planned = yaml.safe_load(out.read_text())["tables"]
    own = CliRunner().invoke(cli, ["plan", str(sequence_config(tmp_path, planned)), "-w", "2"])
    assert own.exit_code == 0, own.output
    kind = planned["history"]["type"]
    assert f"  history (sequence): {kind}" in own.output
    assert "because the config's own plan says so" in own.output
    memory_and_cost = [line.split()[:4] for line in own.output.splitlines()[1:3]]
    assert memory_and_cost == [line.split()[:4] for line in result.output.splitlines()[1:3]]


def test_plans_copying_sequence_tables_show_and_training_them_fails(tmp_path):
    mixed = {
        "user": {"type": "table_wise", "rank": 0},
        "item": {"type": "table_wise", "rank": 0},
        "category": {"type": "table_wise", "rank": 0},
        "city": {"type": "table_wise", "rank": 0},
        "device": {"type": "table_wise", "rank": 0},
        "history": {"type": "table_wise", "rank": 0},
        "query": {"type": "column_wise", "ranks": [0, 1]},
    }
    copied = mixed | {"history": {"type": "data_parallel"}, "query": {"type": "row_wise"}}
    plan = tmp_path / "copied.yaml"
    plan.write_text(yaml.safe_dump({"tables": copied}))
    config = sequence_config(tmp_path)
    shown = CliRunner().invoke(cli, ["show", str(plan), "--config", str(config), "-w", "2"])
    assert shown.exit_code == 0, shown.output
    assert "history (sequence) (5000 x 16) DataParallel\n  every row and column on each" in (
        shown.output
    )
    for command in (["simulate", str(config), "-w", "2"], ["train", str(config)]):
        refused = CliRunner().invoke(cli, command)
        assert refused.exit_code == 1, refused.output
        assert "tables[5].pooling: none makes 'history' a sequence table" in refused.output


def small_with(tmp_path: Path, **keys) -> Path:
    """small.yaml with ``keys`` replaced (None: removed)."""
    data = yaml.safe_load(SMALL.read_text()) | keys
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}))
    return path


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nproc", "0"], "Invalid value for '--nproc': 0 is not in the range x>=1."),
        (["--nproc", "-1"], "Invalid value for '--nproc': -1 is not in the range x>=1."),
        (
            ["--max-restarts", "-1"],
            "Invalid value for '--max-restarts': -1 is not in the range x>=0.",
        ),
        (
            ["--nnodes", "2:1"],
            "Invalid value for '--nnodes': '2:1' is not N or MIN:MAX with 1 <= MIN <= MAX",
        ),
        (
            ["--nnodes", "two"],
            "Invalid value for '--nnodes': 'two' is not N or MIN:MAX with 1 <= MIN <= MAX",
        ),
        (["--nnodes", "2"], "--nnodes above 1 needs --rdzv-endpoint HOST:PORT"),
    ],
)
def test_train_refuses_bad_counts_before_launching(options, message):
    result = CliRunner().invoke(cli, ["train", str(SMALL), *options])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.splitlines()[-1] == f"Error: {message}"


def test_train_refuses_a_plan_for_another_world_size_before_launching(tmp_path):
    names = [t["name"] for t in yaml.safe_load(SMALL.read_text())["tables"]]
    plan = {n: {"type": "table_wise", "rank": 0} for n in names}
    plan["user"] = {"type": "row_wise", "sizes": [50_000, 50_000]}
    config = small_with(tmp_path, plan=plan)
    result = CliRunner().invoke(cli, ["train", str(config), "--nproc", "3"])
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {config}.plan: invalid sharding plan:\n"
        "  table 'user': row_wise gives 2 sizes for a world of 3 ranks\n"
    )


def test_a_fixed_host_count_checks_the_plan_for_every_hosts_ranks(tmp_path):
    names = [t["name"] for t in yaml.safe_load(SMALL.read_text())["tables"]]
    plan = {n: {"type": "table_wise", "rank": 0} for n in names}
    plan["user"] = {"type": "row_wise", "sizes": [50_000, 50_000]}
    config = small_with(tmp_path, plan=plan)
    options = ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400"]
    result = CliRunner().invoke(cli, ["train", str(config), *options])
    assert result.exit_code == 1, result.output
    assert "row_wise gives 2 sizes for a world of 4 ranks" in result.output


def test_resume_without_a_checkpoint_section_is_refused_before_launching(tmp_path):
    config = small_with(tmp_path, checkpoint=None)
    result = CliRunner().invoke(cli, ["train", str(config), "--resume"])
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {config}: --resume continues from the latest checkpoint under "
        "checkpoint.dir, and the config has no checkpoint: section\n"
    )


@pytest.mark.parametrize("from_config", [False, True])
def test_cuda_without_a_gpu_per_rank_is_refused_in_one_line_before_launching(
    tmp_path, monkeypatch, from_config
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    config = small_with(tmp_path, device="cuda" if from_config else None)
    option = [] if from_config else ["--device", "cuda"]
    result = CliRunner().invoke(cli, ["train", str(config), "--nproc", "2", *option])
    assert result.exit_code == 1, result.output
    where = f"{config}.device" if from_config else "--device"
    assert result.output == (
        f"Error: {where}: cuda needs 2 CUDA devices for this host's 2 ranks (one each: NCCL "
        "refuses two ranks on one device); torch sees no CUDA device\n"
    )


def test_train_takes_the_configs_devices():
    result = CliRunner().invoke(cli, ["train", str(SMALL), "--device", "gpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    known = ", ".join(repr(d) for d in typing.get_args(Device))  # the config's
    assert result.output.splitlines()[-1] == (
        f"Error: Invalid value for '--device': 'gpu' is not one of {known}."
    )


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_a_cuda_only_sparse_optimizer_is_refused_on_cpu_in_one_line(tmp_path, optimizer):
    config = small_with(tmp_path, sparse_optimizer={"type": optimizer, "lr": 0.01})
    refusal = (
        f"Error: {config}.sparse_optimizer.type: the fused optimizer {optimizer} runs on cuda "
        "only: FBGEMM's CPU kernels lack it; on cpu use sgd, rowwise_adagrad or adagrad\n"
    )
    for command in (["train", str(config)], ["simulate", str(config), "-w", "2", "--check"]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 1 and result.output == refusal, result.output
    # Planning prices its two moments: twice the weights' bytes in float32 state.
    planned = CliRunner().invoke(cli, ["simulate", str(config), "-w", "2", "--json"])
    assert planned.exit_code == 0, planned.output
    for rank in json.loads(planned.output)["ranks"]:
        assert rank["optimizer_state"] == 2 * rank["weights"]


def tables_only(tmp_path: Path) -> Path:
    """Three tables of three dims, and nothing else."""
    tables = [
        {"name": "user", "num_embeddings": 50_000, "embedding_dim": 64, "features": ["uid"]},
        {"name": "item", "num_embeddings": 20_000, "embedding_dim": 32, "features": ["iid"]},
        {"name": "city", "num_embeddings": 300, "embedding_dim": 16, "features": ["city"]},
    ]
    path = tmp_path / "tables.yaml"
    path.write_text(yaml.safe_dump({"tables": tables}))
    return path


def test_plan_show_and_simulate_take_a_tables_only_config_of_mixed_dims(tmp_path):
    config, out = tables_only(tmp_path), tmp_path / "plan.yaml"
    planned = CliRunner().invoke(cli, ["plan", str(config), "-w", "2", "--out", str(out)])
    assert planned.exit_code == 0, planned.output
    # Priced at the planner's defaults: a batch of 512 a rank, row-wise Adagrad's state.
    model = load_config(config, use="plan")
    assert (model.batch_size, model.sparse_optimizer.type) == (512, "rowwise_adagrad")
    loads = plan_loads(ShardingPlan.load(out), model.tables, topology_for(model, 2), 512)
    assert [line.split()[:2] for line in planned.output.splitlines()[1:3]] == [
        [str(load.rank), format_bytes(load.memory).split()[0]] for load in loads
    ]

    shown = CliRunner().invoke(cli, ["show", str(out), "--config", str(config)])
    assert shown.exit_code == 0, shown.output
    assert "user (50000 x 64) " in shown.output and "city (300 x 16) " in shown.output

    simulated = CliRunner().invoke(
        cli, ["simulate", str(config), "-w", "2", "--plan", str(out), "--batches", "1"]
    )
    assert simulated.exit_code == 0, simulated.output
    assert "batches of 512 samples per rank (synthetic data)" in simulated.output

    trained = CliRunner().invoke(cli, ["train", str(config)])
    assert trained.exit_code == 1 and "Traceback" not in trained.output
    assert trained.output.startswith(
        f"Error: {config}: missing keys ['model', 'sparse_optimizer', 'dense_optimizer', "
        "'batch_size', 'steps'] (training needs them;"
    )
