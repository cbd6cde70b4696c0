"""2-D plans: a plan made for a sharding group of G ranks, copied on each of the
W / G groups of a W-rank job, and the all-reduce that averages the copies each step.

Each rank's all-reduce moves ``2 (R - 1) / R`` times its local shards' weights and
fused optimizer state as float32 (``sync_replicas`` flattens them into one float32
buffer), R = W / G the replicas, in a ring of ``2 (R - 1)`` messages: across hosts
where a replica peer is on another host, inside its host otherwise. The buffer is a
second copy of them for the time of the all-reduce, so a rank's shards, state and
buffer must fit its usable memory. The planner chooses G by planning each candidate
and keeping the lowest step: the slowest rank, all-reduce included, plus the base.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from embshard.errors import PlanError, PlanningError
from embshard.plan.specs import ShardingPlan, plural
from embshard.planner.report import PlanReport, RankLoad
from embshard.planner.search import SAME_WITHIN
from embshard.planner.tables import AnyTable, as_config
from embshard.planner.topology import Topology, format_bytes
from embshard.storage.optimizers import state_values

Planner = Callable[[Topology], tuple[ShardingPlan, PlanReport]]


@dataclass(frozen=True)
class GroupEstimate:
    """One candidate group size: its step (slowest rank, all-reduce included, plus the
    base), or why it has none (its plan did not fit)."""

    size: int
    step: float | None
    problem: str = ""

    def text(self) -> str:
        shown = f"{1e3 * self.step:.3f} ms" if self.step is not None else "does not fit"
        return f"G={self.size}: {shown}"


@dataclass(frozen=True)
class GroupChoice:
    """A plan's sharding groups: ``size`` ranks each in a ``world_size`` job, each
    group rank's all-reduce (seconds, in its report cost; bytes of its float32 buffer),
    and the candidates weighed where the planner chose the size."""

    size: int
    world_size: int
    sync: tuple[float, ...]
    sync_bytes: tuple[int, ...]
    across_hosts: bool
    candidates: tuple[GroupEstimate, ...] = ()

    @property
    def replicas(self) -> int:
        return self.world_size // self.size

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "replicas": self.replicas,
            "sync_s": list(self.sync),
            "sync_bytes": list(self.sync_bytes),
            "sync_across_hosts": self.across_hosts,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
        }

    def lines(self) -> list[str]:
        groups = f"{plural(self.replicas, 'sharding group')} of {self.size}"
        lines = [f"{groups} in {self.world_size} ranks"]
        if self.replicas > 1:
            where = "across hosts" if self.across_hosts else "inside a host"
            lines.append(
                f"  each rank's cost includes its all-reduce of its shards and state over "
                f"{self.replicas} replicas, {where}: up to {1e3 * max(self.sync):.3f} ms "
                f"({format_bytes(max(self.sync_bytes))} as float32)"
            )
        if self.candidates:
            shown = "; ".join(c.text() for c in self.candidates)
            lines.append(f"  chosen as the lowest step (slowest rank + base) of {shown}")
        return lines


def group_topology(job: Topology, size: int) -> Topology:
    """The topology a sharding group of ``size`` of ``job``'s ranks is planned on: its
    ranks, on hosts of ``job``'s ranks per host or ``size``, whichever is fewer."""
    return dataclasses.replace(job, world_size=size, ranks_per_host=min(job.ranks_per_host, size))


def candidate_sizes(job: Topology) -> list[int]:
    """The group sizes the planner weighs, largest first: the world, and every whole
    number of hosts that divides it (a group smaller than a host leaves its all-to-alls
    inside the host, as a host's group does, with more copies to keep and average)."""
    world, host = job.world_size, job.ranks_per_host
    hosts = {host * k for k in range(1, world // host + 1) if world % (host * k) == 0}
    return sorted(hosts | {world}, reverse=True)


def sync_bytes(
    plan: ShardingPlan, tables: Sequence[AnyTable], topology: Topology, optimizer: str
) -> list[int]:
    """Each rank's float32 all-reduce buffer: its shards' weights and fused optimizer
    state (copies, data-parallel tables and hot rows, included)."""
    resolved = plan.resolve([as_config(t) for t in tables], topology.world_size)
    found = [0] * topology.world_size
    for table in resolved.values():
        for shard in table.shards:
            values = shard.rows * shard.cols
            found[shard.rank] += 4 * (values + state_values(optimizer, shard.rows, shard.cols))
    return found


def spans_hosts(job: Topology, size: int, rank: int) -> bool:
    """Whether group rank ``rank``'s replica peers (``rank + k size``) span hosts."""
    peers = range(rank, job.world_size, size)
    return len({peer // job.ranks_per_host for peer in peers}) > 1


def ring_bytes(replicas: int, nbytes: int) -> float:
    """Bytes each replica sends in a ring all-reduce of ``nbytes`` over ``replicas``."""
    return 2 * (replicas - 1) / replicas * nbytes


def sync_seconds(job: Topology, size: int, rank: int, nbytes: int) -> float:
    """Group rank ``rank``'s all-reduce of ``nbytes``: a ring over the replicas."""
    replicas = job.world_size // size
    if replicas <= 1:
        return 0.0
    moved = ring_bytes(replicas, nbytes)
    if spans_hosts(job, size, rank):
        return job.seconds(0, moved) + 2 * (replicas - 1) * job.inter_latency
    return job.seconds(moved, 0) + 2 * (replicas - 1) * job.intra_latency


def replicated(
    plan: ShardingPlan,
    report: PlanReport,
    tables: Sequence[AnyTable],
    job: Topology,
    optimizer: str,
) -> PlanReport:
    """``report`` of ``plan`` (made for a sharding group of ``report``'s ranks) in
    ``job``: each rank's cost with its all-reduce added. A PlanningError where a rank's
    shards, state and all-reduce buffer exceed its usable memory."""
    size = report.topology.world_size
    buffers = sync_bytes(plan, tables, report.topology, optimizer)
    if size < job.world_size:
        for load, buffer in zip(report.ranks, buffers):
            if load.memory + buffer > job.usable_memory:
                raise PlanningError(
                    f"sharding groups of {size}: rank {load.rank} needs "
                    f"{format_bytes(load.memory)} of shards and state and "
                    f"{format_bytes(buffer)} of float32 all-reduce buffer, more than its "
                    f"{format_bytes(job.usable_memory)} usable"
                )
    sync = [sync_seconds(job, size, r, b) for r, b in enumerate(buffers)]
    ranks = [
        RankLoad(load.rank, load.memory, load.cost + s, load.shards)
        for load, s in zip(report.ranks, sync)
    ]
    across = any(spans_hosts(job, size, r) for r in range(size))
    group = GroupChoice(size, job.world_size, tuple(sync), tuple(buffers), across)
    return dataclasses.replace(report, ranks=ranks, group=group)


def plan_groups(
    planner: Planner,
    tables: Sequence[AnyTable],
    job: Topology,
    optimizer: str,
    sizes: Sequence[int],
) -> tuple[ShardingPlan, PlanReport]:
    """The plan, for one sharding group, of the size in ``sizes`` (each dividing the
    job's world) whose step is lowest, ties to the larger group (fewer copies);
    ``planner`` plans for a group's topology. With several sizes, the report lists
    every candidate's step; with none fitting, the largest one's PlanningError."""
    best: tuple[ShardingPlan, PlanReport] | None = None
    estimates, problems = [], []
    for size in sizes:
        try:
            plan, report = planner(group_topology(job, size))
            report = replicated(plan, report, tables, job, optimizer)
        except (PlanningError, PlanError) as e:
            problems.append(e)
            estimates.append(GroupEstimate(size, None, str(e)))
            continue
        step = report.slowest + report.base_cost
        estimates.append(GroupEstimate(size, step))
        if best is None or step < (best[1].slowest + best[1].base_cost) / SAME_WITHIN:
            best = plan, report
    if best is None:
        raise problems[0]
    plan, report = best
    if len(sizes) > 1:
        group = dataclasses.replace(report.group, candidates=tuple(estimates))
        report = dataclasses.replace(report, group=group)
    return plan, report
