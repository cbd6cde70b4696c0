"""The planner's estimated step time against the bench's measured one.

    .venv/bin/python tools/calibrate.py docs/bench.json docs/bench_d.json docs/bench_e.json

For every timed cell at W = 2 of the given bench results (``tools/bench.py --json``, or
such results keyed by id law): the cost model's estimate of a step, its slowest rank
(``plan_loads``) plus what every rank pays alike (``CostModel.base_cost``), for 2
ranks, the workload's batch per rank and mean ids a bag, against embshard's
measured median step. The topology is the CPU defaults, with ``--set KEY=VALUE``
overrides (a config's ``topology:`` keys, e.g. ``--set lookup_bandwidth=4e9``). The
model knows no id law: its estimate is the same for uniform and power-law ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import WORKLOADS, make_plan, table_configs

from embshard.planner.cost import CostModel
from embshard.planner.search import plan_loads
from embshard.planner.tables import planned_tables
from embshard.planner.topology import Topology


def estimate_ms(workload: str, plan_name: str, world: int, **topology: float) -> float:
    configs = table_configs(workload)
    spec = WORKLOADS[workload]
    pooling = {c.name: float(p) for c, (_, _, p) in zip(configs, spec["tables"])}
    topology, batch = Topology.cpu(world, **topology), spec["batch"]
    loads = plan_loads(make_plan(plan_name, configs, world), configs, topology, batch, "sgd",
                       mean_pooling=pooling)  # fmt: skip
    base = CostModel(topology, batch, "sgd").base_cost(planned_tables(configs, pooling))
    return 1e3 * (max(load.cost for load in loads) + base)


def timed_cells(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    runs = [data] if "results" in data else list(data.values())
    return [r for run in runs for r in run["results"] if r.get("outputs_equal")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench JSON files")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="topology overrides, in bytes/s and seconds")  # fmt: skip
    args = parser.parse_args()
    overrides = {key: float(value) for key, value in (s.split("=", 1) for s in args.set)}
    print("| workload | ids | plan | measured ms | estimated ms | measured / estimated |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in args.results:
        for r in timed_cells(path):
            if r["world_size"] != 2:
                continue
            measured = r["embshard"]["median_ms"]
            estimated = estimate_ms(r["workload"], r["plan"], 2, **overrides)
            print(f"| {r['workload']} | {r['ids']} | {r['plan']} | {measured:.1f} | "
                  f"{estimated:.1f} | {measured / estimated:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
