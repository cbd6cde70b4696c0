"""A dynamic table's id map made lookup-only for serving: the live keys, sorted, each
with its row. A raw id hashes to its key (``hash_ids``) and finds its row by a binary
search, as training's eval mode looks ids up (``IdMap.lookup``): no sighting, admission
or eviction. Plain tensors, so ``torch.export`` traces the lookup."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from embshard import checkpoint
from embshard.checkpoint.dynamic import COUNTS, DYNAMIC
from embshard.errors import CheckpointError
from embshard.runtime.keys import hash_ids
from embshard.storage.id_map import IdMapSpec, sorted_find


class ServedIdMap(nn.Module):
    """Raw ids to rows of a dynamic table (``forward``: -1 for an id without a row,
    negative ids included). ``keys``: the live keys, sorted, after a sentinel -1 that no
    key equals (so the search never meets an empty map); ``rows``: each one's row."""

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        sentinel = torch.full((1,), -1, dtype=torch.int64, device=keys.device)
        self.register_buffer("keys", torch.cat([sentinel, keys.long()]))
        self.register_buffer("rows", torch.cat([sentinel, rows.long()]))

    @classmethod
    def from_state(
        cls, name: str, spec: IdMapSpec, state: Mapping[str, torch.Tensor]
    ) -> ServedIdMap:
        """The map of table ``name`` from its whole ``IdMap.state_dict()`` tensors
        (``keys`` and ``occupied``, ``(buckets, rows_per_bucket)``: every bucket range
        joined); a one-line CheckpointError for tensors of another shape."""
        shape = (spec.buckets, spec.rows_per_bucket)
        for part in ("keys", "occupied"):
            if part not in state or tuple(state[part].shape) != shape:
                got = tuple(state[part].shape) if part in state else "none"
                raise CheckpointError(
                    f"table {name!r}: id map {part} of shape {got}, its spec needs {shape}"
                )
        flat = state["occupied"].reshape(-1).nonzero()[:, 0]
        keys, order = torch.sort(state["keys"].reshape(-1)[flat])
        return cls(keys, flat[order])

    @property
    def live(self) -> int:
        """How many ids have a row."""
        return len(self.keys) - 1

    def map_bytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes

    def forward(self, raw_ids: torch.Tensor) -> torch.Tensor:
        rows = sorted_find(self.keys, self.rows, hash_ids(raw_ids))[0]
        return torch.where(raw_ids >= 0, rows, -1)


def saved_specs(path: str | Path) -> dict[str, IdMapSpec]:
    """The dynamic tables of the embshard checkpoint at ``path`` (a step) and their
    specs, by the table's weight key in the model's state dict (``...<table>.weight``)."""
    if checkpoint.META not in checkpoint.read_metadata(path).state_dict_metadata:
        return {}  # a plain DCP checkpoint: no description, no id maps
    tables = checkpoint.read_description(path)["tables"]
    return {f"{fqn}.weight": IdMapSpec(**t[DYNAMIC]) for fqn, t in tables.items() if DYNAMIC in t}


def saved_maps(
    path: str | Path, expected: Mapping[str, IdMapSpec] | None = None
) -> dict[str, tuple[IdMapSpec, dict[str, torch.Tensor]]]:
    """Every dynamic table's spec and whole id map state (``IdMap.state_dict()``, every
    bucket range joined) in the embshard checkpoint at ``path`` (a step), by the table's
    name. ``expected``: the specs the model's dynamic tables have, by name, where known
    (a training config's): a table dynamic in one and not the other, or of another spec,
    is a one-line CheckpointError."""
    specs = saved_specs(path)
    if expected is not None:
        saved = {table_of(key): s for key, s in specs.items()}
        for name in sorted(set(saved) | set(expected)):
            if saved.get(name) != expected.get(name):
                raise CheckpointError(
                    f"{path}: table {name!r}: {_mismatch(saved.get(name), expected.get(name))}"
                )
    maps = {}
    for key, spec in specs.items():
        tensors = checkpoint.read_tensors(path, f"{DYNAMIC}.{key.removesuffix('.weight')}.")
        maps[key] = (spec, {k: v for k, v in tensors.items() if k != COUNTS})
    return maps


def checkpoint_id_maps(
    path: str | Path, expected: Mapping[str, IdMapSpec] | None = None
) -> dict[str, ServedIdMap]:
    """Every dynamic table's served map from the embshard checkpoint at ``path`` (a
    step), by the table's weight key; ``expected`` as ``saved_maps``'."""
    return {
        key: ServedIdMap.from_state(table_of(key), spec, state)
        for key, (spec, state) in saved_maps(path, expected).items()
    }


def table_of(key: str) -> str:
    """The table of a weight key (``...embedding_bags.<table>.weight``)."""
    return key.removesuffix(".weight").rpartition(".")[2]


def _mismatch(saved: IdMapSpec | None, expected: IdMapSpec | None) -> str:
    if saved is None:
        return "dynamic in the config, but the checkpoint holds no id map for it"
    if expected is None:
        return "static in the config, but the checkpoint holds its id map"
    return f"the checkpoint's id map is {saved}, the config's {expected}"
