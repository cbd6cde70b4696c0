"""embshard's floor on this machine, lookup side: the rank's own lookups, backward and
update in a bare TBE, the ids it received that deduplicating would save, and the
machine's gather bandwidth."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import TYPE_CHECKING

from .libraries import loss

if TYPE_CHECKING:
    import torch


def received_ids(ours, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The indices and offsets this rank's TBE receives for ``batch`` in one training
    step (collective: every rank calls it); None on a rank without a TBE."""
    captured = {}
    storage = ours._storage
    original = storage.tbe

    def capture(indices, offsets, per_sample_weights=None):
        captured.update(indices=indices.clone(), offsets=offsets.clone())
        return original(indices, offsets, per_sample_weights=per_sample_weights)

    if original is not None:
        storage.tbe = capture
    loss(ours, batch).backward()
    storage.tbe = original
    return (captured["indices"], captured["offsets"]) if original is not None else None


def repeated_ids(ids: torch.Tensor) -> int:
    """How many of ``ids`` repeat an earlier one: lookups deduplication would save."""
    return ids.numel() - ids.unique().numel()


def duplicate_fraction(indices: torch.Tensor, offsets: torch.Tensor, slots: int) -> float:
    """Of the ids a TBE received (``slots`` table shards, TBE layout), the fraction
    that repeat an id of the same shard."""
    starts = offsets[:: (len(offsets) - 1) // slots].tolist()
    repeated = sum(repeated_ids(indices[a:b]) for a, b in itertools.pairwise(starts))
    return repeated / max(1, indices.numel())


def bare_tbe_time(ours, received, repeats: int) -> tuple[float, float]:
    """The rank's own lookups, backward and update in a fresh TBE with the same
    weights, on the indices its TBE received (``received_ids``), and the forward's
    achieved gather bandwidth. Collective: the ranks take turns, the others waiting at
    a barrier, so that no rank's timing shares the cores with another's (timed
    together at W = 4 on 2 cores, each would get half a core, and the floor would come
    out above the step). One untimed call first; the output's gradient is allocated
    once, as a step's arrives in the all-to-all's buffer."""
    import torch.distributed as dist

    result = (0.0, 0.0)
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank() and received is not None:
            result = _time_bare_tbe(ours, *received, repeats)
    dist.barrier()
    return result


def _time_bare_tbe(ours, indices, offsets, repeats: int) -> tuple[float, float]:
    import torch

    from embshard.storage.lookup import build_tbe
    from embshard.storage.optimizers import SGD

    shards, sharded = ours._storage.shards, ours._storage.tbe
    tbe = build_tbe([(s.rows, s.cols) for _, s in shards], SGD(0.01), torch.device("cpu"),
                    [slot.tbe_table for slot in ours._routes.slots[ours.rank]])  # fmt: skip
    # The same weights: every page touched before timing, as the sharded TBE's are.
    for mine, theirs in zip(tbe.split_embedding_weights(), sharded.split_embedding_weights()):
        mine.copy_(theirs)
    gradient = torch.ones_like(tbe(indices, offsets))
    tbe(indices, offsets).backward(gradient)  # untimed: the first call's page faults
    times, forwards = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = tbe(indices, offsets)
        forwards.append(time.perf_counter() - start)
        out.backward(gradient)
        times.append(time.perf_counter() - start)
    dims = ours._routes.slot_dims(ours.rank)
    batch_size = (len(offsets) - 1) // len(dims)
    counts = (offsets[1:] - offsets[:-1]).view(len(dims), batch_size).sum(1).tolist()
    gathered = sum(c * d * 4 for c, d in zip(counts, dims))
    return statistics.median(times), gathered / statistics.median(forwards)


def gather_bandwidth(rows: int = 1 << 22, dim: int = 64, ids: int = 8 * 1024 * 20) -> float:
    """Bytes/s of summing random rows of a 1 GiB table (bigger than the caches), one thread."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    table = torch.randn(rows, dim)
    index = torch.randint(0, rows, (ids,))
    offsets = torch.arange(0, ids, 20)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        F.embedding_bag(index, table, offsets, mode="sum")
        times.append(time.perf_counter() - start)
    return ids * dim * 4 / statistics.median(times)
