"""The bench's runs: a gloo world of each size in turn (``in_world``, which the other
tools use too), its cells, and the records written."""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .case import bench_case
from .floor import gather_bandwidth
from .report import plot, summary_line
from .workloads import PLANS, WORKLOADS


@dataclass(frozen=True)
class Options:
    """What the bench runs: the options of ``tools/bench.py`` (and ``embshard bench``),
    the same names."""

    world_sizes: tuple[int, ...] = (2, 4)
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    plans: tuple[str, ...] = tuple(PLANS)
    steps: int = 20  # timed training steps
    warmup: int = 5  # untimed steps before them
    comm_precision: str = "fp32"
    ids: str = "uniform"
    json: str = "bench.json"
    png: str | None = None


def quiet_worker() -> None:
    """Silence what a worker would print that says nothing of the run: TorchRec's
    calls of the collectives torch 2.13 deprecates (a FutureWarning each) and, in
    TorchRec 1.6, of ``_get_pg_default_device`` (UserWarnings); torch 2.11's profiler
    saying at its first start that it keeps one cycle's events; kineto's USDT lines at
    every start and stop of the profiler that counts the collectives
    (``per_step_comm``); and FBGEMM 1.6's warning at import, once per library, that its
    own table of torch versions stops at FBGEMM 1.5 (1.6 is torch 2.11's pairing).
    Kineto reads its level when a profile starts; 6 is above USDT's 5, its highest
    (its errors, 4, are below USDT's level already)."""
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torchrec\.distributed\.types")
    warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    logging.getLogger().addFilter(
        lambda record: "_fbgemm_torch_compat_table" not in record.getMessage()
    )


def _rank_main(rank: int, world: int, tmp: str, job: Callable, args: tuple) -> None:
    quiet_worker()  # first: embshard's import imports FBGEMM
    import torch
    import torch.distributed as dist

    from embshard.runtime.teardown import shutdown

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))  # fmt: skip
    result = job(*args)
    if rank == 0:
        Path(tmp, "result.pickle").write_bytes(pickle.dumps(result))
    shutdown()  # TorchRec's DMP holds gloo groups that can abort a normal exit


def in_world(world: int, job: Callable, *args):
    """``job(*args)`` on every rank of a fresh gloo world of ``world`` processes on this
    host (one thread each), as the bench runs them; returns rank 0's result. ``job``
    must be a module-level function (the processes are spawned)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(world, tmp, job, args), nprocs=world,
                           start_method="spawn")  # fmt: skip
        return pickle.loads(Path(tmp, "result.pickle").read_bytes())


def bench_cells(args: Options) -> list[dict]:
    """Every cell of ``args`` in this rank's world, rank 0 printing a line for each."""
    import torch.distributed as dist

    records = []
    for workload in args.workloads:
        for plan_name in args.plans:
            record = bench_case(workload, plan_name, args.steps, args.warmup,
                                args.comm_precision, args.ids)  # fmt: skip
            records.append(record)
            if dist.get_rank() == 0:
                print(summary_line(record), flush=True)
    return records


def run(options: Options) -> list[dict]:
    """Run the benchmark: a gloo world of each size in turn, its records written to
    ``options.json`` (and plotted to ``options.png``); returns them."""
    limit = gather_bandwidth()
    print(f"machine: random-row gather bandwidth {limit / 1e9:.2f} GB/s (one thread)", flush=True)
    records = []
    for world in options.world_sizes:
        records += in_world(world, bench_cells, options)
    for r in records:
        if r.get("outputs_equal"):
            r["lookup_fraction_of_gather_limit"] = r["lookup_gather_gbps"] * 1e9 / limit
    Path(options.json).write_text(
        json.dumps({"gather_gbps": limit / 1e9, "results": records}, indent=2)
    )
    if options.png:
        plot(records, options.png)
    print(f"wrote {options.json}" + (f" and {options.png}" if options.png else ""), file=sys.stderr)
    return records
