"""Where each rank's embshard training step goes, phase by phase, on the bench's inputs.

    .venv/bin/python tools/step_timeline.py --world-size 2 --workload d --ids power-law \
        --plans table_wise row_wise column_wise mixed

Starts W gloo processes (one thread each), builds embshard as the benchmark does
(tools/bench/), and times ``--steps`` training steps after 5 warm-up steps, the
ranks starting each step together. The step's four all-to-alls and its TBE call are
its landmarks: every phase runs from one landmark to the next, so the phases add up
to the step. Prints, per plan and rank, each phase's median ms as a markdown table;
the step column is the median step, not the sum of the phases' medians. Profilers
charge the waits of a blocking collective to whatever Python frame called it;
landmarks do not, and with every rank's row side by side, a phase that is one rank
waiting for another shows as the difference.
"""

from __future__ import annotations

import argparse
import os
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

# Each phase ends at a landmark: the start or end of an all-to-all (in the order the
# step makes them: counts, ids started and waited on, pooled rows, their gradients),
# of the TBE forward, of the forward, or of the step.
PHASES = (
    ("check and route", "counts start"),
    ("counts exchange", "counts end"),
    ("pack ids", "ids start"),
    ("ids all-to-all", "ids arrived"),
    ("unpack ids", "tbe start"),
    ("TBE forward", "tbe end"),
    ("pooled all-to-all", "pooled end"),
    ("place columns", "forward end"),
    ("loss, gradient columns", "gradients start"),
    ("gradient all-to-all", "gradients end"),
    ("TBE backward, update", "step end"),
)
ALL_TO_ALLS = ("counts", "ids", "pooled", "gradients")


class Landmarks:
    """Times of one step's landmarks: while entered, wraps ``all_to_all_single`` and
    the model's TBE call."""

    def __init__(self, model) -> None:
        self.times: dict[str, float] = {}
        self.calls = 0
        self._storage = model._storage
        self._all_to_all = dist.all_to_all_single
        self._tbe = model._storage.tbe

    def __enter__(self) -> Landmarks:
        dist.all_to_all_single = self._timed_all_to_all
        self._storage.tbe = self._timed_tbe
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._all_to_all
        self._storage.tbe = self._tbe

    def start(self) -> float:
        self.times.clear()
        self.calls = 0
        return time.perf_counter()

    def _timed_all_to_all(self, *args, **kwargs):
        if self.calls == len(ALL_TO_ALLS):
            raise RuntimeError(f"more than {len(ALL_TO_ALLS)} all-to-alls in a step")
        name = ALL_TO_ALLS[self.calls]
        self.calls += 1
        self.times[f"{name} start"] = time.perf_counter()
        work = self._all_to_all(*args, **kwargs)
        if not kwargs.get("async_op"):
            self.times[f"{name} end"] = time.perf_counter()
            return work
        return _TimedWork(work, self.times)

    def _timed_tbe(self, *args, **kwargs):
        self.times["tbe start"] = time.perf_counter()
        pooled = self._tbe(*args, **kwargs)
        self.times["tbe end"] = time.perf_counter()
        return pooled


class _TimedWork:
    """The ids all-to-all's work: its wait's end is the "ids arrived" landmark."""

    def __init__(self, work, times: dict[str, float]) -> None:
        self._work, self._times = work, times

    def wait(self) -> bool:
        done = self._work.wait()
        self._times["ids arrived"] = time.perf_counter()
        return done


def worker(rank: int, world: int, store: str, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    configs = bench.table_configs(args.workload)
    batches = bench.make_inputs(args.workload, rank, WARMUP + args.steps, args.ids)
    rows = {}
    for plan_name in args.plans:
        model = bench.build("embshard", configs, bench.make_plan(plan_name, configs, world), world)
        phases: dict[str, list[float]] = {name: [] for name, _ in PHASES}
        steps = []
        with Landmarks(model) as landmarks:
            for step, batch in enumerate(batches):
                dist.barrier()
                start = landmarks.start()
                loss = bench.loss(model, batch)
                landmarks.times["forward end"] = time.perf_counter()
                loss.backward()
                landmarks.times["step end"] = time.perf_counter()
                if landmarks.calls != len(ALL_TO_ALLS):
                    raise RuntimeError(
                        f"{plan_name}: {landmarks.calls} all-to-alls in a step, "
                        f"not {len(ALL_TO_ALLS)}"
                    )
                if step < WARMUP:
                    continue
                steps.append(landmarks.times["step end"] - start)
                for name, landmark in PHASES:
                    phases[name].append(landmarks.times[landmark] - start)
                    start = landmarks.times[landmark]
        rows[plan_name] = {name: 1e3 * statistics.median(t) for name, t in phases.items()}
        rows[plan_name]["step"] = 1e3 * statistics.median(steps)
    results.put((rank, rows))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workload", default="d", choices=[w for w in bench.WORKLOADS if w != "e"])
    parser.add_argument("--plans", nargs="+", default=list(bench.PLANS), choices=bench.PLANS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ids", default="uniform", choices=bench.ID_LAWS)
    args = parser.parse_args()
    if args.world_size < 2:
        parser.error("--world-size must be 2 or more: on one rank no all-to-all runs")
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.get_context("spawn").SimpleQueue()
        worker_args = (args.world_size, os.path.join(tmp, "store"), args, results)
        mp.start_processes(worker, worker_args, nprocs=args.world_size, start_method="spawn")
        ranks = sorted(results.get() for _ in range(args.world_size))
    names = [name for name, _ in PHASES] + ["step"]
    print("| plan | rank | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 2) + "|")
    for plan_name in args.plans:
        for rank, rows in ranks:
            cells = [f"{rows[plan_name][n]:.2f}" for n in names]
            print(f"| {plan_name} | {rank} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
