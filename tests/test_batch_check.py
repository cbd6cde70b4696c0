"""The CPU batch check (runtime/native_batch.cpp's bounds check, an op of its own) against a
plain reference written here and against FBGEMM's ``bounds_check_indices`` as
runtime/batch.py calls it where the kernel does not run (CUDA): the same batches are
bad, for every (lengths, ids) dtype pair, empty bags and batches included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard.runtime import native
from embshard.runtime.batch import fbgemm_bounds_check
from tools.bench.ops import Tally

DTYPES = [
    (lengths, ids) for lengths in (torch.int32, torch.int64) for ids in (torch.int32, torch.int64)
]


@pytest.fixture(autouse=True)
def built() -> None:
    """CI builds the kernels: a missing build fails here."""
    assert native.library() is not None, "the CPU kernels did not build"


def reference(
    lengths: list[list[int]], ids: list[int], rows: list[int]
) -> tuple[int, list[list[int]]]:
    """1 for lengths that are negative or do not add up to the ids, else the ids outside
    [0, rows) of their feature; and the lengths to route by: the batch's, or where they
    are bad one bag holding every id."""
    if any(n < 0 for bags in lengths for n in bags) or sum(map(sum, lengths)) != len(ids):
        stand_in = [[0] * len(bags) for bags in lengths]
        if stand_in and stand_in[0]:
            stand_in[0][0] = len(ids)
        return 1, stand_in
    at, outside = 0, 0
    for bags, bound in zip(lengths, rows):
        total = sum(bags)
        outside += sum(not 0 <= i < bound for i in ids[at : at + total])
        at += total
    return outside, lengths


def kernel(
    lengths: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor
) -> tuple[int, list[list[int]]]:
    problems = torch.full((1,), -7, dtype=torch.int64)
    routable = torch.full_like(lengths, -7)
    native.bounds_check(lengths, ids, rows - 1, problems, routable)
    return int(problems), routable.tolist()


def fbgemm(lengths: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> int:
    problems = torch.empty(1, dtype=torch.int64)
    fbgemm_bounds_check(lengths, ids, rows - 1, problems)
    return int(problems)


@st.composite
def batches(draw):
    features, batch = draw(st.integers(1, 4)), draw(st.integers(0, 4))
    rows = draw(st.lists(st.integers(1, 30), min_size=features, max_size=features))
    lengths = [draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)) for _ in rows]
    if batch and draw(st.booleans()):  # a negative length, its total kept or not
        f, b = draw(st.integers(0, features - 1)), draw(st.integers(0, batch - 1))
        lengths[f][b] = -draw(st.integers(1, 3))
    count = sum(max(n, 0) for bags in lengths for n in bags)
    count = max(0, count + draw(st.sampled_from([0, 0, 0, -1, 1])))
    ids = draw(st.lists(st.integers(-3, 33), min_size=count, max_size=count))
    return lengths, ids, rows


@settings(max_examples=300, deadline=None)
@given(batches(), st.sampled_from(DTYPES))
def test_the_kernel_finds_the_problems_of_the_reference_and_fbgemm(case, dtypes):
    lengths, ids, rows = case
    expected = reference(lengths, ids, rows)
    length_dtype, id_dtype = dtypes
    as_tensors = (
        torch.tensor(lengths, dtype=length_dtype).view(len(rows), -1),
        torch.tensor(ids, dtype=id_dtype),
        torch.tensor(rows, dtype=torch.int64),
    )
    assert kernel(*as_tensors) == expected
    assert (fbgemm(*as_tensors) == 0) == (expected[0] == 0)


@pytest.mark.parametrize("dtypes", DTYPES)
def test_the_kernel_checks_every_id_against_its_feature_at_the_dtype_extremes(dtypes):
    length_dtype, id_dtype = dtypes
    info = torch.iinfo(id_dtype)
    ids = torch.tensor([0, 4, info.max, info.min, 5, -1, 9], dtype=id_dtype)
    lengths = torch.tensor([[2, 0], [3, 2]], dtype=length_dtype)  # 2 ids, then 5
    rows = torch.tensor([5, 10], dtype=torch.int64)
    # Feature 0 holds 0 and 4 (inside 5 rows); feature 1 holds max, min and -1 (outside
    # 10 rows), 5 and 9 (inside).
    assert kernel(lengths, ids, rows) == (3, lengths.tolist())
    assert kernel(lengths, ids.clone().fill_(1), rows) == (0, lengths.tolist())
    assert kernel(lengths[:, :0], ids[:0], rows) == (0, [[], []])


def test_the_kernel_is_one_op_of_its_own():
    lengths, ids = torch.ones(2, 3, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    rows_less_one, problems = torch.zeros(2, dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    routable = torch.empty_like(lengths)
    with Tally() as tally:
        native.bounds_check(lengths, ids, rows_less_one, problems, routable)
    assert tally.ops == {"embshard.bounds_check.default": 1} and int(problems) == 0


def test_the_check_benchmark_times_both_checks_and_bucketizers():
    """tools/bench_check.py, on a small batch: both checks and both bucketizers timed,
    on the workload's ids."""
    tool = Path(__file__).parents[1] / "tools" / "bench_check.py"
    args = ["--batch", "16", "--calls", "3", "--warmup", "1"]
    done = subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ids"] == 16 * 214  # (d)'s 214 ids a sample
    assert report["fbgemm"]["wall_ms"] > 0 and report["embshard_kernel"]["wall_ms"] > 0
    assert report["fbgemm_bucketize"]["wall_ms"] > 0
    assert report["embshard_bucketize"]["wall_ms"] > 0
