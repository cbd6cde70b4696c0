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
    DIM,
    FEATURES,
    ROWS,
    TOL,
    Case,
    Reference,
    _output,
    blocks,
    configs,
    fold,
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

    _, cramped = _sharded(CASE, {"t": row_wise([9, 1]), "u": row_wise([5, 1])})
    before = gather_table(cramped.embedding_bag_collection.weights["t"])
    found = {
        "cramped": refused(lambda: ckpt.load(root, cramped)),
        "input_size": refused(lambda: ckpt.load(root, _sharded(replace(CASE, input_size=50))[1])),
        "policy": refused(lambda: ckpt.load(root, _sharded(replace(CASE, policy="lru"))[1])),
        "into_plain": refused(lambda: ckpt.load(root, _plain(CASE))),
        "from_plain": refused(lambda: ckpt.load(plain_root, _sharded(CASE)[1])),
    }
    with warnings.catch_warnings():  # a plain DCP checkpoint has no checksums
        warnings.simplefilter("ignore")
        found["plain_state_dict"] = refused(lambda: ckpt.load(dcp_root, _sharded(CASE)[1]))
    after = gather_table(cramped.embedding_bag_collection.weights["t"])
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
    assert r["cramped"].endswith(" in 1 row: give it more rows"), r
    assert "its block of rows 9:10 would hold" in r["cramped"] or "rows 5:6" in r["cramped"], r
    assert (
        f"table 't' ({key}): its managed-collision modules were saved for input size 48, "
        "the model's take 50: the ids' input ranges would change"
    ) in r["input_size"], r
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


# Resharding: saved at one world size and plan, loaded at another. The reference runs
# TorchRec's pieces to the save on the saved blocks, then moves every held id, with its
# metadata, its pending history and its row (weights and optimizer state), to the block
# owning its input range under the new plan (the rule below, written plainly), and runs
# on with those blocks.
EMPTY = torch.iinfo(torch.int64).max


def _reshard_reference(ref: Reference, case: Case) -> None:
    """``ref``'s modules and rows as a load under ``case``'s plan places them: per new
    block, the held ids of its input range sorted, each keeping its row where that row
    is the block's, else taking the block's lowest free row (in id order); the pending
    history of its range, in a buffer as large as the saved blocks' it overlaps."""
    for t in FEATURES:
        old = ref.mchs[t]
        old_width = -(-case.input_size // len(old))
        cuts = blocks(case, t)
        width = -(-case.input_size // len(cuts))
        segments = [first for first, _ in cuts] + [ROWS[t]]
        weights, state = ref.weights[t].detach().clone(), ref.state[t].clone()
        new = []
        for k, (first, rows) in enumerate(cuts):
            lo, hi = k * width, case.input_size if k == len(cuts) - 1 else (k + 1) * width
            sources = [
                m
                for j, m in enumerate(old)
                if j * old_width < hi and (lo < (j + 1) * old_width or j == len(old) - 1)
            ]
            mch = ref.own[t].rebuild_with_output_id_range((first, first + rows), segments)
            names = list(mch._mch_metadata)
            entries = sorted(
                (int(i), int(r), {n: int(m._mch_metadata[n][s]) for n in names})
                for m in sources
                for s, (i, r) in enumerate(
                    zip(m._mch_sorted_raw_ids.tolist(), m._mch_remapped_ids_mapping.tolist())
                )
                if i != EMPTY and lo <= i < hi
            )
            assert len(entries) <= rows, (t, k, len(entries), rows)
            kept = {r for _, r, _ in entries if first <= r < first + rows}
            free = [r for r in range(first, first + rows) if r not in kept]
            placed = []
            for i, r, meta in entries:
                if r not in kept:
                    new_row = free.pop(0)
                    ref.weights[t].data[new_row] = weights[r]
                    ref.state[t][new_row] = state[r]
                    r = new_row
                placed.append((i, r, meta))
            ids = [i for i, _, _ in placed] + [EMPTY] * (rows - len(placed))
            mch._mch_sorted_raw_ids.copy_(torch.tensor(ids))
            mch._mch_remapped_ids_mapping.copy_(torch.tensor([r for _, r, _ in placed] + free))
            for n in names:
                values = [meta[n] for _, _, meta in placed] + [0] * (rows - len(placed))
                mch._mch_metadata[n].copy_(torch.tensor(values))
            mch._current_iter = sources[0]._current_iter
            mch._current_iter_tensor.copy_(sources[0]._current_iter_tensor)
            mch._last_eviction_iter = sources[0]._last_eviction_iter
            if sources[0]._input_history_buffer_size != -1:
                pending = [
                    (m._history_accumulator[: m._current_history_buffer_offset], m) for m in sources
                ]
                mine = [(p >= lo) & (p < hi) for p, _ in pending]
                size = sum(m._input_history_buffer_size for m in sources)
                ids_ = torch.cat([p[w] for (p, _), w in zip(pending, mine)])
                mch._input_history_buffer_size = size
                mch._history_accumulator = torch.zeros(size, dtype=torch.int64)
                mch._history_accumulator[: len(ids_)] = ids_
                for n, _, is_history in mch._eviction_policy.metadata_info:
                    if is_history:
                        buffer = torch.zeros(size, dtype=torch.int64)
                        buffer[: len(ids_)] = torch.cat(
                            [
                                m._history_metadata[n][: len(w)][w]
                                for (_, m), w in zip(pending, mine)
                            ]
                        )
                        mch._history_metadata[n] = buffer
                mch._current_history_buffer_offset = len(ids_)
            new.append(mch)
        ref.mchs[t] = new
    ref.case = case


def _probe(sharded, held: dict[str, list[int]]) -> torch.Tensor:
    """In eval mode, each held id's row: a bag of its own (a row of its own in an MC-EC)."""
    n = max(len(v) for v in held.values())
    bags = [[[i] for i in held["t"]] + [[]] * (n - len(held["t"])), [[]] * n]
    bags.append([[i] for i in held["u"]] + [[]] * (n - len(held["u"])))
    with torch.no_grad():
        out, _ = _output(sharded.eval(), bags, torch.zeros(n, 2 * DIM))
    sharded.train()
    return out


def _held(ref: Reference) -> dict[str, list[int]]:
    """The ids the modules hold, as a batch brings them (before ``fold`` where hashed)."""
    size = ref.case.input_size
    raw = fold(torch.arange(size), size).argsort() if ref.case.hashed else torch.arange(size)
    return {
        t: sorted(
            int(raw[i]) for m in ref.mchs[t] for i in m._mch_sorted_raw_ids.tolist() if i != EMPTY
        )
        for t in FEATURES
    }


def _replayed(case: Case, saved_at: int, initial) -> Reference:
    """The reference run to ``saved_at`` on ``case``'s blocks."""
    torch.manual_seed(0)
    ref = Reference(case, mc_ebc(case), initial)
    for ranks in stream(case)[:saved_at]:
        ref.step(ranks)
    return ref


def _save_for_reshard(case: Case, saved_at: int, root: str) -> torch.Tensor:
    """Train to ``saved_at`` and save; the held ids' rows then."""
    rank = torch.distributed.get_rank()
    _, sharded = _sharded(case)
    for ranks in stream(case)[:saved_at]:
        bags, upstream = ranks[rank]
        _output(sharded, bags, upstream)[1].backward()
    ckpt.save(root, sharded, step=saved_at)
    initial = {t: gather_table(w) for t, w in sharded_tables(_sharded(case)[1]).weights.items()}
    return _probe(sharded, _held(_replayed(case, saved_at, initial)))


def _load_resharded(saved: Case, case: Case, saved_at: int, root: str, probed) -> dict:
    rank = torch.distributed.get_rank()
    _, sharded = _sharded(case, torch_seed=1)
    initial = {t: gather_table(w) for t, w in sharded_tables(sharded).weights.items()}
    ref = _replayed(saved, saved_at, initial)
    held = _held(ref)
    assert ckpt.load(root, sharded) == saved_at
    probe_gap = (_probe(sharded, held) - probed).abs().max().item()
    _reshard_reference(ref, case)
    evicted_before, out_gap = ref.evicted, 0.0
    for ranks in stream(case)[saved_at : case.steps]:
        bags, upstream = ranks[rank]
        out, loss = _output(sharded, bags, upstream)
        loss.backward()
        expected = ref.step(ranks)[rank]
        out_gap = max(out_gap, (out.detach() - expected).abs().max().item())
    weights = sharded_tables(sharded).weights
    table_gap = max(
        (gather_table(weights[t]) - ref.weights[t]).abs().max().item() for t in FEATURES
    )
    return {
        "probe_gap": probe_gap,
        "out_gap": out_gap,
        "table_gap": table_gap,
        "evicted": ref.evicted - evicted_before,
        "held": sum(map(len, held.values())),
    }


RESHARDS = {
    # Saved between evictions (every 3 steps): pending history moves too.
    "w2_to_w3_lfu_adagrad_mid_interval": (
        Case(
            2,
            {"t": row_wise(), "u": row_wise()},
            "lfu",
            Adagrad(lr=0.1),
            interval=3,
            meta=True,
            steps=16,
        ),
        {"t": row_wise([5, 3, 2]), "u": row_wise([2, 2, 2])},
        7,
    ),
    # A table-wise table becomes row-wise; hashed inputs.
    "w3_to_w2_lru_rowwise_adagrad_hashed": (
        Case(
            3,
            {"t": row_wise(ranks=[2, 0, 1]), "u": table_wise(1)},
            "lru",
            RowWiseAdagrad(lr=0.1),
            interval=2,
            hashed=True,
            meta=True,
            steps=16,
        ),
        {"t": row_wise([6, 4]), "u": row_wise([3, 3], ranks=[1, 0])},
        8,
    ),
    # A ManagedCollisionEmbeddingCollection with DistanceLFU.
    "w2_to_w3_dlfu_sgd_sequence": (
        Case(
            2,
            {"t": row_wise(), "u": table_wise(0)},
            "dlfu",
            SGD(lr=0.1),
            interval=3,
            init_fn=True,
            sequence=True,
            steps=16,
        ),
        {"t": row_wise([4, 2, 4]), "u": row_wise([3, 2, 1])},
        5,
    ),
}


@pytest.mark.parametrize("name", list(RESHARDS))
def test_a_resharded_load_moves_each_id_with_its_row_and_history(world, tmp_path, name) -> None:
    saved, plan, saved_at = RESHARDS[name]
    world_to = len(plan["t"].sizes)
    probed = world(saved.world).run(_save_for_reshard, saved, saved_at, str(tmp_path))[0]
    case = replace(saved, world=world_to, plan=plan)
    results = world(world_to).run(_load_resharded, saved, case, saved_at, str(tmp_path), probed)
    for r in results:
        assert r["probe_gap"] < TOL, r
        assert r["out_gap"] < TOL, r
        assert r["table_gap"] < TOL, r
    assert results[0]["evicted"] > 0 and results[0]["held"] > 0, results[0]
