"""Checking a rank's local KeyedJaggedTensor before anything is sent.

A bad batch must not leave the other ranks waiting in an all-to-all, so the check
never raises: what can be seen without reading the data (keys, dtypes, sizes) comes
back as a message; what needs the data (lengths, id ranges) comes back as a count of
problems computed on the batch's device, which travels in the counts exchange (see
``InputDistribution.exchange_counts``) without a host sync of its own, or on one rank is
read in its one host read. When any rank's count is not 0, every rank raises together,
and the bad ranks say why (``describe_problem``). A bad batch's ids are never looked up.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.runtime import native
from embshard.runtime.routes import Routes
from embshard.runtime.sparse_ops import permute_2d

_INDEX_DTYPES = (torch.int32, torch.int64)
_NO_BOUND = 2**62  # the rows of a key the model does not use: none of its ids is checked


@dataclass(frozen=True)
class LocalBatch:
    """A batch in the model's feature order: lengths [features, batch], ids and weights
    in the dtypes they came in, and ``row_ids``: int64 [rows of the route's lengths table
    + 1] on the batch's device, whose last value, ``problems``, is how many problems the
    bounds check found (0 for a good batch). The route writes each row's ids in front of
    it, so that one gather gives the counts exchange every send row's ids and the
    problems (``InputDistribution.tally``).

    ``lengths`` may be bad until the counts have said the batch is good: before that, a
    kernel that reads ids by them takes ``routable_lengths``. ``offsets`` are their flat
    offsets when they are the batch's own (then on one rank the TBE's), and
    ``stand_in`` is None when they are routable already (the batch's where they are
    good, one bag holding every id where they are not: on CPU the check's kernel gives
    them so). What is computed on first use costs nothing where it is not needed: on
    one rank the TBE takes the batch's own bags, after one host read of ``problems``.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    row_ids: torch.Tensor
    offsets: torch.Tensor | None = None
    stand_in: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[1]

    @property
    def problems(self) -> torch.Tensor:
        """The bounds check's problem count, int64 [1] (a view of ``row_ids``)."""
        return self.row_ids[-1:]

    @cached_property
    def valid(self) -> torch.Tensor:
        """Whether the batch is good, as a 0-dim bool tensor on its device."""
        return (self.problems == 0).view(())

    @cached_property
    def routable_lengths(self) -> torch.Tensor:
        """``lengths`` if the batch is good, else one bag holding every id: lengths that
        add up, so permuting and bucketizing stay in bounds, with no host read to
        decide it. A bad batch's ids are never looked up."""
        if self.stand_in is None:
            return self.lengths
        return torch.where(self.valid, self.lengths, self.stand_in * self.values.numel())

    @cached_property
    def ids_per_feature(self) -> torch.Tensor:
        """How many ids each feature has: only numbers, read back with the counts, so
        a bad batch's do no harm."""
        return self.lengths.sum(1)


class CheckInputs:
    """The constant tensors a batch's check takes: for FBGEMM's bounds check, every
    key's rows less one (of the smallest table its feature feeds; no bound for keys
    the model does not use) in the batch's key order, and the stand-in lengths table.
    Both are kept for the last key order and batch shape seen, as they rarely change.
    ``table_rows``: the rows of the route's lengths table (``LocalBatch.row_ids``)."""

    def __init__(
        self, features: tuple[str, ...], feature_rows: tuple[int, ...], table_rows: int, device
    ) -> None:
        self._rows = dict(zip(features, feature_rows))
        self.table_rows = table_rows
        self._device = device
        self._keys: tuple[tuple[str, ...], torch.Tensor] | None = None
        self._unit: tuple[tuple[tuple[int, ...], torch.dtype], torch.Tensor] | None = None

    def rows_less_one(self, keys: list[str]) -> torch.Tensor:
        """Each key's rows less one, int64, in ``keys``' order."""
        if self._keys is None or self._keys[0] != tuple(keys):
            last = [self._rows.get(k, _NO_BOUND) - 1 for k in keys]
            self._keys = (tuple(keys), torch.tensor(last, dtype=torch.int64, device=self._device))
        return self._keys[1]

    def first_bag(self, lengths: torch.Tensor) -> torch.Tensor:
        """A lengths table shaped like ``lengths``: 1 in the first bag, 0 elsewhere."""
        key = (tuple(lengths.shape), lengths.dtype)
        if self._unit is None or self._unit[0] != key:
            unit = torch.zeros_like(lengths)
            unit.view(-1)[:1] = 1
            self._unit = (key, unit)
        return self._unit[1]


def check_batch(features: object, routes: Routes, inputs: CheckInputs) -> LocalBatch | str:
    """The batch in model order with its bounds check's count, or a message saying
    what is wrong with its structure. On CPU the check is embshard's kernel
    (``native.bounds_check``), which gives routable lengths too; elsewhere FBGEMM's, on
    the bags' offsets (then kept for a one-rank TBE). Features the model does not use
    are left out, as TorchRec's modules ignore them; that costs one host read (of the
    kept ids' count), the only one here."""
    problem = _structure_problem(features, routes)
    if problem:
        return problem
    assert isinstance(features, KeyedJaggedTensor)
    values, lengths, keys = features.values(), features.lengths(), features.keys()
    lengths = lengths.view(len(keys), lengths.numel() // len(keys))
    row_ids = torch.empty(inputs.table_rows + 1, dtype=torch.int64, device=values.device)
    weights = features.weights_or_none() if routes.weighted else None
    if native.available(values):  # its lengths come back routable
        routable = torch.empty_like(lengths)
        native.bounds_check(lengths, values, inputs.rows_less_one(keys), row_ids[-1:], routable)
        given = LocalBatch(routable, values, weights, row_ids)
    else:
        offsets = fbgemm_bounds_check(lengths, values, inputs.rows_less_one(keys), row_ids[-1:])
        given = LocalBatch(lengths, values, weights, row_ids, offsets, inputs.first_bag(lengths))
    if list(keys) == list(routes.features):
        return given
    return LocalBatch(*_in_model_order(features, routes, given.routable_lengths), row_ids)


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
        rows = routes.id_limits[feature]
        bad = ((ids < 0) | (ids >= rows)).nonzero()
        if len(bad):
            where = (
                f"feature {routes.features[feature]!r} (table {routes.feature_table[feature]!r})"
            )
            if routes.buckets_or_none[feature] is not None:
                return f"{where}: raw id {int(ids[bad[0]])} is negative (a dynamic table's are not)"
            return f"{where}: id {int(ids[bad[0]])} is outside [0, {rows})"
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
    return permute_2d(perm, lengths, values, weights, kept)


def fbgemm_bounds_check(
    lengths: torch.Tensor, values: torch.Tensor, rows_less_one: torch.Tensor, problems: torch.Tensor
) -> torch.Tensor:
    """The bags' flat offsets, and into ``problems`` (int64 [1], on the batch's device;
    no host read) how many problems FBGEMM's bounds check finds in one pass over the
    lengths table and the ids: negative lengths, lengths that do not add up to the ids,
    ids outside [0, rows of their key). It skips -1 (FBGEMM's mark of a pruned row) and
    zeroes the ids and fixes the offsets it finds bad, so it checks ``id - 1`` against
    ``rows - 1``, in a buffer of its own (an id of -1 is -2 there, and the batch stays
    as it came for ``describe_problem``), and the offsets are only to be used when it
    finds nothing. Where embshard's kernel does not run (``native.bounds_check``)."""
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.reshape(-1))
    if offsets.numel() == 1:  # no bags: FBGEMM's CUDA check returns without its count
        problems.fill_(int(values.numel() > 0))
        return offsets
    torch.ops.fbgemm.bounds_check_indices(
        rows_less_one, values - 1, offsets, BoundsCheckMode.WARNING.value, problems
    )
    return offsets
