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
def train(config: str, nproc: int) -> None:
    """Train the DLRM that CONFIG (YAML) describes, with NPROC ranks on this host.

    The same as: torchrun --standalone --nproc-per-node NPROC -m embshard.train --config CONFIG
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        load_config(config)  # fail here, before any process starts
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(nproc), "-m", "embshard.train", "--config", config]
    )
    try:
        run(args)
    except ChildFailedError as e:
        raise click.ClickException(f"training failed:\n{e}") from None
