"""DCP checkpoints of sharded models: atomic, resharding, checked before anything changes.

A checkpoint is a directory ``step_<N>`` under a root, written aside as
``.step_<N>.tmp`` and renamed once every rank has finished; the last ``keep`` stay.
Inside, DCP's files hold one state dict:

    model.<fqn>                 dense tensors and every table (a DTensor)
    sparse_optimizer.<fqn>      the fused optimizer's state (``...momentum1``)
    dense_optimizer.*           the dense optimizer (FQN-keyed, DCP's state_dict API)
    embshard                    JSON: step, world size, each table's shards and optimizer

A DCP checkpoint of a plain state dict (an unsharded TorchRec model saved with
``dcp.save(model.state_dict())``) loads too: its keys are the model's own.

Loading takes a checkpoint or a root of them (then its latest), reads and checks the
metadata first (as ``nn.Module.load_state_dict``, ``strict`` also refuses what the
model lacks), loads everything into fresh staging tensors (each rank only its own
shards, DCP resharding from whatever layout saved them), and writes the model only
when all of it has arrived: a failed load changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from embshard.lookup import Adagrad, RowWiseAdagrad
from embshard.module import ShardedEmbeddingBagCollection
from embshard.plan import plural
from embshard.shards import LocalShardsWrapper, column_blocks

META = "embshard"
_STEP_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this model; the message says why."""


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _sharded(model: nn.Module) -> dict[str, ShardedEmbeddingBagCollection]:
    """Every sharded collection, by the prefix of its keys in the model's state dict."""
    return {
        f"{path}." if path else "": m
        for path, m in _unwrap(model).named_modules()
        if isinstance(m, ShardedEmbeddingBagCollection)
    }


def _optimizer_kind(module: ShardedEmbeddingBagCollection) -> str | None:
    return {Adagrad: "adagrad", RowWiseAdagrad: "rowwise_adagrad"}.get(type(module.fused_optimizer))


def _describe(model: nn.Module, step: int) -> dict[str, Any]:
    tables = {}
    for prefix, module in _sharded(model).items():
        for name, table in module.tables.items():
            tables[f"{prefix}embedding_bags.{name}"] = {
                "rows": table.num_embeddings,
                "dim": table.embedding_dim,
                "shards": [
                    [s.rank, s.row_offset, s.rows, s.col_offset, s.cols] for s in table.shards
                ],
                "optimizer": _optimizer_kind(module),
                "blocks": [list(b) for b in column_blocks(table)],
            }
    return {"step": step, "world_size": dist.get_world_size(), "tables": tables}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    sparse = {
        prefix + key: value
        for prefix, module in _sharded(model).items()
        for key, value in module.optimizer_state().items()
    }
    state = {"model": _unwrap(model).state_dict(), "sparse_optimizer": sparse}
    if optimizer is not None:
        state["dense_optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(
    root: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    keep: int = 3,
) -> Path:
    """Save ``root/step_<step>`` atomically; collective. Keeps the last ``keep``."""
    root = Path(root)
    name = f"{_STEP_PREFIX}{step:08d}"
    final, aside = root / name, root / f".{name}.tmp"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(aside, ignore_errors=True)
    dist.barrier()
    state = _state(model, optimizer)
    state[META] = json.dumps(_describe(model, step))
    dcp.save(state, checkpoint_id=aside)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(aside, final)
        _fsync_dir(root)
        for old in checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (a save cut off midway
    leaves only its ``.tmp`` directory, which is not one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_STEP_PREFIX) and p.is_dir()]
    return sorted((p for p in found if (p / ".metadata").is_file()), key=lambda p: p.name)


def latest(root: str | Path) -> Path | None:
    found = checkpoints(root)
    return found[-1] if found else None


def read_metadata(path: str | Path) -> Metadata:
    """DCP's metadata, after checking every file it names is there and long enough."""
    path = Path(path)
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint's metadata: {e}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for relative, size in sorted(needed.items()):
        file = path / relative
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {plural(have, 'byte')}, needs {size}"
            raise CheckpointError(f"{path}: incomplete checkpoint: {relative} {state}")
    return metadata


def _load_alone(state: dict[str, Any], path: Path) -> None:
    """DCP load in this process alone, whatever the process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)


def read_description(path: str | Path) -> dict[str, Any]:
    """The checkpoint's own description (step, tables, layout); needs no process group."""
    holder = {META: ""}
    try:
        _load_alone(holder, Path(path))
        return json.loads(holder[META])
    except (CheckpointException, ValueError) as e:
        raise CheckpointError(f"{path}: reading the checkpoint failed: {e}") from None


def load(
    path: str | Path | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> int:
    """Load a checkpoint into ``model`` (and ``optimizer``), resharding as needed;
    returns the saved step. Collective.

    ``path`` is a checkpoint or a root of them, then its latest complete one (as
    ``embshard ckpt inspect`` reads it). As ``nn.Module.load_state_dict``: with
    ``strict`` (the default) tables and dense tensors in the checkpoint that the model
    lacks are an error; ``strict=False`` ignores them and loads the rest. Tables and
    tensors the model has but the checkpoint lacks are an error either way: they would
    silently keep whatever values they had.

    Raises CheckpointError on every rank, changing nothing, when there is no
    checkpoint (``path`` None, as ``latest`` returns for an empty root), or it is
    incomplete, unreadable or does not match."""
    path = resolve(path)
    metadata = read_metadata(path)
    if META not in metadata.state_dict_metadata:
        return _load_model_state(path, metadata, model, strict)
    saved = read_description(path)
    live = _state(model, optimizer)
    staging, commits = _staging(live, saved, model)
    _check(path, metadata, staging, "model." if strict else None)
    _read(path, staging)
    with torch.no_grad():
        _copy(staging["model"], live["model"])
        for commit in commits:
            commit(staging["sparse_optimizer"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, staging["dense_optimizer"])
    return int(saved["step"])


def _read(path: Path, staging: dict[str, Any]) -> None:
    try:
        dcp.load(staging, checkpoint_id=str(path))
    except CheckpointException as e:
        raise CheckpointError(f"{path}: reading the checkpoint failed: {e}") from None


def _load_model_state(path: Path, metadata: Metadata, model: nn.Module, strict: bool) -> int:
    """A DCP checkpoint of a plain state dict (an unsharded TorchRec model's, say):
    its keys are the model's own. Returns step 0."""
    live = _unwrap(model).state_dict()
    staging = _empty_like(live)
    _check(path, metadata, staging, "" if strict else None)
    _read(path, staging)
    with torch.no_grad():
        _copy(staging, live)
    return 0


def _empty_like(value: Any) -> Any:
    if isinstance(value, DTensor):
        spec = value._spec
        return DTensor.from_local(
            torch.empty_like(value.to_local()),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=spec.stride,
        )
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: _empty_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_empty_like(v) for v in value]
    return value


def _copy_one(source: torch.Tensor, target: torch.Tensor) -> None:
    local = source.to_local() if isinstance(source, DTensor) else source
    (target.to_local() if isinstance(target, DTensor) else target).copy_(local)


def _copy(source: dict[str, Any], target: dict[str, Any]) -> None:
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            _copy_one(value, target[key])


def _staging(
    live: dict[str, Any], saved: dict[str, Any], model: nn.Module
) -> tuple[dict[str, Any], list[Callable[[dict[str, Any]], None]]]:
    """Fresh tensors shaped like ``live`` for DCP to fill, and how each table's fused
    optimizer state goes live: copied, converted from other column blocks
    (row-wise Adagrad), or zeroed when the checkpoint has none of this kind."""
    staging = {"model": _empty_like(live["model"]), "sparse_optimizer": {}, META: ""}
    if "dense_optimizer" in live:
        staging["dense_optimizer"] = _empty_like(live["dense_optimizer"])
    commits = []
    for prefix, module in _sharded(model).items():
        for name, table in module.tables.items():
            key = f"{prefix}embedding_bags.{name}.momentum1"
            if key not in live["sparse_optimizer"]:
                continue
            target = live["sparse_optimizer"][key]
            old = saved["tables"].get(f"{prefix}embedding_bags.{name}", {})
            kind = _optimizer_kind(module)
            if old.get("optimizer") != kind:
                commits.append(lambda _, target=target: _zero(target))
            elif kind == "adagrad" or [tuple(b) for b in old["blocks"]] == column_blocks(table):
                staging["sparse_optimizer"][key] = _empty_like(target)
                commits.append(
                    lambda staged, key=key, target=target: _copy_one(staged[key], target)
                )
            else:
                staged, convert = _rowwise_conversion(module, name, old["blocks"], target)
                staging["sparse_optimizer"][key] = staged
                commits.append(convert)
    return staging, commits


def _zero(value: DTensor) -> None:
    local = value.to_local()
    for shard in local.local_shards() if isinstance(local, LocalShardsWrapper) else []:
        shard.zero_()


def _rowwise_conversion(
    module: ShardedEmbeddingBagCollection, name: str, saved_blocks: list, live: DTensor
) -> tuple[DTensor, Callable[[dict[str, Any]], None]]:
    """Row-wise Adagrad keeps, per row, the mean over a block's columns of the squared
    gradients. A new block's state is the width-weighted mean of the saved blocks it
    overlaps: exact when it is a union of saved blocks (column-wise to table-wise or
    row-wise), an approximation when it splits one (the other way round)."""
    table = module.tables[name]
    rank = module.rank
    ranges = sorted({(s.row_offset, s.rows) for s in table.shards_on(rank) if s.rows and s.cols})
    width = len(saved_blocks)
    shards = [torch.empty(rows, width) for _, rows in ranges]
    staged = DTensor.from_local(
        LocalShardsWrapper(shards, [(row, 0) for row, _ in ranges]),
        live.device_mesh,
        live.placements,
        run_check=False,
        shape=torch.Size((table.num_embeddings, width)),
        stride=(width, 1),
    )
    blocks = column_blocks(table)

    def convert(_: dict[str, Any]) -> None:
        local = live.to_local()
        if not isinstance(local, LocalShardsWrapper):
            return  # this rank holds none of the table
        for shard, (row, block) in zip(local.local_shards(), local.local_offsets()):
            start, cols = blocks[block]
            source = shards[ranges.index((row, len(shard)))]
            weights = torch.tensor(
                [max(0, min(start + cols, s + w) - max(start, s)) / cols for s, w in saved_blocks]
            )
            shard.copy_((source @ weights).unsqueeze(1))

    return staged, convert


def _check(
    path: Path, metadata: Metadata, staging: dict[str, Any], model_prefix: str | None
) -> None:
    """Every tensor the model needs is in the checkpoint with its shape and dtype; and,
    unless ``model_prefix`` is None (not strict), every saved key starting with it (the
    model's part of the checkpoint) is one the model has."""
    flat, _ = flatten_state_dict(staging)
    saved = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            if key not in saved:
                problems.append(f"{key}: missing from the checkpoint")
            continue
        what = _name(key)
        entry = saved.get(key)
        if entry is None:
            problems.append(f"{what}: missing from the checkpoint")
        elif not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{what}: the checkpoint holds an object, not a tensor")
        elif tuple(entry.size) != tuple(value.shape) or entry.properties.dtype != value.dtype:
            problems.append(
                f"{what}: the checkpoint has {tuple(entry.size)} {entry.properties.dtype}, "
                f"the model {tuple(value.shape)} {value.dtype}"
            )
    if model_prefix is not None:
        problems += [
            f"{_name(key)}: in the checkpoint, not in the model (strict=False ignores it)"
            for key in sorted(saved)
            if key.startswith(model_prefix) and key not in flat
        ]
    if problems:
        raise CheckpointError(f"{path} does not match the model:\n  " + "\n  ".join(problems))


def _name(key: str) -> str:
    parts = key.split(".")
    if "embedding_bags" in parts:
        table = parts[parts.index("embedding_bags") + 1]
        return f"table {table!r} ({key})"
    return key


def resolve(path: str | Path | None) -> Path:
    """A checkpoint directory, or a root of them (then its latest complete one)."""
    if path is None:
        raise CheckpointError(
            "no checkpoint to load: the path is None, which latest(root) returns when "
            "root holds no complete step_* checkpoint"
        )
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    found = latest(path)
    if found is None:
        why = "it does not exist" if not path.exists() else "no .metadata, no complete step_*"
        raise CheckpointError(f"no checkpoint under {path} ({why}; latest() returns None)")
    return found


def read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every whole tensor whose key starts with ``prefix``, in one process (keys without
    the prefix): what export writes."""
    metadata = read_metadata(path)
    tensors = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    try:
        _load_alone(tensors, path)
    except CheckpointException as e:
        raise CheckpointError(f"{path}: reading the checkpoint failed: {e}") from None
    return {key.removeprefix(prefix): value for key, value in tensors.items()}


def export(path: str | Path, out: str | Path) -> list[str]:
    """Write the checkpoint's model as a plain unsharded state dict (``torch.save``), the
    keys the unsharded TorchRec model has; returns them. Runs in one process."""
    path = resolve(path)
    embshard = META in read_metadata(path).state_dict_metadata
    model = read_tensors(path, "model." if embshard else "")
    torch.save(model, out)
    return list(model)


def describe(path: str | Path) -> dict[str, Any]:
    """What ``embshard ckpt inspect`` shows: step, size on disk, and per table its
    shape, dtype, saved layout and optimizer state. Needs no process group."""
    path = resolve(path)
    metadata = read_metadata(path)
    entries = metadata.state_dict_metadata
    info = read_description(path) if META in entries else {"step": None, "tables": {}}
    tables = {}
    for fqn, table in info["tables"].items():
        weight = entries[f"model.{fqn}.weight"]
        state = entries.get(f"sparse_optimizer.{fqn}.momentum1")
        tables[fqn] = {
            "shape": list(weight.size),
            "dtype": str(weight.properties.dtype).removeprefix("torch."),
            "shards": [
                dict(zip(("rank", "row_offset", "rows", "col_offset", "cols"), s))
                for s in table["shards"]
            ],
            "optimizer": table["optimizer"] or "sgd",
            "optimizer_state_shape": list(state.size) if state is not None else None,
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
        "bytes_on_disk": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "tables": tables,
        "dense_tensors": len(dense),
        "dense_optimizer": any(k.startswith("dense_optimizer.") for k in entries),
    }
