"""Checking a rank's local KeyedJaggedTensor before anything is sent.

A bad batch must not leave the other ranks waiting in an all-to-all, so the check
never raises: it returns the problem, which the rank then announces in the counts
exchange (see ``dist.exchange_counts``) and every rank raises together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.routes import Routes

_INDEX_DTYPES = (torch.int32, torch.int64)


class InputError(ValueError):
    """A rank's batch is not valid for the sharded module; raised on every rank."""


@dataclass(frozen=True)
class LocalBatch:
    """A checked batch in the model's feature order: lengths [features, batch]."""

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[1]


def check_batch(features: object, routes: Routes) -> LocalBatch | str:
    """The batch in model order, or a message saying what is wrong with it."""
    if not isinstance(features, KeyedJaggedTensor):
        return f"expected a KeyedJaggedTensor, got {type(features).__name__}"
    keys = features.keys()
    unknown = [k for k in keys if k not in routes.features]
    missing = [f for f in routes.features if f not in keys]
    if unknown or missing or len(set(keys)) != len(keys):
        return (
            f"feature keys {keys} do not match the model's {list(routes.features)}"
            f" (unknown: {unknown}, missing: {missing})"
        )
    values, lengths = features.values(), features.lengths()
    if values.dtype not in _INDEX_DTYPES or lengths.dtype not in _INDEX_DTYPES:
        return f"ids and lengths must be int32 or int64, got {values.dtype} and {lengths.dtype}"
    if lengths.numel() % len(keys):
        return f"{lengths.numel()} lengths do not split evenly over {len(keys)} features"
    lengths = lengths.long().view(len(keys), -1)
    if (lengths < 0).any():
        feature = int((lengths < 0).any(1).nonzero()[0])
        return f"feature {keys[feature]!r} has a negative length {int(lengths[feature].min())}"
    if int(lengths.sum()) != values.numel():
        return f"lengths add up to {int(lengths.sum())} but there are {values.numel()} ids"
    weights = features.weights_or_none() if routes.weighted else None
    if routes.weighted:
        if weights is None:
            return "the module is weighted but the batch has no weights"
        if weights.dtype != torch.float32 or weights.numel() != values.numel():
            return f"weights must be float32, one per id; got {weights.dtype} x {weights.numel()}"
    order = [keys.index(f) for f in routes.features]
    if order != list(range(len(keys))):
        perm = torch.tensor(order, dtype=torch.int32)
        lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
            perm, lengths, values, weights
        )
    problem = _out_of_range(lengths, values, routes)
    if problem:
        return problem
    return LocalBatch(lengths.to(routes.id_dtype), values.to(routes.id_dtype), weights)


def _out_of_range(lengths: torch.Tensor, values: torch.Tensor, routes: Routes) -> str | None:
    """The first id outside its feature's table, if any: one pass over all ids when
    they are all below the smallest table's rows, else one per feature."""
    if not values.numel():
        return None
    if _within(values, min(routes.feature_rows)):
        return None
    for feature, ids in enumerate(values.split(lengths.sum(1).tolist())):
        rows = routes.feature_rows[feature]
        if not len(ids) or _within(ids, rows):
            continue
        first = int(((ids < 0) | (ids >= rows)).nonzero()[0])
        return (
            f"feature {routes.features[feature]!r} (table {routes.feature_table[feature]!r}): "
            f"id {int(ids[first])} is outside [0, {rows})"
        )
    return None


def _within(ids: torch.Tensor, rows: int) -> bool:
    low, high = torch.aminmax(ids)
    return bool(low >= 0 and high < rows)
