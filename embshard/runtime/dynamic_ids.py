"""The sender's side of dynamic tables: raw ids become keys, routed by bucket.

A dynamic table's raw ids travel as their keys (``id_map.hash_ids``), whole, to the
rank that owns their bucket. Its rows are ``buckets * rows_per_bucket``, bucket ``b``
owning rows ``[b * rows_per_bucket, (b + 1) * rows_per_bucket)``, and its plan cuts
rows on bucket boundaries only; so FBGEMM's bucketizer, given the first row of each
key's bucket in place of the key, sends it where a static table's row would go. The
keys then take the place of those stand-ins in the bucketized ids.

A managed-collision table's raw ids (``Routes.feature_ranges``) are routed the same way,
unhashed: by input range, each range's ids to one row block, as TorchRec's sharded
managed-collision modules route them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from embshard.runtime.batch import LocalBatch
from embshard.runtime.keys import KEY_LIMIT, bucket_width, hash_ids
from embshard.runtime.routes import Routes


class DynamicIds:
    """Per feature, the width of its id ranges, its last range, the rows of a range's
    block (1, 0 and 0 for a feature of a static table), and whether its raw ids travel
    as keys (a dynamic table's), on ``device``."""

    def __init__(self, routes: Routes, device: torch.device) -> None:
        ranges = routes.feature_ranges or (None,) * len(routes.features)
        specs = [_routing(b, r) for b, r in zip(routes.buckets_or_none, ranges)]
        self._width = torch.tensor([s[0] for s in specs], dtype=torch.int64, device=device)
        self._last = torch.tensor([s[1] for s in specs], device=device)
        self._rows = torch.tensor([s[2] for s in specs], device=device)
        self._hashed = torch.tensor([s[3] for s in specs], device=device)
        self._any_hashed = any(s[3] for s in specs)
        self._features = torch.arange(len(specs), device=device)

    def keyed(self, batch: LocalBatch) -> LocalBatch:
        """``batch``'s ids as int64, its dynamic features' raw ids replaced by their keys.
        Negative raw ids have no key: the batch's bounds check has flagged them, so
        whatever they hash to is never sent."""
        values = batch.values.long()
        if not self._any_hashed:
            return replace(batch, values=values)
        hashed = self._hashed[self._feature_of(batch.routable_lengths, values)]
        return replace(batch, values=torch.where(hashed, hash_ids(values), values))

    def stand_ins(
        self, lengths: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the bucketizer routes by: each key's bucket's first row in place of the
        key (other ids as they are), and which ids are keys."""
        feature = self._feature_of(lengths, keys)
        rows = self._rows[feature]
        bucket = torch.minimum(keys // self._width[feature], self._last[feature])
        is_key = rows > 0
        return torch.where(is_key, bucket * rows, keys), is_key

    @staticmethod
    def put_back(
        bucketized: torch.Tensor, where: torch.Tensor, keys: torch.Tensor, is_key: torch.Tensor
    ) -> torch.Tensor:
        """A pass's bucketized ids with the keys back in place of their stand-ins;
        ``where``: FBGEMM's unbucketize permutation (where each id went)."""
        where = where.long()
        moved = torch.empty_like(keys).scatter_(0, where, keys)
        return torch.where(torch.empty_like(is_key).scatter_(0, where, is_key), moved, bucketized)

    def _feature_of(self, lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Each id's feature, from the batch's lengths table [features, batch]."""
        return torch.repeat_interleave(self._features, lengths.sum(1), output_size=values.numel())


def _routing(
    buckets: tuple[int, int] | None, ranges: tuple[int, int, int] | None
) -> tuple[int, int, int, bool]:
    """A feature's (range width, last range, rows a range's block, hashed)."""
    if buckets is not None:
        # One bucket's width is 2**63, no int64: any width of 2**63 - 1 or more puts
        # every key in bucket 0 once clamped to the last bucket.
        return min(bucket_width(buckets[0]), KEY_LIMIT - 1), buckets[0] - 1, buckets[1], True
    if ranges is not None:
        size, blocks, rows = ranges
        return -(-size // blocks), blocks - 1, rows, False
    return 1, 0, 0, False
