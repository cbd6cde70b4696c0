"""What a checkpoint holds, read without a process group and without loading it into a
model: ``embshard ckpt inspect``'s description (``describe``), ``embshard ckpt
export``'s plain state dict (``export``), and whole tensors by key prefix
(``read_tensors``, what serving reads)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from embshard.checkpoint import managed_collision as mc
from embshard.checkpoint.dynamic import DYNAMIC, describe_map
from embshard.checkpoint.store import (
    META,
    STEP,
    TABLE_PARENTS,
    load_alone,
    read_description,
    read_metadata,
    resolve,
)
from embshard.errors import CheckpointError


def read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every whole tensor whose key starts with ``prefix``, in one process (keys without
    the prefix): what export writes."""
    metadata = read_metadata(path)
    tensors = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    load_alone(tensors, path)
    return {key.removeprefix(prefix): value for key, value in tensors.items()}


def module_prefixes(keys: Iterable[str]) -> list[str]:
    """The modules that hold tables, in order, by the prefix of their state dict keys:
    ``ebc`` for ``ebc.embedding_bags.t.weight``, ``""`` for a collection's own keys."""
    found: dict[str, None] = {}
    for key in keys:
        parts = key.split(".")
        at = next((i for i, part in enumerate(parts[:-2]) if part in TABLE_PARENTS), None)
        if at is not None:
            found.setdefault(".".join(parts[:at]))
    return list(found)


def _model_keys(entries: dict[str, Any]) -> list[str]:
    """The keys of the saved model's tensors, as its own state dict names them."""
    prefix = "model." if META in entries else ""
    return [
        key.removeprefix(prefix)
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    ]


def export(path: str | Path, out: str | Path, *, module: str | None = None) -> list[str]:
    """Write the checkpoint's model as a plain unsharded state dict (``torch.save``) and
    return its keys: those of the unsharded model's state dict, or with ``module``
    (``"ebc"``) only those under ``module.``, that prefix stripped: the state dict of
    the module at that path, as ``EmbeddingBagCollection.load_state_dict`` takes it.
    Optimizer state is not exported. Runs in one process."""
    path = resolve(path)
    entries = read_metadata(path).state_dict_metadata
    prefix = "model." if META in entries else ""
    if module:
        prefix += module.rstrip(".") + "."
        if not any(key.startswith(prefix) for key in entries):
            raise CheckpointError(f"{path}: no tensors under {module!r}; {_where_tables(entries)}")
    model = read_tensors(path, prefix)
    torch.save(model, out)
    return list(model)


def _where_tables(entries: dict[str, Any]) -> str:
    modules = module_prefixes(_model_keys(entries))
    if not modules:
        return "it holds no tables"
    shown = ", ".join(repr(m) if m else "the top level (no module to give)" for m in modules)
    return f"its tables are under {shown}"


def _saved_steps(path: Path, entries: dict[str, Any]) -> dict[str, int]:
    """Each table's saved step count (Adam, LAMB), by its key."""
    ending = f".{STEP}"
    steps = {
        key: torch.zeros((), dtype=torch.int64)
        for key in entries
        if key.startswith("sparse_optimizer.") and key.endswith(ending)
    }
    if steps:
        load_alone(steps, path)
    return {
        key.removeprefix("sparse_optimizer.").removesuffix(ending): int(value)
        for key, value in steps.items()
    }


def describe(path: str | Path) -> dict[str, Any]:
    """What ``embshard ckpt inspect`` shows: step, size on disk, and per table its
    shape, dtype, saved layout, optimizer state (each tensor's shape), the optimizer's
    step count (Adam, LAMB; else None) and, for a dynamic table, its id map's spec,
    live ids and counts (else None). Needs no process group."""
    path = resolve(path)
    metadata = read_metadata(path)
    entries = metadata.state_dict_metadata
    info = read_description(path) if META in entries else {"step": None, "tables": {}}
    tables = {}
    steps = _saved_steps(path, entries)

    def read(tensors: dict[str, torch.Tensor]) -> None:
        load_alone(tensors, path)

    for fqn, table in info["tables"].items():
        weight = entries[f"model.{fqn}.weight"]
        table_state = f"sparse_optimizer.{fqn}."
        states = {
            key.removeprefix(table_state): list(entry.size)
            for key, entry in entries.items()
            if key.startswith(table_state) and key.count(".") == table_state.count(".")
        }
        tables[fqn] = {
            "shape": list(weight.size),
            "dtype": str(weight.properties.dtype).removeprefix("torch."),
            "layout": table.get("layout"),  # not in checkpoints before data-parallel tables
            "shards": [
                dict(zip(("rank", "row_offset", "rows", "col_offset", "cols"), s))
                for s in table["shards"]
            ],
            "optimizer": table["optimizer"] or "sgd",
            "optimizer_state": {n: shape for n, shape in states.items() if n != STEP},
            "optimizer_step": steps.get(fqn),
            "dynamic": describe_map(fqn, table[DYNAMIC], read) if DYNAMIC in table else None,
            "managed_collision": table.get(mc.RECORD),
        }
    dense = [
        k.removeprefix("model.")
        for k, v in entries.items()
        if k.startswith("model.")
        and isinstance(v, TensorStorageMetadata)
        and not any(k == f"model.{t}.weight" for t in info["tables"])
    ]
    return {
        "path": str(path),
        "step": info["step"],
        "world_size": info.get("world_size"),
        # Checkpoints saved before 2-D sharding groups: one group of the whole world.
        "sharding_group_size": info.get("sharding_group_size", info.get("world_size")),
        "replicas": info.get("replicas", 1 if info.get("world_size") else None),
        "bytes_on_disk": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "tables": tables,
        "dense_tensors": len(dense),
        "dense_optimizer": any(k.startswith("dense_optimizer.") for k in entries),
        "modules": module_prefixes(_model_keys(entries)),
    }
