"""Peak resident memory of a rank loading a checkpoint of a 1 GiB model, at world size 2.

    .venv/bin/torchrun --nproc-per-node 2 tools/ckpt_memory.py --dir /tmp/ckpt_memory

Builds 8 row-wise tables of 2**20 x 32 fp32 (1 GiB in all, 0.5 GiB per rank) with
SGD, saves them, then in a fresh pair of processes (launched by this script) builds the
same model and loads the checkpoint. Each rank prints its resident memory (ru_maxrss,
the peak so far) before and after the load, what the load added as a fraction of the
rank's shard bytes, and how long the save and the load took. ``--without-checksums``
deletes the checksums after the save, as in a checkpoint saved before embshard
recorded them.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import embshard
from embshard import checkpoint

TABLES = [
    EmbeddingBagConfig(
        name=f"t{i}", num_embeddings=1 << 20, embedding_dim=32, feature_names=[f"f{i}"]
    )
    for i in range(8)
]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model() -> embshard.ShardedEmbeddingBagCollection:
    plan = embshard.ShardingPlan({t.name: embshard.row_wise() for t in TABLES})
    return embshard.shard(EmbeddingBagCollection(tables=TABLES, device="meta"), plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--phase", choices=["save", "load"], default="save")
    parser.add_argument("--without-checksums", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    sharded = model()
    if args.phase == "save":
        if rank == 0:
            shutil.rmtree(args.dir, ignore_errors=True)
        dist.barrier()
        start = time.perf_counter()
        saved = checkpoint.save(args.dir, sharded, step=1)
        if rank == 0:
            print(f"save: {time.perf_counter() - start:.1f} s", flush=True)
            if args.without_checksums:
                (saved / checkpoint.CHECKSUMS).unlink()
        dist.destroy_process_group()
        if rank == 0:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "2",
                    __file__,
                    "--dir",
                    args.dir,
                    "--phase",
                    "load",
                ],
                check=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
        return
    before = peak_mib()
    start = time.perf_counter()
    checkpoint.load(checkpoint.latest(args.dir), sharded)
    seconds = time.perf_counter() - start
    after = peak_mib()
    local = (
        sum(s.rows * s.cols * 4 for t in sharded.tables.values() for s in t.shards_on(rank)) / 2**20
    )
    print(
        f"rank {rank}: owns {local:.0f} MiB of 1024 MiB; peak RSS {before:.0f} MiB before the "
        f"load, {after:.0f} MiB after it: the load added {after - before:.0f} MiB "
        f"({(after - before) / local:.2f} of its shards) in {seconds:.1f} s",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
