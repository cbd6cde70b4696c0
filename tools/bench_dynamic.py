"""A training step with dynamic tables against the same step with static tables of the
same sizes: workload (d)'s tables and bags, every table row-wise over ``--world`` gloo
ranks on CPU, or NCCL ranks with a GPU each (``--device cuda``).

    .venv/bin/python tools/bench_dynamic.py
    .venv/bin/python tools/bench_dynamic.py --world 2 --steps 10 --policy lfu
    python tools/bench_dynamic.py --device cuda --world 1

Workload (d)'s tables of 400,000 rows (its five largest) are the dynamic ones, each
1,000 buckets of 400 rows, fed raw ids by a power law over a window of
``--vocabulary`` ids that moves ``--drift`` a step (so ids keep arriving and others
are evicted); the static run gives the same tables ids by the same law over their
rows. Each rank times forward and backward (the fused optimizer included) of its
batch of 512; the figures are the medians of the measured steps over ranks' slowest,
wall and the process's CPU time (with one thread, the CPU time does not count the
time a busy machine made the process wait), and the ids admitted and evicted a
measured step (all ranks). On CUDA a step's wall time runs until the
GPU has finished it, and the ratio that counts is the wall times'.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import click
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BIG = 400_000  # workload (d)'s largest tables: these are dynamic
BUCKETS, ROWS_PER_BUCKET = 1_000, 400


def _batch(tables, dynamic: set[int], batch: int, step: int, rank: int, args: dict):
    from torchrec import KeyedJaggedTensor

    from embshard.app.data import power_law_ids

    generator = torch.Generator().manual_seed(step * 1_000 + rank)
    values = []
    for index, (rows, _, hot) in enumerate(tables):
        if index in dynamic:
            window = power_law_ids(args["vocabulary"], batch * hot, generator)
            values.append(window + step * args["drift"])
        else:
            values.append(power_law_ids(rows, batch * hot, generator))
    lengths = torch.tensor([hot for _, _, hot in tables]).repeat_interleave(batch)
    return KeyedJaggedTensor.from_lengths_sync(
        [f"f{i}" for i in range(len(tables))], torch.cat(values), lengths
    )


def _rank(rank: int, world: int, store: str, args: dict, results) -> None:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    import embshard
    from embshard import IdMapSpec, ShardingPlan, row_wise

    torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    from bench.device import synchronize
    from bench.workloads import WORKLOADS

    spec = WORKLOADS["d"]
    tables, batch = spec["tables"], spec["batch"]
    dynamic = {i for i, (rows, _, _) in enumerate(tables) if rows == BIG}
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"]
        )
        for i, (rows, dim, _) in enumerate(tables)
    ]
    plan = ShardingPlan({c.name: row_wise() for c in configs})
    id_map = IdMapSpec(BUCKETS, ROWS_PER_BUCKET, args["policy"], admit_after=args["admit_after"])
    figures = {}
    for mode in ("static", "dynamic"):
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        sharded = embshard.shard(
            ebc,
            plan,
            optimizer=embshard.RowWiseAdagrad(lr=0.01),
            dynamic={f"t{i}": id_map for i in dynamic} if mode == "dynamic" else None,
        )
        walls, cpus, before = [], [], {}
        for step in range(args["warmup"] + args["steps"]):
            if mode == "dynamic" and step == args["warmup"]:
                before = sharded.dynamic_stats()  # a collective: every rank, same step
            features = _batch(
                tables, dynamic if mode == "dynamic" else set(), batch, step, rank, args
            ).to(device)
            dist.barrier()
            synchronize(device)
            wall, cpu = time.perf_counter(), time.process_time()
            sharded(features).values().sum().backward()
            synchronize(device)
            if step >= args["warmup"]:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        figures[mode] = (walls, cpus)
        if mode == "dynamic":  # the measured steps' admissions and evictions
            stats = sharded.dynamic_stats()
            figures["per_step"] = {
                what: sum(getattr(stats[t], what) - getattr(before[t], what) for t in stats)
                // args["steps"]
                for what in ("admitted", "evicted")
            }
    results.put((rank, figures))
    dist.destroy_process_group()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--world", default=2, show_default=True, help="ranks")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="cpu: gloo ranks; cuda: NCCL ranks, a GPU each",
)
@click.option(
    "--vocabulary", default=1_000_000, show_default=True, help="raw ids a step draws from"
)
@click.option("--drift", default=10_000, show_default=True, help="how far the window moves a step")
@click.option("--policy", default="lru", show_default=True)
@click.option(
    "--admit-after", default=1, show_default=True, help="an id's row at its k-th sighting"
)
@click.option("--steps", default=10, show_default=True, help="measured steps")
@click.option("--warmup", default=3, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch's intra-op threads a rank")
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
def main(**args) -> None:
    world = args.pop("world")
    as_json = args.pop("as_json")
    if args["device"] == "cuda" and world > torch.cuda.device_count():
        raise click.UsageError(
            f"--world {world} on cuda needs a GPU a rank; torch sees {torch.cuda.device_count()}"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, args, results)) for r in range(world)
        ]
        for p in procs:
            p.start()
        got = dict(results.get() for _ in procs)
        for p in procs:
            p.join()

    def slowest(mode: str, which: int) -> float:
        per_step = zip(*(got[r][mode][which] for r in range(world)))
        return round(statistics.median(max(s) for s in per_step) * 1e3, 1)

    figures = {
        "world": world,
        "device": args["device"],
        "policy": args["policy"],
        "admit_after": args["admit_after"],
        "static_ms": slowest("static", 0),
        "dynamic_ms": slowest("dynamic", 0),
        "static_cpu_ms": slowest("static", 1),
        "dynamic_cpu_ms": slowest("dynamic", 1),
        **{f"{k}_per_step": v for k, v in got[0]["per_step"].items()},
    }
    figures["ratio_cpu"] = round(figures["dynamic_cpu_ms"] / figures["static_cpu_ms"], 2)
    figures["ratio_wall"] = round(figures["dynamic_ms"] / figures["static_ms"], 2)
    if as_json:
        click.echo(json.dumps(figures, indent=1))
        return
    for name, value in figures.items():
        click.echo(f"{name:>18}: {value}")


if __name__ == "__main__":
    main()
