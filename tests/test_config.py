"""Training configs fail before training, naming the file, key and problem."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig

from embshard.app.cli import main as cli
from embshard.app.config import launch_device, load_config
from embshard.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from make_criteo_sample import sample_lines  # noqa: E402


def small() -> dict:
    return yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_configs_load(tmp_path):
    """From a copy of configs/ beside a data/ folder: the Criteo config reads
    ../data/criteo_sample/*.tsv, relative to its own folder."""
    (tmp_path / "data" / "criteo_sample").mkdir(parents=True)
    for name in ("train", "eval"):
        (tmp_path / "data" / "criteo_sample" / f"{name}.tsv").write_text("")
    (tmp_path / "configs").mkdir()
    for path in (ROOT / "configs").glob("*.yaml"):
        if path.name != "example_plan.yaml":
            copy = tmp_path / "configs" / path.name
            copy.write_text(path.read_text())
            load_config(copy)


def broken(change) -> dict:
    data = small()
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["model"].update(dense_in=3),
            r"config.yaml.model: unknown keys \['dense_in'\]",
        ),
        (lambda d: d.pop("steps"), r"config.yaml: missing keys \['steps'\]"),
        (lambda d: d.update(batch_size="big"), "config.yaml.batch_size: expected int, got 'big'"),
        (lambda d: d["model"].update(kind="wide"), "config.yaml.model.kind: expected one of"),
        (lambda d: d["tables"][0].update(embedding_dim=8), "one embedding_dim for all"),
        (lambda d: d["tables"][1].update(name="user"), "table names repeat"),
        (
            lambda d: d.update(plan={"user": {"type": "row_wise"}}),
            r"table 'item': no entry in the plan\n  table 'category': no entry",
        ),
        (
            lambda d: d["tables"][1].update(data_type="fp16"),
            r"all tables need one data_type .* got \['fp16', 'fp32'\]",
        ),
        (lambda d: d["tables"][0].update(data_type="int8"), "data_type: expected one of"),
        (lambda d: d.update(comm_precision="fp8"), "comm_precision: expected one of"),
        (
            lambda d: d.setdefault("data", {}).update(epochs=0),
            "config.yaml.data.epochs: must be at least 1",
        ),
        (
            lambda d: d.update(plan={"user": {"type": "row_wise", "size": [1]}}),
            r"config.yaml.plan: invalid sharding plan:\n  table 'user': unknown keys",
        ),
        (
            lambda d: d["dense_optimizer"].update(type="lamb"),
            r"config.yaml.dense_optimizer.type: the dense layers take \['sgd', 'adagrad', 'adam'\]",
        ),
        (
            lambda d: d.update(data={"type": "criteo", "path": "/nope.tsv"}),
            r"tables: Criteo features are cat_0..cat_25, got \['category'",
        ),
        (lambda d: d.update(steps=0), "config.yaml.steps: must be at least 1"),
        (
            lambda d: d.update(data={"type": "criteo", "path": "x.tsv", "drift": {}}),
            "config.yaml.data.drift: only synthetic data drifts",
        ),
        (
            lambda d: d.update(data={"drift": {"live_per_row": 0}}),
            "config.yaml.data.drift.live_per_row: must be above 0",
        ),
        (
            lambda d: d["tables"][3].update(dynamic={"buckets": 300}),
            r"tables\[3\].dynamic.buckets: must divide num_embeddings \(5000\), got 300",
        ),
        (
            lambda d: d["tables"][3].update(dynamic={"buckets": 50, "policy": "ttl"}),
            r"tables\[3\].dynamic: policy 'ttl' needs ttl_steps",
        ),
        (
            lambda d: d["tables"][3].update(dynamic={"buckets": 50, "admit_after": 0}),
            r"tables\[3\].dynamic: admit_after",
        ),
        (
            lambda d: d["tables"][3].update(features=["city", "device"], dynamic={"buckets": 50}),
            r"the dynamic table 'city' takes raw ids, so its features feed no other table; "
            r"\['device'\] do",
        ),
        (
            lambda d: d["tables"][3].update(dynamic={"buckets": 50}, shardings=["data_parallel"]),
            r"tables\[3\].shardings: a dynamic table is table_wise, row_wise or column_wise, "
            r"got \[.data_parallel.\]",
        ),
        (
            lambda d: d.update(data={"drift": {"turnover_steps": 0}}),
            "config.yaml.data.drift.turnover_steps: must be at least 1",
        ),
        (
            lambda d: d.update(data={"drift": {"live": {"users": 10}}}),
            r"config.yaml.data.drift.live: 'users' is no table a feature draws from \[",
        ),
        (
            lambda d: d.update(data={"drift": {"live": {"user": 0.5}}}),
            r"config.yaml.data.drift.live.user: expected a count of ids above 0, got 0.5",
        ),
        (
            lambda d: d.update(device="gpu"),
            r"config.yaml.device: expected one of \['auto', 'cpu', 'cuda'\], got 'gpu'",
        ),
    ],
)
def test_config_errors(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, broken(change)))


def seen_gpus(monkeypatch, count: int) -> None:
    """torch sees ``count`` CUDA devices (none: CUDA is not available)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(
    ("gpus", "ranks", "choice", "chosen"),
    [
        (0, 1, "auto", "cpu"),
        (1, 2, "auto", "cpu"),  # NCCL takes one rank per device
        (1, 1, "auto", "cuda"),
        (4, 2, "auto", "cuda"),
        (2, 2, "cpu", "cpu"),
        (2, 2, "cuda", "cuda"),
    ],
)
def test_the_device_is_cuda_where_each_rank_has_a_gpu(monkeypatch, gpus, ranks, choice, chosen):
    seen_gpus(monkeypatch, gpus)
    config = replace(load_config(ROOT / "configs" / "small.yaml"), device=choice)
    assert launch_device(config, "small.yaml", ranks) == chosen
    assert launch_device(config, "small.yaml", ranks, override="cpu") == "cpu"


@pytest.mark.parametrize(
    ("gpus", "ranks", "need", "seen"),
    [
        (0, 1, "1 CUDA device for this host's 1 rank", "no CUDA device"),
        (1, 2, "2 CUDA devices for this host's 2 ranks", "1 CUDA device"),
        (2, 3, "3 CUDA devices for this host's 3 ranks", "2 CUDA devices"),
    ],
)
def test_cuda_without_a_gpu_per_rank_is_refused_naming_what_torch_sees(
    monkeypatch, gpus, ranks, need, seen
):
    seen_gpus(monkeypatch, gpus)
    config = load_config(ROOT / "configs" / "small.yaml")
    why = f"cuda needs {need} (one each: NCCL refuses two ranks on one device); torch sees {seen}"
    with pytest.raises(ConfigError) as refused:
        launch_device(config, "small.yaml", ranks, override="cuda")
    assert str(refused.value) == f"--device: {why}"
    with pytest.raises(ConfigError) as refused:
        launch_device(replace(config, device="cuda"), "small.yaml", ranks)
    assert str(refused.value) == f"small.yaml.device: {why}"


def test_unreadable_criteo_file(tmp_path):
    data = yaml.safe_load((ROOT / "configs" / "criteo_sample.yaml").read_text())
    data["data"]["path"] = str(tmp_path / "missing.tsv")
    with pytest.raises(ConfigError, match=r"data.path: cannot read .*missing.tsv"):
        load_config(write(tmp_path, data))


def test_unreadable_config(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "none.yaml")


def test_cli_reports_config_errors_before_starting(tmp_path):
    path = write(tmp_path, broken(lambda d: d["model"].update(dense_in=3)))
    result = CliRunner().invoke(cli, ["train", str(path), "--nproc", "2"])
    assert result.exit_code == 1
    assert "unknown keys ['dense_in']" in result.output


SEQUENCE = {
    "name": "history",
    "num_embeddings": 500,
    "embedding_dim": 16,
    "features": ["history"],
    "pooling": "none",
}


def test_sequence_tables_load_for_planning_not_training(tmp_path):
    path = write(tmp_path, broken(lambda d: d["tables"].append(SEQUENCE)))
    with pytest.raises(
        ConfigError,
        match=r"config.yaml.tables\[5\].pooling: none makes 'history' a sequence table, "
        "which the DLRM model cannot take",
    ):
        load_config(path)
    config = load_config(path, use="plan")
    assert type(config.tables[0].torchrec_config()) is EmbeddingBagConfig
    history = config.tables[5].torchrec_config()
    assert type(history) is EmbeddingConfig and history.feature_names == ["history"]
    with pytest.raises(ValueError, match="'history' has pooling none"):
        config.tables[5].embedding_bag_config()

    def all_fp16(data: dict) -> None:
        data["tables"].append(SEQUENCE)
        for table in data["tables"]:
            table["data_type"] = "fp16"

    fp16 = load_config(write(tmp_path, broken(all_fp16)), use="plan")
    assert fp16.tables[5].torchrec_config().data_type == DataType.FP16


def test_relative_paths_are_read_from_the_configs_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project" / "configs"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.tsv").write_text("\n".join(sample_lines(64, seed=0)) + "\n")
    data = yaml.safe_load((ROOT / "configs" / "criteo_sample.yaml").read_text())
    data.pop("plan")
    data["data"] = {"type": "criteo", "path": "data/train.tsv"}
    data["logging"] = {"metrics": "../runs/metrics.jsonl"}
    data["checkpoint"] = {"dir": str(tmp_path / "absolute")}
    (folder / "criteo.yaml").write_text(yaml.safe_dump(data))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    config = load_config(folder / "criteo.yaml")
    assert config.data.path == str(folder / "data" / "train.tsv")
    assert config.logging.metrics == str(tmp_path / "project" / "runs" / "metrics.jsonl")
    assert config.checkpoint.dir == str(tmp_path / "absolute")
    simulated = CliRunner().invoke(
        cli, ["simulate", str(folder / "criteo.yaml"), "-w", "2", "--batches", "1"]
    )
    assert simulated.exit_code == 0, simulated.output
    assert f"Criteo data from {folder / 'data' / 'train.tsv'}" in simulated.output

    (folder / "data" / "train.tsv").unlink()
    refused = CliRunner().invoke(cli, ["simulate", str(folder / "criteo.yaml"), "-w", "2"])
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    assert refused.output == (
        f"Error: {folder / 'criteo.yaml'}.data.path: cannot read {folder / 'data' / 'train.tsv'} "
        "(a relative path in a config is read from the config's folder)\n"
    )
