"""Training steps timed on each rank, and their figures gathered over the ranks."""

from __future__ import annotations

import time

from .libraries import loss


def train_step(model, batch) -> float:
    """One training step's time on this rank. The ranks start it together: the two
    libraries' steps alternate, and without the barrier a rank that finished the other
    library's step early would wait for the rest inside this one, charging that
    library's imbalance to this one."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss(model, batch).backward()
    return time.perf_counter() - start


def pipelined_steps(model, batches) -> list[float]:
    """Step times of embshard's pipeline (``prefetch``, as ``TrainPipeline`` does): each
    step starts the next batch's input distribution, then runs its own forward and
    backward. The first batch is distributed before the clock starts."""
    model.prefetch(batches[0])
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        if i + 1 < len(batches):
            model.prefetch(batches[i + 1])
        loss(model, batch).backward()
        times.append(time.perf_counter() - start)
    return times


def slowest(values: list[float]) -> list[float]:
    """Per step, the largest value over ranks."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def per_rank(value: float) -> list[float]:
    """Every rank's ``value``, in rank order, on every rank."""
    import torch
    import torch.distributed as dist

    values = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return values.tolist()
