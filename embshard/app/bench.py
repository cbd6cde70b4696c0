"""Benchmark embshard against TorchRec's DistributedModelParallel, side by side.

    embshard bench --world-sizes 2 4 --workloads a b c d --ids uniform --json bench.json
    (or .venv/bin/python tools/bench.py with the same options)

For each world size it starts W gloo processes (one thread each). For every workload
and plan, both libraries get the same tables, the same weights (TorchRec's local shards
are copied from embshard's) and the same pre-generated inputs, the same plan (converted
with ``embshard.to_torchrec_plan``, FUSED kernel) and the same fused optimizer
(EXACT_SGD), and, with ``--comm-precision fp16``, fp16 pooled all-to-alls (TorchRec's
qcomms; TorchRec falls back from bf16 to fp16 on gloo, embshard sends bf16). Outputs
are compared before anything is timed; then training steps
(forward, backward with the fused update) alternate between the two libraries. A
step's time is the slowest rank's. It also times the same per-rank lookups, backward
and update in a bare TBE (the data the rank's TBE received, one rank at a time so that
no two timings share the cores), and the step's collectives replayed alone with the
same sizes: their sum, the slowest rank's, is the step's floor on this machine. Also
the machine's gather bandwidth against the local lookup's, and the fraction of the
ids each rank's TBE received that repeat within their table (what deduplicating would
save).
Workload (e) is an EmbeddingCollection (a row per id; TorchRec's
EmbeddingCollectionSharder); a cell embshard refuses to shard (there: compressed
all-to-alls) is skipped, its reason recorded.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

# torch is imported inside the functions, so that `embshard bench --help` is quick.
if TYPE_CHECKING:
    import torch

CRITEO_KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip

# MLPerf DLRMv2 (DCNv2 on Criteo 1TB) multi-hot sizes: ids in every bag of each of the
# 26 features, in Criteo's feature order (facebookresearch/dlrm,
# torchrec_dlrm/scripts/materialize_synthetic_multihot_dataset.py).
MLPERF_MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27,
                          10, 3, 1, 1]  # fmt: skip


def width_by_rows(rows: int) -> int:
    """Workload (d)'s dimensions: wider for bigger tables, as production models size them."""
    return 16 if rows < 1_000 else 32 if rows < 100_000 else 64


# Workload (e), a sequence model over user histories: an item-id table big and hot, then
# smaller ones (categories, creators, ...), one dim (TorchRec's EmbeddingCollection takes
# one), and the mean length of each table's sequences (~150 ids a sample in all).
SEQUENCE_ROWS = [400_000, 200_000, 100_000, 50_000, 20_000, 10_000, 5_000, 1_000]
SEQUENCE_MEANS = [50, 30, 20, 20, 10, 10, 5, 5]

# Each table is (rows, dim, pooling). Bags: "mean" draws each bag's size uniformly from
# 1 to 2 * pooling - 1; "fixed" gives every bag exactly pooling ids (MLPerf's multi-hot).
# A "sequence" workload is an EmbeddingCollection (a row per id; its "bags" are
# sequences); the others are EmbeddingBagCollections.
WORKLOADS = {
    "a": {"tables": [(100_000, 64, 20)] * 8, "bags": "mean", "batch": 1024},
    "b": {"tables": [(10_000, 32, 5)] * 64, "bags": "mean", "batch": 1024},
    "c": {
        "tables": [(min(r, 1_000_000), 64, 1) for r in CRITEO_KAGGLE_ROWS],
        "bags": "mean",
        "batch": 1024,
    },
    "d": {
        "tables": [
            (min(r, 400_000), width_by_rows(r), hot)
            for r, hot in zip(CRITEO_KAGGLE_ROWS, MLPERF_MULTI_HOT_SIZES)
        ],
        "bags": "fixed",
        "batch": 512,
    },
    "e": {
        "tables": [(rows, 64, mean) for rows, mean in zip(SEQUENCE_ROWS, SEQUENCE_MEANS)],
        "bags": "mean",
        "batch": 512,
        "sequence": True,
    },
}
ID_LAWS = ["uniform", "power-law"]
LIBRARIES = ["embshard", "torchrec"]
PLANS = ["table_wise", "row_wise", "column_wise", "mixed"]
COMM_PRECISIONS = ["fp32", "fp16", "bf16"]
# Unit roundoff of the comm precisions: how far compressed outputs may drift, relatively.
UNIT_ROUNDOFF = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}


def table_configs(workload: str):
    """The workload's tables: EmbeddingConfigs for a sequence workload, else
    EmbeddingBagConfigs (the configs' type picks the module in both libraries)."""
    from torchrec import EmbeddingBagConfig, EmbeddingConfig

    spec = WORKLOADS[workload]
    config = EmbeddingConfig if spec.get("sequence") else EmbeddingBagConfig
    return [
        config(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
        for i, (rows, dim, _) in enumerate(spec["tables"])
    ]


def collection(configs, device: str | torch.device):
    """TorchRec's unsharded module of ``configs``: an EmbeddingCollection of
    EmbeddingConfigs, an EmbeddingBagCollection of EmbeddingBagConfigs."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig

    if all(isinstance(c, EmbeddingConfig) for c in configs):
        return EmbeddingCollection(tables=configs, device=device)
    return EmbeddingBagCollection(tables=configs, device=device)


def make_plan(name: str, configs, world: int):
    import embshard

    def spec(i: int, kind: str):
        if kind == "table_wise":
            return embshard.table_wise(i % world)
        if kind == "row_wise":
            return embshard.row_wise()
        blocks = world if configs[i].embedding_dim % (4 * world) == 0 else 1
        return embshard.column_wise([(i + b) % world for b in range(blocks)])

    kinds = ["table_wise", "row_wise", "column_wise"]
    return embshard.ShardingPlan(
        {c.name: spec(i, kinds[i % 3] if name == "mixed" else name) for i, c in enumerate(configs)}
    )


def make_inputs(workload: str, rank: int, steps: int, ids: str = "uniform"):
    """The rank's batches: ids uniform over each table's rows, or ``"power-law"`` as
    embshard's synthetic data draws them (low ids hot)."""
    import torch
    from torchrec import KeyedJaggedTensor

    from embshard.app.data import power_law_ids

    if ids not in ID_LAWS:
        raise ValueError(f"ids must be one of {ID_LAWS}, got {ids!r}")
    spec = WORKLOADS[workload]
    batch = spec["batch"]
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(steps):
        lengths, values = [], []
        for rows, _, pooling in spec["tables"]:
            if spec["bags"] == "fixed":
                bag = torch.full((batch,), pooling)
            else:
                bag = torch.randint(1, 2 * pooling, (batch,), generator=generator)
            lengths.append(bag)
            count = int(bag.sum())
            if ids == "uniform":
                values.append(torch.randint(0, rows, (count,), generator=generator))
            else:
                values.append(power_law_ids(rows, count, generator))
        keys = [f"f{i}" for i in range(len(spec["tables"]))]
        batches.append(
            KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
        )
    return batches


def build_torchrec(configs, plan, world: int, comm_precision: str = "fp32"):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec import EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    import embshard

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = collection(configs, torch.device("meta"))

        def forward(self, features):
            return self.tables(features)

    holder = Holder()
    sequence = isinstance(holder.tables, EmbeddingCollection)
    # FBGEMM's bounds check off, as in embshard's TBE (which checks ids before sending
    # them), so that both run the same kernels; TorchRec's default is WARNING.
    sharder = (EmbeddingCollectionSharder if sequence else EmbeddingBagCollectionSharder)(
        fused_params={
            "optimizer": EmbOptimType.EXACT_SGD,
            "learning_rate": 0.01,
            "bounds_check_mode": BoundsCheckMode.NONE,
        },
        qcomm_codecs_registry=get_qcomm_codecs_registry(
            QCommsConfig(CommType(comm_precision), CommType(comm_precision)),
            device=torch.device("cpu"),
        ),
    )
    module_plan = embshard.to_torchrec_plan(plan, configs, world)
    return DistributedModelParallel(
        holder,
        device=torch.device("cpu"),
        plan=ShardingPlan({"tables": module_plan}),
        sharders=[sharder],
    )


def build(library: str, configs, plan, world: int, comm_precision: str = "fp32"):
    """One library's sharded module on this rank, as the bench builds it."""
    import embshard

    if library == "torchrec":
        return build_torchrec(configs, plan, world, comm_precision)
    if library != "embshard":
        raise ValueError(f"library must be one of {LIBRARIES}, got {library!r}")
    return embshard.shard(collection(configs, "meta"), plan, comm_precision=comm_precision)


def copy_weights(ours, theirs) -> None:
    """TorchRec's local shards take embshard's values, matched by global offsets."""
    import torch

    state = theirs.state_dict()
    for name, weight in ours.weights.items():
        local = weight.to_local()
        mine = (
            dict(zip(map(tuple, local.local_offsets()), local.local_shards()))
            if local.numel()
            else {}
        )
        target = state[f"tables.{ours.table_key(name)}.weight"]
        shards = target.local_shards() if hasattr(target, "local_shards") else []
        for shard in shards:
            offsets = tuple(shard.metadata.shard_offsets)
            if shard.tensor.numel():
                with torch.no_grad():
                    shard.tensor.copy_(mine[offsets])


def output(model, batch):
    """The model's output: a KeyedTensor of pooled rows (an EmbeddingBagCollection), or
    a JaggedTensor per feature holding each id's row (an EmbeddingCollection)."""
    out = model(batch)
    return out.wait() if hasattr(out, "wait") else out


def values(out) -> list[torch.Tensor]:
    """Every value of an ``output``, in as few tensors as it holds."""
    return [jagged.values() for jagged in out.values()] if isinstance(out, dict) else [out.values()]


def by_key(out) -> dict[str, torch.Tensor]:
    """An ``output``'s values per feature."""
    return dict(zip(out, values(out))) if isinstance(out, dict) else out.to_dict()


def loss(model, batch) -> torch.Tensor:
    """A training step's loss, the same for both libraries: the sum of every output value."""
    return sum(v.sum() for v in values(output(model, batch)))


def difference(ours, theirs, batch) -> tuple[float, float]:
    """Largest difference of the two outputs, key by key (TorchRec orders keys its own
    way), and the largest output value."""
    import torch

    with torch.no_grad():
        mine, other = by_key(output(ours, batch)), by_key(output(theirs, batch))
    gap = max((mine[k] - other[k]).abs().max().item() for k in mine)
    return gap, max(v.abs().max().item() for v in other.values())


def train_step(model, batch) -> float:
    """One training step's time on this rank. The ranks start it together: the two
    libraries' steps alternate, and without the barrier a rank that finished the other
    library's step early would wait for the rest inside this one, charging that
    library's imbalance to this one."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss(model, batch).backward()
    return time.perf_counter() - start


def pipelined_steps(model, batches) -> list[float]:
    """Step times of embshard's pipeline (``prefetch``, as ``TrainPipeline`` does): each
    step starts the next batch's input distribution, then runs its own forward and
    backward. The first batch is distributed before the clock starts."""
    model.prefetch(batches[0])
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        if i + 1 < len(batches):
            model.prefetch(batches[i + 1])
        loss(model, batch).backward()
        times.append(time.perf_counter() - start)
    return times


class CollectiveBytes:
    """Counts the bytes a rank hands to torch.distributed's collectives, in all and by
    dtype, and keeps each call (its tensors as uninitialised twins) for ``replay``."""

    OUTPUT_FIRST = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
                    "reduce_scatter_tensor")  # fmt: skip
    NAMES = (*OUTPUT_FIRST, "all_reduce", "broadcast")

    def __init__(self) -> None:
        self.bytes = 0
        self.by_dtype: dict[torch.dtype, int] = {}
        self.calls: list[tuple[Callable, dict]] = []
        self.originals: dict[str, Callable] = {}

    def __enter__(self) -> CollectiveBytes:
        import torch
        import torch.distributed as dist

        def twin(value):
            if isinstance(value, list | tuple):
                return [twin(v) for v in value]
            return torch.empty_like(value) if isinstance(value, torch.Tensor) else value

        for name in self.NAMES:
            original = getattr(dist, name)
            self.originals[name] = original

            def wrapped(*args, _original=original, _name=name, **kwargs):
                bound = inspect.signature(_original).bind(*args, **kwargs)
                sent = list(bound.signature.parameters)[1 if _name in self.OUTPUT_FIRST else 0]
                tensors = bound.arguments[sent]
                tensors = tensors if isinstance(tensors, list | tuple) else [tensors]
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        size = t.numel() * t.element_size()
                        self.bytes += size
                        self.by_dtype[t.dtype] = self.by_dtype.get(t.dtype, 0) + size
                arguments = {k: twin(v) for k, v in bound.arguments.items()}
                self.calls.append((_original, arguments))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, original in self.originals.items():
            setattr(dist, name, original)

    def replay(self, repeats: int) -> float:
        """The median time of the calls made again, one after another, each waited on,
        with nothing else running: the collectives' share of the step's floor. The
        ranks start each repeat together. Collective: every rank calls it."""
        import torch.distributed as dist

        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for original, arguments in self.calls:
                work = original(**arguments)
                if work is not None:
                    work.wait()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def per_step_comm(model, batch) -> tuple[int, CollectiveBytes]:
    """The backend collectives of one training step, and what this rank handed them."""
    from torch.profiler import ProfilerActivity, profile

    with CollectiveBytes() as counter, profile(activities=[ProfilerActivity.CPU]) as prof:
        loss(model, batch).backward()
    return sum(e.name.startswith("gloo:") for e in prof.events()), counter


def received_ids(ours, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The indices and offsets this rank's TBE receives for ``batch`` in one training
    step (collective: every rank calls it); None on a rank without a TBE."""
    captured = {}
    storage = ours._storage
    original = storage.tbe

    def capture(indices, offsets, per_sample_weights=None):
        captured.update(indices=indices.clone(), offsets=offsets.clone())
        return original(indices, offsets, per_sample_weights=per_sample_weights)

    if original is not None:
        storage.tbe = capture
    loss(ours, batch).backward()
    storage.tbe = original
    return (captured["indices"], captured["offsets"]) if original is not None else None


def repeated_ids(ids: torch.Tensor) -> int:
    """How many of ``ids`` repeat an earlier one: lookups deduplication would save."""
    return ids.numel() - ids.unique().numel()


def duplicate_fraction(indices: torch.Tensor, offsets: torch.Tensor, slots: int) -> float:
    """Of the ids a TBE received (``slots`` table shards, TBE layout), the fraction
    that repeat an id of the same shard."""
    starts = offsets[:: (len(offsets) - 1) // slots].tolist()
    repeated = sum(repeated_ids(indices[a:b]) for a, b in itertools.pairwise(starts))
    return repeated / max(1, indices.numel())


def bare_tbe_time(ours, received, repeats: int) -> tuple[float, float]:
    """The rank's own lookups, backward and update in a fresh TBE with the same
    weights, on the indices its TBE received (``received_ids``), and the forward's
    achieved gather bandwidth. Collective: the ranks take turns, the others waiting at
    a barrier, so that no rank's timing shares the cores with another's (timed
    together at W = 4 on 2 cores, each would get half a core, and the floor would come
    out above the step). One untimed call first; the output's gradient is allocated
    once, as a step's arrives in the all-to-all's buffer."""
    import torch.distributed as dist

    result = (0.0, 0.0)
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank() and received is not None:
            result = _time_bare_tbe(ours, *received, repeats)
    dist.barrier()
    return result


def _time_bare_tbe(ours, indices, offsets, repeats: int) -> tuple[float, float]:
    import torch

    from embshard.storage.lookup import build_tbe
    from embshard.storage.optimizers import SGD

    shards, sharded = ours._storage.shards, ours._storage.tbe
    tbe = build_tbe([(s.rows, s.cols) for _, s in shards], SGD(0.01), torch.device("cpu"),
                    [slot.tbe_table for slot in ours._routes.slots[ours.rank]])  # fmt: skip
    # The same weights: every page touched before timing, as the sharded TBE's are.
    for mine, theirs in zip(tbe.split_embedding_weights(), sharded.split_embedding_weights()):
        mine.copy_(theirs)
    gradient = torch.ones_like(tbe(indices, offsets))
    tbe(indices, offsets).backward(gradient)  # untimed: the first call's page faults
    times, forwards = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = tbe(indices, offsets)
        forwards.append(time.perf_counter() - start)
        out.backward(gradient)
        times.append(time.perf_counter() - start)
    dims = ours._routes.slot_dims(ours.rank)
    batch_size = (len(offsets) - 1) // len(dims)
    counts = (offsets[1:] - offsets[:-1]).view(len(dims), batch_size).sum(1).tolist()
    gathered = sum(c * d * 4 for c, d in zip(counts, dims))
    return statistics.median(times), gathered / statistics.median(forwards)


def slowest(values: list[float]) -> list[float]:
    """Per step, the largest value over ranks."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def per_rank(value: float) -> list[float]:
    """Every rank's ``value``, in rank order, on every rank."""
    import torch
    import torch.distributed as dist

    values = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return values.tolist()


def bench_case(
    workload: str,
    plan_name: str,
    steps: int,
    warmup: int,
    comm_precision: str = "fp32",
    ids: str = "uniform",
) -> dict:
    import torch.distributed as dist

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
        record[name] = {
            "median_ms": 1e3 * statistics.median(times),
            "p10_ms": 1e3 * percentile(times, 0.1),
            "p90_ms": 1e3 * percentile(times, 0.9),
            "samples_per_s": samples / statistics.median(times),
            "collectives_per_step": collectives,
            "bytes_sent_per_rank": max(slowest([float(sent.bytes)])),
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


def quiet_worker() -> None:
    """Silence what a worker would print that says nothing of the run: TorchRec's
    calls of the collectives torch 2.13 deprecates (a FutureWarning each), and kineto's
    USDT lines at every start and stop of the profiler that counts the collectives
    (``per_step_comm``). Kineto reads its level when a profile starts; 6 is above
    USDT's 5, its highest (its errors, 4, are below USDT's level already)."""
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def worker(rank: int, world: int, store: str, args: Options, results) -> None:
    import torch
    import torch.distributed as dist

    from embshard.runtime.teardown import shutdown

    quiet_worker()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    records = []
    for workload in args.workloads:
        for plan_name in args.plans:
            record = bench_case(workload, plan_name, args.steps, args.warmup,
                                args.comm_precision, args.ids)  # fmt: skip
            records.append(record)
            if rank == 0:
                print(summary_line(record), flush=True)
    if rank == 0:
        results.put(records)
    shutdown()  # TorchRec's DMP holds gloo groups that can abort a normal exit


def gather_bandwidth(rows: int = 1 << 22, dim: int = 64, ids: int = 8 * 1024 * 20) -> float:
    """Bytes/s of summing random rows of a 1 GiB table (bigger than the caches), one thread."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    table = torch.randn(rows, dim)
    index = torch.randint(0, rows, (ids,))
    offsets = torch.arange(0, ids, 20)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        F.embedding_bag(index, table, offsets, mode="sum")
        times.append(time.perf_counter() - start)
    return ids * dim * 4 / statistics.median(times)


def summary_line(r: dict) -> str:
    head = f"W={r['world_size']} {r['workload']} {r['plan']:<12} {r['comm_precision']} {r['ids']}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if not r["outputs_equal"]:
        return f"{head} outputs differ by {r['max_difference']:.2e}: not timed"
    ours, theirs = r["embshard"], r["torchrec"]
    return (
        f"{head} embshard {ours['median_ms']:7.2f} ms [{ours['p10_ms']:.2f}-{ours['p90_ms']:.2f}] "
        f"{ours['collectives_per_step']} coll {ours['bytes_sent_per_rank'] / 2**20:6.2f} MiB | "
        f"torchrec {theirs['median_ms']:7.2f} ms [{theirs['p10_ms']:.2f}-{theirs['p90_ms']:.2f}] "
        f"{theirs['collectives_per_step']} coll {theirs['bytes_sent_per_rank'] / 2**20:6.2f} MiB | "
        f"ratio {r['throughput_ratio']:.2f}x | bare TBE {r['bare_tbe_ms']:.2f} ms "
        f"(x{r['overhead_vs_bare_tbe']:.2f}) + collectives alone "
        f"{r['collectives_alone_ms']:.2f} ms (x{r['step_over_floor']:.2f}) | "
        f"pipelined {r['pipelined_median_ms']:.2f} ms (x{r['pipeline_gain']:.2f}) | repeated ids "
        + " ".join(f"{f:.2f}" for f in r["duplicate_id_fraction_per_rank"])
    )


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if r.get("outputs_equal")]
    labels = [f"{r['workload']}/{r['plan']}\nW={r['world_size']}" for r in timed]
    x = range(len(timed))
    figure, axes = plt.subplots(figsize=(max(8, len(timed) * 0.9), 4.5))
    axes.bar(
        [i - 0.2 for i in x], [r["embshard"]["samples_per_s"] for r in timed], 0.4, label="embshard"
    )
    axes.bar(
        [i + 0.2 for i in x],
        [r["torchrec"]["samples_per_s"] for r in timed],
        0.4,
        label="TorchRec DMP",
    )
    axes.set_xticks(list(x), labels, fontsize=7)
    axes.set_ylabel("training samples/s (all ranks)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


@dataclass(frozen=True)
class Options:
    """What ``embshard bench`` runs (its options, the same names)."""

    world_sizes: tuple[int, ...] = (2, 4)
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    plans: tuple[str, ...] = tuple(PLANS)
    steps: int = 20  # timed training steps
    warmup: int = 5  # untimed steps before them
    comm_precision: str = "fp32"
    ids: str = "uniform"
    json: str = "bench.json"
    png: str | None = None


def run(options: Options) -> list[dict]:
    """Run the benchmark: a gloo world of each size in turn, its records written to
    ``options.json`` (and plotted to ``options.png``); returns them."""
    import torch.multiprocessing as mp

    limit = gather_bandwidth()
    print(f"machine: random-row gather bandwidth {limit / 1e9:.2f} GB/s (one thread)", flush=True)
    records = []
    for world in options.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            results = mp.get_context("spawn").SimpleQueue()
            mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), options, results),
                               nprocs=world, start_method="spawn")  # fmt: skip
            records += results.get()
    for r in records:
        if r.get("outputs_equal"):
            r["lookup_fraction_of_gather_limit"] = r["lookup_gather_gbps"] * 1e9 / limit
    Path(options.json).write_text(
        json.dumps({"gather_gbps": limit / 1e9, "results": records}, indent=2)
    )
    if options.png:
        plot(records, options.png)
    print(f"wrote {options.json}" + (f" and {options.png}" if options.png else ""), file=sys.stderr)
    return records
