"""LocalShardsWrapper's ops and DCP chunk protocol, against slices of a plain tensor."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from embshard import LocalShardsWrapper


@pytest.fixture
def base() -> torch.Tensor:
    # One rank's storage; the wrapper holds two non-adjacent column blocks of rows 2..5.
    return torch.randn(4, 12)


def blocks(base: torch.Tensor) -> LocalShardsWrapper:
    return LocalShardsWrapper([base[:, 0:4], base[:, 8:12]], [(2, 0), (2, 8)])


def test_shape_metadata_and_views(base):
    w = blocks(base)
    assert w.shape == (4, 8) and w.dtype == base.dtype
    assert w.local_offsets() == [torch.Size((2, 0)), torch.Size((2, 8))]
    assert w.local_sizes() == [torch.Size((4, 4)), torch.Size((4, 4))]
    for op in (lambda t: t.detach(), lambda t: t.view(t.shape), lambda t: t.view_as(t)):
        shards = op(w).local_shards()
        shards[1].fill_(7.0)
        assert torch.equal(base[:, 8:12], torch.full((4, 4), 7.0))


def test_clone_is_independent_and_equal(base):
    w = blocks(base)
    c = w.clone()
    assert torch.equal(c, w)
    c.local_shards()[0].zero_()
    assert not torch.equal(c, w)
    assert base[:, 0:4].abs().sum() > 0


def test_copy_from_plain_tensor_and_wrapper(base):
    w = blocks(base)
    source = torch.randn(4, 8)
    w.copy_(source)
    assert torch.equal(base[:, 0:4], source[:, :4]) and torch.equal(base[:, 8:12], source[:, 4:])
    other = torch.randn(4, 12)
    w.copy_(blocks(other))
    assert torch.equal(base[:, 8:12], other[:, 8:12])
    with pytest.raises(ValueError, match="same shard layout"):
        w.copy_(LocalShardsWrapper([other[:, 0:8]], [(2, 0)]))


def test_to_dtype_and_like_constructors(base):
    w = blocks(base)
    doubled = w.to(torch.float64)
    assert isinstance(doubled, LocalShardsWrapper) and doubled.dtype == torch.float64
    assert torch.equal(doubled.local_shards()[1], base[:, 8:12].double())
    zeros = torch.zeros_like(w)
    assert zeros.local_offsets() == w.local_offsets()
    assert all(torch.equal(s, torch.zeros(4, 4)) for s in zeros.local_shards())
    assert torch.empty_like(w).local_sizes() == w.local_sizes()


def test_equal_checks_offsets(base):
    w = blocks(base)
    moved = LocalShardsWrapper([base[:, 0:4], base[:, 8:12]], [(2, 0), (2, 4)])
    assert not torch.equal(w, moved)


def test_unsupported_ops_fail_clearly(base):
    with pytest.raises(NotImplementedError, match="gather_table"):
        blocks(base) + 1
    with pytest.raises(NotImplementedError, match="cannot be viewed"):
        blocks(base).view(8, 4)


def test_dcp_chunk_protocol(base):
    w = blocks(base)
    chunks = w.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [
        ((2, 0), (4, 4)),
        ((2, 8), (4, 4)),
    ]
    shard = w.__get_tensor_shard__(MetadataIndex("t", torch.Size((2, 8))))
    assert shard.data_ptr() == base[:, 8:12].data_ptr()
    with pytest.raises(ValueError, match="no shard at offset"):
        w.__get_tensor_shard__(MetadataIndex("t", torch.Size((0, 0))))
    items = w.__create_write_items__("t", torch.empty(10, 12))
    assert [tuple(i.tensor_data.chunk.offsets) for i in items] == [(2, 0), (2, 8)]
    assert all(i.tensor_data.size == torch.Size((10, 12)) for i in items)


def test_empty_wrapper():
    w = LocalShardsWrapper([], [], dtype=torch.float16, device=torch.device("cpu"))
    assert w.shape == (0, 0) and w.dtype == torch.float16
    assert w.__create_chunk_list__() == [] and w.__create_write_items__("t", w) == []
    assert w.detach().local_shards() == []


def test_shards_of_different_heights_as_a_grid_rank_holds_them():
    # Rows 5:10 of columns 0:4 and rows 0:3 of columns 4:12: two grid blocks on one rank.
    tall, short = torch.randn(5, 4), torch.randn(3, 8)
    w = LocalShardsWrapper([tall, short], [(5, 0), (0, 4)])
    assert w.shape == (5, 12)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in w.__create_chunk_list__()] == [
        ((5, 0), (5, 4)),
        ((0, 4), (3, 8)),
    ]
    source = torch.randn(5, 12)
    w.copy_(source)  # laid out as the shape: side by side, each shard its top rows
    assert torch.equal(tall, source[:, :4]) and torch.equal(short, source[:3, 4:])
    with pytest.raises(ValueError, match="2-D"):
        LocalShardsWrapper([torch.zeros(3)], [(0,)])
