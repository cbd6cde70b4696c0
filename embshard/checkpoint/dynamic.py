"""Dynamic tables in checkpoints: their id maps, forward count and counts.

Each dynamic table's map tensors (``IdMap.state_dict()``: keys, occupied, last step
seen, sightings, and probation's with ``admit_after`` > 1) are saved as DTensors of
global shape ``(buckets, rows_per_bucket)``, sharded by bucket range as the table's
rows are (bucket ``b`` is rows ``[b * rows_per_bucket, +rows_per_bucket)``), so DCP
reshards them with the rows to any plan whose cuts are bucket-aligned. Beside them,
under ``dynamic.`` in the checkpoint:

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
from torch.distributed.tensor import DTensor

from embshard.errors import CheckpointError
from embshard.modules.collection import ShardedCollection
from embshard.storage.dynamic import STATS, DynamicTables
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
        mine = tables.maps()
        stats = module.dynamic_stats()
        for name in tables.names:
            first, maps = mine.get(name, (0, None))
            key = prefix + module.table_key(name)
            for state_name, wrapper in _wrappers(module, name, first, maps).items():
                state[f"{key}.{state_name}"] = wrapper
            counts = [getattr(stats[name], stat) for stat in STATS]
            state[f"{key}.{COUNTS}"] = torch.tensor(counts, dtype=torch.int64)
        state[f"{prefix}{STEP}"] = torch.tensor(tables.step, dtype=torch.int64)
    return state


def load_targets(
    collections: Mapping[str, ShardedCollection],
) -> tuple[dict[str, Any], Callable[[Any], None]]:
    """What DCP fills for the collections' dynamic tables (fresh tensors of the
    layout ``save_state`` gives), and how it then goes live: every map, forward count
    and the counts (the first rank takes the totals)."""
    targets: dict[str, Any] = {}
    for prefix, module in collections.items():
        tables = module.dynamic_tables
        if tables is None:
            continue
        mine = tables.maps()
        for name in tables.names:
            key = prefix + module.table_key(name)
            first, maps = mine.get(name, (0, None))
            fresh = None if maps is None else {n: torch.zeros_like(t) for n, t in maps.items()}
            for state_name, wrapper in _wrappers(module, name, first, fresh).items():
                targets[f"{key}.{state_name}"] = wrapper
            targets[f"{key}.{COUNTS}"] = torch.zeros(len(STATS), dtype=torch.int64)
        targets[f"{prefix}{STEP}"] = torch.zeros((), dtype=torch.int64)

    def restore(_: Any) -> None:
        for prefix, module in collections.items():
            if module.dynamic_tables is not None:
                _restore(prefix, module, module.dynamic_tables, targets)

    return targets, restore


def _restore(
    prefix: str, module: ShardedCollection, tables: DynamicTables, read: Mapping[str, Any]
) -> None:
    maps, counts = {}, {}
    for name in tables.names:
        key = prefix + module.table_key(name)
        local = {}
        for state_name in _layout(tables.specs[name]):
            wrapper = read[f"{key}.{state_name}"].to_local()
            if isinstance(wrapper, LocalShardsWrapper) and wrapper.local_shards():
                local[state_name] = wrapper.local_shards()[0]
        if local:
            maps[name] = local
        first = module.rank == 0  # the totals once, where dynamic_stats() sums the ranks
        counts[name] = read[f"{key}.{COUNTS}"].tolist() if first else [0] * len(STATS)
    tables.restore(maps, int(read[f"{prefix}{STEP}"]), counts)


def _layout(spec: IdMapSpec) -> dict[str, torch.dtype]:
    """The map's tensors and their dtypes, from a one-bucket map of the spec."""
    return {n: t.dtype for n, t in IdMap(spec, 0, 1).state_dict().items()}


def _wrappers(
    module: ShardedCollection,
    name: str,
    first: int,
    maps: Mapping[str, torch.Tensor] | None,
) -> dict[str, DTensor]:
    """Table ``name``'s map tensors as DTensors of (buckets, rows_per_bucket), this
    rank's range ``maps`` (None: it holds none) at bucket ``first``."""
    spec, mesh = module.dynamic_tables.specs[name], module.sharding_mesh
    table = module.tables[name]
    wrappers = {}
    for state_name, dtype in _layout(spec).items():
        local = (
            LocalShardsWrapper([maps[state_name]], [(first, 0)])
            if maps is not None
            else LocalShardsWrapper([], [], dtype=dtype, device=mesh.device)
        )
        wrappers[state_name] = table_dtensor(
            table, local, mesh.mesh, mesh.submesh, (spec.buckets, spec.rows_per_bucket)
        )
    return wrappers


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
