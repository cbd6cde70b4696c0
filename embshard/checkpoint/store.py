"""DCP checkpoints of sharded models: atomic, resharding, checked before anything changes.

A checkpoint is a directory ``step_<N>`` under a root, written aside as
``.step_<N>.tmp`` and renamed once every rank has finished; the last ``keep`` stay.
Inside, DCP's files hold one state dict:

    model.<fqn>                 dense tensors and every table (a DTensor)
    sparse_optimizer.<fqn>      the fused optimizer's state per table (``...momentum1``,
                                ``...momentum2``) and its step count (``...step``:
                                Adam's and LAMB's, an int64 scalar)
    dense_optimizer.*           the dense optimizer (FQN-keyed, DCP's state_dict API)
    dynamic.*                   dynamic tables' id maps, counts and forward count
                                (``checkpoint.dynamic``; absent without dynamic tables)
    managed_collision.*         each row block's TorchRec MCH module, whole
                                (``checkpoint.managed_collision``; absent without
                                managed-collision tables)
    embshard                    JSON: step, world size, sharding group size and replicas
                                (2-D meshes), each table's shards and optimizer (and a
                                dynamic table's IdMapSpec), and the training config
                                where the saver gave it

and beside them ``embshard_checksums.json``: the crc32 of every saved chunk's bytes
(file, offset, length) and of DCP's ``.metadata``, written after DCP's save and before
the rename, so that a load or ``verify`` finds a changed byte and names its chunk.

A DCP checkpoint of a plain state dict (an unsharded TorchRec model saved with
``dcp.save(model.state_dict())``) loads too: its keys are the model's own.

Loading takes a checkpoint or a root of them (then its latest), reads and checks the
metadata first (as ``nn.Module.load_state_dict``, ``strict`` also refuses what the
model lacks), verifies the bytes of every chunk each rank will read against their
checksums (every rank raises if any finds a bad one), and only then lets DCP read
each rank's own shards straight into the model, one saved chunk at a time, resharding
from whatever layout saved them. No staging copy: the load adds about one saved chunk
to a rank's memory, and what it cannot check beforehand (an I/O error or a rank dying
during the read) can leave the model partly loaded.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from itertools import groupby
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from embshard.checkpoint import managed_collision as mc
from embshard.checkpoint.dynamic import (
    DYNAMIC,
    check_specs,
    load_targets,
    refuse_without_maps,
    save_state,
    spec_record,
)
from embshard.checkpoint.untrusted import SafeLoadPlanner, SafeReader, load_bytes
from embshard.errors import CheckpointError
from embshard.modules.collection import ShardedCollection
from embshard.plan.specs import TableShard, plural
from embshard.storage.optimizers import SGD, column_blocks
from embshard.storage.shards import LocalShardsWrapper

META = "embshard"
CHECKSUMS = "embshard_checksums.json"
_STEP_PREFIX = "step_"
_READ_BLOCK = 1 << 22
TABLE_PARENTS = ("embedding_bags", "embeddings")  # EmbeddingBagCollection, EmbeddingCollection
STEP = "step"  # the key ending of a table's fused optimizer step count

Checksums = dict[tuple[str, int], tuple[int, int]]
"""Recorded checksums: (file, offset) -> (length, crc32) of each saved chunk."""


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _sharded(model: nn.Module) -> dict[str, ShardedCollection]:
    """Every sharded collection, by the prefix of its keys in the model's state dict."""
    return {
        f"{path}." if path else "": m
        for path, m in _unwrap(model).named_modules()
        if isinstance(m, ShardedCollection)
    }


def _optimizer_kind(module: ShardedCollection) -> str | None:
    """The fused optimizer with state, as checkpoints name it (None: SGD, stateless)."""
    kind = module.fused_optimizer.KIND
    return None if kind == SGD.KIND else kind


def _describe(
    model: nn.Module, step: int, job: str | None, config: Mapping[str, Any] | None
) -> dict[str, Any]:
    tables = {}
    for prefix, module in _sharded(model).items():
        specs = module.dynamic_tables.specs if module.dynamic_tables is not None else {}
        for name, table in module.tables.items():
            key = prefix + module.table_key(name)
            tables[key] = {
                "rows": table.num_embeddings,
                "dim": table.embedding_dim,
                "layout": table.kind,
                "shards": [
                    [s.rank, s.row_offset, s.rows, s.col_offset, s.cols] for s in table.shards
                ],
                "optimizer": _optimizer_kind(module),
                "blocks": [list(b) for b in column_blocks(table)],
            }
            if name in specs:  # static tables' descriptions stay as they were
                tables[key][DYNAMIC] = spec_record(specs[name])
            if (managed := mc.record(module, name)) is not None:
                tables[key][mc.RECORD] = managed
    world = dist.get_world_size()
    meshes = [module.sharding_mesh for module in _sharded(model).values()]
    group = meshes[0].size if meshes else world  # shard_model gives every collection one mesh
    return {
        "step": step,
        "world_size": world,
        "sharding_group_size": group,
        "replicas": world // group,
        "job": job,
        "tables": tables,
        "config": None if config is None else dict(config),
    }


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state dict DCP saves (collective: the fused optimizers' step counts)."""
    sparse = {}
    for prefix, module in _sharded(model).items():
        sparse |= {prefix + key: value for key, value in module.optimizer_state().items()}
        steps = module.optimizer_steps()
        if steps is not None:  # every table's own copy: its checkpoint entries are whole
            sparse |= {
                f"{prefix}{module.table_key(n)}.{STEP}": steps.clone() for n in module.tables
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
    job: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``root/step_<step>`` atomically; collective. Keeps the last ``keep``.

    ``job`` names the job that saves it (a training job's rendezvous id): a job that
    finds its own checkpoint knows it is continuing, whatever its local restart count.
    ``config`` (JSON data: the training config) is kept in the description, under the
    checksums, for what reads the checkpoint later (``saved_config``)."""
    root = Path(root)
    name = f"{_STEP_PREFIX}{step:08d}"
    final, aside = root / name, root / f".{name}.tmp"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(aside, ignore_errors=True)
    dist.barrier()
    state = _state(model, optimizer)
    dynamic = save_state(_sharded(model))
    if dynamic:
        state[DYNAMIC] = dynamic
    if managed := mc.save_state(_sharded(model)):
        state[mc.MANAGED] = managed
    state[META] = json.dumps(_describe(model, step, job, config))
    dcp.save(state, checkpoint_id=aside)
    _record_checksums(aside)
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
        metadata = SafeReader(path).read_metadata()
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


def load_alone(state: dict[str, Any], path: Path) -> None:
    """DCP load in this process alone, whatever the process group; what DCP cannot read
    is a CheckpointError naming the checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        try:
            dcp.load(
                state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=True
            )
        except CheckpointException as e:
            raise read_failed(path, e) from None


def read_description(path: str | Path) -> dict[str, Any]:
    """The checkpoint's own description (step, tables, layout); needs no process group."""
    holder = {META: ""}
    try:
        load_alone(holder, Path(path))
        return json.loads(holder[META])
    except ValueError as e:  # what the reader or JSON cannot decode
        raise read_failed(path, e) from None


def saved_config(path: str | Path) -> dict[str, Any] | None:
    """The training config saved in the checkpoint's description, its bytes first
    checked against their checksums (a changed byte is a CheckpointError); None for a
    checkpoint saved without one. Needs no process group."""
    path = resolve(path)
    metadata = read_metadata(path)
    if META not in metadata.state_dict_metadata:
        return None
    _verify_layout(path, metadata, _recorded_checksums(path))
    return read_description(path).get("config")


@dataclass(frozen=True)
class Chunk:
    """One saved item's bytes: the state dict key it holds (part of) and where it lies."""

    key: str
    file: str
    offset: int
    length: int

    def __str__(self) -> str:
        where = f"{self.file} at offset {self.offset} ({plural(self.length, 'byte')})"
        return f"{_name(self.key)}: {where}"


@dataclass
class Verification:
    """What ``verify`` found. ``checked`` is False for a checkpoint without checksums
    (saved before embshard recorded them, or not by embshard): nothing could be checked."""

    path: Path
    checked: bool
    chunks: int
    bytes: int
    bad: list[Chunk]

    @property
    def ok(self) -> bool:
        return self.checked and not self.bad

    def summary(self) -> str:
        """What ``embshard ckpt verify`` prints: OK, or each bad chunk."""
        if not self.checked:
            return (
                f"{self.path}: no checksums (saved before embshard recorded them, or not by "
                "embshard): cannot verify"
            )
        if self.bad:
            return (
                f"{self.path}: corrupt, {len(self.bad)} of {self.chunks} chunks not matching "
                "the checksums saved with it:\n  " + "\n  ".join(str(c) for c in self.bad)
            )
        return f"{self.path}: OK, {self.chunks} chunks ({self.bytes:,} bytes) match their checksums"


def verify(path: str | Path) -> Verification:
    """Check every saved chunk (and DCP's ``.metadata``) against the checksums recorded
    at save time, reading each byte once; needs no process group and loads nothing."""
    path = resolve(path)
    chunks = [_metadata_chunk(path), *_chunks(read_metadata(path))]
    recorded = _recorded_checksums(path)
    bad = [] if recorded is None else _mismatched(path, chunks, recorded)
    total = sum(c.length for c in chunks)
    return Verification(path, recorded is not None, len(chunks), total, bad)


def _chunks(metadata: Metadata, indices: Iterable[MetadataIndex] | None = None) -> list[Chunk]:
    """The saved chunks (all, or those holding ``indices``) in file and offset order."""
    storage = metadata.storage_data or {}
    found = {}
    for index in storage if indices is None else indices:
        info = storage[index]
        found[info.relative_path, info.offset] = Chunk(
            index.fqn, info.relative_path, info.offset, info.length
        )
    return [found[place] for place in sorted(found)]


def _metadata_chunk(path: Path) -> Chunk:
    file = path / ".metadata"
    return Chunk("DCP's .metadata", ".metadata", 0, file.stat().st_size if file.is_file() else 0)


def _checksums(path: Path, chunks: list[Chunk]) -> list[int]:
    """crc32 of each chunk's bytes, streamed through one small buffer."""
    buffer = memoryview(bytearray(_READ_BLOCK))
    sums = []
    for file, group in groupby(chunks, key=lambda c: c.file):
        with open(path / file, "rb", buffering=0) as stream:
            for chunk in group:
                stream.seek(chunk.offset)
                crc, left = 0, chunk.length
                while left and (n := stream.readinto(buffer[: min(left, _READ_BLOCK)])):
                    crc, left = zlib.crc32(buffer[:n], crc), left - n
                sums.append(crc)
    return sums


def _record_checksums(aside: Path) -> None:
    """After DCP's save, each rank checksums a share of the files and rank 0 writes
    them all to ``CHECKSUMS``, before the checkpoint is renamed into place. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = _chunks(SafeReader(aside).read_metadata())
    files = sorted({c.file for c in chunks})[rank::world]
    mine = [c for c in chunks if c.file in files] + ([_metadata_chunk(aside)] if rank == 0 else [])
    records = [[c.file, c.offset, c.length, crc] for c, crc in zip(mine, _checksums(aside, mine))]
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(records, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        every = sorted(r for part in gathered for r in part)
        with open(aside / CHECKSUMS, "w") as out:
            json.dump({"algorithm": "crc32", "chunks": every}, out)
            out.flush()
            os.fsync(out.fileno())
        _fsync_dir(aside)


def _recorded_checksums(path: Path) -> Checksums | None:
    """The checksums saved with the checkpoint, by (file, offset): (length, crc32); None
    when it has none."""
    file = path / CHECKSUMS
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
        return {(f, offset): (length, crc) for f, offset, length, crc in record["chunks"]}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: {CHECKSUMS} is unreadable: {e!r}") from None


def _mismatched(path: Path, chunks: list[Chunk], recorded: Checksums) -> list[Chunk]:
    """The chunks whose bytes do not match their recorded checksum (or have none)."""
    sums = _checksums(path, chunks)
    return [
        c for c, crc in zip(chunks, sums) if recorded.get((c.file, c.offset)) != (c.length, crc)
    ]


def _corrupt(path: Path, bad: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{path}: corrupt checkpoint, {plural(len(bad), 'chunk')} not matching the "
        "checksums saved with it:\n  " + "\n  ".join(bad)
    )


def _verify_layout(path: Path, metadata: Metadata, recorded: Checksums | None) -> None:
    """DCP's ``.metadata`` and embshard's description match their checksums: what the
    checks before the load rely on. Every rank reads the same bytes, so all agree."""
    if recorded is None:
        return
    chunks = [_metadata_chunk(path)]
    if META in metadata.state_dict_metadata:
        chunks += _chunks(metadata, [MetadataIndex(META)])
    if bad := _mismatched(path, chunks, recorded):
        raise _corrupt(path, [str(c) for c in bad])


class _DryRun(SafeLoadPlanner):
    """Reads and decodes every chunk a load would, copying it nowhere (a meta tensor):
    without checksums, proof before anything is written that the load can read it all."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        like = self.lookup_tensor(read_item.dest_index)
        return torch.empty(read_item.lengths, dtype=like.dtype, device="meta")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        load_bytes(value, read_item.dest_index.fqn)


def _verify_reads(
    path: Path,
    metadata: Metadata,
    recorded: Checksums | None,
    state: dict[str, Any],
) -> None:
    """Before anything is written: the bytes of every chunk this rank will read into
    ``state`` match their checksums; every rank raises, naming each bad chunk, when
    any rank finds one. Collective. A checkpoint without checksums is read and decoded
    once first instead (no DCP error halfway through the real read, then), though a
    changed byte in a tensor goes unnoticed."""
    if recorded is None:
        _read(path, state, _DryRun())
        return
    planner = SafeLoadPlanner()
    planner.set_up_planner(state, metadata)
    indices = {item.storage_index for item in planner.create_local_plan().items}
    bad = [str(c) for c in _mismatched(path, _chunks(metadata, indices), recorded)]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)
    found = sorted(set().union(*everyone))
    if found:
        raise _corrupt(path, found)


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
    incomplete, corrupt (a chunk not matching its checksum), unreadable or does not
    match. A checkpoint without checksums (saved before embshard recorded them, or a
    plain DCP one) loads with a warning on every rank: it is read once first to prove
    it readable, but a changed byte in it goes unnoticed."""
    path = resolve(path)
    metadata = read_metadata(path)
    recorded = _recorded_checksums(path)
    if recorded is None:  # on every rank, so that ``-W error`` stops all of them alike
        warnings.warn(
            f"{path} has no checksums (saved before embshard recorded them, or not by "
            "embshard): it cannot be verified",
            stacklevel=2,
        )
    _verify_layout(path, metadata, recorded)
    if META not in metadata.state_dict_metadata:
        return _load_model_state(path, metadata, recorded, model, strict)
    saved = read_description(path)
    check_specs(path, saved["tables"], _sharded(model))
    mc.check(path, saved["tables"], _sharded(model))
    targets, commits = _targets(_state(model, optimizer), saved, model)
    dynamic, restore = load_targets(_sharded(model))
    if dynamic:
        targets[DYNAMIC] = dynamic
        commits.append(restore)

    def read_first(state: dict[str, Any]) -> None:
        _verify_reads(path, metadata, recorded, state)
        _read(path, state)

    managed = mc.load(path, metadata, saved["tables"], _sharded(model), read_first)
    if managed is not None:
        commits.append(managed)
    _check(path, metadata, targets, "model." if strict else None)
    _verify_reads(path, metadata, recorded, targets)
    _read(path, targets)
    with torch.no_grad():
        for commit in commits:
            commit(targets["sparse_optimizer"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, targets["dense_optimizer"])
    return int(saved["step"])


class _ChunkByChunk(SafeReader):
    """DCP's file reader, handed one read item at a time: at most one saved chunk is
    decoded in memory at once (DCP's own loop holds the last while decoding the next)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            super().read_data(replace(plan, items=[item]), planner).wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read(path: Path, state: dict[str, Any], planner: SafeLoadPlanner | None = None) -> None:
    try:
        dcp.load(state, storage_reader=_ChunkByChunk(path), planner=planner or SafeLoadPlanner())
    except CheckpointException as e:
        raise read_failed(path, e) from None


def rank_failures(error: CheckpointException) -> str:
    """What failed on which rank, without DCP's tracebacks."""
    return "; ".join(
        f"rank {rank}: {first_line(exc)}" for rank, (exc, _) in sorted(error.failures.items())
    )


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def read_failed(path: Path, error: CheckpointException | ValueError) -> CheckpointError:
    reason = rank_failures(error) if isinstance(error, CheckpointException) else first_line(error)
    return CheckpointError(f"{path}: reading the checkpoint failed: {reason}")


def _load_model_state(
    path: Path,
    metadata: Metadata,
    recorded: Checksums | None,
    model: nn.Module,
    strict: bool,
) -> int:
    """A DCP checkpoint of a plain state dict (an unsharded TorchRec model's, say):
    its keys are the model's own. Returns step 0."""
    refuse_without_maps(path, _sharded(model))
    mc.refuse_plain(path, _sharded(model))
    live = _unwrap(model).state_dict()
    _check(path, metadata, live, "" if strict else None)
    _verify_reads(path, metadata, recorded, live)
    _read(path, live)
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


def _targets(
    live: dict[str, Any], saved: dict[str, Any], model: nn.Module
) -> tuple[dict[str, Any], list[Callable[[dict[str, Any]], None]]]:
    """What DCP fills: the model's own tensors (tables, dense parameters) and fused
    optimizer state, written in place, and fresh tensors for the dense optimizer's
    state (``set_optimizer_state_dict`` takes it afterwards); and how the rest of each
    table's fused optimizer state goes live: converted from other column blocks
    (row-wise Adagrad), or zeroed when the checkpoint has none of this kind; and each
    module's step count, the saved one (0 when none of its tables has one of this kind)."""
    targets = {"model": live["model"], "sparse_optimizer": {}, META: ""}
    if "dense_optimizer" in live:
        targets["dense_optimizer"] = _empty_like(live["dense_optimizer"])
    sparse, commits = live["sparse_optimizer"], []
    for prefix, module in _sharded(model).items():
        kind, steps = _optimizer_kind(module), []
        for name, table in module.tables.items():
            key = prefix + module.table_key(name)
            old = saved["tables"].get(key, {})
            if old.get("optimizer") != kind:
                for state, _ in module.fused_optimizer.STATES:
                    commits.append(lambda _, target=sparse[f"{key}.{state}"]: _zero(target))
                continue
            for state, layout in module.fused_optimizer.STATES:
                target = sparse[f"{key}.{state}"]
                if not layout.BY_BLOCK or [tuple(b) for b in old["blocks"]] == column_blocks(table):
                    targets["sparse_optimizer"][f"{key}.{state}"] = target
                else:
                    staged, convert = _rowwise_conversion(module, name, old["blocks"], target)
                    targets["sparse_optimizer"][f"{key}.{state}"] = staged
                    commits.append(convert)
            if f"{key}.{STEP}" in sparse:
                targets["sparse_optimizer"][f"{key}.{STEP}"] = sparse[f"{key}.{STEP}"]
                steps.append(f"{key}.{STEP}")
        if module.fused_optimizer.COUNTS_STEPS:
            commits.append(lambda read, module=module, steps=steps: _set_steps(module, read, steps))
    return targets, commits


def _set_steps(module: ShardedCollection, read: dict[str, Any], keys: list[str]) -> None:
    """The module's step count from its tables' loaded ones (all equal as saved)."""
    module.set_optimizer_steps(max((int(read[k]) for k in keys), default=0))


def _zero(value: DTensor) -> None:
    local = value.to_local()
    for shard in local.local_shards() if isinstance(local, LocalShardsWrapper) else []:
        shard.zero_()


def _rowwise_conversion(
    module: ShardedCollection, name: str, saved_blocks: list, live: DTensor
) -> tuple[DTensor, Callable[[dict[str, Any]], None]]:
    """Row-wise Adagrad keeps, per row, the mean over a block's columns of the squared
    gradients. A new block's state is the width-weighted mean of the saved blocks it
    overlaps: exact when it is a union of saved blocks (column-wise or grid to
    table-wise or row-wise), an approximation when it splits one (the other way round)."""
    table = module.tables[name]
    spans = _row_spans(s for s in table.shards_on(module.rank) if s.rows and s.cols)
    width = len(saved_blocks)
    device = live.to_local().device  # staged where the state lives: DCP fills them in place
    shards = [torch.empty(rows, width, device=device) for _, rows in spans]
    staged = DTensor.from_local(
        LocalShardsWrapper(shards, [(row, 0) for row, _ in spans]),
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
            i, first = next((i, f) for i, (f, n) in enumerate(spans) if f <= row < f + n)
            source = shards[i][row - first : row - first + len(shard)]
            weights = torch.tensor(
                [max(0, min(start + cols, s + w) - max(start, s)) / cols for s, w in saved_blocks],
                device=device,
            )
            shard.copy_((source @ weights).unsqueeze(1))

    return staged, convert


def _row_spans(shards: Iterable[TableShard]) -> list[tuple[int, int]]:
    """Disjoint row ranges (offset, rows) covering the shards' rows, one staged chunk
    each: a grid rank's blocks may hold overlapping rows, and DCP reads a chunk by its
    offset."""
    spans: list[tuple[int, int]] = []
    for start, rows in sorted((s.row_offset, s.rows) for s in shards):
        if spans and start <= spans[-1][0] + spans[-1][1]:
            first, length = spans[-1]
            spans[-1] = (first, max(length, start + rows - first))
        else:
            spans.append((start, rows))
    return spans


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
    for tables in TABLE_PARENTS:
        if tables in parts[:-1]:
            return f"table {parts[parts.index(tables) + 1]!r} ({key})"
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
