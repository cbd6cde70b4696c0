from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from worlds import World


@pytest.fixture(scope="session")
def world() -> Iterator[Callable[[int], World]]:
    """``world(n)``: a shared world of ``n`` gloo ranks, started on first use."""
    worlds: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in worlds or not worlds[size].alive:
            worlds[size] = World(size)
        return worlds[size]

    yield get
    for w in worlds.values():
        w.close()
