"""The bench's command line: ``tools/bench.py`` runs it, and ``embshard bench`` runs it
from a source checkout, with the same options."""

from __future__ import annotations

import click

from embshard.app.cli import PLOT_SUFFIXES, OutputFile

from .workloads import COMM_PRECISIONS, ID_LAWS, PLANS, WORKLOADS


class ListOptions(click.Command):
    """A command whose ``multiple`` options take their values after one flag, as
    argparse's ``nargs="+"`` does (``--world-sizes 2 4``), or a flag each."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        lists = {name for p in self.params if getattr(p, "multiple", False) for name in p.opts}
        spread, flag = [], None
        for arg in args:
            if arg.startswith("-"):
                name = arg.split("=", 1)[0]  # --world-sizes=2 4 too
                flag = name if name in lists else None
            elif flag is not None and spread[-1] != flag:
                spread.append(flag)
            spread.append(arg)
        return super().parse_args(ctx, spread)


def cell_options(world_sizes: tuple[int, ...], workloads: tuple[str, ...] = tuple(WORKLOADS)):
    """The options that pick the bench's cells (world sizes, workloads, plans, id law),
    with these defaults: ``tools/bench.py``'s and ``tools/op_count.py``'s."""
    every = workloads == tuple(WORKLOADS)
    options = [
        click.option(
            "--world-sizes",
            type=click.IntRange(min=1),
            multiple=True,
            default=world_sizes,
            show_default=True,
            metavar="N...",
            help="Ranks of each run.",
        ),
        click.option(
            "--workloads",
            type=click.Choice(list(WORKLOADS)),
            multiple=True,
            default=workloads,
            show_default=not every,
            metavar="W...",
            help="a: 8 tables of 100k x 64, ~20 ids a bag; b: 64 of 10k x 32, ~5 ids; c: "
            "Criteo Kaggle's 26 (rows up to 1M) x 64, 1 id; d: Criteo Kaggle's 26 (rows up to "
            "400k) x 16, 32 or 64, MLPerf DLRMv2's 1 to 100 ids a bag, batch 512; e: "
            "EmbeddingCollection, 8 tables of 1k to 400k x 64, sequences of ~5 to ~50 ids "
            "(~150 a sample), batch 512." + (" Default: all." if every else ""),
        ),
        click.option(
            "--plans",
            type=click.Choice(PLANS),
            multiple=True,
            default=tuple(PLANS),
            metavar="P...",
            help=f"Every table sharded one way ({', '.join(PLANS[:3])}), or mixed: the three "
            "in turn. Default: all.",
        ),
        click.option(
            "--ids",
            type=click.Choice(ID_LAWS),
            default="uniform",
            show_default=True,
            help="Ids uniform over each table's rows, or a power law as embshard's synthetic "
            "data draws them (low ids hot).",
        ),
    ]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


@click.command(cls=ListOptions)
@cell_options(world_sizes=(2, 4))
@click.option(
    "--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Timed steps."
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="Untimed steps before them.",
)
@click.option(
    "--comm-precision",
    type=click.Choice(COMM_PRECISIONS),
    default="fp32",
    show_default=True,
    help="Precision of the pooled all-to-alls, both ways, in both libraries.",
)
@click.option(
    "--json",
    "json_path",
    type=OutputFile(),
    default="bench.json",
    show_default=True,
    help="The results, every figure of every cell.",
)
@click.option("--png", type=OutputFile(*PLOT_SUFFIXES), help="Plot samples/s per plan.")
def bench(
    world_sizes: tuple[int, ...],
    workloads: tuple[str, ...],
    plans: tuple[str, ...],
    steps: int,
    warmup: int,
    comm_precision: str,
    ids: str,
    json_path: str,
    png: str | None,
) -> None:
    """Benchmark embshard against TorchRec's DistributedModelParallel, side by side.

    For each world size, W gloo processes on this host (one thread each) train both
    libraries on the same tables, weights, inputs and plan, with the same fused
    optimizer, after checking that their outputs agree; steps alternate between the
    two. Each cell's line gives both libraries' step (the slowest rank's median,
    p10-p90), collectives and bytes a step, their throughput ratio, and embshard's
    floor: a bare TBE doing the same lookups and update (each rank alone) plus the
    step's collectives replayed alone. docs/performance.md explains every figure.
    """
    from .launch import Options, run

    run(Options(world_sizes, workloads, plans, steps, warmup, comm_precision, ids, json_path, png))
