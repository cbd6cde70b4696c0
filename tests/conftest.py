from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from worlds import World


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a GPU: skipped where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _worlds(make: Callable[[int], World]) -> Iterator[Callable[[int], World]]:
    worlds: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in worlds or not worlds[size].alive:
            worlds[size] = make(size)
        return worlds[size]

    yield get
    for w in worlds.values():
        w.close()


@pytest.fixture(scope="session")
def world() -> Iterator[Callable[[int], World]]:
    """``world(n)``: a shared world of ``n`` gloo ranks, started on first use."""
    yield from _worlds(World)


@pytest.fixture(scope="session")
def cuda_world() -> Iterator[Callable[[int], World]]:
    """``cuda_world(n)``: a shared world of ``n`` ranks on the one GPU. NCCL at one
    rank; several ranks run gloo over CUDA tensors, since NCCL refuses two ranks on
    one device."""
    yield from _worlds(lambda n: World(n, "nccl" if n == 1 else "gloo", cuda=True))


@pytest.fixture(scope="session")
def fbgemm_world() -> Iterator[Callable[[int], World]]:
    """``fbgemm_world(n)``: a shared world of ``n`` gloo ranks with embshard's CPU
    kernels off (``EMBSHARD_NATIVE=0``), so the step runs the FBGEMM and torch
    operations a GPU runs."""
    yield from _worlds(lambda n: World(n, env={"EMBSHARD_NATIVE": "0"}))
