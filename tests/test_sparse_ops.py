"""embshard.runtime.sparse_ops against FBGEMM's CPU operations, empty cases included:
on CUDA too, where FBGEMM's own kernels return their input or refuse to launch; and
embshard's CPU bucketizing kernel against FBGEMM's and a plain reference written here,
for every dtype pair, bucket count and kind of bad id."""

from __future__ import annotations

import itertools

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard.runtime import native
from embshard.runtime.sparse_ops import BucketBounds, block_bucketize, permute_1d, permute_2d
from tools.bench.ops import Tally

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
    bounds = BucketBounds.of(((0, 5, 10),), torch.device(device))
    for lengths, values, weights in cases_bucketize():
        full = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths, values, False, with_positions, torch.tensor([5]), 2, weights, None, -1, None
        )
        want = (full[0], full[1], full[2], full[4])
        got = block_bucketize(*moved((lengths, values, weights), device), bounds, with_positions)
        same(got, want)


DTYPES = [(a, b) for a in (torch.int32, torch.int64) for b in (torch.int32, torch.int64)]


@st.composite
def bucketings(draw):
    """(lengths [features, batch], ids, each feature's boundaries): up to 20 buckets, some
    empty (repeated boundaries, as a hot-rows pass's first bucket of a feature without
    hot rows), or all rows in one (a table-wise table's feature in a row-wise pass); ids
    inside, beyond the last boundary and negative."""
    features, batch = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    buckets = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 11, 16, 20]))
    bounds = []
    for _ in range(features):
        if draw(st.booleans()):
            steps = draw(st.lists(st.integers(0, 6), min_size=buckets, max_size=buckets))
        else:
            steps = [0] * buckets
            steps[draw(st.integers(0, buckets - 1))] = draw(st.integers(1, 9))
        bounds.append(tuple([0, *[sum(steps[: k + 1]) for k in range(buckets)]]))
    lengths = [draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch)) for _ in bounds]
    count = sum(map(sum, lengths))
    top = max(b[-1] for b in bounds)
    outside = draw(st.sampled_from([0, 3]))  # ids beyond the boundaries, or none
    ids = draw(st.lists(st.integers(-outside, top + outside), min_size=count, max_size=count))
    return lengths, ids, tuple(bounds)


def reference_bucketize(lengths, ids, bounds, bits):
    """Plain Python: each id's bucket, and its id there, bag by bag; an id outside every
    bucket (read as an unsigned ``bits``-bit number) to bucket id % buckets as id //
    buckets. Lengths that are negative or overrun the ids are cut short."""
    buckets = len(bounds[0]) - 1
    out = {}  # (bucket, feature, bag) -> [(new id, where it came from)]
    at = 0
    for f, bags in enumerate(lengths):
        for b, length in enumerate(bags):
            for i in range(at, min(len(ids), at + max(length, 0))):
                raw = ids[i] % 2**bits
                p = sum(edge <= raw for edge in bounds[f]) - 1
                inside = p < buckets
                bucket, new_id = (
                    (p, raw - bounds[f][p]) if inside else (raw % buckets, raw // buckets)
                )
                out.setdefault((bucket, f, b), []).append((new_id, i))
            at = min(len(ids), at + max(length, 0))
    new_lengths, new_ids, order = [], [], [0] * len(ids)
    for p in range(buckets):
        for f, bags in enumerate(lengths):
            for b in range(len(bags)):
                got = out.get((p, f, b), [])
                new_lengths.append(len(got))
                for new_id, i in got:
                    order[i] = len(new_ids)
                    new_ids.append(new_id - 2**bits if new_id >= 2 ** (bits - 1) else new_id)
    return new_lengths, new_ids, order


@settings(max_examples=300, deadline=None)
@given(bucketings(), st.sampled_from(DTYPES), st.booleans(), st.booleans())
def test_the_kernel_bucketizes_as_fbgemm_and_the_reference(case, dtypes, weighted, positions):
    lengths, ids, bounds = case
    length_dtype, id_dtype = dtypes
    lengths_t = torch.tensor(lengths, dtype=length_dtype).view(-1)
    ids_t = torch.tensor(ids, dtype=id_dtype)
    weights = torch.randn(len(ids)) if weighted else None
    buckets = len(bounds[0]) - 1
    got = native.block_bucketize(
        lengths_t, ids_t, weights, native.bucket_bounds(bounds), buckets, positions
    )
    same(got, fbgemm_bucketize(lengths_t, ids_t, weights, bounds, positions))
    new_lengths, new_ids, order = reference_bucketize(
        lengths, ids, bounds, torch.iinfo(id_dtype).bits
    )
    assert got[0].tolist() == new_lengths and got[1].tolist() == new_ids
    if positions:
        assert got[3].tolist() == order


@pytest.mark.parametrize("dtypes", DTYPES)
def test_the_kernel_cuts_bad_lengths_short(dtypes):
    """A bad batch's lengths (negative, overrunning the ids) never make the kernel read
    or write outside its buffers: it reads them as cut short."""
    length_dtype, id_dtype = dtypes
    lengths, ids, bounds = [[2, -3, 9], [4, 1, 0]], [0, 7, 3, 9, 1], ((0, 4, 8), (0, 5, 10))
    check_bucketize(lengths, ids, bounds, length_dtype, id_dtype)


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("bounds", [((0, 6, 6),), ((0, 0, 6),), ((0, 0, 6, 6),), ((0, 0, 0),)])
@pytest.mark.parametrize("bad", [-1, 6, 10**6])
def test_ids_outside_a_feature_in_one_bucket_go_as_fbgemms(dtypes, bounds, bad):
    """A feature whose rows are all in one bucket (the kernel copies its ids as they
    are) with one id outside them: that id goes to bucket id % buckets, as FBGEMM's."""
    length_dtype, id_dtype = dtypes
    for ids in ([0, 5, 3, bad], [bad, 0, 5, 3], [0, 5, 3, 4]):
        check_bucketize([[2, 0, 2]], ids, bounds, length_dtype, id_dtype)


def check_bucketize(lengths, ids, bounds, length_dtype, id_dtype) -> None:
    """The kernel against the reference and, for lengths that add up, FBGEMM."""
    buckets = len(bounds[0]) - 1
    lengths_t = torch.tensor(lengths, dtype=length_dtype).view(-1)
    ids_t = torch.tensor(ids, dtype=id_dtype)
    got = native.block_bucketize(
        lengths_t, ids_t, None, native.bucket_bounds(bounds), buckets, True
    )
    new_lengths, new_ids, order = reference_bucketize(
        lengths, ids, bounds, torch.iinfo(id_dtype).bits
    )
    assert got[0].tolist() == new_lengths and got[1].tolist() == new_ids
    assert got[3].tolist() == order
    if all(n >= 0 for bags in lengths for n in bags) and sum(map(sum, lengths)) == len(ids):
        same(got, fbgemm_bucketize(lengths_t, ids_t, None, bounds, True))


def fbgemm_bucketize(lengths, ids, weights, bounds, positions):
    """FBGEMM's bucketizer given ``bounds``: lengths, ids, weights, where each id went."""
    full = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths,
        ids,
        False,
        positions,
        torch.tensor([max(1, b[1]) for b in bounds], dtype=ids.dtype),
        len(bounds[0]) - 1,
        weights,
        None,
        -1,
        [torch.tensor(b, dtype=ids.dtype) for b in bounds],
    )
    return full[0], full[1], full[2], full[4]


def test_the_kernel_is_one_op_of_its_own():
    lengths, ids = torch.tensor([1, 2]), torch.tensor([3, 9, 1])
    table = native.bucket_bounds(((0, 5, 10),))
    with Tally() as tally:
        got = native.block_bucketize(lengths, ids, None, table, 2, False)
    assert tally.ops == {"embshard.block_bucketize.default": 1}
    assert got[0].tolist() == [1, 1, 0, 1] and got[1].tolist() == [3, 1, 4]


@st.composite
def packings(draw):
    """(lengths [rows, batch], each destination's rows): rows sent to one destination,
    to several, or to none, in any order."""
    rows, batch = draw(st.integers(1, 5)), draw(st.integers(0, 4))
    lengths = [
        draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)) for _ in range(rows)
    ]
    dests = draw(st.lists(st.lists(st.integers(0, rows - 1), max_size=4), min_size=1, max_size=4))
    return lengths, dests


@settings(max_examples=200, deadline=None)
@given(
    packings(), st.sampled_from(DTYPES), st.sampled_from([torch.int32, torch.int64]), st.booleans()
)
def test_the_pack_kernel_gives_fbgemms_permute_and_a_cat(case, dtypes, payload_dtype, weighted):
    lengths, dests = case
    length_dtype, id_dtype = dtypes
    lengths_t = torch.tensor(lengths, dtype=length_dtype).view(len(lengths), -1)
    ids = torch.randint(-(2**31), 2**31, (int(lengths_t.sum()),), dtype=torch.int64).to(id_dtype)
    weights = torch.randn(len(ids)) if weighted else None
    send_rows = torch.tensor([r for rows in dests for r in rows], dtype=torch.int32)
    total = int(lengths_t.sum(1)[send_rows.long()].sum())
    rows, values, row_weights = permute_2d(send_rows, lengths_t, ids, weights, total)
    counts = [int(lengths_t.sum(1)[torch.tensor(d, dtype=torch.long)].sum()) for d in dests]
    pieces = []
    for dest_rows, dest_ids, dest_weights in zip(
        rows.split([len(d) for d in dests]),
        values.split(counts),
        row_weights.split(counts) if weighted else [None] * len(dests),
    ):
        pieces += [dest_rows.reshape(-1), dest_ids]
        if weighted:
            pieces.append(dest_weights.view(torch.int32))
    want = torch.cat([p.to(payload_dtype) for p in pieces])
    got = torch.full_like(want, -7)
    native.pack(lengths_t, ids, weights, send_rows, [len(d) for d in dests], got)
    assert torch.equal(got, want)


@st.composite
def arrivals(draw):
    """Each source's bags, slot by slot: (batch size, [slot][sample] -> ids)."""
    slots, sources = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    arrived = []
    for _ in range(sources):
        batch = draw(st.integers(0, 3))
        bags = [
            [draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3)) for _ in range(batch)]
            for _ in range(slots)
        ]
        arrived.append((batch, bags))
    return slots, arrived


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.sampled_from([torch.int32, torch.int64]), st.booleans())
def test_the_unpack_kernel_takes_the_bags_slot_by_slot(case, dtype, weighted):
    """native.unpack against a plain reference: the TBE's ids slot by slot, each slot's
    sources in rank order, its bags' offsets and their weights."""
    slots, arrived = case
    chunks, sizes, batch_sizes, weight_of = [], [], [], {}
    for batch, bags in arrived:
        ids = [i for slot in bags for bag in slot for i in bag]
        bits = torch.randn(len(ids)).view(torch.int32)
        weight_of.update({(len(chunks), k): int(b) for k, b in enumerate(bits)})
        chunk = [len(bag) for slot in bags for bag in slot] + ids
        chunk += bits.tolist() if weighted else []
        chunks.append(chunk)
        sizes.append(len(chunk))
        batch_sizes.append(batch)
    ids_in_order, lengths_in_order, weights_in_order = [], [], []
    for s in range(slots):
        for r, (_, bags) in enumerate(arrived):
            before = sum(len(bag) for slot in bags[:s] for bag in slot)
            for bag in bags[s]:
                lengths_in_order.append(len(bag))
                ids_in_order += bag
                weights_in_order += [weight_of[r, before + k] for k in range(len(bag))]
                before += len(bag)
    received = torch.tensor([v for c in chunks for v in c], dtype=torch.int64).to(dtype)
    values = torch.full((len(ids_in_order),), -7, dtype=dtype)
    offsets = torch.full((len(lengths_in_order) + 1,), -7, dtype=dtype)
    weights = torch.zeros(len(ids_in_order)) if weighted else None
    native.unpack(received, sizes, batch_sizes, slots, values, offsets, weights)
    assert values.tolist() == ids_in_order
    assert offsets.tolist() == [0, *itertools.accumulate(lengths_in_order)]
    if weighted:
        assert weights.view(torch.int32).tolist() == weights_in_order


def test_the_kernels_take_strided_ids_and_weights():
    """Ids and weights that are views with strides (a KJT's may be) bucketize and pack
    as their contiguous copies do."""
    lengths = torch.tensor([2, 1, 0, 3])  # 2 features, 2 bags each
    ids, weights = torch.arange(12)[::2], torch.randn(12)[::2]
    bounds = ((0, 4, 8), (0, 6, 11))
    got = native.block_bucketize(lengths, ids, weights, native.bucket_bounds(bounds), 2, True)
    same(got, fbgemm_bucketize(lengths, ids.contiguous(), weights.contiguous(), bounds, True))
    table = torch.tensor([[2, 9, 1], [0, 9, 3]])[:, ::2]  # rows of 2 bags, strided
    send_rows = torch.tensor([1, 0], dtype=torch.int32)
    payloads = []
    for kept in ((ids, weights), (ids.contiguous(), weights.contiguous())):
        payload = torch.empty(2 * 2 + 2 * 6, dtype=torch.int64)
        native.pack(table, *kept, send_rows, [1, 1], payload)
        payloads.append(payload)
    assert torch.equal(*payloads)
