"""Training configs fail before training, naming the file, key and problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig

from embshard.cli import main as cli
from embshard.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def small() -> dict:
    return yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_configs_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Criteo config reads data/criteo_sample/*.tsv
    for name in ("train", "eval"):
        (tmp_path / "data" / "criteo_sample").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "criteo_sample" / f"{name}.tsv").write_text("")
    for path in (ROOT / "configs").glob("*.yaml"):
        if path.name != "example_plan.yaml":
            load_config(path)


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
            lambda d: d["sparse_optimizer"].update(type="adam"),
            "sparse_optimizer.type: FBGEMM's CPU",
        ),
        (
            lambda d: d.update(data={"type": "criteo", "path": "/nope.tsv"}),
            r"tables: Criteo features are cat_0..cat_25, got \['category'",
        ),
        (lambda d: d.update(steps=0), "config.yaml.steps: must be at least 1"),
    ],
)
def test_config_errors(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, broken(change)))


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
    config = load_config(path, trains=False)
    assert type(config.tables[0].torchrec_config()) is EmbeddingBagConfig
    history = config.tables[5].torchrec_config()
    assert type(history) is EmbeddingConfig and history.feature_names == ["history"]
    with pytest.raises(ValueError, match="'history' has pooling none"):
        config.tables[5].embedding_bag_config()

    def all_fp16(data: dict) -> None:
        data["tables"].append(SEQUENCE)
        for table in data["tables"]:
            table["data_type"] = "fp16"

    fp16 = load_config(write(tmp_path, broken(all_fp16)), trains=False)
    assert fp16.tables[5].torchrec_config().data_type == DataType.FP16
