"""Working ops and host syncs of a training step, embshard against TorchRec's
DistributedModelParallel, on the bench's tables, plans and inputs.

    .venv/bin/python tools/op_count.py --world-sizes 1 2 4 --workloads d --ids power-law
    .venv/bin/python tools/op_count.py --world-sizes 2 --plans mixed --by-op
    .venv/bin/python tools/op_count.py --world-sizes 2 --plans mixed --by-site

For each world size it starts W gloo processes as the bench does (tools/bench/), builds
both libraries on each cell, runs a warm-up step, then counts steps (forward, backward
with the fused update) on different ids. It prints, per workload, a table of plan x
world size: the most ops of any rank a step, embshard / TorchRec, and one of host
syncs. ``--by-op`` adds each cell's ops by name, rank by rank, forward (F) and
backward (B) apart; ``--by-site`` the same by the Python function that made each
op. What counts is defined in tools/bench/ops.py (and docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click
from bench.command import ListOptions, cell_options

from embshard.app.cli import OutputFile


def count_cells(workloads, plans, ids: str, steps: int, sites: bool) -> list[dict]:
    from bench.ops import count_case

    return [count_case(w, p, ids, steps, sites) for w in workloads for p in plans]


def most(record: dict, library: str, figure: str) -> str:
    """A library's figure (``ops`` or ``syncs``) in a cell, the most of any rank;
    starred where another counted step gave a different count."""
    value = max(getattr(counted, figure) for counted in record[library])
    return f"{value}" + ("" if record[f"{library}_steps_agree"] else "*")


def table(records: list[dict], workload: str, figure: str) -> list[str]:
    """A workload's ``figure`` as a markdown table, plan x world size."""
    cells = {(r["plan"], r["world_size"]): r for r in records if r["workload"] == workload}
    worlds = sorted({world for _, world in cells})
    lines = ["| plan | " + " | ".join(f"W = {w}" for w in worlds) + " |"]
    lines.append("| --- " * (1 + len(worlds)) + "|")
    for plan in dict.fromkeys(plan for plan, _ in cells):
        row = [cells[(plan, w)] for w in worlds]
        row = [
            "skipped"
            if "skipped" in r
            else f"{most(r, 'embshard', figure)} / {most(r, 'torchrec', figure)}"
            for r in row
        ]
        lines.append(f"| {plan} | " + " | ".join(row) + " |")
    return lines


def breakdown(record: dict) -> list[str]:
    """A cell's ops by name (or site), rank by rank, both libraries, most first."""
    columns = [
        (lib, rank, counted)
        for lib in ("embshard", "torchrec")
        for rank, counted in enumerate(record[lib])
    ]
    rows = {}
    for phase in ("forward", "backward"):
        for _, _, counted in columns:
            for op in getattr(counted, phase):
                rows[(phase[0].upper(), op)] = [getattr(c, phase).get(op, 0) for _, _, c in columns]
    labels = " ".join(f"{lib[0] + ':r' + str(rank):>5}" for lib, rank, _ in columns)
    lines = [
        f"W={record['world_size']} {record['workload']} {record['plan']} {record['ids']} ids: "
        "ops a step on each rank (e: embshard, t: TorchRec; F forward, B backward)",
        f"{labels}  op",
    ]
    ordered = sorted(rows.items(), key=lambda item: (-max(item[1]), item[0]))
    for (phase, op), counts in ordered:
        lines.append(" ".join(f"{c:5d}" for c in counts) + f"  {phase} {op}")
    lines.append(" ".join(f"{c.ops:5d}" for _, _, c in columns) + "  all")
    return lines


@click.command(cls=ListOptions)
@cell_options(world_sizes=(1, 2), workloads=("d",))
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Counted steps, each on other ids: they should count the same.",
)
@click.option("--by-op", is_flag=True, help="Each cell's ops by name, rank by rank.")
@click.option("--by-site", is_flag=True, help="Each cell's ops by name and making function.")
@click.option(
    "--json",
    "json_path",
    type=OutputFile(),
    help="Write every count, op by op, here.",
)
def op_count(world_sizes, workloads, plans, ids, steps, by_op, by_site, json_path) -> None:
    """Working ops and host syncs a training step, embshard / TorchRec."""
    from bench.launch import in_world

    records = []
    for world in world_sizes:
        records += in_world(world, count_cells, workloads, plans, ids, steps, by_site)
    print(
        "Working ops a step (forward, backward with the fused update), the most of any "
        "rank, embshard / TorchRec (* where the counted steps differ):"
    )
    for workload in workloads:
        print(f"\nworkload ({workload}), {ids} ids\n" + "\n".join(table(records, workload, "ops")))
    print("\nHost syncs a step, embshard / TorchRec:")
    for workload in workloads:
        print(f"\nworkload ({workload})\n" + "\n".join(table(records, workload, "syncs")))
    if by_op or by_site:
        for record in records:
            if "skipped" not in record:
                print("\n" + "\n".join(breakdown(record)))
    if json_path:
        plain = [
            {
                k: [dataclasses.asdict(c) for c in v] if k in ("embshard", "torchrec") else v
                for k, v in r.items()
            }
            for r in records
        ]
        Path(json_path).write_text(json.dumps(plain, indent=2))


if __name__ == "__main__":
    op_count(prog_name="tools/op_count.py")
