"""Lookups per rank of the planner's plans on skewed ids, measured with simulate.

    .venv/bin/python tools/balance.py configs/criteo_1tb.yaml --world-sizes 8 64

For each world size: the planner's plan without and with measured traffic
(``measure_traffic``, 4 batches), each simulated over 2 batches of every rank's own
data; prints the slowest rank's lookups (ids its TBE receives plus its own batch's
ids of data-parallel tables) and the bytes they read, each over the mean rank's, and
how many tables the plan copies to every rank.
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


def slowest_over_mean(values: list[int]) -> float:
    return max(values) / (sum(values) / len(values))


def balance(config_path: str, world: int, plan) -> tuple[float, float]:
    """Slowest over mean rank: lookups (rows read), and the bytes they read."""
    with tempfile.TemporaryDirectory() as tmp:
        plan.save(Path(tmp) / "plan.yaml")
        report = simulate(config_path, world, str(Path(tmp) / "plan.yaml"), batches=2)
    lookups = [r.ids_received + r.ids_local for r in report.ranks]
    return slowest_over_mean(lookups), slowest_over_mean([r.lookup_bytes for r in report.ranks])


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
            rows, read = balance(args.config, world, plan)
            print(
                f"W={world} {label:<8} slowest/mean rank: lookups {rows:.2f}, "
                f"bytes looked up {read:.2f} ({copies} copied tables)"
            )


if __name__ == "__main__":
    main()
