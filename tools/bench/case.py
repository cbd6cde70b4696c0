"""One cell of the bench on every rank: both libraries built, their outputs compared,
then timed, with embshard's floor beside them, and one more step of each counted
(ops.py: its working ops and host syncs)."""

from __future__ import annotations

import statistics

from .collectives import per_step_comm
from .floor import bare_tbe_time, duplicate_fraction, received_ids
from .libraries import build, copy_weights, difference
from .timing import per_rank, percentile, pipelined_steps, slowest, train_step
from .workloads import WORKLOADS, make_inputs, make_plan, table_configs

# Unit roundoff of the comm precisions: how far compressed outputs may drift, relatively.
UNIT_ROUNDOFF = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}


def bench_case(
    workload: str,
    plan_name: str,
    steps: int,
    warmup: int,
    comm_precision: str = "fp32",
    ids: str = "uniform",
) -> dict:
    import torch.distributed as dist

    from .ops import count_step, every_rank  # imports torch

    world, rank = dist.get_world_size(), dist.get_rank()
    configs = table_configs(workload)
    plan = make_plan(plan_name, configs, world)
    record = {
        "workload": workload,
        "plan": plan_name,
        "world_size": world,
        "comm_precision": comm_precision,
        "ids": ids,
    }
    try:
        ours = build("embshard", configs, plan, world, comm_precision)
    except ValueError as refused:  # raised alike on every rank, before any collective
        record["skipped"] = f"embshard refuses it: {refused}"
        return record
    theirs = build("torchrec", configs, plan, world, comm_precision)
    copy_weights(ours, theirs)
    batches = make_inputs(workload, rank, warmup + steps, ids)
    gap, scale = slowest(list(difference(ours, theirs, batches[0])))
    # Compressed, each library rounds each value a few times, in its own places.
    agree = gap <= 1e-4 + 4 * UNIT_ROUNDOFF[comm_precision] * scale
    record["outputs_equal"] = agree
    if not agree:
        record["max_difference"] = gap
        return record
    for i in range(warmup):
        train_step(ours, batches[i])
        train_step(theirs, batches[i])
    ours_times, theirs_times = [], []
    for batch in batches[warmup:]:
        ours_times.append(train_step(ours, batch))
        theirs_times.append(train_step(theirs, batch))
    piped_times = slowest(pipelined_steps(ours, batches[warmup:]))
    ours_times, theirs_times = slowest(ours_times), slowest(theirs_times)
    received = received_ids(ours, batches[0])
    bare, bandwidth = bare_tbe_time(ours, received, max(5, steps // 2))
    slots = len(ours._routes.slot_dims(rank))
    duplicates = duplicate_fraction(*received, slots) if received is not None else 0.0
    bandwidth = min(-x for x in slowest([-bandwidth]))
    samples = WORKLOADS[workload]["batch"] * world
    for name, times, model in (("embshard", ours_times, ours), ("torchrec", theirs_times, theirs)):
        collectives, sent = per_step_comm(model, batches[0])
        if model is ours:
            alone = sent.replay(max(5, steps // 2))
        counted = every_rank(count_step(model, make_inputs(workload, rank, 1, ids)[0]))
        record[name] = {
            "median_ms": 1e3 * statistics.median(times),
            "p10_ms": 1e3 * percentile(times, 0.1),
            "p90_ms": 1e3 * percentile(times, 0.9),
            "samples_per_s": samples / statistics.median(times),
            "collectives_per_step": collectives,
            "bytes_sent_per_rank": max(slowest([float(sent.bytes)])),
            "ops_per_step": max(c.ops for c in counted),
            "ops_per_step_per_rank": [c.ops for c in counted],
            "host_syncs_per_step": max(c.syncs for c in counted),
        }
    record["throughput_ratio"] = (
        record["embshard"]["samples_per_s"] / record["torchrec"]["samples_per_s"]
    )
    record["pipelined_median_ms"] = 1e3 * statistics.median(piped_times)
    record["pipeline_gain"] = record["embshard"]["median_ms"] / record["pipelined_median_ms"]
    record["bare_tbe_ms"] = 1e3 * slowest([bare])[0]
    record["overhead_vs_bare_tbe"] = record["embshard"]["median_ms"] / record["bare_tbe_ms"]
    record["collectives_alone_ms"] = 1e3 * slowest([alone])[0]
    record["floor_ms"] = 1e3 * slowest([bare + alone])[0]
    record["step_over_floor"] = record["embshard"]["median_ms"] / record["floor_ms"]
    record["lookup_gather_gbps"] = bandwidth / 1e9
    record["duplicate_id_fraction_per_rank"] = per_rank(duplicates)
    return record
