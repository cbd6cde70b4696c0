"""Managed-collision tables in checkpoints: a run saved at step k and resumed in fresh
sharded modules equals the reference run (TorchRec's pieces, ``test_managed_collision``)
left uninterrupted; what cannot load is refused on every rank in one line; a flipped
byte in a module's state is caught."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from test_checkpoint import flip_a_byte
from test_managed_collision import (
    FEATURES,
    TOL,
    Case,
    Reference,
    _output,
    configs,
    mc_ebc,
    sharded_tables,
    stream,
    weights_of,
)
from torch import nn
from torchrec import EmbeddingBagCollection

import embshard
from embshard import (
    SGD,
    Adagrad,
    CheckpointError,
    RowWiseAdagrad,
    ShardingPlan,
    row_wise,
    table_wise,
)
from embshard import checkpoint as ckpt
from embshard.app.cli import main as cli
from embshard.storage.shards import gather_table

CASES = {
    # Saved between evictions (every 3 steps): LRU's profiled ids and last access
    # iterations are pending in the history.
    "w2_row_wise_lru_adagrad_hashed_mid_interval": (
        Case(
            2,
            {"t": row_wise(), "u": table_wise(1)},
            "lru",
            Adagrad(lr=0.1),
            interval=3,
            hashed=True,
            init_fn=True,
        ),
        4,
    ),
    # Ranks 0 and 1 hold no module.
    "w3_table_wise_on_one_rank_lru_adagrad": (
        Case(
            3,
            {"t": table_wise(2), "u": table_wise(2)},
            "lru",
            Adagrad(lr=0.1),
            interval=3,
            init_fn=True,
        ),
        4,
    ),
    "w2_row_wise_lfu_rowwise_adagrad_seeded": (
        Case(2, {"t": row_wise(), "u": row_wise()}, "lfu", RowWiseAdagrad(lr=0.1), meta=True),
        3,
    ),
    # DistanceLFU's counts and last access iterations, and its pending history.
    "w2_row_wise_dlfu_sgd_mid_interval": (
        Case(
            2,
            {"t": row_wise(), "u": row_wise()},
            "dlfu",
            SGD(lr=0.1),
            steps=20,
            interval=3,
            init_fn=True,
        ),
        8,
    ),
    # Uneven row blocks, one without rows.
    "w3_uneven_lfu_adagrad_mid_interval": (
        Case(
            3,
            {"t": row_wise([2, 5, 3], ranks=[1, 2, 0]), "u": row_wise([0, 4, 2])},
            "lfu",
            Adagrad(lr=0.1),
            interval=3,
            init_fn=True,
        ),
        5,
    ),
    # A ManagedCollisionEmbeddingCollection's modules, saved mid-interval.
    "w2_row_wise_lfu_adagrad_sequence_mid_interval": (
        Case(
            2,
            {"t": row_wise(), "u": table_wise(0)},
            "lfu",
            Adagrad(lr=0.1),
            interval=3,
            hashed=True,
            init_fn=True,
            sequence=True,
        ),
        4,
    ),
}


def _sharded(case: Case, plan: dict | None = None, torch_seed: int = 0):
    """A fresh sharded MC-EBC (MC-EC); ``torch_seed`` draws its tables' values unless on meta
    (embshard's seed, which evicted rows' values come from too, stays 0)."""
    torch.manual_seed(torch_seed)
    module = mc_ebc(case, "meta" if case.meta else "cpu")
    return module, embshard.shard(module, ShardingPlan(plan or case.plan), optimizer=case.optimizer)


def _resume(case: Case, saved_at: int, root: str) -> dict:
    """Train to ``saved_at``, save, load into fresh modules (other initial values off
    meta), train on: each step's output and the final tables against the uninterrupted reference."""
    rank = torch.distributed.get_rank()
    module, sharded = _sharded(case)
    weights = sharded_tables(sharded).weights
    if case.meta:
        initial = {t: gather_table(w) for t, w in weights.items()}
    else:
        initial = {t: w.detach() for t, w in weights_of(module._embedding_module).items()}
    ref = Reference(case, module, initial)
    out_gap = 0.0
    for step, ranks in enumerate(stream(case)[: case.steps]):
        if step == saved_at:
            ckpt.save(root, sharded, step=step)
            evicted_before = ref.evicted
            _, sharded = _sharded(case, torch_seed=1)
            assert ckpt.load(root, sharded) == saved_at
        bags, upstream = ranks[rank]
        out, loss = _output(sharded, bags, upstream)
        loss.backward()
        expected = ref.step(ranks)[rank]
        out_gap = max(out_gap, (out.detach() - expected).abs().max().item())
    weights = sharded_tables(sharded).weights
    table_gap = max(
        (gather_table(weights[t]) - ref.weights[t]).abs().max().item() for t in FEATURES
    )
    return {"out_gap": out_gap, "table_gap": table_gap, "evicted": ref.evicted - evicted_before}


@pytest.mark.parametrize("name", list(CASES))
def test_a_resumed_run_equals_the_uninterrupted_reference(world, tmp_path, name) -> None:
    case, saved_at = CASES[name]
    results = world(case.world).run(_resume, case, saved_at, str(tmp_path))
    for r in results:
        assert r["out_gap"] < TOL, r
        assert r["table_gap"] < TOL, r
    assert results[0]["evicted"] > 0, "the stream must evict after the load"


CASE = replace(CASES["w2_row_wise_lfu_rowwise_adagrad_seeded"][0], meta=False, steps=3)


class _Holder(nn.Module):
    """A plain EmbeddingBagCollection at the keys an MC-EBC's tables have."""

    def __init__(self, sharded: nn.Module) -> None:
        super().__init__()
        self._embedding_module = sharded


def _plain(case: Case) -> nn.Module:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=configs(case))
    return _Holder(embshard.shard(ebc, ShardingPlan(case.plan), optimizer=case.optimizer))


def _train_and_save(root: str) -> None:
    rank = torch.distributed.get_rank()
    _, sharded = _sharded(CASE)
    for ranks in stream(CASE)[: CASE.steps]:
        bags, upstream = ranks[rank]
        _output(sharded, bags, upstream)[1].backward()
    ckpt.save(root, sharded, step=CASE.steps)


def _refusals(root: str, plain_root: str, dcp_root: str) -> dict[str, str]:
    ckpt.save(plain_root, _plain(CASE), step=1)
    path = ckpt.latest(plain_root)
    keys = ckpt.read_metadata(path).state_dict_metadata
    plain_record = any(
        "managed_collision" in t for t in ckpt.read_description(path)["tables"].values()
    )
    torch.manual_seed(0)
    dcp.save(mc_ebc(CASE).state_dict(), checkpoint_id=dcp_root)

    def refused(load) -> str:
        try:
            load()
        except CheckpointError as error:
            return str(error)
        return "no error"

    _, resharded = _sharded(CASE, {"t": table_wise(0), "u": row_wise()})
    before = gather_table(resharded.embedding_bag_collection.weights["t"])
    found = {
        "reshard": refused(lambda: ckpt.load(root, resharded)),
        "policy": refused(lambda: ckpt.load(root, _sharded(replace(CASE, policy="lru"))[1])),
        "into_plain": refused(lambda: ckpt.load(root, _plain(CASE))),
        "from_plain": refused(lambda: ckpt.load(plain_root, _sharded(CASE)[1])),
    }
    with warnings.catch_warnings():  # a plain DCP checkpoint has no checksums
        warnings.simplefilter("ignore")
        found["plain_state_dict"] = refused(lambda: ckpt.load(dcp_root, _sharded(CASE)[1]))
    after = gather_table(resharded.embedding_bag_collection.weights["t"])
    found["unchanged"] = str(torch.equal(before, after))
    found["plain_saves_no_modules"] = str(
        not plain_record and not any(k.startswith("managed_collision.") for k in keys)
    )
    return found


def test_loads_that_would_lose_the_modules_are_refused_on_every_rank(world, tmp_path) -> None:
    root = str(tmp_path / "mc")
    world(2).run(_train_and_save, root)
    results = world(2).run(
        _refusals, root, str(tmp_path / "plain"), str(tmp_path / "dcp" / "step_00000000")
    )
    assert results[0] == results[1]
    r = results[0]
    assert r.pop("unchanged") == "True"
    assert r.pop("plain_saves_no_modules") == "True"
    for message in r.values():
        assert "\n" not in message, r
    key = "_embedding_module.embedding_bags.t"
    assert (
        f"table 't' ({key}): its managed-collision modules were saved for 2 row blocks of 5 rows"
        in (r["reshard"])
    )
    assert "resharding a managed-collision table" in r["reshard"], r
    assert (
        "modules were saved with LFU_EvictionPolicy, the model's use LRU_EvictionPolicy"
        in (r["policy"])
    )
    assert (
        "the checkpoint holds its managed-collision modules, the model has none"
        in (r["into_plain"])
    )
    assert (
        "the model has a managed-collision module for it, the checkpoint holds no"
        in (r["from_plain"])
    )
    assert "a plain state dict holds none saved by row block" in r["plain_state_dict"], r


def _load(root: str) -> str:
    try:
        ckpt.load(root, _sharded(CASE)[1])
    except CheckpointError as error:
        return str(error)
    return "no error"


def test_a_flipped_byte_in_a_module_is_caught(world, tmp_path) -> None:
    world(2).run(_train_and_save, str(tmp_path))
    path = ckpt.latest(tmp_path)
    assert ckpt.verify(path).ok
    key = "managed_collision._embedding_module.embedding_bags.t.rows_5_10._mch_sorted_raw_ids"
    chunk = flip_a_byte(path, key)
    found = ckpt.verify(path)
    assert [str(c) for c in found.bad] == [str(chunk)], found.summary()
    messages = world(2).run(_load, str(tmp_path))
    assert messages[0] == messages[1] and "corrupt checkpoint" in messages[0], messages
    assert key in messages[0]


def _keys(root: str) -> list[str]:
    _train_and_save(root)
    return sorted(ckpt.read_metadata(ckpt.latest(root)).state_dict_metadata)


def test_each_block_saves_its_module_whole(world, tmp_path) -> None:
    keys = world(2).run(_keys, str(tmp_path))[0]
    managed = [k.split(".", 3)[-1] for k in keys if k.startswith("managed_collision.")]
    per_block = {
        "_current_iter_tensor",
        "_output_segments_tensor",
        "_mch_sorted_raw_ids",
        "_mch_remapped_ids_mapping",
        "_mch_counts",  # LFU's eviction metadata
        "history.accumulator",
        "counters",
    }
    expected = {
        f"{t}.rows_{first}_{end}.{n}"
        for t, blocks in {"t": [(0, 5), (5, 10)], "u": [(0, 3), (3, 6)]}.items()
        for first, end in blocks
        for n in per_block
    }
    assert set(managed) == expected, managed
    assert not any(k.startswith("dynamic.") for k in keys)
    info = ckpt.describe(ckpt.latest(tmp_path))  # inspect reads it as any other
    assert sorted(info["tables"]) == [f"_embedding_module.embedding_bags.{t}" for t in "tu"]
    t = info["tables"]["_embedding_module.embedding_bags.t"]["managed_collision"]
    assert (t["policy"], t["block_rows"]) == ("LFU_EvictionPolicy", [5, 5])
    shown = CliRunner().invoke(cli, ["ckpt", "inspect", str(ckpt.latest(tmp_path))])
    assert shown.exit_code == 0, shown.output
    line = (
        "    managed collisions: TorchRec MCH modules, LFU_EvictionPolicy, 2 row blocks of "
        f"5 rows over input size {t['input_size']}"
    )
    assert line in shown.output.splitlines(), shown.output
