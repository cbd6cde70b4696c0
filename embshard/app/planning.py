"""Planning a training config: its topology, its tables' constraints, the traffic of
its data, and its own plan if it gives one; the planner itself takes none of these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

import numpy as np
import torch

from embshard.app.config import GroupSize, TrainConfig
from embshard.app.data import Batch, build_data
from embshard.errors import ConfigError, PlanningError
from embshard.plan.specs import ShardingPlan
from embshard.planner.cost import CostModel
from embshard.planner.groups import candidate_sizes, plan_groups
from embshard.planner.report import PlanReport
from embshard.planner.search import plan_report, plan_tables
from embshard.planner.tables import TableConstraint, planned_tables
from embshard.planner.topology import SIZE_FIELDS, Topology, format_bytes, parse_bytes
from embshard.planner.traffic import TableTraffic, TrafficStats, balanced_plan
from embshard.runtime.keys import bucket_of, hash_ids
from embshard.storage.id_map import IdMapSpec


def topology_for(
    config: TrainConfig,
    world_size: int,
    memory_per_rank: str | int | None = None,
    ranks_per_host: int | None = None,
) -> Topology:
    """The config's topology (its kind's defaults, then its overrides) for a world;
    ``memory_per_rank`` and ``ranks_per_host`` in place of the config's where given."""
    t = config.topology
    overrides = {
        f.name: getattr(t, f.name)
        for f in fields(t)
        if f.name != "kind" and getattr(t, f.name) is not None
    }
    if memory_per_rank is not None:
        overrides["memory_per_rank"] = memory_per_rank
    if ranks_per_host is not None:
        overrides["ranks_per_host"] = ranks_per_host
    overrides |= {k: parse_bytes(overrides[k]) for k in SIZE_FIELDS if k in overrides}
    kind = Topology.gpu if t.kind == "gpu" else Topology.cpu
    return kind(world_size, **overrides)


def plan_config(
    config: TrainConfig,
    world_size: int,
    memory_per_rank: str | int | None = None,
    stats: TrafficStats | None = None,
    ranks_per_host: int | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """Plan a training config's tables, with its tables' constraints and optimizer (and
    measured ``stats``, see ``plan_tables``), for ``topology_for``'s topology; a config
    with its own ``plan:`` (which training uses) gets that plan, and its report."""
    topology = topology_for(config, world_size, memory_per_rank, ranks_per_host)
    return _plan_on(config, topology, stats)


def plan_job(
    config: TrainConfig,
    world_size: int,
    memory_per_rank: str | int | None = None,
    stats: TrafficStats | None = None,
    ranks_per_host: int | None = None,
    group_size: GroupSize | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """``plan_config`` for a job of ``world_size`` ranks in sharding groups of
    ``group_size`` (else the config's ``sharding_group_size``): the plan for one group,
    its report with each rank's all-reduce over the replicas priced (``planner.groups``);
    ``auto`` plans every candidate size and keeps the lowest step. One group of every
    rank is ``plan_config``'s plan and report. The choice is the same on every rank:
    the planner is deterministic."""
    size = config.sharding_group_size if group_size is None else group_size
    if size in (None, world_size):
        return plan_config(config, world_size, memory_per_rank, stats, ranks_per_host)
    job = topology_for(config, world_size, memory_per_rank, ranks_per_host)
    if size == "auto":
        sizes = candidate_sizes(job)
    elif size < 1 or world_size % size:
        raise ConfigError(f"sharding group size {size} does not divide the {world_size} ranks")
    else:
        sizes = [size]
    return plan_groups(
        lambda topology: _plan_on(config, topology, stats),
        config.tables,
        job,
        config.sparse_optimizer.type,
        sizes,
    )


def _plan_on(
    config: TrainConfig, topology: Topology, stats: TrafficStats | None
) -> tuple[ShardingPlan, PlanReport]:
    optimizer = config.sparse_optimizer.type
    given = config.sharding_plan()
    if given is not None:
        return given, _report(given, config, topology, "the config's own plan says so")
    constraints = {
        t.name: TableConstraint(
            tuple(t.shardings or ()) or None, tuple(t.ranks) if t.ranks else None, t.column_blocks
        )
        for t in config.tables
    }
    return plan_tables(
        config.tables,
        topology,
        config.batch_size,
        constraints,
        optimizer,
        stats=stats,
        dynamic=config.id_maps(),
    )


def lookup_balanced_plan(
    config: TrainConfig,
    world_size: int,
    stats: TrafficStats,
    memory_per_rank: str | int | None = None,
    ranks_per_host: int | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """``traffic.balanced_plan`` of a config's tables, their row blocks spread over the
    ranks by the bytes of their rows (weights and optimizer state), and its report; a
    PlanningError naming the first rank whose shards exceed its usable memory."""
    topology = topology_for(config, world_size, memory_per_rank, ranks_per_host)
    model = CostModel(topology, config.batch_size, config.sparse_optimizer.type)
    specs = planned_tables(config.tables, dynamic=config.id_maps())
    row_bytes = {t.name: model.memory(t, 1, t.embedding_dim) for t in specs}
    buckets = {t.name: t.rows_per_bucket for t in specs if t.dynamic}
    plan = balanced_plan(stats, world_size, row_bytes, buckets)
    report = _report(
        plan, config, topology, "--balance-lookups balances every rank's lookups", stats
    )
    for load in report.ranks:
        if load.memory > topology.usable_memory:
            raise PlanningError(
                f"the lookup-balanced plan does not fit: rank {load.rank} needs "
                f"{format_bytes(load.memory)} of {format_bytes(topology.usable_memory)} usable"
            )
    return plan, report


def _report(
    plan: ShardingPlan,
    config: TrainConfig,
    topology: Topology,
    reason: str,
    stats: TrafficStats | None = None,
) -> PlanReport:
    return plan_report(
        plan,
        config.tables,
        topology,
        config.batch_size,
        config.sparse_optimizer.type,
        reason,
        stats,
        config.id_maps(),
    )


def count_traffic(config: TrainConfig, batches: Iterable[Batch]) -> TrafficStats:
    """The lookups per row, bags and samples of each of ``config``'s tables over
    ``batches`` (a table's lookups are those of all features it serves). A dynamic
    table's raw ids are counted on the first row of the bucket their key falls in:
    which of its rows an id gets is the map's to decide, its bucket is fixed."""
    maps = config.id_maps()
    ids: dict[str, list[np.ndarray]] = {t.name: [] for t in config.tables}
    bags = dict.fromkeys(ids, 0)
    samples = 0
    for batch in batches:
        samples += batch.size
        features = batch.sparse.to_dict()
        for table in config.tables:
            for feature in table.features:
                jagged = features[feature]
                ids[table.name].append(_rows(jagged.values(), maps.get(table.name)))
                bags[table.name] += int((jagged.lengths() > 0).sum())
    tables = {}
    for table in config.tables:
        values = np.concatenate(ids[table.name]) if ids[table.name] else np.zeros(0, np.int64)
        rows, counts = np.unique(values, return_counts=True)
        tables[table.name] = TableTraffic(
            table.num_embeddings, rows, counts, samples, bags[table.name]
        )
    return TrafficStats(tables)


def _rows(values: torch.Tensor, spec: IdMapSpec | None) -> np.ndarray:
    """A feature's ids as the rows counted for them (``count_traffic``)."""
    if spec is None:
        return values.numpy()
    return (bucket_of(hash_ids(values), spec.buckets) * spec.rows_per_bucket).numpy()


def measure_traffic(
    config: TrainConfig, world_size: int, batches: int = 4, ranks: int = 2
) -> TrafficStats:
    """``batches`` batches of each of the first ``ranks`` ranks' data readers (those
    training builds for a world of ``world_size``): a cheap sample of the traffic."""

    def read() -> Iterable[Batch]:
        for rank in range(min(ranks, world_size)):
            reader = build_data(config, rank, world_size)
            for _, batch in zip(range(batches), reader.epoch_batches()):
                yield batch

    return count_traffic(config, read())
