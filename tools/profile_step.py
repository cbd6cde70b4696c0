"""Where a training step spends its time (embshard or TorchRec): cProfile of rank 0.

    .venv/bin/python tools/profile_step.py --world-size 2 --workload a --plan table_wise
    .venv/bin/python tools/profile_step.py --library torchrec ...   (TorchRec's DMP)

Starts W gloo processes (one thread each) on the benchmark's tables and inputs
(embshard/bench.py), trains 5 warm-up steps, then profiles 25 steps on rank 0 and
prints the functions with the most time of their own, in ms per step. With
``--library torchrec`` it profiles TorchRec's DistributedModelParallel on the same
plan, as the benchmark builds it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embshard import bench

WARMUP, STEPS = 5, 25


def worker(
    rank: int, world: int, store: str, workload: str, plan_name: str, rows: int, library: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    from torchrec import EmbeddingBagCollection

    import embshard

    configs = bench.table_configs(workload)
    plan = bench.make_plan(plan_name, configs, world)
    if library == "torchrec":
        model = bench.build_torchrec(configs, plan, world)
    else:
        model = embshard.shard(EmbeddingBagCollection(tables=configs, device="meta"), plan)
    batches = bench.make_inputs(workload, rank, WARMUP + STEPS)
    profiler = cProfile.Profile()
    for step, batch in enumerate(batches):
        if step == WARMUP:
            profiler.enable()
        bench.pooled(model, batch).sum().backward()
    profiler.disable()
    if rank == 0:
        stats = pstats.Stats(profiler).stats
        total = sum(tottime for _, _, tottime, _, _ in stats.values())
        print(f"{library} W={world} {workload} {plan_name}: {1e3 * total / STEPS:.1f} ms a step")
        print("  own ms/step  calls/step  function")
        ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:rows]
        for (path, line, name), (_, calls, tottime, _, _) in ranked:
            where = name if path == "~" else f"{os.path.basename(path)}:{line}({name})"
            print(f"  {1e3 * tottime / STEPS:11.2f}  {calls / STEPS:10.0f}  {where}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workload", default="a", choices=list(bench.WORKLOADS))
    parser.add_argument("--plan", default="table_wise", choices=bench.PLANS)
    parser.add_argument("--rows", type=int, default=12, help="functions to print")
    parser.add_argument("--library", default="embshard", choices=["embshard", "torchrec"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        worker_args = (args.world_size, store, args.workload, args.plan, args.rows, args.library)
        mp.start_processes(worker, worker_args, nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
