"""Lookups per rank of the planner's plans on skewed ids, measured with simulate.

    .venv/bin/python tools/balance.py configs/criteo_1tb.yaml --world-sizes 8 64

For each world size: the planner's plan without and with measured traffic
(``measure_traffic``, 4 batches), each simulated over 2 batches of every rank's own
data; prints the slowest rank's lookups (ids its TBE receives plus its own batch's
ids of data-parallel tables) over the mean rank's, and the plan's copies.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from embshard.config import load_config
from embshard.plan import DataParallel
from embshard.planner import plan_config
from embshard.simulate import simulate
from embshard.traffic import measure_traffic


def lookups_ratio(config_path: str, world: int, plan) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        plan.save(Path(tmp) / "plan.yaml")
        report = simulate(config_path, world, str(Path(tmp) / "plan.yaml"), batches=2)
    lookups = [r.ids_received + r.ids_local for r in report.ranks]
    return max(lookups) / (sum(lookups) / len(lookups))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    config = load_config(args.config)
    for world in args.world_sizes:
        for label, stats in (("even", None), ("traffic", measure_traffic(config, world, 4))):
            plan, _ = plan_config(config, world, stats=stats)
            copies = sum(isinstance(s, DataParallel) for s in plan.tables.values())
            ratio = lookups_ratio(args.config, world, plan)
            print(f"W={world} {label:<8} slowest/mean lookups {ratio:.2f} ({copies} copied tables)")


if __name__ == "__main__":
    main()
