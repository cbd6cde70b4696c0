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
per row at all. The table's description records the policy, input size and blocks'
rows (``RECORD``); a model without managed-collision tables saves none of this.

A load may change the row blocks (world size, plan), not the input size or policy.
A block owns the input range that routing gives it, so each new block takes, from the
saved blocks whose ranges overlap its own, the held ids of its range with their
metadata and their pending history; an id keeps its row where the row is the new
block's, else takes one of its free rows, and its row's weights and optimizer state
move there (from whichever rank the tables' read put the saved row on). With the same
blocks this is the saved modules as they were. A block too small for its range's ids
is refused on every rank before the load changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
_EMPTY = torch.iinfo(torch.int64).max  # TorchRec's id of an empty slot


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
            if _fixed(saved) != _fixed(live):
                raise CheckpointError(f"{path}: table {name!r} ({key}): {_mismatch(saved, live)}")


def _fixed(layout: dict[str, Any] | None) -> tuple | None:
    """What a load cannot change: the policy and input size (row blocks it can)."""
    return None if layout is None else (layout["policy"], layout["input_size"])


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
        f"its managed-collision modules were saved for input size {saved['input_size']}, "
        f"the model's take {live['input_size']}: the ids' input ranges would change"
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


def load(
    path: object,
    metadata: Metadata,
    tables: Mapping[str, Any],
    collections: Mapping[str, ShardedCollection],
    read: Callable[[dict[str, Any]], None],
) -> Callable[[Any], None] | None:
    """Read the saved blocks' modules that this rank's blocks take ids from (``read``:
    the checkpoint's checked read, collective), and check every new block can hold the
    ids of its input range: else a one-line CheckpointError on every rank, before the
    model changes. Returns how the modules then go live, after the tables' read (their
    rows moved to the ids' new rows: collective), or None for a model without
    managed-collision tables (on every rank alike). ``tables``: the description's."""
    if not any(m.managed_collisions is not None for m in collections.values()):
        return None
    blocks = _new_blocks(metadata, tables, collections)
    targets = {key: t for block in blocks for key, t in block.targets.items()}
    read({MANAGED: targets})
    placed, problems = [], []
    for block in blocks:
        placement = _place(block, targets)
        if isinstance(placement, str):
            problems.append(f"table {block.name!r} ({block.key}): {placement}")
        else:
            placed.append(placement)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = [p for part in everyone for p in part]
    if found:
        raise CheckpointError(f"{path}: {found[0]}")

    def commit(_: Any) -> None:
        _move_rows(placed)
        for placement in placed:
            placement.restore()

    return commit


@dataclass(frozen=True)
class _Layout:
    """A table's row blocks (those with rows, in row order) over its input size: block
    ``k`` owns ids ``[k * width, (k + 1) * width)``, the last one the rest."""

    input_size: int
    block_rows: tuple[int, ...]

    @property
    def firsts(self) -> list[int]:
        return [sum(self.block_rows[:k]) for k in range(len(self.block_rows))]

    def span(self, k: int) -> tuple[int, int]:
        width = -(-self.input_size // len(self.block_rows))
        return k * width, self.input_size if k == len(self.block_rows) - 1 else (k + 1) * width


def _layout(record: Mapping[str, Any]) -> _Layout:
    return _Layout(record["input_size"], tuple(record["block_rows"]))


@dataclass(frozen=True)
class _NewBlock:
    """One of this rank's blocks and the saved blocks its input range overlaps."""

    collection: ShardedCollection
    name: str
    key: str  # the table's key
    mch: MCHManagedCollisionModule
    span: tuple[int, int]  # its input range
    sources: tuple[str, ...]  # the saved blocks' entry keys (without MANAGED)
    targets: dict[str, torch.Tensor]


def _new_blocks(
    metadata: Metadata, tables: Mapping[str, Any], collections: Mapping[str, ShardedCollection]
) -> list[_NewBlock]:
    saved = metadata.state_dict_metadata
    blocks = []
    for prefix, module in collections.items():
        for name, mch in module.managed_collision_modules().items():
            key = prefix + module.table_key(name)
            if key not in tables:
                continue  # the checks of the tables' keys name it
            old, new = _layout(tables[key][RECORD]), _layout(record(module, name))
            lo, hi = new.span(new.firsts.index(mch._output_global_offset))
            sources = tuple(
                f"{key}.rows_{first}_{first + rows}"
                for j, (first, rows) in enumerate(zip(old.firsts, old.block_rows))
                if old.span(j)[0] < hi and lo < old.span(j)[1]
            )
            targets = {
                entry[len(MANAGED) + 1 :]: torch.zeros(
                    tuple(meta.size), dtype=meta.properties.dtype
                )
                for source in sources
                for entry, meta in saved.items()
                if entry.startswith(f"{MANAGED}.{source}.")
            }
            blocks.append(_NewBlock(module, name, key, mch, (lo, hi), sources, targets))
    return blocks


@dataclass(frozen=True)
class _Placement:
    """A new block's module state, built from the saved blocks' entries, and the rows
    its ids move from and to (global rows; the tables' read put each saved row back at
    its row, whoever holds it now)."""

    block: _NewBlock
    buffers: dict[str, torch.Tensor]
    counters: list[int]
    history: dict[str, torch.Tensor]
    moved_from: torch.Tensor
    moved_to: torch.Tensor

    def restore(self) -> None:
        _restore(self.block.mch, self.buffers, self.counters, self.history)


def _place(block: _NewBlock, read: Mapping[str, torch.Tensor]) -> _Placement | str:
    """The new block's module: the saved blocks' ids of its input range, each with its
    metadata, sorted as TorchRec keeps them; an id keeps its row where that row is the
    block's, else takes the block's first free row (in id order); free slots keep
    TorchRec's empty id. Its pending history: the saved blocks' entries of its range,
    in a buffer their sizes together. A problem (more ids than rows) as a string."""
    mch, (lo, hi) = block.mch, block.span
    names = [n for n, is_mch, _ in mch._eviction_policy.metadata_info if is_mch]
    ids, rows, meta = [], [], {n: [] for n in names}
    for source in block.sources:
        raw = read[f"{source}._mch_sorted_raw_ids"]
        held = (raw != _EMPTY) & (raw >= lo) & (raw < hi)
        ids.append(raw[held])
        rows.append(read[f"{source}._mch_remapped_ids_mapping"][held])
        for n in names:
            meta[n].append(read[f"{source}._mch_{n}"][held])
    order = torch.cat(ids).argsort()
    ids_, rows_ = torch.cat(ids)[order], torch.cat(rows)[order]
    size, first = mch.output_size(), mch._output_global_offset
    if len(ids_) > size:
        return (
            f"its block of rows {first}:{first + size} would hold {len(ids_)} ids of its "
            f"input range [{lo}, {hi}) in {plural(size, 'row')}: give it more rows"
        )
    kept = (rows_ >= first) & (rows_ < first + size)
    taken = torch.zeros(size, dtype=torch.bool)
    taken[rows_[kept] - first] = True
    free = (~taken).nonzero()[:, 0] + first
    moving = int((~kept).sum())
    new_rows = rows_.clone()
    new_rows[~kept] = free[:moving]
    empty = size - len(ids_)
    buffers = dict(mch.state_dict())
    buffers["_mch_sorted_raw_ids"] = torch.cat([ids_, torch.full((empty,), _EMPTY)])
    buffers["_mch_remapped_ids_mapping"] = torch.cat([new_rows, free[moving:]])
    for n in names:
        buffers[f"_mch_{n}"] = torch.cat(
            [torch.cat(meta[n])[order], torch.zeros(empty, dtype=torch.int64)]
        )
    counters = [read[f"{s}.{_COUNTERS}"].tolist() for s in block.sources]
    current, last, _, _ = counters[0]
    buffers["_current_iter_tensor"] = read[f"{block.sources[0]}._current_iter_tensor"]
    history: dict[str, torch.Tensor] = {}
    length = -1
    if any(c[2] != -1 for c in counters):
        length = sum(max(c[2], 0) for c in counters)
        pending = [read[f"{s}.{_HISTORY}.{_ACCUMULATOR}"] for s in block.sources]
        mine = [(p >= lo) & (p < hi) for p in pending]
        for n in (_ACCUMULATOR, *_history_names(mch)):
            parts = [read[f"{s}.{_HISTORY}.{n}"] for s in block.sources]
            history[n] = torch.cat([p[m] for p, m in zip(parts, mine)])
    offset = len(history.get(_ACCUMULATOR, ()))
    return _Placement(
        block,
        buffers,
        [current, last, length, offset],
        history,
        rows_[~kept],
        new_rows[~kept],
    )


def _move_rows(placed: list[_Placement]) -> None:
    """Every moved id's row (weights and optimizer state) from the rank that holds its
    saved row now to its new row: each rank sends the rows asked of it, all read
    before any is written. Collective (on every rank, with or without blocks)."""
    world = dist.get_world_size()
    asked: list[Any] = [None] * world
    dist.all_gather_object(asked, {p.block.key: p.moved_from.tolist() for p in placed})
    mine = {p.block.key: p.block for p in placed}
    given: dict[tuple[int, str], tuple[list[int], list[torch.Tensor]]] = {}
    for rank, wants in enumerate(asked):
        for key, rows in wants.items():
            if key not in mine or not rows:
                continue
            block = mine[key]
            first = block.mch._output_global_offset
            wanted = torch.tensor(rows)
            here = wanted[(wanted >= first) & (wanted < first + block.mch.output_size())]
            if len(here):
                held = block.collection.managed_tables.rows(block.name)
                given[rank, key] = (here.tolist(), [t[here - first].cpu() for t in held])
    sent: list[Any] = [None] * world
    dist.all_gather_object(sent, given)
    rank = dist.get_rank()
    for placement in placed:
        block = placement.block
        if not len(placement.moved_from):
            continue
        parts = [part[rank, block.key] for part in sent if (rank, block.key) in part]
        found = torch.tensor([r for rows, _ in parts for r in rows])
        values = [torch.cat([v[i] for _, v in parts]) for i in range(len(parts[0][1]))]
        at = {r: i for i, r in enumerate(found.tolist())}
        pick = torch.tensor([at[r] for r in placement.moved_from.tolist()])
        local = placement.moved_to - block.mch._output_global_offset
        held = block.collection.managed_tables.rows(block.name)
        for target, value in zip(held, values):
            target[local] = value[pick].to(target.device)


def _restore(
    mch: MCHManagedCollisionModule,
    buffers: Mapping[str, torch.Tensor],
    counters: list[int],
    history: Mapping[str, torch.Tensor],
) -> None:
    """The module as placed: its buffers, iteration counters and profiled history."""
    mch.load_state_dict(dict(buffers))
    current, last, size, offset = counters
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
        buffer[:offset] = history[name]


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
