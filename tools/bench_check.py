"""The cost of a batch's check and of its row-wise routing, on one rank's batch of a
bench workload, each timed alone: embshard's CPU kernels against FBGEMM's operations
as embshard calls them where the kernels do not run. The check: embshard's
``torch.ops.embshard.bounds_check`` against FBGEMM's ``bounds_check_indices`` (the
bags' offsets, the ids less one, the check). The routing, every table cut row-wise
into ``--world-size`` even blocks: ``torch.ops.embshard.block_bucketize`` against
FBGEMM's ``block_bucketize_sparse_features`` given the same boundaries.

    .venv/bin/python tools/bench_check.py
    .venv/bin/python tools/bench_check.py --workload d --batch 8192 --ids uniform --world-size 4

One thread, the median of ``--calls`` calls after ``--warmup``; the CPU time of the
process is reported beside the wall time (it holds on a busy machine).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import bench
import click
import torch

from embshard.runtime import native
from embshard.runtime.batch import fbgemm_bounds_check
from embshard.runtime.sparse_ops import BucketBounds, block_bucketize


def timed(call: Callable[[], object], calls: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        call()
    walls, cpus = [], []
    for _ in range(calls):
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {
        "wall_ms": round(statistics.median(walls) * 1e3, 4),
        "cpu_ms": round(statistics.median(cpus) * 1e3, 4),
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workload", default="d", show_default=True, type=click.Choice(bench.WORKLOADS))
@click.option("--batch", default=512, show_default=True, help="samples a rank")
@click.option("--ids", default="power-law", show_default=True, type=click.Choice(bench.ID_LAWS))
@click.option("--calls", default=300, show_default=True)
@click.option("--warmup", default=20, show_default=True)
@click.option("--world-size", default=2, show_default=True, help="row blocks a table")
def main(workload: str, batch: int, ids: str, calls: int, warmup: int, world_size: int) -> None:
    torch.set_num_threads(1)
    spec = dict(bench.WORKLOADS[workload], batch=batch)
    features = bench.make_inputs(spec, 0, 1, ids)[0]
    lengths, values = features.lengths(), features.values()
    lengths = lengths.view(len(features.keys()), -1)
    rows_less_one = torch.tensor([c.num_embeddings - 1 for c in bench.table_configs(spec)])
    problems = torch.empty(1, dtype=torch.int64)

    def fbgemm() -> None:
        fbgemm_bounds_check(lengths, values, rows_less_one, problems)

    routable = torch.empty_like(lengths)

    def kernel() -> None:
        native.bounds_check(lengths, values, rows_less_one, problems, routable)

    blocks = [-(-c.num_embeddings // world_size) for c in bench.table_configs(spec)]
    bounds = BucketBounds.of(
        tuple(tuple(min(b * k, b * world_size) for k in range(world_size + 1)) for b in blocks),
        values.device,
    )

    def fbgemm_bucketize() -> None:
        torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths.view(-1),
            values,
            False,
            False,
            bounds.block_sizes[values.dtype],
            world_size,
            None,
            None,
            -1,
            bounds.boundaries[values.dtype],
        )

    def kernel_bucketize() -> None:
        block_bucketize(lengths.view(-1), values, None, bounds, False)

    report = {"workload": workload, "batch": batch, "ids": values.numel()}
    report["fbgemm"] = timed(fbgemm, calls, warmup)
    report["fbgemm_bucketize"] = timed(fbgemm_bucketize, calls, warmup)
    if native.library() is not None:
        report["embshard_kernel"] = timed(kernel, calls, warmup)
        report["embshard_bucketize"] = timed(kernel_bucketize, calls, warmup)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
