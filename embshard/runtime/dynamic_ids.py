"""The sender's side of dynamic tables: raw ids become keys, routed by bucket.

A dynamic table's raw ids travel as their keys (``id_map.hash_ids``), whole, to the
rank that owns their bucket. Its rows are ``buckets * rows_per_bucket``, bucket ``b``
owning rows ``[b * rows_per_bucket, (b + 1) * rows_per_bucket)``, and its plan cuts
rows on bucket boundaries only; so FBGEMM's bucketizer, given the first row of each
key's bucket in place of the key, sends it where a static table's row would go. The
keys then take the place of those stand-ins in the bucketized ids.

A managed-collision table's raw ids (``Routes.feature_ranges``) are routed the same way,
unhashed: by input range, each range's ids to one row block (its first row the stand-in,
blocks of any sizes), as TorchRec's sharded managed-collision modules route them.

On CPU each step is one pass of a fused kernel (``runtime/native_dynamic.cpp``) where torch
needs a per-id feature and several passes over all ids; the torch operations stay for
CUDA and where the kernels cannot be built, with the same results.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from embshard.runtime import native
from embshard.runtime.batch import LocalBatch
from embshard.runtime.keys import KEY_LIMIT, bucket_width, hash_ids
from embshard.runtime.routes import Routes


class DynamicIds:
    """Per feature, the width of its id ranges, its last range, the rows of a range's
    block (1, 0 and 0 for a feature of a static table), and whether its raw ids travel
    as keys (a dynamic table's), on ``device``. A managed-collision table's blocks may
    differ in rows: its ranges' first rows are looked up (``_firsts`` from ``_base``)."""

    def __init__(self, routes: Routes, device: torch.device) -> None:
        specs = [_routing(b, r) for b, r in zip(routes.buckets_or_none, routes.ranges_or_none)]
        self._width = torch.tensor([s[0] for s in specs], dtype=torch.int64, device=device)
        self._last = torch.tensor([s[1] for s in specs], device=device)
        self._rows = torch.tensor([s[2] for s in specs], device=device)
        self._hashed = torch.tensor([s[3] for s in specs], device=device)
        self._any_hashed = any(s[3] for s in specs)
        self._features = torch.arange(len(specs), device=device)
        firsts = [r[1] if r is not None else () for r in routes.ranges_or_none]
        self._ranged = torch.tensor([bool(f) for f in firsts], device=device)
        self._firsts = torch.tensor([0, *(r for f in firsts for r in f)], device=device)
        # Where each feature's first rows begin in _firsts (0, its leading 0, for none).
        starts = torch.tensor([0, *(len(f) for f in firsts)]).cumsum(0)[:-1] + 1
        self._base = torch.where(self._ranged.cpu(), starts, 0).to(device)
        self._any_ranged = any(firsts)

    def keyed(self, batch: LocalBatch) -> LocalBatch:
        """``batch``'s ids as int64, its dynamic features' raw ids replaced by their keys.
        Negative raw ids have no key: the batch's bounds check has flagged them, so
        whatever they hash to is never sent."""
        values = batch.values.long()
        if not self._any_hashed:
            return replace(batch, values=values)
        if native.available(values):
            counts = batch.routable_lengths.sum(1)
            return replace(batch, values=native.keyed(values, counts, self._hashed))
        hashed = self._hashed[self._feature_of(batch.routable_lengths, values)]
        return replace(batch, values=torch.where(hashed, hash_ids(values), values))

    def stand_ins(
        self, lengths: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the bucketizer routes by: each key's bucket's first row in place of the
        key (other ids as they are), and which ids are keys."""
        if native.available(keys):
            settings = (self._width, self._last, self._rows, self._ranged, self._base, self._firsts)
            return native.stand_ins(keys, lengths.sum(1), settings)
        feature = self._feature_of(lengths, keys)
        bucket = torch.minimum(keys // self._width[feature], self._last[feature])
        first = bucket * self._rows[feature]
        is_key = self._rows[feature] > 0
        if self._any_ranged:  # a negative id's bucket is flagged; any row stands in
            ranged = self._ranged[feature]
            at = self._base[feature] + torch.where(ranged, bucket.clamp(min=0), 0)
            first = torch.where(ranged, self._firsts[at], first)
            is_key = is_key | ranged
        return torch.where(is_key, first, keys), is_key

    @staticmethod
    def put_back(
        bucketized: torch.Tensor, where: torch.Tensor, keys: torch.Tensor, is_key: torch.Tensor
    ) -> torch.Tensor:
        """A pass's bucketized ids with the keys back in place of their stand-ins;
        ``where``: FBGEMM's unbucketize permutation (where each id went)."""
        where = where.long()
        if native.available(keys):
            return native.put_back(bucketized, where, keys, is_key)
        moved = torch.empty_like(keys).scatter_(0, where, keys)
        return torch.where(torch.empty_like(is_key).scatter_(0, where, is_key), moved, bucketized)

    def _feature_of(self, lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Each id's feature, from the batch's lengths table [features, batch]."""
        return torch.repeat_interleave(self._features, lengths.sum(1), output_size=values.numel())


def _routing(
    buckets: tuple[int, int] | None, ranges: tuple[int, tuple[int, ...]] | None
) -> tuple[int, int, int, bool]:
    """A feature's (range width, last range, rows a range's block (0 where its blocks'
    first rows are looked up), hashed)."""
    if buckets is not None:
        # One bucket's width is 2**63, no int64: any width of 2**63 - 1 or more puts
        # every key in bucket 0 once clamped to the last bucket.
        return min(bucket_width(buckets[0]), KEY_LIMIT - 1), buckets[0] - 1, buckets[1], True
    if ranges is not None:
        size, firsts = ranges
        return -(-size // len(firsts)), len(firsts) - 1, 0, False
    return 1, 0, 0, False
