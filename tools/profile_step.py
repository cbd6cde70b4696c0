"""Where a training step spends its time (embshard or TorchRec): cProfile of rank 0.

    .venv/bin/python tools/profile_step.py --world-size 2 --workload a --plan table_wise
    .venv/bin/python tools/profile_step.py --library torchrec ...   (TorchRec's DMP)
    .venv/bin/python tools/profile_step.py --library both --workload d --ids power-law ...

Starts W gloo processes (one thread each) on the benchmark's tables and inputs
(tools/bench/), trains 5 warm-up steps, then profiles ``--steps`` steps (25) on
rank 0 and prints the functions with the most time of their own, in ms per step.
With ``--library torchrec`` it profiles TorchRec's DistributedModelParallel on the
same plan, as the benchmark builds it; with ``--library both``, both libraries in the
same processes, their steps alternating as in the benchmark, so that a busy machine
slows both alike. ``--duplicates`` also prints, per table, the
fraction of the first profiled step's ids (all ranks' samples) that repeat an id of
the same table: what deduplicating the lookups could save.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
from datetime import timedelta

import bench
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embshard.runtime.teardown import shutdown

WARMUP = 5


def table_duplicates(workload: str, world: int, ids: str) -> list[float]:
    """Per table, the fraction of one step's ids over all ranks' samples that repeat."""
    steps = [
        bench.make_inputs(workload, r, WARMUP + 1, ids)[WARMUP].to_dict() for r in range(world)
    ]
    fractions = []
    for key in steps[0]:
        values = torch.cat([batch[key].values() for batch in steps])
        fractions.append(bench.repeated_ids(values) / values.numel())
    return fractions


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    workload, plan_name, steps = args.workload, args.plan, args.steps
    libraries = bench.LIBRARIES if args.library == "both" else [args.library]
    configs = bench.table_configs(workload)
    plan = bench.make_plan(plan_name, configs, world)
    models = {library: bench.build(library, configs, plan, world) for library in libraries}
    batches = bench.make_inputs(workload, rank, WARMUP + steps, args.ids)
    profilers = {library: cProfile.Profile() for library in libraries}
    for step, batch in enumerate(batches):
        for library, model in models.items():
            dist.barrier()  # neither library's waits include the other's imbalance
            if step >= WARMUP:
                profilers[library].enable()
            bench.loss(model, batch).backward()
            profilers[library].disable()
    if rank == 0:
        for library, profiler in profilers.items():
            title = f"{library} W={world} {workload} {plan_name} {args.ids} ids"
            print_profile(profiler, title, steps, args.rows)
        if args.duplicates:
            fractions = table_duplicates(workload, world, args.ids)
            print("repeated ids per table: " + " ".join(f"{f:.2f}" for f in fractions))
    shutdown()


def print_profile(profiler: cProfile.Profile, title: str, steps: int, rows: int) -> None:
    stats = pstats.Stats(profiler).stats
    total = sum(tottime for _, _, tottime, _, _ in stats.values())
    print(f"{title}: {1e3 * total / steps:.1f} ms a step")
    print("  own ms/step  calls/step  function")
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:rows]
    for (path, line, name), (_, calls, tottime, _, _) in ranked:
        where = name if path == "~" else f"{os.path.basename(path)}:{line}({name})"
        print(f"  {1e3 * tottime / steps:11.2f}  {calls / steps:10.0f}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workload", default="a", choices=list(bench.WORKLOADS))
    parser.add_argument("--plan", default="table_wise", choices=bench.PLANS)
    parser.add_argument("--rows", type=int, default=12, help="functions to print")
    parser.add_argument("--library", default="embshard", choices=[*bench.LIBRARIES, "both"])
    parser.add_argument("--steps", type=int, default=25, help="profiled steps")
    parser.add_argument("--ids", default="uniform", choices=bench.ID_LAWS)
    parser.add_argument("--duplicates", action="store_true", help="print repeated ids per table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        worker_args = (args.world_size, store, args)
        mp.start_processes(worker, worker_args, nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
