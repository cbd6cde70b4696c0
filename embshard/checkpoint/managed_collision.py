"""TorchRec's managed-collision (MCH) modules in checkpoints: every id's row kept.

Each rank holds, per row block of a managed-collision table, TorchRec's
``MCHManagedCollisionModule`` rebuilt for the block's rows (``storage.managed_collision``).
A block's module is saved whole, as plain tensors keyed by the block's row range:

    managed_collision.<module prefix><table key>.rows_<first>_<end>.<buffer>
        the module's state dict (TorchRec's persistent buffers: sorted raw ids,
        remapped ids mapping, eviction metadata, iteration counter, output segments)
    ...rows_<first>_<end>.history.<name>
        the ids and metadata profiled since the last eviction (``accumulator`` and the
        policy's history metadata), which TorchRec's state dict leaves out
    ...rows_<first>_<end>.counters
        iteration, last eviction's iteration, history buffer size and fill (int64)

so that a loaded module profiles, evicts and remaps exactly as the saved one would
have. Per-block entries, not DTensors over the table's rows: a block's module is one
whole (its sorted ids and mapping are not rows of the table), and its history is not
per row at all. A block owns the input range that routing gives it, so a checkpoint's
modules load only into the same row blocks and input size, with the same eviction
policy: anything else is refused on every rank before the load changes anything. The
table's description records them (``RECORD``); a model without managed-collision
tables saves none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from embshard.errors import CheckpointError
from embshard.modules.collection import ShardedCollection
from embshard.plan.specs import plural

MANAGED = "managed_collision"  # the checkpoint's top-level key of what this module saves
RECORD = "managed_collision"  # a table's description field: input size, row blocks
_COUNTERS = "counters"
_HISTORY = "history"
_ACCUMULATOR = "accumulator"


def record(module: ShardedCollection, name: str) -> dict[str, Any] | None:
    """What the description records of table ``name``'s managed collisions (None for a
    table without): its eviction policy, which fixes the modules' buffers, and its
    input size and row blocks, which fix each block's input range."""
    managed = module.managed_collisions
    if managed is None or name not in managed.modules:
        return None
    input_size, firsts = managed.ranges(module.tables)[name]
    ends = (*firsts[1:], module.tables[name].num_embeddings)
    return {
        "policy": type(managed.modules[name]._eviction_policy).__name__,
        "input_size": input_size,
        "block_rows": [end - first for first, end in zip(firsts, ends)],
    }


def save_state(collections: Mapping[str, ShardedCollection]) -> dict[str, Any]:
    """This rank's blocks' modules as the checkpoint saves them, keyed under ``MANAGED``
    (nothing without managed-collision tables)."""
    state: dict[str, Any] = {}
    for key, mch in _blocks(collections).items():
        history = _history(mch)
        offset = mch._current_history_buffer_offset
        state |= {f"{key}.{n}": t for n, t in mch.state_dict().items()}
        state |= {f"{key}.{_HISTORY}.{n}": t[:offset].clone() for n, t in history.items()}
        state[f"{key}.{_COUNTERS}"] = torch.tensor(
            [mch._current_iter, mch._last_eviction_iter, mch._input_history_buffer_size, offset],
            dtype=torch.int64,
        )
    return state


def check(
    path: object, tables: Mapping[str, Any], collections: Mapping[str, ShardedCollection]
) -> None:
    """Every table saved and in the model has managed collisions in both, over the same
    row blocks and input size, or in neither: else a one-line CheckpointError (the
    description and the plan are the same on every rank, so every rank raises it).
    ``tables``: the description's, by key."""
    for prefix, module in collections.items():
        for name in module.tables:
            key = prefix + module.table_key(name)
            if key not in tables:
                continue  # the shape checks name it
            saved, live = tables[key].get(RECORD), record(module, name)
            if saved != live:
                raise CheckpointError(f"{path}: table {name!r} ({key}): {_mismatch(saved, live)}")


def _mismatch(saved: dict[str, Any] | None, live: dict[str, Any] | None) -> str:
    if saved is None:
        return (
            "the model has a managed-collision module for it, the checkpoint holds no "
            "module state (saved without one)"
        )
    if live is None:
        return "the checkpoint holds its managed-collision modules, the model has none for it"
    if saved["policy"] != live["policy"]:
        return (
            f"its managed-collision modules were saved with {saved['policy']}, the model's "
            f"use {live['policy']}"
        )
    return (
        f"its managed-collision modules were saved for {shown(saved)}, the model has "
        f"{shown(live)}: resharding a managed-collision table (or changing its input "
        "size) is refused, as each row block owns an input range"
    )


def shown(layout: Mapping[str, Any]) -> str:
    """A table's record in words: its row blocks' rows and input size."""
    rows = layout["block_rows"]
    blocks = (
        f"{plural(len(rows), 'row block')} of {rows[0]} rows"
        if len(set(rows)) == 1
        else f"row blocks of {', '.join(map(str, rows))} rows"
    )
    return f"{blocks} over input size {layout['input_size']}"


def refuse_plain(path: object, collections: Mapping[str, ShardedCollection]) -> None:
    """A plain state dict holds no sharded modules' state: refused for a model with
    managed-collision tables."""
    for prefix, module in collections.items():
        if module.managed_collisions is not None:
            name = sorted(module.managed_collisions.modules)[0]
            raise CheckpointError(
                f"{path}: table {name!r} ({prefix}{module.table_key(name)}) has a "
                "managed-collision module, and a plain state dict holds none saved by "
                "row block"
            )


def load_targets(
    metadata: Metadata, collections: Mapping[str, ShardedCollection]
) -> tuple[dict[str, Any], Callable[[Any], None]]:
    """What DCP fills for this rank's blocks' modules (fresh tensors; the history's
    lengths are the saved ones, from ``metadata``), and how they then go live: TorchRec's
    ``load_state_dict`` for its buffers, then the counters and history."""
    saved = metadata.state_dict_metadata
    targets: dict[str, Any] = {}
    modules = _blocks(collections)
    for key, mch in modules.items():
        targets |= {f"{key}.{n}": torch.zeros_like(t) for n, t in mch.state_dict().items()}
        for name in (_ACCUMULATOR, *_history_names(mch)):
            entry = saved.get(f"{MANAGED}.{key}.{_HISTORY}.{name}")
            length = entry.size[0] if entry is not None else 0  # missing: the check names it
            targets[f"{key}.{_HISTORY}.{name}"] = torch.zeros(length, dtype=torch.int64)
        targets[f"{key}.{_COUNTERS}"] = torch.zeros(4, dtype=torch.int64)

    def restore(_: Any) -> None:
        for key, mch in modules.items():
            _restore(mch, key, targets)

    return targets, restore


def _restore(mch: MCHManagedCollisionModule, key: str, read: Mapping[str, torch.Tensor]) -> None:
    """The module as saved: its buffers, iteration counters and profiled history."""
    mch.load_state_dict({n: read[f"{key}.{n}"] for n in mch.state_dict()})
    current, last, size, offset = read[f"{key}.{_COUNTERS}"].tolist()
    mch._current_iter, mch._last_eviction_iter = current, last
    mch._input_history_buffer_size, mch._current_history_buffer_offset = size, offset
    if size == -1:  # never profiled: its history buffers come with its first batch
        return
    device = mch._mch_sorted_raw_ids.device
    mch._history_accumulator = torch.zeros(size, dtype=torch.int64, device=device)
    for name in _history_names(mch):
        mch.register_buffer(
            f"_history_{name}",
            torch.zeros(size, dtype=torch.int64, device=device),
            persistent=False,
        )
        mch._history_metadata[name] = getattr(mch, f"_history_{name}")
    for name, buffer in _history(mch).items():
        buffer[:offset] = read[f"{key}.{_HISTORY}.{name}"]


def _blocks(collections: Mapping[str, ShardedCollection]) -> dict[str, MCHManagedCollisionModule]:
    """This rank's modules by their entries' key (without ``MANAGED``): a rank holds at
    most one row block of a managed-collision table."""
    found = {}
    for prefix, module in collections.items():
        for name, mch in module.managed_collision_modules().items():
            first = mch._output_global_offset
            rows = f"rows_{first}_{first + mch.output_size()}"
            found[f"{prefix}{module.table_key(name)}.{rows}"] = mch
    return found


def _history_names(mch: MCHManagedCollisionModule) -> list[str]:
    """The eviction policy's history metadata (TorchRec's ``_history_<name>`` buffers)."""
    return [name for name, _, is_history in mch._eviction_policy.metadata_info if is_history]


def _history(mch: MCHManagedCollisionModule) -> dict[str, torch.Tensor]:
    """The profiled ids and their metadata buffers (empty ones before the first
    profile, which allocates them)."""
    if mch._input_history_buffer_size == -1:
        empty = torch.zeros(0, dtype=torch.int64)
        return {name: empty for name in (_ACCUMULATOR, *_history_names(mch))}
    return {_ACCUMULATOR: mch._history_accumulator} | {
        name: mch._history_metadata[name] for name in _history_names(mch)
    }
