"""What gloo's all-to-all costs on this machine, and how much of it hides behind compute.

    .venv/bin/python tools/gloo_alltoall.py

Two gloo processes (one thread each) time ``all_to_all_single`` for a range of sizes
per destination (each starts after a barrier), then time an all-to-all of 4 MB per
destination, about 7 ms of elementwise compute, and the two together (the
all-to-all asynchronous): medians of 20 rounds, slowest rank.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROUNDS = 20


def slowest_median(times: list[float]) -> float:
    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return 1e3 * median.item()


def timed(fn) -> float:
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return slowest_median(times)


def worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for size in (1 << 10, 1 << 16, 1 << 20, 1 << 22):
        send = torch.randn(size // 4 * world)
        received = torch.empty_like(send)
        ms = timed(lambda out=received, inp=send: dist.all_to_all_single(out, inp))
        if rank == 0:
            print(f"all_to_all_single, {size / 2**20:8.3f} MiB per destination: {ms:6.2f} ms")
    send = torch.randn((1 << 20) * world)
    received = torch.empty_like(send)
    work = torch.randn(2000, 2000)

    def compute() -> None:
        for _ in range(3):
            work.mul_(1.0000001).add_(1e-9)

    def both() -> None:
        pending = dist.all_to_all_single(received, send, async_op=True)
        compute()
        pending.wait()

    alone = timed(lambda: dist.all_to_all_single(received, send))
    busy, together = timed(compute), timed(both)
    if rank == 0:
        print(
            f"4 MiB per destination: all-to-all {alone:.2f} ms, compute {busy:.2f} ms, "
            f"both at once {together:.2f} ms (one after the other: {alone + busy:.2f} ms)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, (2, os.path.join(tmp, "store")), nprocs=2, start_method="spawn")
