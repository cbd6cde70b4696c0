"""One rank's figures on its own device (a GPU, or the CPU for a dry run): a training
step of embshard against a bare FBGEMM TBE doing the same lookups and update, and
against TorchRec's DMP on the same plan, tables and inputs; kernels and host time a
step; forward lookup bandwidth on tables far bigger than the caches, against the
device's own copy bandwidth. ``tools/gpu_check.py`` runs them in a one-rank world
(NCCL on CUDA)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torchrec import KeyedJaggedTensor

from .floor import received_ids
from .libraries import build, copy_weights, difference, loss
from .ops import count_step
from .workloads import make_inputs, make_plan, table_configs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[object], None], batches: list, device: torch.device) -> dict:
    """Each step's wall time (issued and finished on the device) and host time (until
    the call returns: launch overhead, plus any wait at a host sync), median ms."""
    walls, hosts = [], []
    for batch in batches:
        synchronize(device)
        start = time.perf_counter()
        step(batch)
        issued = time.perf_counter()
        synchronize(device)
        walls.append(time.perf_counter() - start)
        hosts.append(issued - start)
    return {
        "median_ms": 1e3 * statistics.median(walls),
        "host_ms": 1e3 * statistics.median(hosts),
    }


def kernels(step: Callable[[], None], device: torch.device) -> dict | None:
    """Device kernels and memory copies of one call of ``step`` (CUDA only), their
    device time, and the longest six by name."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    work = [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
    copies = sum(name.startswith(("Memcpy", "Memset")) for name, _ in work)
    longest = sorted(work, key=lambda w: -w[1])[:6]
    return {
        "kernels": len(work) - copies,
        "copies": copies,
        "device_ms": sum(us for _, us in work) / 1e3,
        "longest": [(name[:80], us / 1e3) for name, us in longest],
    }


def _bare_tbe(ours, device: torch.device):
    """A fresh TBE holding the rank's shards with the same weights: what embshard's
    lookup runs, without anything around it."""
    from embshard.storage.lookup import build_tbe
    from embshard.storage.optimizers import SGD

    storage = ours._storage
    shapes = [(s.rows, s.cols) for _, s in storage.shards]
    tables = [slot.tbe_table for slot in ours._routes.slots[ours.rank]]
    tbe = build_tbe(shapes, SGD(0.01), device, tables)
    for mine, theirs in zip(tbe.split_embedding_weights(), storage.tbe.split_embedding_weights()):
        mine.copy_(theirs)
    return tbe


def step_cells(
    workload: dict,
    batch_sizes: tuple[int, ...],
    plan_name: str,
    ids: str,
    steps: int,
    warmup: int,
    device: torch.device,
) -> list[dict]:
    """embshard's training step against a bare TBE on the ids its TBE received and
    against TorchRec's DMP, one rank, every batch already on the device: a record per
    batch size. Both libraries hold the same weights, drawn on the device by TorchRec's
    own init (embshard copies them from the unsharded module, TorchRec from embshard)."""
    import embshard

    from .workloads import collection

    configs = table_configs(workload)
    plan = make_plan(plan_name, configs, 1)
    ours = embshard.shard(collection(configs, device), plan)
    theirs = build("torchrec", configs, plan, 1, device=device)
    copy_weights(ours, theirs)
    return [
        {
            "batch": size,
            **_step_cell(
                ours, theirs, dict(workload, batch=size), plan_name, ids, steps, warmup, device
            ),
        }
        for size in batch_sizes
    ]


def _step_cell(ours, theirs, workload, plan_name, ids, steps, warmup, device) -> dict:
    batches = [b.to(device) for b in make_inputs(workload, 0, warmup + steps + 2, ids)]
    gap, scale = difference(ours, theirs, batches[0])
    record = {"plan": plan_name, "ids": ids, "max_difference": gap, "max_output": scale}

    def train(model):
        return lambda batch: loss(model, batch).backward()

    indices, offsets = received_ids(ours, batches[0])  # a training step: TorchRec's too
    train(theirs)(unseen(batches[0]))
    tbe = _bare_tbe(ours, device)
    gradient = torch.ones_like(tbe(indices, offsets))

    def bare(_batch) -> None:
        tbe(indices, offsets).backward(gradient)

    steppers = {"embshard": train(ours), "torchrec": train(theirs), "bare_tbe": bare}
    for batch in batches[:warmup]:
        for step in steppers.values():
            step(batch)
    timed_batches = batches[warmup : warmup + steps]
    for name, step in steppers.items():
        record[name] = timed(step, timed_batches, device)
    # Once more, the other way round, so neither library always follows the other:
    # each figure is the better of its two medians.
    for name, step in reversed(steppers.items()):
        again = timed(step, timed_batches, device)
        record[name] = min(record[name], again, key=lambda r: r["median_ms"])
    # Two more steps on batches neither library has seen, the same ids for both (each
    # its own copy: a KJT keeps what it computed), which keeps their weights equal for
    # the next batch size's cell.
    for library, model in (("embshard", ours), ("torchrec", theirs)):
        profiled, counted = unseen(batches[-2]), unseen(batches[-1])
        record[library]["kernels"] = kernels(lambda m=model, b=profiled: train(m)(b), device)
        record[library]["ops"] = count_step(model, counted).ops
    record["bare_tbe"]["kernels"] = kernels(lambda: bare(None), device)
    record["over_bare_tbe"] = record["embshard"]["median_ms"] / record["bare_tbe"]["median_ms"]
    record["throughput_ratio"] = record["torchrec"]["median_ms"] / record["embshard"]["median_ms"]
    return record


def unseen(batch: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A copy of ``batch`` that nothing has computed anything of yet."""
    weights = batch.weights_or_none()
    return KeyedJaggedTensor(
        keys=batch.keys(),
        values=batch.values().clone(),
        weights=None if weights is None else weights.clone(),
        lengths=batch.lengths().clone(),
    )


def copy_bandwidth(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def lookup_bandwidth(
    tables: int, rows: int, dim: int, batch: int, pooling: int, device: torch.device
) -> dict:
    """Bytes/s of the forward lookup of ``tables`` tables of ``rows`` x ``dim``, uniform
    ids, ``pooling`` a bag: embshard's sharded forward (one rank, table-wise) and the
    bare TBE's. Bytes: the rows read, the ids and offsets read, the pooled rows written."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    import embshard

    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"]
        )
        for i in range(tables)
    ]
    # Real weights made on the device (fast), each rank copying its rows from them.
    module = EmbeddingBagCollection(tables=configs, device=device)
    plan = embshard.ShardingPlan({c.name: embshard.table_wise(0) for c in configs})
    ours = embshard.shard(module, plan)
    del module
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rows, (tables * batch * pooling,), generator=generator)
    kjt = KeyedJaggedTensor(
        keys=[c.feature_names[0] for c in configs],
        values=ids,
        lengths=torch.full((tables * batch,), pooling),
    ).to(device)
    moved = (
        ids.numel() * dim * 4
        + ids.numel() * 8
        + (tables * batch + 1) * 8
        + batch * tables * dim * 4
    )
    indices, offsets = received_ids(ours, kjt)
    tbe = _bare_tbe(ours, device)
    figures = {"table_bytes": tables * rows * dim * 4, "bytes_per_forward": moved}
    for name, forward in (
        ("embshard", lambda: ours(kjt)),
        ("bare_tbe", lambda: tbe(indices, offsets)),
    ):
        with torch.no_grad():
            forward()
            times = []
            for _ in range(10):
                synchronize(device)
                start = time.perf_counter()
                forward()
                synchronize(device)
                times.append(time.perf_counter() - start)
            figures[name] = {
                "median_ms": 1e3 * statistics.median(times),
                "bytes_per_s": moved / statistics.median(times),
                "kernels": kernels(forward, device),
            }
    return figures
