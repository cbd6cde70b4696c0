"""The sender's side of dynamic tables: raw ids become keys, routed by bucket.

A dynamic table's raw ids travel as their keys (``id_map.hash_ids``), whole, to the
rank that owns their bucket. Its rows are ``buckets * rows_per_bucket``, bucket ``b``
owning rows ``[b * rows_per_bucket, (b + 1) * rows_per_bucket)``, and its plan cuts
rows on bucket boundaries only; so FBGEMM's bucketizer, given the first row of each
key's bucket in place of the key, sends it where a static table's row would go. The
keys then take the place of those stand-ins in the bucketized ids.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from embshard.runtime.batch import LocalBatch
from embshard.runtime.keys import KEY_LIMIT, bucket_width, hash_ids
from embshard.runtime.routes import Routes


class DynamicIds:
    """Per feature, its dynamic table's bucket width, last bucket and rows per bucket
    (1, 0 and 0 for a feature of a static table), on ``device``."""

    def __init__(self, routes: Routes, device: torch.device) -> None:
        specs = routes.buckets_or_none
        # One bucket's width is 2**63, no int64: any width of 2**63 - 1 or more puts
        # every key in bucket 0 once clamped to the last bucket.
        widths = [min(bucket_width(s[0]), KEY_LIMIT - 1) if s else 1 for s in specs]
        self._width = torch.tensor(widths, dtype=torch.int64, device=device)
        self._last = torch.tensor([s[0] - 1 if s else 0 for s in specs], device=device)
        self._rows = torch.tensor([s[1] if s else 0 for s in specs], device=device)
        self._features = torch.arange(len(specs), device=device)

    def keyed(self, batch: LocalBatch) -> LocalBatch:
        """``batch`` with its dynamic features' raw ids replaced by their keys (int64).
        Negative raw ids have no key: the batch's bounds check has flagged them, so
        whatever they hash to is never sent."""
        values = batch.values.long()
        dynamic = self._rows[self._feature_of(batch.routable_lengths, values)] > 0
        return replace(batch, values=torch.where(dynamic, hash_ids(values), values))

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
