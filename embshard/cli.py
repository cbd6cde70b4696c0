"""The ``embshard`` command line."""

from __future__ import annotations

import click

from embshard.config import ConfigError, load_config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Shard the embedding tables of TorchRec models across torch.distributed ranks."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--nproc", default=2, show_default=True, help="Processes (ranks) on this host.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint.")
@click.option(
    "--max-restarts",
    default=0,
    show_default=True,
    help="Restart every rank this many times when one fails; restarts resume.",
)
def train(config: str, nproc: int, resume: bool, max_restarts: int) -> None:
    """Train the DLRM that CONFIG (YAML) describes, with NPROC ranks on this host.

    The same as: torchrun --standalone --nproc-per-node NPROC --max-restarts K
    -m embshard.train --config CONFIG [--resume]
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        load_config(config)  # fail here, before any process starts
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    launch = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    job = ["-m", "embshard.train", "--config", config, *(["--resume"] if resume else [])]
    args = get_args_parser().parse_args([*launch, *job])
    try:
        run(args)
    except ChildFailedError as e:
        raise click.ClickException(f"training failed:\n{e}") from None


@main.group()
def ckpt() -> None:
    """Inspect and export checkpoints (no process group needed)."""


@ckpt.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def inspect(directory: str, as_json: bool) -> None:
    """Show a checkpoint: step, size, tables, their saved layout and optimizer state.

    DIRECTORY is a checkpoint (step_*) or a root of them, for the latest.
    """
    import json

    from embshard.checkpoint import CheckpointError, describe

    try:
        info = describe(directory)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    size = info["bytes_on_disk"]
    shown = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    click.echo(
        f"{info['path']}: step {info['step']}, saved by {info['world_size']} ranks, {shown} on disk"
    )
    click.echo(
        f"dense: {info['dense_tensors']} tensors, optimizer state: {info['dense_optimizer']}"
    )
    for name, table in info["tables"].items():
        state = table["optimizer_state_shape"]
        click.echo(
            f"{name}: {tuple(table['shape'])} {table['dtype']}, {table['optimizer']}"
            + (f" state {tuple(state)}" if state else "")
        )
        for s in table["shards"]:
            if s["rows"] and s["cols"]:
                click.echo(
                    f"    rank {s['rank']}: rows {s['row_offset']}:{s['row_offset'] + s['rows']}, "
                    f"cols {s['col_offset']}:{s['col_offset'] + s['cols']}"
                )


@ckpt.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
def export(directory: str, out: str) -> None:
    """Write DIRECTORY's model as a plain unsharded state dict (torch.save) to OUT."""
    from embshard.checkpoint import CheckpointError
    from embshard.checkpoint import export as export_checkpoint

    try:
        keys = export_checkpoint(directory, out)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {len(keys)} tensors to {out}")
