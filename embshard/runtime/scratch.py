"""Buffers a rank keeps from step to step, handed out again only when free; and
small constant tensors kept for the last few shapes seen."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

KeptT = TypeVar("KeptT")


def kept(
    cache: dict[Hashable, KeptT], key: Hashable, make: Callable[[], KeptT], limit: int = 8
) -> KeptT:
    """``cache[key]``, made by ``make`` at its first use; past ``limit`` entries the
    oldest is dropped. For what a step needs per batch size (index tensors, tables of
    sizes), which rarely changes: a new one costs ops and a copy to the device."""
    if key not in cache:
        if len(cache) == limit:
            del cache[next(iter(cache))]
        cache[key] = make()
    return cache[key]


class Scratch:
    """Buffers kept from step to step. On CPU, glibc hands large freed blocks back to
    the kernel, so a fresh buffer each step page-faults on its first touch: a third of
    a row-wise step on workload (b) (`tools/profile_step.py`). A buffer is handed out
    again only when no tensor holds it any more, so neither a gradient that autograd
    has not consumed yet nor an output the caller still holds is ever overwritten;
    two buffers a name let an output alternate while the caller holds the last one.
    CUDA's caching allocator already reuses memory: there every call gets a new
    tensor."""

    def __init__(self) -> None:
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        like: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """A contiguous tensor of ``shape`` on ``like``'s device, of ``dtype`` (default
        ``like``'s). Not a view to autograd: the caller may modify an output built in it
        in place."""
        dtype = dtype or like.dtype
        if like.device.type != "cpu":
            return like.new_empty(shape, dtype=dtype)
        numel = math.prod(shape)
        kept = self._buffers.setdefault(name, [])
        in_use = [_held_elsewhere(b) for b in kept]
        held = [b for b, used in zip(kept, in_use) if used]
        fits = [
            b
            for b, used in zip(kept, in_use)
            if not used and b.numel() >= numel and b.dtype == dtype
        ]
        if fits:
            buffer = fits[0]
        else:
            # Room to spare once sizes are seen to change (ids vary from step to step).
            room = numel // 4 if kept and kept[-1].numel() != numel else 0
            buffer = like.new_empty(numel + room, dtype=dtype)
            kept[:] = [*held[-1:], buffer]
        return buffer.new_empty(0).set_(buffer.untyped_storage(), 0, shape)


def _held_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether a tensor other than ``buffer`` uses its memory (views included)."""
    storage = buffer.untyped_storage()
    # Counted: ``buffer`` itself and ``storage`` here.
    return torch._C._storage_Use_Count(storage._cdata) > 2
