"""Dynamic tables in checkpoints: their id maps, forward count and counts.

Each dynamic table's map tensors (``IdMap.state_dict()``: keys, occupied, last step
seen, sightings, and probation's with ``admit_after`` > 1) are saved as DTensors of
global shape ``(buckets, rows_per_bucket)``, sharded by bucket range as the table's
rows are (bucket ``b`` is rows ``[b * rows_per_bucket, +rows_per_bucket)``), so DCP
reshards them with the rows to any plan whose cuts are bucket-aligned. The column blocks
of a column-wise or grid table hold equal maps: the first block's (``col_offset`` 0) are
saved, one copy of each bucket range, and a load fills every block's from them. Beside
them, under ``dynamic.`` in the checkpoint:

    dynamic.<module prefix><table key>.<map tensor>   the map, a DTensor
    dynamic.<module prefix><table key>.counts         admitted, evicted, overflow: the
                                                      totals over every rank (int64)
    dynamic.<module prefix>step                       the module's forward count

A load gives the totals to the sharding group's first rank and zero to the others, so
``dynamic_stats()``, which sums the ranks, continues from them at any world size. A
model without dynamic tables saves none of this: its checkpoint is what it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from embshard.errors import CheckpointError
from embshard.modules.collection import ShardedCollection
from embshard.storage.dynamic import STATS
from embshard.storage.id_map import IdMap, IdMapSpec
from embshard.storage.shards import LocalShardsWrapper, table_dtensor

DYNAMIC = "dynamic"  # the checkpoint's top-level key of what this module saves
COUNTS = "counts"
STEP = "step"


def spec_record(spec: IdMapSpec) -> dict[str, Any]:
    """The spec as a checkpoint's description records it (JSON)."""
    return dataclasses.asdict(spec)


def save_state(collections: Mapping[str, ShardedCollection]) -> dict[str, Any]:
    """What a checkpoint saves of the collections' dynamic tables, keyed under
    ``DYNAMIC`` (nothing without dynamic tables). Collective: the counts are summed
    over the ranks."""
    state: dict[str, Any] = {}
    for prefix, module in collections.items():
        tables = module.dynamic_tables
        if tables is None:
            continue
        stats = module.dynamic_stats()
        counts = {
            name: torch.tensor([getattr(stats[name], s) for s in STATS], dtype=torch.int64)
            for name in tables.names
        }
        step = torch.tensor(tables.step, dtype=torch.int64)
        state |= _entries(prefix, module, tables.maps(), counts, step)
    return state


def load_targets(
    collections: Mapping[str, ShardedCollection],
) -> tuple[dict[str, Any], Callable[[Any], None]]:
    """What DCP fills for the collections' dynamic tables (fresh tensors in the layout
    ``save_state`` gives), and how it then goes live: every map and forward count, and
    the counts (the sharding group's first rank takes the totals, the others zero)."""
    targets: dict[str, Any] = {}
    restores = []
    for prefix, module in collections.items():
        tables = module.dynamic_tables
        if tables is None:
            continue
        maps = {
            name: (first, _empty_map(tables.specs[name], last - first, module.sharding_mesh.device))
            for name, (first, last) in tables.map_ranges().items()
        }
        counts = {name: torch.zeros(len(STATS), dtype=torch.int64) for name in tables.names}
        step = torch.zeros((), dtype=torch.int64)
        targets |= _entries(prefix, module, maps, counts, step)
        restores.append((module, tables, maps, counts, step))

    def restore(_: Any) -> None:
        for module, tables, maps, counts, step in restores:
            totals = {
                name: c.tolist() if module.rank == 0 else [0] * len(STATS)
                for name, c in counts.items()
            }
            tables.restore(maps, int(step), totals)

    return targets, restore


def _entries(
    prefix: str,
    module: ShardedCollection,
    maps: Mapping[str, tuple[int, Mapping[str, torch.Tensor]]],
    counts: Mapping[str, torch.Tensor],
    step: torch.Tensor,
) -> dict[str, Any]:
    """A module's checkpoint entries: each dynamic table's map tensors as DTensors of
    ``(buckets, rows_per_bucket)`` over this rank's ``maps`` (by table: its first
    bucket and tensors; tables it holds none of are absent), its counts, and the
    module's step."""
    tables = module.dynamic_tables
    assert tables is not None
    mesh, entries = module.sharding_mesh, {}
    for name in tables.names:
        spec, key = tables.specs[name], prefix + module.table_key(name)
        first, state = maps.get(name, (0, None))
        for state_name, dtype in _layout(spec).items():
            local = (
                LocalShardsWrapper([state[state_name]], [(first, 0)])
                if state is not None
                else LocalShardsWrapper([], [], dtype=dtype, device=mesh.device)
            )
            entries[f"{key}.{state_name}"] = table_dtensor(
                module.tables[name],
                local,
                mesh.mesh,
                mesh.submesh,
                (spec.buckets, spec.rows_per_bucket),
            )
        entries[f"{key}.{COUNTS}"] = counts[name]
    entries[f"{prefix}{STEP}"] = step
    return entries


def _empty_map(spec: IdMapSpec, buckets: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Zeroed map tensors of ``buckets`` buckets of ``spec``: what a load fills."""
    return {
        n: torch.zeros(buckets, spec.rows_per_bucket, dtype=dtype, device=device)
        for n, dtype in _layout(spec).items()
    }


def _layout(spec: IdMapSpec) -> dict[str, torch.dtype]:
    """The map's tensors and their dtypes, from a one-bucket map of the spec: what a
    rank holding none of the table's buckets saves and loads nothing of."""
    return {n: t.dtype for n, t in IdMap(spec, 0, 1).state_dict().items()}


def check_specs(
    path: object, tables: Mapping[str, Any], collections: Mapping[str, ShardedCollection]
) -> None:
    """Every table saved and in the model is dynamic in both, with the same spec, or in
    neither: else a one-line CheckpointError (the description is the same on every
    rank, so every rank raises it). ``tables``: the description's, by key."""
    for prefix, module in collections.items():
        specs = module.dynamic_tables.specs if module.dynamic_tables is not None else {}
        for name in module.tables:
            key = prefix + module.table_key(name)
            if key not in tables:
                continue  # the shape checks name it
            saved, live = tables[key].get(DYNAMIC), specs.get(name)
            live_record = None if live is None else spec_record(live)
            if saved != live_record:
                raise CheckpointError(f"{path}: table {name!r} ({key}): {_mismatch(saved, live)}")


def _mismatch(saved: dict[str, Any] | None, live: IdMapSpec | None) -> str:
    if saved is None:
        return "dynamic in the model, but the checkpoint holds no id map for it"
    if live is None:
        shown = ", ".join(f"{f}={v!r}" for f, v in saved.items())
        return f"static in the model, but the checkpoint holds its id map (IdMapSpec({shown}))"
    record = spec_record(live)
    fields = [f for f in record if saved.get(f) != record[f]]
    given = ", ".join(f"{f} {saved.get(f)!r}" for f in fields)
    wants = ", ".join(f"{f} {record[f]!r}" for f in fields)
    return f"the checkpoint's id map has {given}, the model's {wants}"


def refuse_without_maps(path: object, collections: Mapping[str, ShardedCollection]) -> None:
    """A plain state dict holds no id maps: refused for a model with dynamic tables."""
    for prefix, module in collections.items():
        if module.dynamic_tables is not None:
            name = module.dynamic_tables.names[0]
            raise CheckpointError(
                f"{path}: table {name!r} ({prefix}{module.table_key(name)}) is dynamic, and a "
                "plain state dict holds no id map for it"
            )


def describe_map(
    fqn: str, spec: Mapping[str, Any], read: Callable[[dict[str, torch.Tensor]], None]
) -> dict[str, Any]:
    """What ``embshard ckpt inspect`` shows of table ``fqn``'s saved id map: its spec,
    its rows and live ids (occupancy), and the counts over every rank. ``read`` fills
    the tensors of a state dict from the checkpoint."""
    shape = (spec["buckets"], spec["rows_per_bucket"])
    occupied, counts = f"{DYNAMIC}.{fqn}.occupied", f"{DYNAMIC}.{fqn}.{COUNTS}"
    tensors = {
        occupied: torch.zeros(shape, dtype=torch.bool),
        counts: torch.zeros(len(STATS), dtype=torch.int64),
    }
    read(tensors)
    live = int(tensors[occupied].sum())
    return {**spec, "rows": shape[0] * shape[1], "live": live} | dict(
        zip(STATS, tensors[counts].tolist())
    )
