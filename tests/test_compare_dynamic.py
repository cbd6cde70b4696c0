"""tools/compare_dynamic.py's static twin: the same bytes as the dynamic config's tables
and maps, and the same raw ids."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from embshard.app.config import load_config
from embshard.app.data import SyntheticData
from tools import compare_dynamic

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dynamic.yaml"


def test_the_static_twin_holds_the_same_bytes_and_draws_the_same_ids(tmp_path):
    twin = tmp_path / "twin.yaml"
    twin.write_text(
        yaml.safe_dump(compare_dynamic.twin(yaml.safe_load(CONFIG.read_text()), CONFIG))
    )
    dynamic, static = load_config(CONFIG, check_files=False), load_config(twin, check_files=False)
    assert dynamic.sparse_optimizer.type == "rowwise_adagrad"  # one float32 of state a row
    grown = 0
    for d, s in zip(dynamic.tables, static.tables, strict=True):
        assert s.dynamic is None
        row = 4 * s.embedding_dim + 4
        held = d.num_embeddings * (4 * d.embedding_dim + 4)
        if d.dynamic is not None:
            held += d.num_embeddings * d.id_map(0).bytes_per_row()
            grown += s.num_embeddings > d.num_embeddings
        assert 0 <= held - s.num_embeddings * row < row, (d.name, held, s.num_embeddings)
    assert grown == 2  # the user and item tables
    for step in (0, 700):
        drawn = [
            SyntheticData(c.tables, 13, 64, c.seed, 1, c.data.drift)._draw(step, "train")[2]
            for c in (dynamic, static)
        ]
        for (f, bags, ids), (g, twin_bags, twin_ids) in zip(*drawn, strict=True):
            assert f == g and torch.equal(bags, twin_bags) and torch.equal(ids, twin_ids)


def test_a_criteo_twin_reads_the_same_file_and_a_set_live_count_is_kept(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())
    config["data"] = {"type": "criteo", "path": "train.tsv"}
    for i, table in enumerate(config["tables"]):
        table["features"] = [f"cat_{i}"]
    path = tmp_path / "criteo.yaml"
    path.write_text(yaml.safe_dump(config))
    twin = compare_dynamic.twin(config, path)
    assert twin["data"] == config["data"]  # no drift: the file's values, whatever the rows
    assert twin["tables"][0]["num_embeddings"] > config["tables"][0]["num_embeddings"]

    config = yaml.safe_load(CONFIG.read_text())
    config["data"]["drift"]["live"] = {"user": 5000}
    path.write_text(yaml.safe_dump(config))
    live = compare_dynamic.twin(config, path)["data"]["drift"]["live"]
    assert live == {"user": 5000, "item": 51200}
