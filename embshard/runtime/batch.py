"""Checking a rank's local KeyedJaggedTensor before anything is sent.

A bad batch must not leave the other ranks waiting in an all-to-all, so the check
never raises: what can be seen without reading the data (keys, dtypes, sizes) comes
back as a message; what needs the data (lengths, id ranges) comes back as a validity
flag computed on the batch's device, which travels in the counts exchange (see
``InputDistribution.exchange_counts``) without a host sync of its own, or on one rank is read
in its one host read. When any rank's flag is down, every rank raises together, and
the bad ranks say why (``describe_problem``). A bad batch's ids are never looked up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.runtime.routes import Routes

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class LocalBatch:
    """A batch in the model's feature order: lengths [features, batch] and ids, in the
    dtypes they came in, and how many ids each feature has.

    ``valid`` is a 0-dim bool tensor on the batch's device. When it is False the
    lengths and ids are stand-ins whose lengths add up to the ids, safe to route
    (bucketizing sorts any id into some bucket), and never looked up.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    valid: torch.Tensor
    ids_per_feature: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[1]


class IdBounds:
    """The last valid id of every feature (of the smallest table it feeds), or one for
    all when every feature has the same, on the batch's device in both id dtypes:
    comparing ids with bounds of their own dtype converts nothing."""

    def __init__(self, feature_rows: tuple[int, ...], device: torch.device) -> None:
        distinct = sorted(set(feature_rows))
        last = [r - 1 for r in (distinct if len(distinct) == 1 else feature_rows)]
        self.one_for_all = len(distinct) == 1
        self._by_dtype = {d: torch.tensor(last, dtype=d, device=device) for d in _INDEX_DTYPES}

    def of(self, dtype: torch.dtype) -> torch.Tensor:
        return self._by_dtype[dtype]


def check_batch(features: object, routes: Routes, bounds: IdBounds) -> LocalBatch | str:
    """The batch in model order with its validity flag, or a message saying what is
    wrong with its structure. Features the model does not use are left out, as
    TorchRec's modules ignore them; that costs one host read (of the kept ids'
    count), the only one here."""
    problem = _structure_problem(features, routes)
    if problem:
        return problem
    assert isinstance(features, KeyedJaggedTensor)
    values, lengths = features.values(), features.lengths()
    keys = len(features.keys())
    lengths = lengths.view(keys, lengths.numel() // keys)
    lengths_ok = (lengths >= 0).all() & (lengths.sum() == values.numel())
    lengths = _trusted(lengths, lengths_ok, values.numel())
    lengths, values, weights = _in_model_order(features, routes, lengths)
    ids_per_feature = lengths.sum(1)
    valid = lengths_ok & _ids_in_range(ids_per_feature, values, bounds)
    return LocalBatch(lengths, values, weights, valid, ids_per_feature)


def describe_problem(features: KeyedJaggedTensor, routes: Routes) -> str:
    """What is wrong with a batch whose ``valid`` flag is False. Reads the data on the
    host: only called once every rank knows some batch is bad."""
    keys, values = features.keys(), features.values()
    lengths = features.lengths().long().view(len(keys), -1)
    if (lengths < 0).any():
        feature = int((lengths < 0).any(1).nonzero()[0])
        return f"feature {keys[feature]!r} has a negative length {int(lengths[feature].min())}"
    if int(lengths.sum()) != values.numel():
        return f"lengths add up to {int(lengths.sum())} but there are {values.numel()} ids"
    lengths, values, _ = _in_model_order(features, routes, lengths)
    for feature, ids in enumerate(values.split(lengths.sum(1).tolist())):
        rows = routes.feature_rows[feature]
        bad = ((ids < 0) | (ids >= rows)).nonzero()
        if len(bad):
            return (
                f"feature {routes.features[feature]!r} (table {routes.feature_table[feature]!r}): "
                f"id {int(ids[bad[0]])} is outside [0, {rows})"
            )
    raise AssertionError("describe_problem called on a valid batch")


def _structure_problem(features: object, routes: Routes) -> str | None:
    if not isinstance(features, KeyedJaggedTensor):
        return f"expected a KeyedJaggedTensor, got {type(features).__name__}"
    keys = features.keys()
    missing = [f for f in routes.features if f not in keys]
    if missing or len(set(keys)) != len(keys):
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        return (
            f"feature keys {keys} do not hold the model's {list(routes.features)}"
            f" (missing: {missing}, repeated: {repeated})"
        )
    values, lengths = features.values(), features.lengths()
    if values.dtype not in _INDEX_DTYPES or lengths.dtype not in _INDEX_DTYPES:
        return f"ids and lengths must be int32 or int64, got {values.dtype} and {lengths.dtype}"
    if lengths.numel() % len(keys):
        return f"{lengths.numel()} lengths do not split evenly over {len(keys)} features"
    if not lengths.numel() and values.numel():
        return f"the batch has no bags but {values.numel()} ids"
    if routes.weighted:
        weights = features.weights_or_none()
        if weights is None:
            return "the module is weighted but the batch has no weights"
        if weights.dtype != torch.float32 or weights.numel() != values.numel():
            return f"weights must be float32, one per id; got {weights.dtype} x {weights.numel()}"
    return None


def _trusted(lengths: torch.Tensor, ok: torch.Tensor, ids: int) -> torch.Tensor:
    """``lengths`` if ``ok``, else one bag holding all ``ids``: lengths that always
    add up, so permuting and bucketizing stay in bounds. No host read."""
    if not lengths.numel():  # no bags, and then no ids (checked before)
        return lengths
    one_bag = torch.zeros_like(lengths)
    one_bag[0, 0] = ids
    return torch.where(ok, lengths, one_bag)


def _in_model_order(
    features: KeyedJaggedTensor, routes: Routes, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``lengths`` ([features, batch], adding up to the ids), the ids and the weights
    of the model's features, in its order."""
    keys, values = features.keys(), features.values()
    weights = features.weights_or_none() if routes.weighted else None
    order = [keys.index(f) for f in routes.features]
    if order == list(range(len(keys))):
        return lengths, values, weights
    perm = torch.tensor(order, dtype=torch.int32, device=values.device)
    # Sized by the ids (no host read) unless some features are left out.
    kept = values.numel() if len(order) == len(keys) else int(lengths[order].sum())
    return torch.ops.fbgemm.permute_2D_sparse_data(perm, lengths, values, weights, kept)


def _ids_in_range(
    ids_per_feature: torch.Tensor, values: torch.Tensor, bounds: IdBounds
) -> torch.Tensor:
    """Whether every id lies in [0, rows of its feature's smallest table), as a 0-dim
    bool tensor: no host read, and one id-sized temporary at most (fresh CPU buffers
    page-fault). ``last - id`` and ``id`` are both at least 0 exactly when their
    bitwise or is: one minimum checks both ends."""
    last = bounds.of(values.dtype)
    if not values.numel():
        return torch.ones((), dtype=torch.bool, device=values.device)
    if bounds.one_for_all:
        low, high = torch.aminmax(values)
        return (low >= 0) & (high <= last[0])
    per_id = torch.repeat_interleave(last, ids_per_feature, output_size=values.numel())
    return per_id.sub_(values).bitwise_or_(values).min() >= 0
