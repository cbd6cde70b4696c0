"""Checkpoints: resharding across worlds and plans, optimizer state, safety, interop, CLI."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from oracle import Case, Table, global_batch, local_batches
from torch import nn
from torchrec import EmbeddingBagCollection

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, grid, row_wise, table_wise
from embshard import checkpoint as ckpt
from embshard.app.cli import main as cli

TABLES = (
    Table("a", 30, 16, ("f_a",)),
    Table("b", 30, 16, ("f_b",)),
    Table("c", 24, 16, ("f_c",)),
    Table("d", 40, 16, ("f_d",)),
)

PLANS = {
    4: {
        "a": table_wise(3),
        "b": row_wise([0, 20, 0, 10]),
        "c": column_wise([3, 0, 3, 1]),
        "d": row_wise(ranks=[2, 0, 3, 1]),  # row blocks out of rank order
    },
    1: {t.name: table_wise(0) for t in TABLES},
    2: {"a": row_wise(), "b": column_wise([1, 0]), "c": table_wise(1), "d": row_wise([5, 35])},
    3: {
        "a": column_wise([2, 0]),
        "b": table_wise(1),
        "c": row_wise(),
        "d": column_wise([0, 1, 2, 0]),
    },
}
GRID_PLANS = {
    4: {
        "a": grid(2, [[0, 1], [2, 3]]),  # TorchRec's grid, hosts of 2 ranks
        "b": grid(2, [[1, 3], [0, 1, 2, 3]], [[10, 20], [5, 0, 15, 10]]),
        "c": grid(4, [[3], [0, 2], [1, 2], [0]]),
        "d": grid(1, [[2, 3]]),  # TorchRec's table-row-wise on host 1
    },
    3: {
        "a": grid(2, [[0, 2], [1]], [[12, 18], [30]]),
        "b": grid(2, [[0, 1, 2], [0, 1, 2]]),
        "c": grid(1, [[1, 2]]),
        "d": grid(4, [[2], [0, 1], [1], [0, 2]]),
    },
    2: {
        "a": grid(1, [[0, 1]], [[30, 0]]),
        "b": grid(2, [[0], [0, 1]]),
        "c": grid(4, [[1], [0, 1], [0], [1]]),
        "d": grid(2, [[0, 1], [0, 1]], [[5, 35], [35, 5]]),
    },
}
LAYOUTS = {"mixed": PLANS, "grid": GRID_PLANS}


def build(world: int, optimizer, seed: int = 0, plan=None):
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=[t.config() for t in TABLES], device="meta")
    return embshard.shard(ebc, ShardingPlan(plan or PLANS[world]), optimizer=optimizer, seed=seed)


def train_steps(sharded, steps: int, seed: int = 0) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    case = Case(TABLES, sharded.plan, tuple([6] * world), seed=seed)
    for step in range(steps):
        sharded(local_batches(case, step)[rank]).values().pow(2).sum().backward()


def full(sharded) -> dict[str, torch.Tensor]:
    tables = {f"weight.{n}": embshard.gather_table(w) for n, w in sharded.weights.items()}
    state = {
        f"state.{k.split('.', 1)[1]}": embshard.gather_table(v)
        for k, v in sharded.optimizer_state().items()
    }
    return tables | state


def save_trained(root: str, optimizer, steps: int = 2, plan=None) -> dict:
    sharded = build(dist.get_world_size(), optimizer, plan=plan)
    train_steps(sharded, steps)
    ckpt.save(root, sharded, step=steps)
    return full(sharded)


def load_into(root: str, optimizer, plan=None) -> tuple[int, dict]:
    sharded = build(dist.get_world_size(), optimizer, seed=9, plan=plan)
    step = ckpt.load(ckpt.latest(root), sharded)
    return step, full(sharded)


def expected_rowwise(saved: torch.Tensor, saved_blocks, target_blocks) -> torch.Tensor:
    """Width-weighted mean of the saved blocks each target block overlaps."""
    columns = []
    for start, width in target_blocks:
        total = torch.zeros(saved.shape[0])
        for index, (s, w) in enumerate(saved_blocks):
            overlap = max(0, min(start + width, s + w) - max(start, s))
            total += saved[:, index] * overlap / width
        columns.append(total)
    return torch.stack(columns, dim=1)


def blocks_of(plan_spec, dim: int = 16) -> list[tuple[int, int]]:
    """The column blocks of a spec of equal widths."""
    if isinstance(plan_spec, embshard.ColumnWise | embshard.Grid):
        width = dim // len(plan_spec.ranks)
        return [(i * width, width) for i in range(len(plan_spec.ranks))]
    return [(0, dim)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reshard_from_4_ranks(world, world_size, tmp_path):
    optimizer = embshard.RowWiseAdagrad(lr=0.1)
    saved = world(4).run(save_trained, str(tmp_path), optimizer)[0]
    for step, loaded in world(world_size).run(load_into, str(tmp_path), optimizer):
        assert step == 2
        for t in TABLES:
            assert torch.equal(loaded[f"weight.{t.name}"], saved[f"weight.{t.name}"]), t.name
            expected = expected_rowwise(
                saved[f"state.{t.name}.momentum1"],
                blocks_of(PLANS[4][t.name]),
                blocks_of(PLANS[world_size][t.name]),
            )
            torch.testing.assert_close(
                loaded[f"state.{t.name}.momentum1"], expected, rtol=1e-6, atol=0
            )
            assert loaded[f"state.{t.name}.momentum1"].abs().sum() > 0


ALL_DATA_PARALLEL = {t.name: data_parallel() for t in TABLES}


@pytest.mark.parametrize("optimizer", [embshard.Adagrad(lr=0.1), embshard.RowWiseAdagrad(lr=0.1)])
def test_data_parallel_tables_reshard_to_and_from_every_layout(world, optimizer, tmp_path):
    # To: data-parallel at 2 ranks from every layout at 4 (and back at 3). Row-wise
    # Adagrad state merges the column blocks of c by their widths, as in any reshard.
    saved = world(4).run(save_trained, str(tmp_path / "4"), optimizer)[0]
    loaded = world(2).run(load_into, str(tmp_path / "4"), optimizer, ALL_DATA_PARALLEL)
    again = world(2).run(save_trained, str(tmp_path / "2"), optimizer, 2, ALL_DATA_PARALLEL)[0]
    back = world(3).run(load_into, str(tmp_path / "2"), optimizer)
    for t in TABLES:
        for step, tables in loaded:
            assert step == 2
            assert torch.equal(tables[f"weight.{t.name}"], saved[f"weight.{t.name}"]), t.name
            state = saved[f"state.{t.name}.momentum1"]
            if isinstance(optimizer, embshard.RowWiseAdagrad):
                state = expected_rowwise(state, blocks_of(PLANS[4][t.name]), [(0, 16)])
            torch.testing.assert_close(
                tables[f"state.{t.name}.momentum1"], state, rtol=1e-6, atol=0
            )
        for _, tables in back:
            assert torch.equal(tables[f"weight.{t.name}"], again[f"weight.{t.name}"]), t.name
            state = again[f"state.{t.name}.momentum1"]
            if isinstance(optimizer, embshard.RowWiseAdagrad):
                state = expected_rowwise(state, [(0, 16)], blocks_of(PLANS[3][t.name]))
            torch.testing.assert_close(
                tables[f"state.{t.name}.momentum1"], state, rtol=1e-6, atol=0
            )


def assert_loaded_as_saved(loaded: dict, saved: dict, saved_plan: dict, loaded_plan: dict) -> None:
    """Every table bit-exact, and its row-wise Adagrad state (non-zero) converted from
    the saved column blocks to the loaded ones."""
    for t in TABLES:
        assert torch.equal(loaded[f"weight.{t.name}"], saved[f"weight.{t.name}"]), t.name
        expected = expected_rowwise(
            saved[f"state.{t.name}.momentum1"],
            blocks_of(saved_plan[t.name]),
            blocks_of(loaded_plan[t.name]),
        )
        torch.testing.assert_close(loaded[f"state.{t.name}.momentum1"], expected, rtol=1e-6, atol=0)
        assert loaded[f"state.{t.name}.momentum1"].abs().sum() > 0


HOT_PLANS = {
    4: {
        "a": row_wise(hot_rows=6, ranks=[1, 2, 3, 0]),
        "b": row_wise([0, 10, 4, 10], hot_rows=6),  # an empty block on rank 0
        "c": data_parallel(),
        "d": row_wise(hot_rows=10),
    },
    2: {
        "a": row_wise([20, 0], hot_rows=10),
        "b": table_wise(1),
        "c": row_wise(hot_rows=1),
        "d": row_wise([1, 25], hot_rows=14),
    },
}


@pytest.mark.parametrize(
    ("saved_as", "loaded_as"),
    [(("hot", 4), ("mixed", 2)), (("mixed", 3), ("hot", 2)), (("hot", 4), ("hot", 2))],
    ids=str,
)
def test_hot_rows_reshard_to_and_from_other_layouts(world, tmp_path, saved_as, loaded_as):
    """Hot rows, copied on every rank, are saved once and load into any layout; any
    layout loads into hot rows and their copies (weights exact, row-wise Adagrad
    state too)."""
    layouts = {"hot": HOT_PLANS, "mixed": PLANS}
    (saved_kind, saved_world), (loaded_kind, loaded_world) = saved_as, loaded_as
    saved_plan, loaded_plan = layouts[saved_kind][saved_world], layouts[loaded_kind][loaded_world]
    optimizer = embshard.RowWiseAdagrad(lr=0.1)
    saved = world(saved_world).run(save_trained, str(tmp_path), optimizer, 2, saved_plan)[0]
    path = ckpt.latest(str(tmp_path))
    assert ckpt.verify(path).ok
    for key, entry in ckpt.read_metadata(path).state_dict_metadata.items():
        chunks = [tuple(c.offsets) for c in getattr(entry, "chunks", [])]
        assert len(chunks) == len(set(chunks)), key  # each copy saved once
    for step, loaded in world(loaded_world).run(load_into, str(tmp_path), optimizer, loaded_plan):
        assert step == 2
        assert_loaded_as_saved(loaded, saved, saved_plan, loaded_plan)


@pytest.mark.parametrize(
    ("saved_as", "loaded_as"),
    [
        (("grid", 4), ("mixed", 1)),
        (("grid", 4), ("mixed", 2)),
        (("mixed", 4), ("grid", 3)),
        (("grid", 3), ("grid", 2)),
        (("grid", 2), ("grid", 4)),
    ],
    ids=str,
)
def test_grid_reshards_to_and_from_every_layout(world, tmp_path, saved_as, loaded_as):
    """Grid tables (uneven, overlapping groups, a rank holding different rows of two
    blocks) to and from table-wise, row-wise, column-wise and other grids, on other
    world sizes: weights exact, row-wise Adagrad state converted per column block."""
    (saved_kind, saved_world), (loaded_kind, loaded_world) = saved_as, loaded_as
    saved_plan, loaded_plan = LAYOUTS[saved_kind][saved_world], LAYOUTS[loaded_kind][loaded_world]
    optimizer = embshard.RowWiseAdagrad(lr=0.1)
    saved = world(saved_world).run(save_trained, str(tmp_path), optimizer, 2, saved_plan)[0]
    for step, loaded in world(loaded_world).run(load_into, str(tmp_path), optimizer, loaded_plan):
        assert step == 2
        assert_loaded_as_saved(loaded, saved, saved_plan, loaded_plan)
    exported = tmp_path / "exported.pt"
    ckpt.export(tmp_path, exported)
    tables = torch.load(exported)
    for t in TABLES:
        assert torch.equal(tables[f"embedding_bags.{t.name}.weight"], saved[f"weight.{t.name}"])


@pytest.mark.parametrize(
    ("saved_kind", "loaded_kind", "world_size"),
    [("mixed", "mixed", 2), ("mixed", "mixed", 3), ("grid", "mixed", 3), ("mixed", "grid", 2)],
)
def test_adagrad_state_reshards_exactly(world, saved_kind, loaded_kind, world_size, tmp_path):
    optimizer = embshard.Adagrad(lr=0.1)
    saved = world(4).run(save_trained, str(tmp_path), optimizer, 2, LAYOUTS[saved_kind][4])[0]
    loaded_plan = LAYOUTS[loaded_kind][world_size]
    for _, loaded in world(world_size).run(load_into, str(tmp_path), optimizer, loaded_plan):
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key


def one_step_state(root: str | None, plan_name: str) -> dict:
    """Row-wise Adagrad after one step under a plan, optionally saved. One rank takes
    the 4-rank global batch with the loss divided by 4, as the 4 ranks do together."""
    world = dist.get_world_size()
    sharded = build(world, embshard.RowWiseAdagrad(lr=0.1), plan=PLANS[int(plan_name)])
    batches = local_batches(Case(TABLES, sharded.plan, (6,) * 4), 0)
    if world == 1:
        (sharded(global_batch(batches)).values().pow(2).sum() / 4).backward()
    else:
        sharded(batches[dist.get_rank()]).values().pow(2).sum().backward()
    if root:
        ckpt.save(root, sharded, step=1)
    return full(sharded)


def test_merging_column_blocks_of_rowwise_state_is_exact(world, tmp_path):
    # One step from the same weights and batch: the table-wise state is exactly the
    # width-weighted mean of the column blocks' states.
    world(4).run(one_step_state, str(tmp_path), "4")
    loaded = world(1).run(load_into, str(tmp_path), embshard.RowWiseAdagrad(lr=0.1))[0][1]
    direct = world(1).run(one_step_state, None, "1")[0]
    torch.testing.assert_close(
        loaded["state.c.momentum1"], direct["state.c.momentum1"], rtol=1e-6, atol=0
    )


def mismatched_load(root: str, change: str):
    tables = list(TABLES)
    if change == "shape":
        tables[2] = Table("c", 25, 16, ("f_c",))
    else:
        tables[2] = Table("z", 24, 16, ("f_c",))
    plan = {t.name: table_wise(0) for t in tables}
    ebc = EmbeddingBagCollection(tables=[t.config() for t in tables], device="meta")
    sharded = embshard.shard(ebc, ShardingPlan(plan), optimizer=embshard.SGD(lr=0.1))
    before = full(sharded)
    try:
        ckpt.load(ckpt.latest(root), sharded)
    except ckpt.CheckpointError as e:
        after = full(sharded)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return None, False


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "shape",
            "table 'c' (model.embedding_bags.c.weight): the checkpoint has (24, 16) "
            "torch.float32, the model (25, 16) torch.float32",
        ),
        ("name", "table 'z' (model.embedding_bags.z.weight): missing from the checkpoint"),
    ],
)
def test_mismatched_checkpoint_fails_on_every_rank_and_changes_nothing(
    world, tmp_path, change, message
):
    world(2).run(save_trained, str(tmp_path), embshard.SGD(lr=0.1))
    for error, unchanged in world(2).run(mismatched_load, str(tmp_path), change):
        assert error is not None and message in error, error
        assert unchanged


def damaged_load(root: str):
    sharded = build(dist.get_world_size(), embshard.RowWiseAdagrad(lr=0.1), seed=9)
    before = full(sharded)
    try:
        ckpt.load(root, sharded)
    except ckpt.CheckpointError as e:
        after = full(sharded)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return None, False


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("missing", "incomplete checkpoint"),
        ("truncated", "incomplete checkpoint"),
        ("garbage", "corrupt checkpoint, "),
    ],
)
def test_damaged_checkpoint_fails_on_every_rank_and_changes_nothing(
    world, tmp_path, damage, expected
):
    world(2).run(save_trained, str(tmp_path), embshard.RowWiseAdagrad(lr=0.1))
    path = ckpt.latest(tmp_path)
    victim = sorted(path.glob("*.distcp"))[-1]
    data = victim.read_bytes()
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.write_bytes(data[:64] + bytes(len(data) - 64))
    for error, unchanged in world(2).run(damaged_load, str(path)):
        assert error is not None and expected in error, error
        assert unchanged


def last_chunk(path, key: str) -> ckpt.Chunk:
    """Where the saved chunk of ``key`` at the highest offset in the tensor lies."""
    storage = ckpt.read_metadata(path).storage_data
    index = max((i for i in storage if i.fqn == key), key=lambda i: tuple(i.offset))
    info = storage[index]
    return ckpt.Chunk(key, info.relative_path, info.offset, info.length)


def flip_a_byte(path, key: str) -> ckpt.Chunk:
    """Flips one bit in the middle of the tensor data of ``key``'s last saved chunk
    (found by its values in the file); returns that chunk."""
    chunk = last_chunk(path, key)
    file = path / chunk.file
    data = bytearray(file.read_bytes())
    item = bytes(data[chunk.offset : chunk.offset + chunk.length])
    values = torch.load(io.BytesIO(item), weights_only=True).numpy().tobytes()
    data[chunk.offset + item.index(values) + len(values) // 2] ^= 0x01
    file.write_bytes(data)
    return chunk


@pytest.mark.parametrize("checksums", [True, False])
def test_an_unreadable_chunk_only_one_rank_reads_fails_on_every_rank_and_changes_nothing(
    world, tmp_path, checksums
):
    world(2).run(save_trained, str(tmp_path), embshard.RowWiseAdagrad(lr=0.1))
    path = ckpt.latest(tmp_path)
    chunk = last_chunk(path, "model.embedding_bags.d.weight")  # rows 5:40, rank 1's
    with open(path / chunk.file, "r+b") as file:
        file.seek(chunk.offset)
        file.write(bytes(chunk.length))
    if not checksums:  # as saved before they were recorded: found by reading it all first
        (path / ckpt.CHECKSUMS).unlink()
    expected = (
        f"table 'd' (model.embedding_bags.d.weight): {chunk.file} at offset {chunk.offset}"
        if checksums
        else "reading the checkpoint failed"
    )
    for error, unchanged in world(2).run(damaged_load, str(path)):
        assert error is not None and expected in error, error
        assert unchanged


def everything(model: nn.Module) -> dict[str, torch.Tensor]:
    head = {f"head.{k}": v.detach().clone() for k, v in model.head.state_dict().items()}
    return full(model.ebc) | head


def save_everything(root: str) -> dict:
    model = WithHead(build(dist.get_world_size(), embshard.RowWiseAdagrad(lr=0.1)), head=True)
    train_steps(model.ebc, 2)
    ckpt.save(root, model, step=3)
    return everything(model)


def load_everything(path: str):
    """Into a model with other weights and the checkpoint's tables and head: the step
    and every weight, or the error and whether every weight stayed as it was."""
    sharded = build(dist.get_world_size(), embshard.RowWiseAdagrad(lr=0.1), seed=9)
    model = WithHead(sharded, head=True)
    before = everything(model)
    try:
        step = ckpt.load(path, model)
    except ckpt.CheckpointError as e:
        after = everything(model)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return step, everything(model)


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("model.ebc.embedding_bags.d.weight", "table 'd' (model.ebc.embedding_bags.d.weight)"),
        (
            "sparse_optimizer.ebc.embedding_bags.b.momentum1",
            "table 'b' (sparse_optimizer.ebc.embedding_bags.b.momentum1)",
        ),
        ("model.head.weight", "model.head.weight"),
    ],
)
def test_a_flipped_bit_fails_on_every_rank_naming_the_chunk_and_changes_nothing(
    world, tmp_path, key, name
):
    saved = world(2).run(save_everything, str(tmp_path))[0]
    path = ckpt.latest(tmp_path)
    intact = ckpt.verify(path)
    storage = ckpt.read_metadata(path).storage_data
    chunks = len(storage) + 1  # and .metadata
    size = sum(info.length for info in storage.values()) + (path / ".metadata").stat().st_size
    assert intact.ok and intact.chunks == chunks and intact.bad == []
    assert intact.summary() == f"{path}: OK, {chunks} chunks ({size:,} bytes) match their checksums"
    bad = flip_a_byte(path, key)
    where = f"{name}: {bad.file} at offset {bad.offset} ({bad.length} bytes)"
    for error, unchanged in world(2).run(load_everything, str(path)):
        assert error == (
            f"{path}: corrupt checkpoint, 1 chunk not matching the checksums saved with it:\n"
            f"  {where}"
        )
        assert unchanged
    report = ckpt.verify(path)
    assert report.checked and not report.ok and report.bad == [bad]
    assert report.summary() == (
        f"{path}: corrupt, 1 of {chunks} chunks not matching the checksums saved with it:\n"
        f"  {where}"
    )
    # The same bit flipped back: the checkpoint loads whole again.
    flip_a_byte(path, key)
    for step, loaded in world(2).run(load_everything, str(path)):
        assert step == 3
        for k, value in saved.items():
            assert torch.equal(loaded[k], value), k


def test_a_changed_dcp_metadata_fails_on_every_rank(world, tmp_path):
    world(2).run(save_everything, str(tmp_path))
    path = ckpt.latest(tmp_path)
    metadata = path / ".metadata"
    data = metadata.read_bytes()
    metadata.write_bytes(data.replace(b"model.head.bias", b"model.head.bias".upper(), 1))
    size = len(data)
    for error, unchanged in world(2).run(load_everything, str(path)):
        assert error == (
            f"{path}: corrupt checkpoint, 1 chunk not matching the checksums saved with it:\n"
            f"  DCP's .metadata: .metadata at offset 0 ({size} bytes)"
        )
        assert unchanged
    assert ckpt.verify(path).bad == [ckpt.Chunk("DCP's .metadata", ".metadata", 0, size)]


def load_with_warnings(root: str, optimizer) -> tuple[int, dict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, loaded = load_into(root, optimizer)
    return step, loaded, [str(w.message) for w in caught if "checksums" in str(w.message)]


def test_checkpoints_without_checksums_load_with_a_warning(world, tmp_path):
    optimizer = embshard.RowWiseAdagrad(lr=0.1)
    saved = world(2).run(save_trained, str(tmp_path), optimizer)[0]
    path = ckpt.latest(tmp_path)
    (path / ckpt.CHECKSUMS).unlink()  # as a checkpoint saved before they were recorded
    for step, loaded, caught in world(2).run(load_with_warnings, str(tmp_path), optimizer):
        assert step == 2
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
        assert caught == [
            f"{path} has no checksums (saved before embshard recorded them, or not by "
            "embshard): it cannot be verified"
        ]
    report = ckpt.verify(tmp_path)
    assert not report.checked and not report.ok and report.bad == []
    assert report.summary() == (
        f"{path}: no checksums (saved before embshard recorded them, or not by embshard): "
        "cannot verify"
    )


def load_nothing(paths: list[str | None]) -> list[tuple[str | None, bool]]:
    sharded = build(dist.get_world_size(), embshard.RowWiseAdagrad(lr=0.1), seed=9)
    before, results = full(sharded), []
    for path in paths:
        try:
            ckpt.load(path, sharded)
            results.append((None, False))
        except ckpt.CheckpointError as e:
            after = full(sharded)
            results.append((str(e), all(torch.equal(before[k], after[k]) for k in before)))
    return results


def test_no_checkpoint_yet_fails_clearly_on_every_rank_and_changes_nothing(world, tmp_path):
    empty = tmp_path / "empty"
    (empty / ".step_00000001.tmp").mkdir(parents=True)  # a save cut off midway
    assert ckpt.latest(empty) is None
    paths = [None, str(empty), str(tmp_path / "absent")]
    for results in world(2).run(load_nothing, paths):
        (none, none_unchanged), (root, root_unchanged), (absent, absent_unchanged) = results
        assert none == (
            "no checkpoint to load: the path is None, which latest(root) returns when root "
            "holds no complete step_* checkpoint"
        )
        assert root == (
            f"no checkpoint under {empty} (no .metadata, no complete step_*; latest() returns None)"
        )
        assert absent == (
            f"no checkpoint under {tmp_path / 'absent'} (it does not exist; latest() returns None)"
        )
        assert none_unchanged and root_unchanged and absent_unchanged


def save_two_steps(root: str, optimizer) -> list[dict]:
    sharded = build(dist.get_world_size(), optimizer)
    saved = []
    for step in (1, 2):
        train_steps(sharded, 1, seed=step)
        ckpt.save(root, sharded, step=step)
        saved.append(full(sharded))
    return saved


def load_root(root: str, optimizer) -> tuple[int, dict]:
    sharded = build(dist.get_world_size(), optimizer, seed=9)
    return ckpt.load(root, sharded), full(sharded)


def test_load_of_a_root_loads_its_latest_checkpoint(world, tmp_path):
    optimizer = embshard.Adagrad(lr=0.1)
    first, second = world(2).run(save_two_steps, str(tmp_path), optimizer)[0]
    assert ckpt.describe(tmp_path)["step"] == 2
    for step, loaded in world(3).run(load_root, str(tmp_path), optimizer):
        assert step == 2
        for key, value in second.items():
            assert torch.equal(loaded[key], value), key
        assert not torch.equal(loaded["weight.a"], first["weight.a"])


class WithHead(nn.Module):
    """A sharded EBC (``self.ebc``) and, optionally, a dense head."""

    def __init__(self, ebc: nn.Module, head: bool) -> None:
        super().__init__()
        self.ebc = ebc
        if head:
            self.head = nn.Linear(3, 2)


def save_with_head(root: str) -> dict:
    model = WithHead(build(dist.get_world_size(), embshard.RowWiseAdagrad(lr=0.1)), head=True)
    train_steps(model.ebc, 2)
    ckpt.save(root, model, step=3)
    return full(model.ebc)


def load_without_c(root: str, strict: bool):
    """Into a model lacking the checkpoint's table 'c' and dense head."""
    tables = [t for t in TABLES if t.name != "c"]
    plan = {n: s for n, s in PLANS[dist.get_world_size()].items() if n != "c"}
    ebc = EmbeddingBagCollection(tables=[t.config() for t in tables], device="meta")
    sharded = embshard.shard(
        ebc, ShardingPlan(plan), optimizer=embshard.RowWiseAdagrad(lr=0.1), seed=9
    )
    model = WithHead(sharded, head=False)
    before = full(sharded)
    try:
        step = ckpt.load(root, model, strict=strict)
    except ckpt.CheckpointError as e:
        after = full(sharded)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return step, full(sharded)


def test_strict_load_refuses_what_the_model_lacks_and_non_strict_ignores_it(world, tmp_path):
    saved = world(2).run(save_with_head, str(tmp_path))[0]
    for error, unchanged in world(2).run(load_without_c, str(tmp_path), True):
        assert error.splitlines()[1:] == [
            "  table 'c' (model.ebc.embedding_bags.c.weight): in the checkpoint, not in the "
            "model (strict=False ignores it)",
            "  model.head.bias: in the checkpoint, not in the model (strict=False ignores it)",
            "  model.head.weight: in the checkpoint, not in the model (strict=False ignores it)",
        ]
        assert unchanged
    for step, loaded in world(2).run(load_without_c, str(tmp_path), False):
        assert step == 3
        assert sorted(loaded) == sorted(k for k in saved if k.split(".")[1] != "c")
        for key, value in loaded.items():
            assert torch.equal(value, saved[key]), key


def save_steps(root: str, steps: list[int], keep: int) -> None:
    sharded = build(dist.get_world_size(), embshard.SGD(lr=0.1))
    for step in steps:
        ckpt.save(root, sharded, step=step, keep=keep)


def test_keeps_the_last_k(world, tmp_path):
    world(2).run(save_steps, str(tmp_path), [1, 2, 3, 4, 5], 2)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    (tmp_path / ".step_00000006.tmp").mkdir()  # a save cut off midway
    assert ckpt.latest(tmp_path).name == "step_00000005"


def load_unsharded_dcp(path: str, reference: dict, strict: bool = True) -> bool | str:
    """True when the load gives the reference's tables at step 0; the error if it fails."""
    sharded = build(dist.get_world_size(), embshard.SGD(lr=0.1), seed=9)
    try:
        step = ckpt.load(path, sharded, strict=strict)
    except ckpt.CheckpointError as e:
        return str(e)
    return step == 0 and all(
        torch.equal(embshard.gather_table(w), reference[n]) for n, w in sharded.weights.items()
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torchrec_state_dicts_load_and_exports_load_into_torchrec(world, tmp_path):
    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables=[t.config() for t in TABLES])
    reference = {n: b.weight.detach().clone() for n, b in ebc.embedding_bags.items()}
    dcp.save(ebc.state_dict(), checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    plain = world(3).run(load_unsharded_dcp, str(tmp_path / "plain"), reference)
    assert plain == [True] * 3
    extra = ebc.state_dict() | {"extra": torch.ones(2)}
    dcp.save(extra, checkpoint_id=str(tmp_path / "extra"), no_dist=True)
    for error in world(3).run(load_unsharded_dcp, str(tmp_path / "extra"), reference):
        assert "\n  extra: in the checkpoint, not in the model (strict=False ignores it)" in error
    lenient = world(3).run(load_unsharded_dcp, str(tmp_path / "extra"), reference, False)
    assert lenient == [True] * 3

    world(2).run(save_trained, str(tmp_path / "sharded"), embshard.SGD(lr=0.1))
    saved = world(2).run(load_into, str(tmp_path / "sharded"), embshard.SGD(lr=0.1))[0][1]
    result = CliRunner().invoke(
        cli, ["ckpt", "export", str(tmp_path / "sharded"), str(tmp_path / "out.pt")]
    )
    assert result.exit_code == 0, result.output
    unsharded = EmbeddingBagCollection(tables=[t.config() for t in TABLES])
    unsharded.load_state_dict(torch.load(tmp_path / "out.pt"), strict=True)
    for name, bag in unsharded.embedding_bags.items():
        assert torch.equal(bag.weight, saved[f"weight.{name}"])


def save_shard_model(root: str) -> dict[str, torch.Tensor]:
    """A ``shard_model`` checkpoint of a model with an EBC at ``ebc`` and a dense head,
    its tables trained two steps; every tensor by the unsharded model's key."""
    torch.manual_seed(4)
    plan = ShardingPlan(PLANS[dist.get_world_size()])
    model = embshard.shard_model(
        WithHead(EmbeddingBagCollection(tables=[t.config() for t in TABLES]), head=True),
        plan,
        optimizer=embshard.SGD(lr=0.1),
    )
    train_steps(model.module.ebc, 2)
    ckpt.save(root, model, step=2)
    tables = {
        f"ebc.embedding_bags.{n}.weight": embshard.gather_table(w)
        for n, w in model.module.ebc.weights.items()
    }
    head = {f"head.{k}": v.detach().clone() for k, v in model.module.head.state_dict().items()}
    return tables | head


def test_export_of_a_module_loads_into_its_plain_torchrec_collection(world, tmp_path):
    saved = world(2).run(save_shard_model, str(tmp_path))[0]
    path = ckpt.latest(tmp_path)
    inspected = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path)])
    assert "\nmodules with tables: ebc\n" in inspected.output, inspected.output

    out = tmp_path / "ebc.pt"
    result = CliRunner().invoke(cli, ["ckpt", "export", str(tmp_path), str(out), "--module", "ebc"])
    assert result.exit_code == 0 and result.output == f"wrote 4 tensors to {out}\n", result.output
    ebc = EmbeddingBagCollection(tables=[t.config() for t in TABLES])
    ebc.load_state_dict(torch.load(out), strict=True)
    for name, bag in ebc.embedding_bags.items():
        assert torch.equal(bag.weight, saved[f"ebc.embedding_bags.{name}.weight"]), name

    # Without --module: the whole model's keys, for the unsharded model itself.
    whole = tmp_path / "whole.pt"
    assert ckpt.export(tmp_path, whole) == list(torch.load(whole))
    model = WithHead(EmbeddingBagCollection(tables=[t.config() for t in TABLES]), head=True)
    model.load_state_dict(torch.load(whole), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key

    missing = tmp_path / "missing.pt"
    result = CliRunner().invoke(
        cli, ["ckpt", "export", str(tmp_path), str(missing), "--module", "sparse"]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        result.output == f"Error: {path}: no tensors under 'sparse'; its tables are under 'ebc'\n"
    )
    assert not missing.exists()


@dataclass(frozen=True)
class CountingAdagrad(embshard.Adagrad):
    """Adagrad whose step count checkpoints keep, as Adam's and LAMB's (which FBGEMM's
    CPU kernels lack): the count's way through save and load, on CPU."""

    COUNTS_STEPS: ClassVar[bool] = True


def steps_through_a_checkpoint(root: str) -> tuple[int, int]:
    """Rank 0 alone counted 7 steps (a rank may hold no lookup): every rank saves 7,
    and a model that counted 9 on every rank takes 7 back (the count is the ranks'
    largest: a rank left at 9 would show). The count after saving and after loading."""
    saved = build(dist.get_world_size(), CountingAdagrad(lr=0.1))
    if dist.get_rank() == 0:
        saved.set_optimizer_steps(7)
    counted = int(saved.optimizer_steps())
    ckpt.save(root, saved, step=2)
    loaded = build(dist.get_world_size(), CountingAdagrad(lr=0.1), seed=9)
    loaded.set_optimizer_steps(9)
    ckpt.load(root, loaded)
    return counted, int(loaded.optimizer_steps())


def test_a_step_count_travels_through_a_checkpoint(world, tmp_path):
    assert world(2).run(steps_through_a_checkpoint, str(tmp_path)) == [(7, 7), (7, 7)]
    text = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path)]).output
    assert "embedding_bags.a: (30, 16) float32, adagrad state momentum1 (30, 16), step 7" in text


def test_ckpt_inspect(world, tmp_path):
    world(4).run(save_trained, str(tmp_path), embshard.RowWiseAdagrad(lr=0.1))
    result = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["step"] == 2 and info["world_size"] == 4 and info["bytes_on_disk"] > 0
    c = info["tables"]["embedding_bags.c"]
    assert (
        c["shape"] == [24, 16] and c["dtype"] == "float32" and c["optimizer"] == "rowwise_adagrad"
    )
    assert c["optimizer_state"] == {"momentum1": [24, 4]} and c["optimizer_step"] is None
    assert [(s["rank"], s["col_offset"], s["cols"]) for s in c["shards"]] == [
        (3, 0, 4),
        (0, 4, 4),
        (3, 8, 4),
        (1, 12, 4),
    ]
    text = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path)])
    assert (
        "embedding_bags.b: (30, 16) float32, rowwise_adagrad state momentum1 (30, 1)" in text.output
    )
    assert "    rank 3: rows 20:30, cols 0:16" in text.output
    assert ", saved by 4 ranks, " in text.output
    bad = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path / "step_00000002" / "..")])
    assert bad.exit_code == 0


SAVER = """
import os, sys, time, torch, torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
import embshard
from embshard import checkpoint as ckpt
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
tables = [
    EmbeddingBagConfig(name=f"t{i}", num_embeddings=1 << 20, embedding_dim=32, feature_names=["f"])
    for i in range(4)
]
plan = embshard.ShardingPlan({t.name: embshard.row_wise() for t in tables})
sharded = embshard.shard(EmbeddingBagCollection(tables=tables, device="meta"), plan)
ckpt.save(sys.argv[1], sharded, step=1)
print("saved", flush=True)
while True:
    ckpt.save(sys.argv[1], sharded, step=2)
"""


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(root), str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "saved"
    deadline = time.monotonic() + 120
    while not (root / ".step_00000002.tmp").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # inside a write of step 2 (the saver keeps rewriting it)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (root / ".step_00000002.tmp").exists()  # the kill cut a save short
    latest = ckpt.latest(root)
    # The last complete checkpoint: step 1, or a step 2 that finished before.
    assert latest.name in ("step_00000001", "step_00000002")
    info = ckpt.describe(root)
    assert info["step"] == int(latest.name.split("_")[1])
    assert info["tables"]["embedding_bags.t0"]["shape"] == [1 << 20, 32]
    tensors = ckpt.read_tensors(latest, "model.")
    assert tensors["embedding_bags.t3.weight"].shape == (1 << 20, 32)


def test_ckpt_verify(world, tmp_path):
    world(2).run(save_trained, str(tmp_path), embshard.SGD(lr=0.1))
    path = ckpt.latest(tmp_path)
    ok = CliRunner().invoke(cli, ["ckpt", "verify", str(tmp_path)])
    assert ok.exit_code == 0 and ok.output.startswith(f"{path}: OK, "), ok.output
    bad = flip_a_byte(path, "model.embedding_bags.a.weight")
    result = CliRunner().invoke(cli, ["ckpt", "verify", str(tmp_path)])
    assert result.exit_code == 1
    expected = f"table 'a' (model.embedding_bags.a.weight): {bad.file} at offset {bad.offset}"
    assert expected in result.output, result.output


class _Gadget:
    """Unpickling it calls ``call(*args)``: what a crafted checkpoint would run."""

    def __init__(self, call, *args) -> None:
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _gadgets(marker: str) -> dict[str, object]:
    touch = f"open({marker!r}, 'w').close()"
    return {
        "os.system": _Gadget(os.system, f"touch {marker}"),
        "builtins.eval": _Gadget(eval, touch),
        "subprocess.Popen": _Gadget(subprocess.call, ["touch", marker]),
    }


def _craft_checkpoints(root, marker: str) -> dict[str, str]:
    """Copies of the saved checkpoint under ``root``, each with a crafted ``.metadata``
    (every gadget alone, and one inside the real metadata), and one whose embshard
    description (a byte item) is a gadget. Returns name: checkpoint path."""
    import copy
    import pickle
    import shutil

    saved = ckpt.latest(root)
    crafted = {}
    gadgets = _gadgets(marker)
    with open(saved / ".metadata", "rb") as f:
        real = pickle.load(f)  # our own file, just saved
    nested = copy.copy(real)
    nested.planner_data = {"model.embedding_bags.a.weight": [gadgets["os.system"]]}
    for name, payload in [*gadgets.items(), ("nested in the metadata", nested)]:
        path = root / "crafted" / name.replace(" ", "_") / "step_00000002"
        shutil.copytree(saved, path)
        (path / ".metadata").write_bytes(pickle.dumps(payload))
        crafted[name] = str(path)
    item = root / "crafted" / "byte_item" / "step_00000002"
    dcp.save(
        {ckpt.META: gadgets["builtins.eval"], "model.embedding_bags.a.weight": torch.ones(30, 16)},
        checkpoint_id=str(item),
        no_dist=True,
    )
    crafted["byte item"] = str(item)
    return crafted


def load_crafted(paths: dict[str, str]) -> dict[str, tuple[str | None, bool]]:
    sharded = build(dist.get_world_size(), embshard.SGD(lr=0.1), seed=9)
    before, results = full(sharded), {}
    for name, path in paths.items():
        try:
            ckpt.load(path, sharded)
            results[name] = (None, False)
        except ckpt.CheckpointError as e:
            after = full(sharded)
            results[name] = (str(e), all(torch.equal(before[k], after[k]) for k in before))
    return results


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:.*has no checksums")
def test_a_crafted_checkpoint_runs_no_code_and_fails_on_every_rank(world, tmp_path):
    marker = tmp_path / "ran"
    world(2).run(save_trained, str(tmp_path / "saved"), embshard.SGD(lr=0.1))
    crafted = _craft_checkpoints(tmp_path / "saved", str(marker))
    refused = {
        "os.system": "refused to load posix.system",
        "builtins.eval": "refused to load builtins.eval",
        "subprocess.Popen": "refused to load subprocess.call",
        "nested in the metadata": "refused to load posix.system",
        "byte item": "refused to load the item 'embshard': it names eval, which a checkpoint's "
        "plain values may not hold",
    }
    for size in (1, 2):
        reports = world(size).run(load_crafted, crafted)
        assert all(r == reports[0] for r in reports)  # the same error on every rank
        for name, (error, unchanged) in reports[0].items():
            assert error is not None and refused[name] in error and "\n" not in error, error
            assert unchanged, name
    for name, path in crafted.items():
        for command in (["inspect", path], ["verify", path], ["export", path, str(tmp_path / "x")]):
            result = CliRunner().invoke(cli, ["ckpt", *command])
            if name == "byte item" and command[0] != "inspect":
                continue  # they never read the item: verify finds no checksums, export no tensor
            assert result.exit_code != 0, (name, command, result.output)
            assert result.output.startswith("Error: ") and result.output.count("\n") == 1
            assert refused[name] in result.output, result.output
    assert not marker.exists()


def test_an_export_loads_with_weights_only(world, tmp_path):
    saved = world(2).run(save_trained, str(tmp_path), embshard.SGD(lr=0.1))[0]
    assert ckpt.export(tmp_path, tmp_path / "out.pt")
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    for name in ("a", "b", "c", "d"):
        assert torch.equal(exported[f"embedding_bags.{name}.weight"], saved[f"weight.{name}"])


def save_dmp_then_load(root: str) -> bool:
    """TorchRec's DistributedModelParallel saves its sharded EBC with DCP; embshard loads
    that checkpoint under another plan and must hold the same tables."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan

    world = dist.get_world_size()
    configs = [t.config() for t in TABLES]
    torch.manual_seed(3)
    full_ebc = EmbeddingBagCollection(tables=configs)
    reference = {n: b.weight.detach().clone() for n, b in full_ebc.embedding_bags.items()}
    theirs_plan = ShardingPlan({t.name: row_wise() for t in TABLES})
    dmp = DistributedModelParallel(
        EmbeddingBagCollection(tables=configs, device="meta"),
        device=torch.device("cpu"),
        plan=TorchRecPlan({"": embshard.to_torchrec_plan(theirs_plan, configs, world)}),
        sharders=[EmbeddingBagCollectionSharder()],
    )
    with torch.no_grad():
        for key, table in dmp.state_dict().items():
            weight = reference[key.split(".")[-2]]
            for shard in table.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(weight[row : row + rows, col : col + cols])
    dcp.save(dmp.state_dict(), checkpoint_id=root)
    ours = build(world, embshard.SGD(lr=0.1), seed=9)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*has no checksums")
        ckpt.load(root, ours)
    return all(torch.equal(embshard.gather_table(w), reference[n]) for n, w in ours.weights.items())


def test_a_torchrec_dmp_checkpoint_loads_under_another_plan(world, tmp_path):
    assert world(2).run(save_dmp_then_load, str(tmp_path / "dmp")) == [True, True]
