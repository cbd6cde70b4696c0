"""FBGEMM's jagged-id operations, with their empty cases the same on every device.

Where the permutation or the lengths are empty, FBGEMM's CUDA permutes hand back their
input unpermuted, and its CUDA bucketizer refuses to launch (``grid.x value 0``); its
CPU operations return empty results. A rank with an empty batch, or a plan that sends
no rank anything, meets those cases: here they return what the CPU operations do,
without calling FBGEMM.
"""

from __future__ import annotations

import torch

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


def block_bucketize(
    lengths: torch.Tensor,
    values: torch.Tensor,
    with_positions: bool,
    block_sizes: torch.Tensor,
    buckets: int,
    weights: torch.Tensor | None,
    boundaries: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each bag of ``lengths`` (1-D) cut into ``buckets`` by its ids' blocks: the
    lengths ([buckets * bags]), ids and weights in bucket order, and with
    ``with_positions`` where each id went (FBGEMM's ``unbucketize_permute``)."""
    if lengths.numel() == 0:
        order = values[:0] if with_positions else None
        return lengths[:0], values[:0], None if weights is None else weights[:0], order
    bucketized = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, values, False, with_positions, block_sizes, buckets, weights, None, -1, boundaries
    )
    new_lengths, new_values, new_weights, _, order = bucketized
    return new_lengths, new_values, new_weights, order
