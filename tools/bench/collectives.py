"""What a training step hands to torch.distributed's collectives: their count, their
bytes, and the same calls replayed alone (the collectives' share of the step's floor)."""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .libraries import loss

if TYPE_CHECKING:
    import torch


class CollectiveBytes:
    """Counts the bytes a rank hands to torch.distributed's collectives, in all and by
    dtype, and keeps each call (its tensors as uninitialised twins) for ``replay``."""

    OUTPUT_FIRST = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
                    "reduce_scatter_tensor")  # fmt: skip
    NAMES = (*OUTPUT_FIRST, "all_reduce", "broadcast")

    def __init__(self) -> None:
        self.bytes = 0
        self.by_dtype: dict[torch.dtype, int] = {}
        self.calls: list[tuple[Callable, dict]] = []
        self.originals: dict[str, Callable] = {}

    def __enter__(self) -> CollectiveBytes:
        import torch
        import torch.distributed as dist

        def twin(value):
            if isinstance(value, list | tuple):
                return [twin(v) for v in value]
            return torch.empty_like(value) if isinstance(value, torch.Tensor) else value

        for name in self.NAMES:
            original = getattr(dist, name)
            self.originals[name] = original

            def wrapped(*args, _original=original, _name=name, **kwargs):
                bound = inspect.signature(_original).bind(*args, **kwargs)
                sent = list(bound.signature.parameters)[1 if _name in self.OUTPUT_FIRST else 0]
                tensors = bound.arguments[sent]
                tensors = tensors if isinstance(tensors, list | tuple) else [tensors]
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        size = t.numel() * t.element_size()
                        self.bytes += size
                        self.by_dtype[t.dtype] = self.by_dtype.get(t.dtype, 0) + size
                arguments = {k: twin(v) for k, v in bound.arguments.items()}
                self.calls.append((_original, arguments))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, original in self.originals.items():
            setattr(dist, name, original)

    def replay(self, repeats: int) -> float:
        """The median time of the calls made again, one after another, each waited on,
        with nothing else running: the collectives' share of the step's floor. The
        ranks start each repeat together. Collective: every rank calls it."""
        import torch.distributed as dist

        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for original, arguments in self.calls:
                work = original(**arguments)
                if work is not None:
                    work.wait()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def per_step_comm(model, batch) -> tuple[int, CollectiveBytes]:
    """The backend collectives of one training step, and what this rank handed them."""
    from torch.profiler import ProfilerActivity, profile

    with CollectiveBytes() as counter, profile(activities=[ProfilerActivity.CPU]) as prof:
        loss(model, batch).backward()
    return sum(e.name.startswith("gloo:") for e in prof.events()), counter
