"""Reading checkpoints that may come from anyone, without running their code.

DCP keeps a checkpoint's layout in ``.metadata``, a pickle, and small objects (the
dense optimizer's settings, embshard's description) as byte items, also pickles; its
own reader unpickles both with no limit, so a crafted checkpoint runs whatever it
names. Here ``.metadata`` is unpickled with an allowlist of the classes DCP's
metadata holds, and byte items with ``torch.load(weights_only=True)``: anything else
is refused, before any of it is used. Tensors DCP already reads with
``weights_only=True``. A checkpoint can still hold wrong values: only checksums saved
elsewhere, or a trusted source, tell that.
"""

from __future__ import annotations

import collections
import enum
import io
import pathlib
import pickle
import re
from typing import IO, Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem


class RefusedPickle(pickle.UnpicklingError):
    """A checkpoint file names something it may not: the message says what."""


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` may name: DCP's metadata records and storage
    locations, ``torch.Size``, dtypes, layouts and memory formats, paths."""
    allowed: dict[tuple[str, str], Any] = {
        (cls.__module__, cls.__qualname__): cls
        for cls in vars(dcp_metadata).values()
        if isinstance(cls, type)
        and cls.__module__ == dcp_metadata.__name__
        and (hasattr(cls, "__dataclass_fields__") or issubclass(cls, enum.Enum))
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for path in (pathlib.PosixPath, pathlib.PurePosixPath):
        allowed[("pathlib", path.__name__)] = path
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    return allowed


_ALLOWED = _metadata_classes()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise RefusedPickle(
                f"refused to load {module}.{name}: a checkpoint's metadata holds only "
                "DCP's records (it may be crafted to run code)"
            )
        return found


def load_metadata(stream: IO[bytes]) -> Metadata:
    """DCP's ``Metadata`` from ``stream``, naming only allowed classes."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise RefusedPickle(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def load_bytes(value: io.BytesIO, key: str) -> Any:
    """A byte item's object, by ``torch.load(weights_only=True)``: plain containers,
    numbers, strings and tensors only."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"{named[1]}, which" if named else "what"
        raise RefusedPickle(
            f"refused to load the item {key!r}: it names {what} a checkpoint's plain "
            "values may not hold (it may be crafted to run code)"
        ) from None


class SafeReader(FileSystemReader):
    """DCP's file reader, its ``.metadata`` read through the allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, its byte items read with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_bytes(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
