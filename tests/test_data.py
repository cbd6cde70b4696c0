"""Synthetic batches and the Criteo reader."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from embshard.config import TableConfig
from embshard.data import CriteoData, CriteoFormatError, SyntheticData

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from make_criteo_sample import sample_lines

TABLES = [
    TableConfig("user", 1000, 8, ["user_id"]),
    TableConfig("item", 300, 8, ["item_id", "last_item"], mean_pooling=4),
    TableConfig("small", 50, 8, ["item_id"]),  # item_id also feeds a smaller table
]


def test_synthetic_is_deterministic_per_rank_and_step():
    a, b = SyntheticData(TABLES, 5, 64, 0, rank=0), SyntheticData(TABLES, 5, 64, 0, rank=0)
    first, again = a.batch(3), b.batch(3)
    assert torch.equal(first.sparse.values(), again.sparse.values())
    assert torch.equal(first.labels, again.labels) and torch.equal(first.dense, again.dense)
    other_rank = SyntheticData(TABLES, 5, 64, 0, rank=1).batch(3)
    assert not torch.equal(first.dense, other_rank.dense)
    assert not torch.equal(first.dense, a.batch(4).dense)
    assert not torch.equal(first.dense, a.batch(3, "eval").dense)


def test_synthetic_ids_pooling_and_labels():
    batch = SyntheticData(TABLES, 5, 4096, 1, rank=0).batch(0)
    assert batch.sparse.keys() == ["user_id", "item_id", "last_item"]
    per_feature = batch.sparse.to_dict()
    assert int(per_feature["user_id"].values().max()) < 1000
    assert int(per_feature["item_id"].values().max()) < 50  # bounded by the smaller table
    assert per_feature["user_id"].lengths().min() >= 1
    assert abs(per_feature["last_item"].lengths().float().mean() - 4) < 0.3
    ids = per_feature["user_id"].values()
    assert (ids < 32).float().mean() > 0.4  # power law: a few hot ids
    assert 0.2 < batch.labels.mean() < 0.8


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


CRITEO_TABLES = [
    TableConfig("a", 100, 8, ["cat_0", "cat_25"]),
    TableConfig("b", 7, 8, ["cat_3"]),
]


def test_criteo_parsing(tmp_path):
    fields = ["1", "5", "", "-4", *["0"] * 10, "ff", "", "", "10", *[""] * 21, "abc"]
    path = write_lines(tmp_path / "one.tsv", ["\t".join(fields)])
    (batch,) = CriteoData(str(path), None, CRITEO_TABLES, 1, 0, 1)._batches(str(path), repeat=False)
    assert batch.labels.tolist() == [1.0]
    assert batch.dense[0, :3].tolist() == pytest.approx([math.log1p(5), 0.0, 0.0])
    assert batch.sparse.keys() == ["cat_0", "cat_25", "cat_3"]
    assert batch.sparse.lengths().tolist() == [1, 1, 1]
    assert batch.sparse.values().tolist() == [0xFF % 100, 0xABC % 100, 0x10 % 7]


def test_ranks_read_every_line_once(tmp_path):
    lines = sample_lines(101, seed=3)
    path = write_lines(tmp_path / "s.tsv", lines)
    seen = []
    for rank in range(3):
        reader = CriteoData(str(path), None, CRITEO_TABLES, 1, rank, 3)
        seen += [text for _, text in reader._lines(str(path))]
    assert sorted(seen) == sorted(lines)
    numbers = [
        n
        for rank in range(3)
        for n, _ in CriteoData(str(path), None, CRITEO_TABLES, 1, rank, 3)._lines(str(path))
    ]
    assert numbers == list(range(1, 102))


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("2\t" + "\t".join(["1"] * 39), "label '2' is not 0 or 1"),
        ("1\tx" + "\t1" * 38, "invalid literal for int"),
        ("1\t1\t1", "3 tab-separated fields, expected 40"),
        ("0" + "\t1" * 13 + "\tzz" + "\t1" * 25, "invalid literal for int() with base 16"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, reason):
    lines = sample_lines(5, seed=0)
    lines.insert(3, bad)
    path = write_lines(tmp_path / "bad.tsv", lines)
    reader = CriteoData(str(path), None, CRITEO_TABLES, 2, 0, 1)
    with pytest.raises(
        CriteoFormatError, match="bad.tsv:4: malformed Criteo line: " + re.escape(reason)
    ):
        list(reader._batches(str(path), repeat=False))
    skipping = CriteoData(str(path), None, CRITEO_TABLES, 2, 0, 1, skip_bad_lines=True)
    batches = list(skipping._batches(str(path), repeat=False))
    assert sum(b.size for b in batches) == 4 and skipping.skipped == 1
