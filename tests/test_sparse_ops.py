"""embshard.runtime.sparse_ops against FBGEMM's CPU operations, empty cases included:
on CUDA too, where FBGEMM's own kernels return their input or refuse to launch."""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import pytest
import torch

from embshard.runtime.sparse_ops import block_bucketize, permute_1d, permute_2d

I32 = torch.int32


def same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
            assert torch.equal(g.cpu(), w), (g, w)


def cases_2d():
    """(permute, lengths [rows, batch], values, weights): some rows, none, empty bags."""
    lengths = torch.tensor([[1, 2], [0, 1], [2, 0]])
    values, weights = torch.arange(6), torch.arange(6, dtype=torch.float32)
    yield torch.tensor([2, 0], dtype=I32), lengths, values, weights
    yield torch.tensor([], dtype=I32), lengths, values, weights  # a plan sending nothing
    yield torch.tensor([1, 0], dtype=I32), torch.zeros(3, 0, dtype=torch.int64), values[:0], None
    yield torch.tensor([], dtype=I32), torch.zeros(0, 4, dtype=torch.int64), values[:0], None


def cases_1d():
    lengths, values = torch.tensor([2, 0, 3]), torch.arange(5)
    yield torch.tensor([2, 1, 0], dtype=I32), lengths, values, values.float()
    yield torch.tensor([], dtype=I32), lengths, values, None
    yield torch.tensor([], dtype=I32), lengths[:0], values[:0], None


def cases_bucketize():
    """(lengths, values, weights): bags with ids, empty bags, no bags (an empty batch)."""
    yield torch.tensor([2, 0, 3]), torch.tensor([0, 9, 4, 7, 1]), torch.arange(5.0)
    yield torch.tensor([0, 0]), torch.tensor([], dtype=torch.int64), None
    yield torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), None


def moved(tensors, device: str):
    return [None if t is None else t.to(device) for t in tensors]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_permutes_give_fbgemms_cpu_results_on_every_device(device):
    for permute, lengths, values, weights in cases_2d():
        total = int(lengths[permute.long()].sum())
        want = torch.ops.fbgemm.permute_2D_sparse_data(permute, lengths, values, weights, total)
        same(permute_2d(*moved((permute, lengths, values, weights), device), total), want)
    for permute, lengths, values, weights in cases_1d():
        total = int(lengths[permute.long()].sum())
        want = torch.ops.fbgemm.permute_1D_sparse_data(permute, lengths, values, weights, total)
        same(permute_1d(*moved((permute, lengths, values, weights), device), total), want)


@pytest.mark.parametrize("with_positions", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bucketize_gives_fbgemms_cpu_results_on_every_device(device, with_positions):
    block_sizes = torch.tensor([5])
    for lengths, values, weights in cases_bucketize():
        full = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths, values, False, with_positions, block_sizes, 2, weights, None, -1, None
        )
        want = (full[0], full[1], full[2], full[4])
        got = block_bucketize(
            *moved((lengths, values), device),
            with_positions,
            block_sizes.to(device),
            2,
            *moved((weights,), device),
            None,
        )
        same(got, want)
