"""FBGEMM's jagged-id operations, with their empty cases the same on every device.

Where the permutation or the lengths are empty, FBGEMM's CUDA permutes hand back their
input unpermuted, and its CUDA bucketizer refuses to launch (``grid.x value 0``); its
CPU operations return empty results. A rank with an empty batch, or a plan that sends
no rank anything, meets those cases: here they return what the CPU operations do,
without calling FBGEMM. On CPU, bucketizing is embshard's kernel (``native``), with
FBGEMM's results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embshard.runtime import native

Jagged = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _permuted(op, permute, lengths, values, weights, total: int) -> Jagged:
    """FBGEMM's permute ``op``; with nothing to permute, the rows ``permute`` picks of
    ``lengths`` and no ids: every picked row is empty."""
    if permute.numel() == 0 or lengths.numel() == 0:
        no_weights = None if weights is None else weights[:0]
        return lengths.index_select(0, permute), values[:0], no_weights
    return op(permute, lengths, values, weights, total)


def permute_2d(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    total: int,
) -> Jagged:
    """The rows ``permute`` picks of the lengths table ``lengths`` ([rows, batch]), with
    their ids and weights (``total`` of them), in that order."""
    op = torch.ops.fbgemm.permute_2D_sparse_data
    return _permuted(op, permute, lengths, values, weights, total)


def permute_1d(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    total: int,
) -> Jagged:
    """The segments ``permute`` picks of ``lengths`` (1-D), with their ids and weights
    (``total`` of them), in that order."""
    op = torch.ops.fbgemm.permute_1D_sparse_data
    return _permuted(op, permute, lengths, values, weights, total)


@dataclass(frozen=True)
class BucketBounds:
    """Each feature's row boundaries for one bucketizing (``buckets + 1`` of them, from 0:
    bucket k holds rows ``[b[k], b[k + 1])``), as each bucketizer takes them: FBGEMM's
    per-feature tensors (with block sizes it ignores given them) in either id dtype,
    and embshard's CPU kernel's padded table."""

    buckets: int
    block_sizes: dict[torch.dtype, torch.Tensor]
    boundaries: dict[torch.dtype, list[torch.Tensor]]
    table: torch.Tensor

    @classmethod
    def of(cls, bounds: tuple[tuple[int, ...], ...], device: torch.device) -> BucketBounds:
        sizes = [max(1, b[1] - b[0]) for b in bounds]
        dtypes = (torch.int32, torch.int64)
        return cls(
            len(bounds[0]) - 1,
            {d: torch.tensor(sizes, dtype=d, device=device) for d in dtypes},
            {d: [torch.tensor(b, dtype=d, device=device) for b in bounds] for d in dtypes},
            native.bucket_bounds(bounds).to(device),
        )


def block_bucketize(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    bounds: BucketBounds,
    with_positions: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each bag of ``lengths`` (1-D, feature-major) cut into ``bounds.buckets`` by its
    ids' rows (rebased to their bucket's first): the lengths ([buckets * bags]), ids and
    weights in bucket order, and with ``with_positions`` where each id went (FBGEMM's
    ``unbucketize_permute``). An id outside every bucket goes to bucket
    ``id % buckets`` as ``id // buckets``, read unsigned, as FBGEMM does."""
    if lengths.numel() == 0:
        order = values[:0] if with_positions else None
        return lengths[:0], values[:0], None if weights is None else weights[:0], order
    if native.available(values) and (weights is None or weights.dtype == torch.float32):
        return native.block_bucketize(
            lengths, values, weights, bounds.table, bounds.buckets, with_positions
        )
    bucketized = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths,
        values,
        False,
        with_positions,
        bounds.block_sizes[values.dtype],
        bounds.buckets,
        weights,
        None,
        -1,
        bounds.boundaries[values.dtype],
    )
    new_lengths, new_values, new_weights, _, order = bucketized
    return new_lengths, new_values, new_weights, order
