"""Each library alone on the benchmark's tables: peak resident memory and step time.

    .venv/bin/python tools/bench_alone.py --workload d --plans table_wise mixed --steps 20

The benchmark runs both libraries in the same processes, so their memory peaks mix,
and it starts every step on all ranks together. Here every (plan, library) pair gets
W fresh gloo processes (one thread each) that build only that library, as the
benchmark builds it (tools/bench/), and train ``--steps`` steps on the
benchmark's inputs back to back, as a training loop runs them. Each rank reports its
peak resident memory (ru_maxrss) before the build (imports, process group and
inputs), after the build, and after the steps; the median over the steps after the
first five of the slowest rank's step time checks the benchmark's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from datetime import timedelta

import bench
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embshard.runtime.teardown import shutdown

WARMUP = 5


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(rank: int, world: int, store: str, library: str, plan_name: str, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    configs = bench.table_configs(args.workload)
    plan = bench.make_plan(plan_name, configs, world)
    batches = bench.make_inputs(args.workload, rank, args.steps, args.ids)
    before = peak_mib()
    model = bench.build(library, configs, plan, world)
    built = peak_mib()
    times = []
    for batch in batches:
        start = time.perf_counter()
        bench.loss(model, batch).backward()
        times.append(time.perf_counter() - start)
    step_ms = 1e3 * statistics.median(bench.slowest(times[WARMUP:]))
    results.put((rank, before, built, peak_mib(), step_ms))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workload", default="d", choices=list(bench.WORKLOADS))
    parser.add_argument("--plans", nargs="+", default=["table_wise", "mixed"], choices=bench.PLANS)
    parser.add_argument("--libraries", nargs="+", default=bench.LIBRARIES, choices=bench.LIBRARIES)
    parser.add_argument("--ids", default="uniform", choices=bench.ID_LAWS)
    parser.add_argument("--steps", type=int, default=20, help="training steps after the build")
    args = parser.parse_args()
    world = args.world_size
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    print(f"W={world} workload {args.workload}, {args.ids} ids, {args.steps} steps: "
          "peak RSS MiB before build / after build / after steps; median step ms "
          "(slowest rank, after the warm-up)")  # fmt: skip
    for plan_name in args.plans:
        for library in args.libraries:
            results = mp.get_context("spawn").SimpleQueue()
            with tempfile.TemporaryDirectory() as tmp:
                store = os.path.join(tmp, "store")
                mp.start_processes(worker, (world, store, library, plan_name, args, results),
                                   nprocs=world, start_method="spawn")  # fmt: skip
            for rank, before, built, trained, step_ms in sorted(
                results.get() for _ in range(world)
            ):
                memory = f"{before:7.0f} {built:7.0f} {trained:7.0f}"
                print(f"{plan_name:<11} {library:<8} rank {rank}: {memory}  {step_ms:7.1f} ms",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
