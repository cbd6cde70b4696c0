"""A trained model made a serving one: each TorchRec EmbeddingBagCollection replaced by
a quantized one, the dense part as it is (float32), forward only. The weights come
from the model itself or from an embshard checkpoint of any world size and plan."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from embshard import checkpoint
from embshard.errors import CheckpointError, ConfigError
from embshard.serving.collection import QuantizedEmbeddingBagCollection
from embshard.serving.id_maps import ServedIdMap, checkpoint_id_maps
from embshard.serving.precision import Precision
from embshard.storage.id_map import IdMapSpec


def collections_of(model: nn.Module) -> dict[str, EmbeddingBagCollection]:
    """The model's float EmbeddingBagCollections by their path in it (``""``: the model)."""
    return {
        name: module
        for name, module in model.named_modules()
        if type(module) is EmbeddingBagCollection
    }


def table_key(path: str, table: str) -> str:
    """A table's weight in the float model's state dict."""
    return f"{path}.embedding_bags.{table}.weight".removeprefix(".")


def quantize_model(
    model: nn.Module,
    precision: Precision | str,
    weights: Mapping[str, torch.Tensor] | None = None,
    id_maps: Mapping[str, ServedIdMap] | None = None,
) -> nn.Module:
    """``model`` with every EmbeddingBagCollection replaced, in place, by a quantized
    one, in eval mode without gradients. Table weights come from ``weights`` (by their
    state dict key) where given, else from the collections themselves. The tables in
    ``id_maps`` (by the same keys) are dynamic: their features take raw ids. In a
    TorchRec managed-collision collection the tables are swapped and its modules kept,
    in eval mode: they remap ids only (an id they do not hold: its block's last row)."""
    found = collections_of(model)
    if not found:
        raise ValueError("the model has no TorchRec EmbeddingBagCollection to quantize")
    known = {table_key(p, t.name) for p, e in found.items() for t in e.embedding_bag_configs()}
    if odd := sorted(set(id_maps or {}) - known):
        raise ConfigError(f"an id map for {odd[0]!r}, which is no table of the model")
    for path, ebc in found.items():
        configs = ebc.embedding_bag_configs()
        source = weights
        if source is None:
            source = {table_key(path, n): bag.weight for n, bag in ebc.embedding_bags.items()}
        tables = {t.name: source[k] for t in configs if (k := table_key(path, t.name)) in source}
        device = next((w.device for w in tables.values()), torch.device("cpu"))
        quantized = QuantizedEmbeddingBagCollection(
            configs,
            tables,
            precision,
            is_weighted=ebc.is_weighted(),
            device=device,
            id_maps={
                t.name: id_maps[k]
                for t in configs
                if id_maps and (k := table_key(path, t.name)) in id_maps
            },
        )
        if path:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, quantized)
        else:
            model = quantized
    return model.eval().requires_grad_(False)


def _refuse_managed(path: str | Path, model: nn.Module) -> None:
    """One line for TorchRec's managed-collision collections: a checkpoint holds their
    modules per row block, which only the sharded path loads."""
    for at, module in model.named_modules():
        if isinstance(module, BaseManagedCollisionEmbeddingCollection):
            raise ConfigError(
                f"{path}: {at or 'the model'} is a TorchRec {type(module).__name__}, whose "
                "modules the checkpoint holds per row block: serve it sharded "
                "(serving.shard_quantized with checkpoint_path)"
            )


def checkpoint_weights(
    path: str | Path, model: nn.Module
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tables and the dense tensors of ``model`` (by state dict key) as whole
    tensors from the checkpoint at ``path`` (a step, or a root for its latest), saved
    by any world size under any plan. A one-line CheckpointError names what the
    checkpoint lacks."""
    path = checkpoint.resolve(path)
    entries = checkpoint.read_metadata(path).state_dict_metadata
    saved = checkpoint.read_tensors(path, "model." if checkpoint.META in entries else "")
    tables = {
        table_key(at, t.name): t
        for at, ebc in collections_of(model).items()
        for t in ebc.embedding_bag_configs()
    }
    missing = [key for key in tables if key not in saved]
    if missing:
        names = ", ".join(repr(tables[k].name) for k in missing)
        raise CheckpointError(f"{path}: the checkpoint has no table {names} (no {missing[0]})")
    dense = [k for k in model.state_dict() if k not in tables]
    lacking = [k for k in dense if k not in saved]
    if lacking:
        raise CheckpointError(f"{path}: the checkpoint has no dense tensor {lacking[0]!r}")
    return {k: saved[k] for k in tables}, {k: saved[k] for k in dense}


def from_checkpoint(
    path: str | Path,
    model: nn.Module,
    precision: Precision | str,
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> nn.Module:
    """``model`` (its tables may be on ``meta``) as a serving model with the weights of
    the checkpoint at ``path`` (see ``checkpoint_weights``): its dense tensors loaded
    as they are, its tables quantized, its dynamic tables' id maps made lookup-only
    (``ServedIdMap``). ``dynamic``: the specs of the tables the model means to be
    dynamic, by name, checked against the checkpoint's where given."""
    _refuse_managed(path, model)
    tables, dense = checkpoint_weights(path, model)
    maps = checkpoint_id_maps(checkpoint.resolve(path), dynamic)
    model = quantize_model(model, precision, tables, maps)
    model.load_state_dict(dense, strict=False)
    return model
