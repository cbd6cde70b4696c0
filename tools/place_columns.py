"""The pooled column placement alone: the ops it runs and its CPU time, per plan.

    .venv/bin/python tools/place_columns.py --workload d --world-sizes 2 4

For each plan and world size of a bench workload, the placement every rank runs on
the pooled blocks it receives (``embshard/runtime/columns.py``), on random blocks of
the workload's batch, in one process and one thread: the width of the runs it moves,
the ops of its forward and of its backward (views and metadata left out; the backward
given a contiguous gradient), and the median [p10-p90] ms of each over ``--repeats``
calls, after the first call has built its indices.
"""

from __future__ import annotations

import argparse
import time

import bench
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from embshard.runtime.columns import ColumnPlacement
from embshard.runtime.routes import build_routes
from embshard.runtime.scratch import Scratch

_METADATA = frozenset({"aten::new_empty", "aten::set_"})


class Ops(TorchDispatchMode):
    """The ops that do work, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._schema.name not in _METADATA:
            self.names.append(func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))


def timed(call, repeats: int) -> str:
    """``call``'s median [p10-p90] ms over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    pick = lambda q: times[int(q * (len(times) - 1))]  # noqa: E731
    return f"{pick(0.5):.3f} [{pick(0.1):.3f}-{pick(0.9):.3f}]"


def measure(workload: str, plan: str, world: int, repeats: int) -> str:
    configs = bench.table_configs(workload)
    resolved = bench.make_plan(plan, configs, world).resolve(configs, world)
    routes = build_routes(configs, resolved, world, weighted=False)
    placement = ColumnPlacement(routes.column_targets(), routes.output_dim)
    batch, scratch = bench.WORKLOADS[workload]["batch"], Scratch()
    sources = torch.randn(batch * sum(placement.block_dims))
    grad = torch.randn(batch, routes.output_dim)
    forward = lambda: placement.place(sources, batch, scratch)  # noqa: E731
    backward = lambda: placement.gradients(grad, scratch)  # noqa: E731
    forward(), backward()  # builds the indices
    with Ops() as forward_ops:
        forward()
    with Ops() as backward_ops:
        backward()
    return (
        f"| {world} | {plan} | {placement.width} | {', '.join(forward_ops.names)} | "
        f"{timed(forward, repeats)} | {', '.join(backward_ops.names)} | "
        f"{timed(backward, repeats)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="d", choices=["a", "b", "c", "d"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--plans", nargs="+", default=bench.PLANS, choices=bench.PLANS)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| W | plan | run width | forward ops | forward ms | backward ops | backward ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for world in args.world_sizes:
        for plan in args.plans:
            print(measure(args.workload, plan, world, args.repeats), flush=True)


if __name__ == "__main__":
    main()
