"""The ``embshard`` command line.

Commands import torch, TorchRec and matplotlib only when they run, so that ``--help``
is quick.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import click

PLOT_SUFFIXES = (".png",)


def output_problem(path: str, suffixes: Sequence[str] = ()) -> str | None:
    """Why a command could not write ``path``, found before it does any work; None if
    it can."""
    suffix, directory = Path(path).suffix, Path(path).parent
    if suffixes and suffix.lower() not in suffixes:
        kind = f"{suffix} files" if suffix else "files without a suffix"
        return f"{path}: cannot write {kind}; supported: {', '.join(suffixes)}"
    if not directory.is_dir():
        return f"{path}: the directory {directory} does not exist"
    if not os.access(directory, os.W_OK):
        return f"{path}: the directory {directory} is not writable"
    return None


class OutputFile(click.Path):
    """A file the command writes: ``output_problem`` checked when the arguments are read."""

    def __init__(self, *suffixes: str) -> None:
        super().__init__(dir_okay=False)
        self.suffixes = suffixes

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        problem = output_problem(os.fspath(path), self.suffixes)
        if problem:
            self.fail(problem, param, ctx)
        return path


class GroupSizeParam(click.ParamType):
    """A sharding group's ranks (a whole number of at least 1) or ``auto``."""

    name = "G|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        if not (value.isdigit() and int(value) >= 1):
            self.fail(f"{value!r} is neither a whole number of at least 1 nor auto", param, ctx)
        return int(value)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Shard the embedding tables of TorchRec models across torch.distributed ranks."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Processes (ranks) on this host.",
)
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint.")
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Restart every rank this many times when one fails; restarts resume.",
)
@click.option(
    "--nnodes",
    default="1",
    show_default=True,
    metavar="N|MIN:MAX",
    callback=lambda ctx, param, value: _host_counts(value),
    help="Hosts in the job, each running this command; MIN:MAX lets hosts leave and join.",
)
@click.option(
    "--rdzv-endpoint",
    metavar="HOST:PORT",
    help="Where the hosts meet (torchrun's c10d rendezvous, hosted by the agent on HOST); "
    "needed for more than one host.",
)
@click.option(
    "--rdzv-id",
    metavar="ID",
    help="The job's name, the same on every host; a job continues from the checkpoints it "
    "saved itself. Default: from the endpoint and the config's file name.",
)
@click.option(
    "--node-rank",
    type=click.IntRange(min=0),
    help="This host's place in the job (default: the rendezvous gives one).",
)
@click.option(
    "--local-addr",
    metavar="ADDR",
    help="This host's address as the others reach it; the host whose address is the "
    "endpoint's hosts the rendezvous.",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    help="Where the ranks train, in place of the config's device (default auto: cuda when "
    "this host has a CUDA device for each rank, else cpu); cuda runs NCCL, cpu gloo.",
)
@click.option(
    "--sharding-group-size",
    type=GroupSizeParam(),
    metavar="G|auto",
    help="Ranks of one sharding group, in place of the config's sharding_group_size: the "
    "plan is made for G ranks, every G consecutive ranks hold a copy of it, and the copies "
    "are averaged each step; auto: the planner's choice (default: one group of every rank).",
)
def train(
    config: str,
    nproc: int,
    resume: bool,
    max_restarts: int,
    nnodes: tuple[int, int],
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    node_rank: int | None,
    local_addr: str | None,
    device: str | None,
    sharding_group_size: int | str | None,
) -> None:
    """Train the DLRM that CONFIG (YAML) describes, with NPROC ranks on this host.

    The same as: torchrun --standalone --nproc-per-node NPROC --max-restarts K
    -m embshard.app.train --config CONFIG [--resume] [--device D]
    [--sharding-group-size G]. With --rdzv-endpoint (a job
    across hosts: run it on every host), torchrun's c10d rendezvous replaces
    --standalone; docs/multihost.md.
    """
    from dataclasses import replace

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from embshard.app.config import check_launch, launch_device, load_config
    from embshard.checkpoint.store import first_line
    from embshard.errors import ConfigError

    fewest, most = nnodes
    if most > 1 and rdzv_endpoint is None:
        raise click.UsageError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT")
    world_size = fewest * nproc if fewest == most else None  # elastic: checked by the ranks
    try:  # fail here, before any process starts
        model = load_config(config)
        if sharding_group_size is not None:
            model = replace(model, sharding_group_size=sharding_group_size)
        check_launch(model, config, world_size, resume)
        launch_device(model, config, nproc, device)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    counts = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    hosts = ["--standalone"]
    if rdzv_endpoint is not None:
        name = rdzv_id or _job_name(rdzv_endpoint, config)
        hosts = [
            *("--nnodes", f"{fewest}:{most}", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", name),
            *(["--node-rank", str(node_rank)] if node_rank is not None else []),
            *(["--local-addr", local_addr] if local_addr is not None else []),
            # torchrun finds the host of the rendezvous by its hostname's addresses,
            # which need not include the endpoint's (several interfaces, namespaces).
            *(["--rdzv-conf", "is_host=true"] if local_addr == _host_of(rdzv_endpoint) else []),
        ]
    job = ["-m", "embshard.app.train", "--config", config, *(["--resume"] if resume else [])]
    job += ["--device", device] if device else []
    job += ["--sharding-group-size", str(sharding_group_size)] if sharding_group_size else []
    args = get_args_parser().parse_args([*hosts, *counts, *job])
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    # Rank 0 hosts each rendezvous round's store (see embshard.app.train.init_process_group).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    quiet = _WorkersSaidWhy()
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(quiet)
    try:
        run(args)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if 1 in codes and codes <= {1, -signal.SIGTERM}:  # the ranks printed why
            raise click.ClickException("training stopped (exit code 1): see above") from None
        raise click.ClickException(f"training failed:\n{e}") from None
    except RendezvousError as e:
        where = rdzv_endpoint or "this host"
        raise click.ClickException(f"the rendezvous at {where} failed: {first_line(e)}") from None
    finally:
        agent_log.removeFilter(quiet)


def _host_counts(value: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` as (fewest, most)."""
    fewest, _, most = value.partition(":")
    try:
        counts = int(fewest), int(most or fewest)
    except ValueError:
        counts = (0, 0)
    if not 1 <= counts[0] <= counts[1]:
        raise click.BadParameter(f"{value!r} is not N or MIN:MAX with 1 <= MIN <= MAX")
    return counts


def _host_of(endpoint: str) -> str:
    """``HOST`` of ``HOST:PORT`` (``[v6]:PORT`` too)."""
    return endpoint.rsplit(":", 1)[0].strip("[]")


def _job_name(endpoint: str, config: str) -> str:
    """A rendezvous id every host derives alike from its own command line."""
    digest = hashlib.sha1(f"{endpoint}|{Path(config).name}".encode()).hexdigest()
    return f"embshard-{digest[:12]}"


class _WorkersSaidWhy(logging.Filter):
    """torchrun's agent logs every failed run of workers, and its stopping of the
    others; ranks that exit with 1 have printed their reason already (``embshard:
    ...``), once and without traceback. Other failures (signals) are still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("failed (exitcode: 1)", "Sending process"))


# The checkout's root when embshard runs from one (installed with pip install -e).
SOURCE_TREE = Path(__file__).resolve().parents[2]


@main.command(context_settings={"ignore_unknown_options": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Benchmark embshard against TorchRec's DistributedModelParallel, side by side.

    Runs tools/bench.py of embshard's source checkout, with the same options.
    """
    command = _checkout_bench(ctx)
    with command.make_context(ctx.info_name, list(args), parent=ctx.parent) as bench_ctx:
        command.invoke(bench_ctx)


def _checkout_bench(ctx: click.Context) -> click.Command:
    """The bench's command, from the checkout this package runs from: the benchmark
    stays out of the installed package."""
    if not (SOURCE_TREE / "tools" / "bench" / "command.py").is_file():
        click.echo(
            "Error: embshard bench runs tools/bench.py from a source checkout of embshard; "
            f"{SOURCE_TREE} is not one (clone the repository, pip install -e it, run it there)",
            err=True,
        )
        ctx.exit(2)
    if str(SOURCE_TREE) not in sys.path:
        sys.path.insert(0, str(SOURCE_TREE))
    return importlib.import_module("tools.bench.command").bench


@main.group()
def ckpt() -> None:
    """Inspect, verify and export checkpoints (no process group needed)."""


@ckpt.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def inspect(directory: str, as_json: bool) -> None:
    """Show a checkpoint: step, size, tables, their saved layout and optimizer state.

    DIRECTORY is a checkpoint (step_*) or a root of them, for the latest.
    """
    import json

    from embshard.checkpoint import managed_collision
    from embshard.checkpoint.contents import describe
    from embshard.errors import CheckpointError
    from embshard.plan.specs import Kind, plural

    try:
        info = describe(directory)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    size = info["bytes_on_disk"]
    shown = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    world = info["world_size"]
    saved_by = "a plain state dict" if world is None else f"saved by {plural(world, 'rank')}"
    if (info.get("replicas") or 1) > 1:
        saved_by += f" as {info['replicas']} sharding groups of {info['sharding_group_size']}"
    click.echo(f"{info['path']}: step {info['step']}, {saved_by}, {shown} on disk")
    dense = plural(info["dense_tensors"], "tensor")
    click.echo(f"dense: {dense}, optimizer state: {info['dense_optimizer']}")
    if any(info["modules"]):  # not a collection's own keys: export --module takes these
        click.echo(f"modules with tables: {', '.join(m or '(top level)' for m in info['modules'])}")
    for name, table in info["tables"].items():
        state = [f"{n} {tuple(shape)}" for n, shape in table["optimizer_state"].items()]
        if table["optimizer_step"] is not None:
            state.append(f"step {table['optimizer_step']}")
        click.echo(
            f"{name}: {tuple(table['shape'])} {table['dtype']}, {table['optimizer']}"
            + (f" state {', '.join(state)}" if state else "")
        )
        if table["dynamic"] is not None:
            click.echo(f"    id map: {_occupancy(table['dynamic'])}")
        if (managed := table.get("managed_collision")) is not None:
            click.echo(
                f"    managed collisions: TorchRec MCH modules, {managed['policy']}, "
                f"{managed_collision.shown(managed)}"
            )
        if table["layout"] == Kind.DATA_PARALLEL:
            ranks = plural(len(table["shards"]), "rank")
            click.echo(f"    a copy on each of {ranks}: rows 0:{table['shape'][0]}, all columns")
            continue
        for s in table["shards"]:
            if s["rows"] and s["cols"]:
                click.echo(
                    f"    rank {s['rank']}: rows {s['row_offset']}:{s['row_offset'] + s['rows']}, "
                    f"cols {s['col_offset']}:{s['col_offset'] + s['cols']}"
                )


def _occupancy(m: dict) -> str:
    """A saved id map in one line: occupancy, shape and rules, the counts over every rank."""
    rules = [m["policy"]]
    if m["ttl_steps"] is not None:
        rules.append(f"ttl_steps {m['ttl_steps']}")
    if m["admit_after"] > 1:
        rules.append(f"admit_after {m['admit_after']}")
    return (
        f"{m['live']} of {m['rows']} rows live ({m['live'] / m['rows']:.0%}), "
        f"{m['buckets']} buckets of {m['rows_per_bucket']} rows, {', '.join(rules)}; "
        f"admitted {m['admitted']}, evicted {m['evicted']}, overflow {m['overflow']}"
    )


@ckpt.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def verify(directory: str) -> None:
    """Check every saved chunk against the checksums saved with the checkpoint.

    DIRECTORY is a checkpoint (step_*) or a root of them, for the latest. Prints OK,
    or each corrupt chunk (table, file, offset) and exits with status 1.
    """
    from embshard.checkpoint.store import verify as verify_checkpoint
    from embshard.errors import CheckpointError

    try:
        report = verify_checkpoint(directory)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    if not report.ok:
        raise click.ClickException(report.summary())
    click.echo(report.summary())


@ckpt.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=OutputFile())
@click.option(
    "--module",
    metavar="PREFIX",
    help="Only the keys under PREFIX. (say ebc), PREFIX. stripped: that module's own "
    "state dict, for EmbeddingBagCollection.load_state_dict. ckpt inspect lists them.",
)
def export(directory: str, out: str, module: str | None) -> None:
    """Write DIRECTORY's model as a plain unsharded state dict (torch.save) to OUT:
    the whole model's keys, or with --module one module's. No optimizer state."""
    from embshard.checkpoint.contents import export as export_checkpoint
    from embshard.errors import CheckpointError
    from embshard.plan.specs import plural

    try:
        keys = export_checkpoint(directory, out, module=module)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {plural(len(keys), 'tensor')} to {out}")


@main.command("export")
@click.argument("checkpoint_dir", metavar="CKPT", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--quantize",
    type=click.Choice(["int8", "int4", "fp16"]),
    required=True,
    help="The tables' stored precision (int8, int4: row-wise scale and bias).",
)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    help="The training config of the job that saved CKPT (its model and tables); "
    "default: the one CKPT carries.",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="Shard the served tables over this many ranks (`predict --nproc` runs them); "
    "default: one host, an exported program.",
)
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(exists=True, dir_okay=False),
    help="With --world-size: the sharding plan (YAML); default: the config's, else the planner's.",
)
def export_serving(
    checkpoint_dir: str,
    out: str,
    quantize: str,
    config: str | None,
    world_size: int | None,
    plan_path: str | None,
) -> None:
    """Export CKPT's model for serving, tables quantized, to the folder OUT.

    OUT holds the model exported with torch.export (model.pt2: it loads with torch
    and fbgemm_gpu alone), serving.json and the config; with --world-size N, each of
    N ranks' quantized shards and the dense part instead, for `predict --nproc N`.
    CKPT is a checkpoint (step_*) or a root of them, for the latest, saved by any world
    size under any plan. (`ckpt export` writes a plain float state dict instead.)
    """
    from embshard.app.serve import export_checkpoint
    from embshard.errors import EmbshardError

    if plan_path is not None and world_size is None:
        raise click.UsageError("--plan needs --world-size")
    try:
        manifest = export_checkpoint(checkpoint_dir, out, quantize, config, world_size, plan_path)
    except EmbshardError as e:
        raise click.ClickException(str(e)) from None
    ratio = manifest.table_bytes / manifest.float32_bytes
    ranks = f" over {world_size} ranks" if world_size else ""
    maps = "".join(
        f", id map {name} {m['live']:,} live ids" for name, m in (manifest.id_maps or {}).items()
    )
    click.echo(
        f"wrote {out}: {len(manifest.features)} features, tables {quantize}{ranks} "
        f"{manifest.table_bytes / 2**20:.1f} MiB ({ratio:.3f}x float32){maps}"
    )


@main.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.argument("data")
@click.option("--batch-size", type=click.IntRange(min=1), help="Default: the config's.")
@click.option(
    "--batches",
    type=click.IntRange(min=1),
    help="Score only this many batches (synthetic: default the config's eval.batches).",
)
@click.option(
    "--out", "scores_out", type=OutputFile(), help="Write every sample's logit here, one a line."
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    help="Torch threads (default: torch's, one a core); 1 on a busy host.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    help="A sharded artifact's ranks, one process each (default and only value: its world size).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def predict(
    artifact: str,
    data: str,
    batch_size: int | None,
    batches: int | None,
    scores_out: str | None,
    threads: int | None,
    nproc: int | None,
    as_json: bool,
) -> None:
    """Score DATA with a serving artifact: throughput, latency, AUC.

    ARTIFACT is what `embshard export` wrote. Prints samples a second, each batch's
    latency (p50, p99) and, with labels, AUC and loss; a progress bar goes to stderr.

    DATA is a file in the training job's Criteo TSV format, or `synthetic` for the
    job's synthetic held-out batches. A sharded artifact (`export --world-size N`)
    is scored by N gloo processes on this host, each a batch at a time.
    """
    import json

    import torch

    from embshard.app.data import CriteoFormatError
    from embshard.app.serve import SYNTHETIC, is_artifact, predict_sharded
    from embshard.app.serve import predict as score_data
    from embshard.errors import EmbshardError
    from embshard.serving.export import Manifest

    if not is_artifact(artifact):
        raise click.ClickException(
            f"{artifact} is not a serving artifact (embshard export writes one)"
        )
    if data != SYNTHETIC and not Path(data).is_file():
        raise click.ClickException(f"{data}: no such data file (or `synthetic`)")
    if threads:
        torch.set_num_threads(threads)
    sharded = Manifest.read(artifact).sharded is not None
    if nproc is not None and not sharded:
        raise click.UsageError("--nproc is for a sharded artifact (export --world-size)")
    try:
        if sharded:
            scores, logits = predict_sharded(artifact, data, batch_size, batches, nproc)
        else:
            scores, logits = score_data(artifact, data, batch_size, batches)
    except (EmbshardError, CriteoFormatError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if scores_out:
        Path(scores_out).write_text("".join(f"{v:.6g}\n" for v in logits.tolist()))
    figures = scores.summary()
    if as_json:
        click.echo(json.dumps(figures, indent=2))
        return
    auc = (
        "no AUC (labels of one class)"
        if figures["auc"] is None
        else f"AUC {figures['auc']:.4f}, loss {figures['loss']:.4f}"
    )
    p50, p99 = figures["batch_latency_ms_p50"], figures["batch_latency_ms_p99"]
    click.echo(
        f"{figures['samples']} samples, {figures['samples_per_s']:,.0f} samples/s, batch "
        f"latency p50 {p50:.2f} ms, p99 {p99:.2f} ms; {auc}"
    )
    if scores_out:
        click.echo(f"wrote {scores_out}")


# Shared by ``plan`` and ``simulate``.
_RANKS_PER_HOST = click.option(
    "--ranks-per-host",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks on each host (ranks h*N to h*N+N-1 on host h); default: the config's "
    "topology, else its kind's (gpu: 8; cpu: the world).",
)


def _group_size_option(does: str) -> Callable:
    """``--sharding-group-size G|auto`` (as ``group``) for ``plan`` and ``simulate``:
    what it ``does``, then its default."""
    return click.option(
        "--sharding-group-size",
        "group",
        type=GroupSizeParam(),
        default=None,
        metavar="G|auto",
        help=f"{does} Default: the config's sharding_group_size, else one group.",
    )


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--world-size", "-w", type=click.IntRange(min=1), required=True, help="Ranks to plan for."
)
@click.option("--memory-per-rank", default=None, help="Like 80GiB; default: the config's topology.")
@_RANKS_PER_HOST
@click.option("--out", type=OutputFile(), help="Write the plan (YAML) here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--batches",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Plan from the traffic measured over this many batches of 2 ranks' data "
    "(0: from each table's mean_pooling, ids spread evenly).",
)
@click.option(
    "--balance-lookups",
    is_flag=True,
    help="With --batches: not the planner's plan but every table row-wise by the "
    "traffic, its hot rows copied on every rank (embshard.app.planning.lookup_balanced_plan), so "
    "each rank makes about as many lookups; slower steps where pooled rows dominate.",
)
@_group_size_option(
    "Plan for sharding groups of G ranks (2-D), each rank's cost with its all-reduce "
    "over the copies; auto: the G of lowest step among the world and whole hosts dividing it."
)
def plan(
    config: str,
    world_size: int,
    memory_per_rank: str | None,
    ranks_per_host: int | None,
    out: str | None,
    as_json: bool,
    batches: int,
    balance_lookups: bool,
    group: int | str | None,
) -> None:
    """Plan CONFIG's tables for WORLD_SIZE ranks.

    Prints each rank's memory, estimated step cost and shards, why each table is
    sharded as it is, and the plan; --out writes the plan for the config's `plan:` or
    `embshard show`. With --batches N, tables are priced, and row-wise ones cut, by
    the lookups measured over N batches of the config's data (skewed ids: hot rows).
    """
    import json

    import yaml

    from embshard.app.config import group_size, load_config
    from embshard.app.planning import lookup_balanced_plan, measure_traffic, plan_job
    from embshard.errors import ConfigError, PlanningError

    if balance_lookups and not batches:
        raise click.ClickException("--balance-lookups needs the traffic: give --batches N")
    try:
        model = load_config(config, use="plan", check_files=batches > 0)  # data: to measure
        if group is None:
            group_size(model, world_size, config)  # the config's must divide the world
        if balance_lookups and (group or model.sharding_group_size) not in (None, world_size):
            raise click.ClickException("--balance-lookups plans one group of every rank")
        stats = measure_traffic(model, world_size, batches) if batches else None
        if balance_lookups:
            sharding, report = lookup_balanced_plan(
                model, world_size, stats, memory_per_rank, ranks_per_host
            )
        else:
            sharding, report = plan_job(
                model, world_size, memory_per_rank, stats, ranks_per_host, group
            )
    except (ConfigError, PlanningError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if out:
        sharding.save(out)
    if as_json:
        click.echo(
            json.dumps(
                {"report": report.to_dict(), "plan": yaml.safe_load(sharding.to_yaml())}, indent=2
            )
        )
        return
    click.echo(report.to_text())
    click.echo(sharding.to_yaml().rstrip())
    if out:
        click.echo(f"wrote {out}")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--world-size", "-w", type=click.IntRange(min=1), required=True, help="Ranks to simulate."
)
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(dir_okay=False),
    help="A plan (YAML); default: the config's, else the planner's.",
)
@click.option("--batches", default=8, show_default=True, help="Batches (steps) per rank.")
@_RANKS_PER_HOST
@click.option(
    "--mode",
    type=click.Choice(["full", "streamed"]),
    default=None,
    help="full: every rank a thread running the whole input stage; streamed: one sending "
    "rank at a time, memory flat in the ranks; the same report. Default: full up to 16 "
    "ranks, else streamed.",
)
@_group_size_option(
    "Simulate a 2-D job: the plan made for sharding groups of G ranks (a --plan is one "
    "group's), the first group's ranks run, each with its all-reduce over its copies "
    "priced; auto: the planner's G."
)
@click.option(
    "--check", is_flag=True, help="Also check a small copy's numerics against the oracle."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def simulate(
    config: str,
    world_size: int,
    plan_file: str | None,
    batches: int,
    ranks_per_host: int | None,
    mode: str | None,
    group: int | str | None,
    check: bool,
    as_json: bool,
) -> None:
    """Run CONFIG's input distribution for WORLD_SIZE ranks in this process, tables
    unallocated: each rank's ids, lookups, all-to-all bytes (inside and across hosts) and
    memory, the slowest rank. Refused up front when it would not fit in memory."""
    import contextlib
    import json

    from embshard.app.data import CriteoFormatError
    from embshard.app.simulate import SimulationError
    from embshard.app.simulate import simulate as run_simulation
    from embshard.errors import ConfigError, PlanError, PlanningError

    # A bar on a terminal's stderr only: never in the report or a pipe's.
    bar = (
        click.progressbar(length=world_size * batches, label="simulating", file=sys.stderr)
        if sys.stderr.isatty()
        else contextlib.nullcontext()
    )
    try:
        with bar as shown:
            result = run_simulation(
                config,
                world_size,
                plan_file,
                batches,
                check,
                ranks_per_host,
                mode=mode,
                progress=shown.update if shown is not None else None,
                group_size=group,
            )
    except (ConfigError, PlanError, PlanningError, CriteoFormatError, SimulationError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.to_text())
    if result.check is not None and not result.check.passed:
        raise click.ClickException("the numerics differ from the unsharded oracle")


@main.command()
@click.argument("plan_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--config", required=True, type=click.Path(dir_okay=False), help="The model's config."
)
@click.option(
    "--world-size", "-w", type=click.IntRange(min=1), help="Ranks; default: as the plan implies."
)
@click.option(
    "--png",
    type=OutputFile(*PLOT_SUFFIXES),
    help="Also draw each rank's shards against its memory, and its estimated cost.",
)
@click.option("--memory-per-rank", default=None, help="Like 80GiB; default: the config's topology.")
@click.option("--width", default=60, show_default=True, help="Characters per bar.")
def show(
    plan_file: str,
    config: str,
    world_size: int | None,
    png: str | None,
    memory_per_rank: str | None,
    width: int,
) -> None:
    """Draw how PLAN_FILE lays out each table of CONFIG: which rank holds which rows
    and columns (a symbol per rank: 0-9, a-z, A-Z, repeating past 62 ranks)."""
    from embshard.app.config import load_config
    from embshard.app.planning import topology_for
    from embshard.app.show import draw_plan, plot_plan, shard_boxes, summary
    from embshard.errors import ConfigError, PlanError, PlanningError
    from embshard.plan.specs import ShardingPlan, plural
    from embshard.planner.cost import CostModel
    from embshard.planner.search import plan_loads
    from embshard.planner.tables import planned_tables

    try:
        model = load_config(config, use="plan", check_files=False)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    try:
        sharding = ShardingPlan.load(plan_file)  # its errors name the file
    except PlanError as e:
        raise click.ClickException(str(e)) from None
    try:
        world = world_size or _implied_world_size(sharding)
    except PlanError as e:
        raise click.ClickException(f"{plan_file}: {e}") from None
    try:
        topology = topology_for(model, world, memory_per_rank)
    except ValueError as e:  # a bad size, or PlanningError: a bad topology
        raise click.ClickException(str(e)) from None
    optimizer = model.sparse_optimizer.type
    try:
        tables = sharding.resolve(model.torchrec_configs(), world)
        loads = plan_loads(
            sharding,
            model.tables,
            topology,
            model.batch_size,
            optimizer,
            dynamic=model.id_maps(),
        )
    except (PlanError, PlanningError) as e:
        raise click.ClickException(f"{plan_file}: {e}") from None
    click.echo(draw_plan(tables, width, {t.name for t in model.tables if t.sequence}))
    click.echo(summary(loads))
    if png:
        costs, specs = (
            CostModel(topology, model.batch_size, optimizer),
            planned_tables(model.tables),
        )
        boxes = shard_boxes(tables, specs, costs)
        title = f"{Path(plan_file).name} on {plural(world, 'rank')}"
        plot_plan(boxes, loads, topology, costs.base_cost(specs), png, title)
        click.echo(f"wrote {png}")


def _implied_world_size(sharding) -> int:
    """The one world size the plan's specs name; else, when none names one and no table
    has a row block on every rank (whose count the world sets), one past the highest
    rank named."""
    from embshard.errors import PlanError

    specs = sharding.tables.values()
    sizes = {s.named_world_size for s in specs if s.named_world_size is not None}
    if len(sizes) == 1:
        return sizes.pop()
    ranks = [r for s in specs for r in s.named_ranks]
    if not sizes and ranks and not any(s.ROW_BLOCK_ON_EVERY_RANK for s in specs):
        return max(ranks) + 1
    raise PlanError("cannot tell the world size from the plan: pass --world-size")
