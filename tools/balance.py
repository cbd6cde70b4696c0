"""Lookups per rank of plans on skewed ids, measured with simulate.

    .venv/bin/python tools/balance.py configs/criteo_1tb.yaml --world-sizes 8 64

For each world size, each plan simulated over 2 batches of every rank's own data:
the planner's plan without and with measured traffic (``measure_traffic``, 4
batches), and every table row-wise over all ranks: even, cut by the traffic, and cut
by the traffic after its hot rows are copied on every rank
(``planner.lookup_balanced_plan``, as ``plan --balance-lookups`` makes it: a table no
cut balances copied whole, row blocks spread over the ranks by their bytes).
Prints the slowest rank's lookups (ids its TBE receives plus its own batch's ids of
copies) and the bytes they read, each over the mean rank's, and how many tables the
plan copies whole and how many it gives hot rows.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from embshard.app.config import load_config
from embshard.app.planning import lookup_balanced_plan, measure_traffic, plan_config
from embshard.app.simulate import simulate
from embshard.plan.specs import DataParallel, RowWise, ShardingPlan, row_wise
from embshard.planner.traffic import balanced_sizes


def slowest_over_mean(values: list[int]) -> float:
    return max(values) / (sum(values) / len(values))


def balance(config_path: str, world: int, plan: ShardingPlan) -> tuple[float, float]:
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
        stats = measure_traffic(config, world, 4)
        plans = {
            "planner, even": plan_config(config, world)[0],
            "planner, traffic": plan_config(config, world, stats=stats)[0],
            "row-wise, even": ShardingPlan({t.name: row_wise() for t in config.tables}),
            "row-wise, traffic": ShardingPlan(
                {n: row_wise(balanced_sizes(t, world)) for n, t in stats.tables.items()}
            ),
            "row-wise, traffic, hot rows": lookup_balanced_plan(config, world, stats)[0],
        }
        for label, plan in plans.items():
            specs = plan.tables.values()
            copies = sum(isinstance(s, DataParallel) for s in specs)
            hot = sum(isinstance(s, RowWise) and bool(s.hot_rows) for s in specs)
            rows, read = balance(args.config, world, plan)
            print(
                f"W={world} {label:<28} slowest/mean rank: lookups {rows:.2f}, bytes looked "
                f"up {read:.2f} ({copies} tables copied, {hot} with hot rows)",
                flush=True,
            )


if __name__ == "__main__":
    main()
