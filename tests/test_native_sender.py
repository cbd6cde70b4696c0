"""The sender's fused CPU kernels (runtime/native_dynamic.cpp) against DynamicIds' torch
operations: the same keys, stand-ins and put-back ids, bit for bit, for static,
dynamic and managed-collision features mixed, with empty bags and features."""

from __future__ import annotations

import pytest
import torch

from embshard.runtime import native
from embshard.runtime.batch import LocalBatch
from embshard.runtime.dynamic_ids import DynamicIds
from embshard.runtime.routes import Routes

# Per feature: (buckets, rows per bucket) of a dynamic table, (input size, first rows)
# of a managed-collision one, or neither (a static table's).
FEATURES = [
    (None, None),
    ((1_000, 400), None),
    (None, (100, (0, 30, 45, 90))),
    ((1, 8), None),  # one bucket: every key in it
    ((7, 3), None),  # 7 does not divide 2**63
    (None, (5, (12,))),
    (None, None),
]
BATCH = 16


def _dynamic_ids() -> DynamicIds:
    names = tuple(f"f{i}" for i in range(len(FEATURES)))
    routes = Routes(
        features=names,
        embeddings=(),
        slots=(),
        bucket_passes=(),
        feature_rows=(1_000,) * len(names),
        feature_table=names,
        weighted=False,
        feature_buckets=tuple(b for b, _ in FEATURES),
        feature_ranges=tuple(r for _, r in FEATURES),
    )
    return DynamicIds(routes, torch.device("cpu"))


def _batch(seed: int, dtype: torch.dtype) -> LocalBatch:
    """Random bags (zeros and whole empty features among them) of ids spanning the
    dtype, negative ones and the extremes included."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES), BATCH), generator=generator)
    lengths[torch.rand(len(FEATURES), generator=generator) < 0.25] = 0
    count = int(lengths.sum())
    info = torch.iinfo(dtype)
    values = torch.cat(
        [
            torch.randint(-5, 200, (count,), generator=generator),
            torch.randint(info.min, info.max, (count,), generator=generator),
        ]
    )[torch.randperm(2 * count, generator=generator)[:count]].to(dtype)
    values[: min(count, 2)] = torch.tensor([info.min, info.max][: min(count, 2)], dtype=dtype)
    return LocalBatch(lengths, values, None, torch.zeros(1, dtype=torch.int64))


def _steps(ids: DynamicIds, batch: LocalBatch, seed: int) -> tuple[torch.Tensor, ...]:
    """keyed, stand_ins and put_back of one batch; put_back under a random permutation."""
    keys = ids.keyed(batch).values
    stand_ins, is_key = ids.stand_ins(batch.lengths, keys)
    generator = torch.Generator().manual_seed(seed)
    where = torch.randperm(len(keys), generator=generator)
    bucketized = torch.randint(-(2**40), 2**40, (len(keys),), generator=generator)
    return keys, stand_ins, is_key, ids.put_back(bucketized, where, keys, is_key)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("seed", range(6))
def test_kernels_match_torch(monkeypatch, seed: int, dtype: torch.dtype) -> None:
    ids, batch = _dynamic_ids(), _batch(seed, dtype)
    assert native.available(batch.values), "the CPU kernels did not build"
    fused = _steps(ids, batch, seed)
    monkeypatch.setattr(native, "library", lambda: None)
    plain = _steps(ids, batch, seed)
    for got, want in zip(fused, plain, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # Every kind of feature (static, dynamic, managed-collision) had ids to check.
    kinds = torch.tensor([(b is not None) + 2 * (r is not None) for b, r in FEATURES])
    assert set(kinds[batch.lengths.sum(1) > 0].tolist()) == {0, 1, 2}


def test_empty_batch(monkeypatch) -> None:
    ids = _dynamic_ids()
    lengths = torch.zeros(len(FEATURES), BATCH, dtype=torch.int64)
    batch = LocalBatch(lengths, torch.zeros(0, dtype=torch.int64), None, torch.zeros(1))
    fused = _steps(ids, batch, 0)
    monkeypatch.setattr(native, "library", lambda: None)
    for got, want in zip(fused, _steps(ids, batch, 0), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
