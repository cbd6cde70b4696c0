"""The id map's cost: one rank's ``IdMap.remap`` on a stream of raw ids, per call and
per id, with admissions, evictions and the map's memory per live id (its state and
its index of live keys).

    .venv/bin/python tools/bench_id_map.py
    .venv/bin/python tools/bench_id_map.py --ids 109568 --vocabulary 2000000 --policy lfu

Each step draws ``--ids`` raw ids by a power law over a vocabulary that drifts: step
s draws from ids ``[s * drift, s * drift + vocabulary)``, low ids of the window hot,
so new ids keep arriving and old ones fade. The ids are hashed to keys
(``hash_ids``) and remapped by one map holding every bucket (one rank's view; a
rank of W holds 1/W of the buckets and gets about 1/W of the keys). Times are the
median of the measured steps, after the warm-up steps; the hash is timed apart. With
one thread (the default) the process's CPU time is reported beside the wall time: it
does not count time the process waited for a core, so it holds on a busy machine.
"""

from __future__ import annotations

import json
import statistics
import time

import click
import torch

from embshard.app.data import power_law_ids
from embshard.runtime.keys import hash_ids
from embshard.storage.id_map import IdMap, IdMapSpec


def stream(ids: int, vocabulary: int, drift: int, steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [power_law_ids(vocabulary, ids, generator) + s * drift for s in range(steps)]


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--ids", default=109_568, show_default=True, help="raw ids a step")
@click.option("--vocabulary", default=1_000_000, show_default=True, help="ids a step draws from")
@click.option("--drift", default=10_000, show_default=True, help="how far the window moves a step")
@click.option("--buckets", default=1024, show_default=True)
@click.option("--rows-per-bucket", default=256, show_default=True)
@click.option("--policy", default="lru", show_default=True)
@click.option("--ttl-steps", type=int, default=None)
@click.option("--admit-after", default=1, show_default=True)
@click.option("--steps", default=20, show_default=True, help="measured steps")
@click.option("--warmup", default=5, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch's intra-op threads")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
def main(
    ids: int,
    vocabulary: int,
    drift: int,
    buckets: int,
    rows_per_bucket: int,
    policy: str,
    ttl_steps: int | None,
    admit_after: int,
    steps: int,
    warmup: int,
    threads: int,
    seed: int,
    as_json: bool,
) -> None:
    torch.set_num_threads(threads)
    spec = IdMapSpec(buckets, rows_per_bucket, policy, ttl_steps, admit_after)
    idmap = IdMap(spec)
    hash_times, remap_times, remap_cpu = [], [], []
    unique, admitted, evicted, overflow = [], [], [], []
    for step, raw in enumerate(stream(ids, vocabulary, drift, warmup + steps, seed)):
        start = time.perf_counter()
        keys = hash_ids(raw)
        hashed, hashed_cpu = time.perf_counter(), time.process_time()
        result = idmap.remap(keys, step)
        done, done_cpu = time.perf_counter(), time.process_time()
        if step < warmup:
            continue
        hash_times.append(hashed - start)
        remap_times.append(done - hashed)
        remap_cpu.append(done_cpu - hashed_cpu)
        unique.append(len(torch.unique(keys)))
        admitted.append(len(result.admitted))
        evicted.append(int(result.evicted))
        overflow.append(int(result.overflow))
    live = int(idmap.slots.occupied.sum())
    state_bytes = sum(t.nbytes for t in idmap.state_dict().values())
    index_bytes = sum(  # the index of live keys (and of candidates) beside the state
        s.index_keys.nbytes + s.index_slots.nbytes
        for s in (idmap.slots, idmap.probation)
        if s is not None
    )
    remap_ms = median_ms(remap_times)
    figures = {
        "spec": {
            "buckets": buckets,
            "rows_per_bucket": rows_per_bucket,
            "policy": policy,
            "ttl_steps": ttl_steps,
            "admit_after": admit_after,
        },
        "ids_per_step": ids,
        "unique_per_step": round(statistics.mean(unique)),
        "hash_ms": median_ms(hash_times),
        "remap_ms": remap_ms,
        "remap_ns_per_id": round(remap_ms * 1e6 / ids, 1),
        "remap_cpu_ms": median_ms(remap_cpu),
        "admitted_per_step": round(statistics.mean(admitted)),
        "evicted_per_step": round(statistics.mean(evicted)),
        "overflow_per_step": round(statistics.mean(overflow)),
        "live": live,
        "rows": buckets * rows_per_bucket,
        "map_bytes_per_live_id": round((state_bytes + index_bytes) / max(live, 1), 1),
        "of_them_index": round(index_bytes / max(live, 1), 1),
        "threads": threads,
    }
    if as_json:
        click.echo(json.dumps(figures, indent=1))
        return
    for name, value in figures.items():
        click.echo(f"{name:>22}: {value}")


if __name__ == "__main__":
    main()
