"""Synthetic batches and the Criteo reader."""

from __future__ import annotations

import itertools
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from embshard.app.config import CRITEO_DENSE, TableConfig
from embshard.app.data import CriteoData, CriteoFormatError, Feed, SyntheticData

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


def test_features_alone_are_the_batches_features(tmp_path):
    synthetic = SyntheticData(TABLES, 5, 64, 0, rank=1)
    path = write_lines(tmp_path / "day.tsv", sample_lines(150, seed=2))
    criteo = CriteoData(str(path), None, CRITEO_TABLES, 64, rank=0, world=1)
    for source in (synthetic, criteo):
        pairs = zip(source.epoch_features(), source.epoch_batches())
        for features, batch in itertools.islice(pairs, 3):
            assert features.keys() == batch.sparse.keys()
            assert torch.equal(features.values(), batch.sparse.values())
            assert torch.equal(features.lengths(), batch.sparse.lengths())


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
    (batch,) = CriteoData(str(path), None, CRITEO_TABLES, 1, 0, 1)._batches(str(path))
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
        list(reader._batches(str(path)))
    skipping = CriteoData(str(path), None, CRITEO_TABLES, 2, 0, 1, skip_bad_lines=True)
    batches = list(skipping._batches(str(path)))
    assert [b.size for b in batches] == [2, 2, 1] and skipping.skipped == 1


def uneven_lines(lines: int, middle: int, seed: int) -> list[str]:
    """``lines`` sample lines, ``middle`` long ones, ``lines`` more: split three ways
    by bytes, the middle rank gets few lines. The long lines hold the same values,
    zeros padded into their integer columns (an empty one reads 0 too)."""
    sample = sample_lines(2 * lines + middle, seed)
    pad = sum(len(line) + 1 for line in sample[:lines]) // middle // CRITEO_DENSE
    padded = []
    for line in sample[lines : lines + middle]:
        fields = line.split("\t")
        fields[1 : 1 + CRITEO_DENSE] = [x.zfill(len(x) + pad) for x in fields[1 : 1 + CRITEO_DENSE]]
        padded.append("\t".join(fields))
    return sample[:lines] + padded + sample[lines + middle :]


def lines_per_rank(lines: list[str], world: int) -> list[int]:
    """The documented split: rank r reads the lines that start in its w-th of the bytes."""
    size = sum(len(line) + 1 for line in lines)
    starts = list(itertools.accumulate([len(line) + 1 for line in lines[:-1]], initial=0))
    return [
        sum(size * r // world <= s < size * (r + 1) // world for s in starts) for r in range(world)
    ]


def batch_sizes(lines: int, batch: int, steps: int) -> list[int]:
    """A rank's batch sizes over ``steps`` steps of one pass: full, partial, then empty."""
    return [min(batch, max(0, lines - batch * i)) for i in range(steps)]


def test_uneven_lines_give_the_middle_rank_few(tmp_path):
    lines = uneven_lines(40, 3, seed=4)
    counts = lines_per_rank(lines, 3)
    assert sum(counts) == 83 and counts[1] <= 4 and min(counts[0], counts[2]) >= 38
    path = write_lines(tmp_path / "u.tsv", lines)
    padded = CriteoData(str(path), None, CRITEO_TABLES, 100, 1, 3)
    plain = write_lines(tmp_path / "p.tsv", sample_lines(83, seed=4))
    (expected,) = CriteoData(str(plain), None, CRITEO_TABLES, 100, 0, 1)._batches(str(plain))
    (batch,) = padded._batches(str(path))
    first = counts[0]
    assert torch.equal(batch.dense, expected.dense[first : first + counts[1]])


def read_passes(feeds: list[Feed]) -> list[list[int]]:
    """Every rank's batch sizes, step by step, driving the feeds as the training loop
    does: the sum of ``pending`` over ranks is its all-reduce; a pass ends when it is 0.
    """
    steps: list[list[int]] = []
    more = [feed.next_epoch() for feed in feeds]
    while all(more) and sum(feed.pending for feed in feeds):
        batches = [feed.take() for feed in feeds]
        steps.append([b.size for b in batches])
        for batch in batches:
            assert batch.sparse.keys() == ["cat_0", "cat_25", "cat_3"]
            assert batch.dense.shape == (batch.size, 13)
            assert batch.sparse.lengths().numel() == 3 * batch.size
        if not sum(feed.pending for feed in feeds):
            more = [feed.next_epoch() for feed in feeds]
    assert not any(more), "the feeds disagree about the passes left"
    return steps


def test_feeds_keep_uneven_ranks_in_step_pass_by_pass(tmp_path):
    lines = uneven_lines(40, 3, seed=4)
    path = write_lines(tmp_path / "u.tsv", lines)
    counts = lines_per_rank(lines, 3)
    readers = [CriteoData(str(path), None, CRITEO_TABLES, 16, r, 3, epochs=2) for r in range(3)]
    steps = read_passes([Feed(reader) for reader in readers])
    per_pass = math.ceil(max(counts) / 16)
    one_pass = [list(s) for s in zip(*[batch_sizes(n, 16, per_pass) for n in counts])]
    assert steps == one_pass * 2
    assert steps[0][1] == counts[1] and steps[1][1] == 0  # a partial batch, then empty ones
    assert sum(map(sum, steps)) == 2 * len(lines)
    assert [r.batches_per_epoch() for r in readers] == [math.ceil(n / 16) for n in counts]
    # Resuming at step per_pass + 1: pass 1, its second step.
    resumed = read_passes([Feed(reader, epoch=1, skip=1) for reader in readers])
    assert resumed == one_pass[1:]


def test_a_rank_with_no_lines_feeds_empty_batches(tmp_path):
    path = write_lines(tmp_path / "two.tsv", sample_lines(2, seed=0))
    readers = [CriteoData(str(path), None, CRITEO_TABLES, 4, r, 3, epochs=1) for r in range(3)]
    assert sum(r.batches_per_epoch() for r in readers) == 2
    steps = read_passes([Feed(reader) for reader in readers])
    assert len(steps) == 1 and sorted(steps[0]) == [0, 1, 1]


def test_criteo_eval_keeps_the_last_partial_batch(tmp_path):
    path = write_lines(tmp_path / "e.tsv", sample_lines(10, seed=2))
    reader = CriteoData(str(tmp_path / "e.tsv"), str(path), CRITEO_TABLES, 4, 0, 1)
    assert [b.size for b in reader.eval_batches(5)] == [4, 4, 2]
    assert [b.size for b in reader.eval_batches(2)] == [4, 4]


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(CriteoFormatError, match=r"empty\.tsv: the file is empty"):
        CriteoData(str(tmp_path / "empty.tsv"), None, CRITEO_TABLES, 4, 0, 1)


def test_synthetic_feed_resumes_at_its_step():
    data = SyntheticData(TABLES, 5, 8, 0, rank=0)
    feed = Feed(data, skip=5)
    assert feed.next_epoch()
    assert torch.equal(feed.take().dense, data.batch(5).dense)
    assert torch.equal(feed.take().dense, data.batch(6).dense)
    empty = data.empty_batch()
    assert empty.size == 0 and empty.sparse.keys() == ["user_id", "item_id", "last_item"]


DRIFT_TABLES = [TableConfig("user", 1000, 8, ["user_id"], mean_pooling=8)]


def drifting(live_per_row: float = 0.5, turnover_steps: int = 10, rank: int = 0):
    from embshard.app.config import DriftConfig

    return SyntheticData(DRIFT_TABLES, 5, 256, 0, rank, DriftConfig(live_per_row, turnover_steps))


def raw_ids(data: SyntheticData, step: int, split: str = "train", at: int | None = None):
    """The raw ids a batch was drawn with (its features hold them hashed onto rows)."""
    return data._draw(step, split, at)[2][0][2]


def test_drifting_ids_live_in_a_window_that_moves_one_turnover_a_live_set():
    data = drifting()  # 500 ids live at a time, 50 born a step
    seen = {s: set(raw_ids(data, s).tolist()) for s in (0, 1, 5, 10, 20)}
    assert all(0 < len(ids) <= 500 for ids in seen.values())
    assert all(0 <= i < 1 << 63 for ids in seen.values() for i in ids)
    assert max(max(ids) for ids in seen.values()) > 1 << 40  # spread over 63 bits
    assert not seen[0] & seen[10] and not seen[10] & seen[20]  # a whole turnover apart
    assert seen[0] & seen[5] and seen[5] & seen[10]  # half a turnover apart
    fresh = seen[1] - seen[0]  # born since: the newest ids are the hottest
    counts = torch.tensor([i in fresh for i in raw_ids(data, 1).tolist()])
    assert counts.float().mean() > 0.3  # 50 of 500 ids, drawn a third of the time or more


def test_drifting_batches_hash_raw_ids_onto_rows_and_score_the_raw_ids():
    data = drifting()
    batch = data.batch(3)
    raw = raw_ids(data, 3)
    assert torch.equal(batch.sparse.values(), raw % 1000)
    assert batch.sparse.values().max() < 1000
    assert torch.equal(batch.labels, data.batch(3).labels)  # deterministic
    assert next(data.epoch_features()).values().max() < 1000
    # the labels come from the raw ids: hashing onto rows loses what collisions hide
    scores = data._score("user_id", raw)
    assert not torch.equal(scores, data._score("user_id", raw % 1000))


def test_drifting_held_out_batches_are_the_stream_at_the_step():
    data = drifting()
    early, late = data.eval_batches(2, step=0), data.eval_batches(2, step=20)
    early_ids = set(raw_ids(data, 0, "eval", 0).tolist())
    assert early_ids & set(raw_ids(data, 0).tolist())
    assert not early_ids & set(raw_ids(data, 20).tolist())
    assert not torch.equal(early[0].sparse.values(), late[0].sparse.values())
    fixed = SyntheticData(DRIFT_TABLES, 5, 256, 0, rank=0)  # no drift: one held-out set
    assert torch.equal(
        fixed.eval_batches(1, step=0)[0].labels, fixed.eval_batches(1, step=50)[0].labels
    )


def test_a_dynamic_tables_features_keep_their_raw_ids(tmp_path):
    from embshard.app.config import DriftConfig, DynamicConfig

    dynamic = TableConfig("user", 1000, 8, ["user_id"], dynamic=DynamicConfig(buckets=10))
    tables = [dynamic, TableConfig("item", 300, 8, ["item_id"])]
    data = SyntheticData(tables, 5, 256, 0, 0, DriftConfig(0.5, 10))
    drawn = {f: ids for f, _, ids in data._draw(4, "train")[2]}
    features = data.batch(4).sparse.to_dict()
    assert torch.equal(features["user_id"].values(), drawn["user_id"])  # raw, over 63 bits
    assert features["user_id"].values().max() > 1 << 40
    assert torch.equal(features["item_id"].values(), drawn["item_id"] % 300)
    criteo = [TableConfig("c0", 1000, 8, ["cat_0"], dynamic=DynamicConfig(buckets=10))]
    criteo.append(TableConfig("c1", 1000, 8, ["cat_1"]))
    path = write_lines(tmp_path / "d.tsv", sample_lines(20, seed=5))
    batch = next(CriteoData(str(path), None, criteo, 20, 0, 1).epoch_batches())
    columns = [line.split("\t")[14:16] for line in sample_lines(20, seed=5)]
    raw = [[int(c, 16) for c in column if c] for column in zip(*columns)]
    found = batch.sparse.to_dict()
    assert found["cat_0"].values().tolist() == raw[0]
    assert found["cat_1"].values().tolist() == [i % 1000 for i in raw[1]]


def test_drifting_features_of_one_table_share_its_ids():
    from embshard.app.config import DriftConfig

    tables = [
        TableConfig("item", 1000, 8, ["item_id", "last_item"]),
        TableConfig("user", 1000, 8, ["user_id"]),
    ]
    data = SyntheticData(tables, 5, 512, 0, 0, DriftConfig(0.5, 10))
    raw = {f: set(ids.tolist()) for f, _, ids in data._draw(3, "train")[2]}
    assert len(raw["item_id"] & raw["last_item"]) > 0.5 * len(raw["item_id"])
    assert not raw["user_id"] & raw["item_id"]


def test_drifting_ids_live_by_table_are_the_same_stream_whatever_its_rows():
    from embshard.app.config import DriftConfig

    def stream(rows: int, live: dict[str, int] | None) -> torch.Tensor:
        tables = [TableConfig("user", rows, 8, ["user_id"], mean_pooling=8)]
        data = SyntheticData(tables, 5, 256, 0, 0, DriftConfig(0.5, 10, live))
        return raw_ids(data, 7)

    assert torch.equal(stream(1000, {"user": 500}), stream(1000, None))  # 0.5 a row
    assert torch.equal(stream(1600, {"user": 500}), stream(1000, None))
    assert not torch.equal(stream(1600, None), stream(1000, None))
