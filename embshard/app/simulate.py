"""``embshard simulate``: a training step's input distribution for N ranks in one process.

In the full mode every rank is a thread of this process and a rank of torch's
in-process threaded process group, so embshard's own input stage runs unchanged: each
rank reads its own part of the data (as in training), and the sharded module's input
stage checks and routes its batch, exchanges counts and sends the ids, real
all-to-alls between the threads. The streamed mode (``embshard.app.streamed``) routes
one sending rank's batch at a time and counts what each rank would receive, in memory
that does not grow with the ranks. The tables are never allocated: the pooled
all-to-alls' bytes follow from the batch sizes and the slot widths, the memory from
the planner's model. A run that would not fit in memory is refused before it starts
(``embshard.app.sim_memory``). ``check`` runs the whole module (forward, backward,
fused update) on a small copy of the model against the unsharded oracle, in a full
simulated world.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg

from embshard.app.config import TrainConfig, check_sparse_optimizer, load_config
from embshard.app.data import Feed, build_data
from embshard.app.planning import plan_job, topology_for
from embshard.app.rank_report import (
    RankReport,
    Traffic,
    across_hosts,
    copies_looked_up,
    pooled_widths,
    step_report,
)
from embshard.app.sim_maps import rank_maps, record_maps
from embshard.app.sim_memory import (
    MODES,
    MemoryNeed,
    available_memory,
    check_need,
    default_mode,
    input_need,
    ranks_that_fit,
)
from embshard.app.streamed import stream_ranks
from embshard.app.train import fused_optimizer
from embshard.errors import EmbshardError
from embshard.modules.mesh import forget_meshes
from embshard.plan.specs import ShardedTable, ShardingPlan, plural
from embshard.planner.cost import LOOKUP_PASSES
from embshard.planner.groups import (
    group_topology,
    ring_bytes,
    spans_hosts,
    sync_bytes,
    sync_seconds,
)
from embshard.planner.search import plan_loads
from embshard.planner.topology import Topology, format_bytes
from embshard.runtime.input_dist import InputDistribution, start_input_dist
from embshard.runtime.routes import Routes, build_routes
from embshard.runtime.scratch import Scratch
from embshard.storage.dynamic import check_dynamic
from embshard.storage.id_map import IdMapSpec

T = TypeVar("T")

CHECK_ROWS = 256  # rows per table at most in --check's small model
CHECK_BATCH = 4  # samples per rank in --check
CHECK_TOLERANCE = 1e-5


class SimulationError(EmbshardError, ValueError):
    """A simulation that cannot run as asked; the message says why."""


def run_ranks(world_size: int, fn: Callable[..., T], *args: Any) -> list[T]:
    """``fn(*args)`` on ``world_size`` threads, each a rank of one threaded process
    group (``torch.testing``'s in-process backend: its all-to-alls copy between the
    threads), so embshard's collectives run as they are. The ranks' results; the
    first error any rank raised is raised here, after every rank stopped."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(*args)
        except BaseException as e:
            errors.append(e)
            multi_threaded_pg.ProcessLocalGroup.exception_handle(e)  # wake the others
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    multi_threaded_pg.ProcessLocalGroup.reset()
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        multi_threaded_pg.ProcessLocalGroup.reset()
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        # Meshes are cached per thread id, and a later world's threads may reuse ids.
        forget_meshes()
    raised = [e for e in errors if not isinstance(e, SystemExit)]  # woken ranks exit
    if raised or errors:
        raise (raised or errors)[0]
    return results


def _install_threaded_pg() -> None:
    """torch's threaded process group, with the ``comms`` list (none: the threaded
    backend makes no comms) that ``destroy_process_group`` reads and torch 2.11's
    threaded world lacks, so that every rank's teardown runs to its end."""
    if not hasattr(multi_threaded_pg.ThreadLocalWorld, "comms"):
        multi_threaded_pg.ThreadLocalWorld.comms = property(lambda self: [])
    multi_threaded_pg._install_threaded_pg()


@dataclass(frozen=True)
class Check:
    """``--check``: the largest differences from the unsharded oracle."""

    forward: float
    weights: float
    rows: int
    batch_size: int
    steps: int

    @property
    def passed(self) -> bool:
        return max(self.forward, self.weights) < CHECK_TOLERANCE


@dataclass
class Simulation:
    """What ``simulate`` found: every rank's report, and the check's if asked."""

    config: str
    world_size: int
    batches: int
    batch_size: int
    data: str
    plan_source: str
    ranks_per_host: int
    mode: str
    ranks: list[RankReport]
    seconds_taken: float
    check: Check | None = None
    # Sharding groups (2-D): the ranks of one, which ``ranks`` are (the others hold
    # copies and see the same kind of traffic); None: one group of every rank.
    group_size: int | None = None

    @property
    def slowest(self) -> RankReport:
        return max(self.ranks, key=lambda r: r.seconds)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for rank, report in zip(out["ranks"], self.ranks):
            rank["inside"], rank["across"] = asdict(report.inside), asdict(report.across)
        out["slowest"] = {"rank": self.slowest.rank, "why": self.why_slowest()}
        if self.check is not None:
            out["check"]["passed"] = self.check.passed
        return out

    def why_slowest(self) -> str:
        """The slowest rank at the planner's prices, and what it has more of."""
        slow = self.slowest
        measures: list[tuple[str, Callable[[RankReport], float]]] = [
            ("looks up {} bytes", lambda r: r.lookup_bytes),
            ("receives {} ids", lambda r: r.ids_received),
            ("moves {} bytes", lambda r: r.moved),
        ]
        parts = [
            phrase.format(_times_mean(value, slow, self.ranks))
            + (" (the most)" if value(slow) == max(map(value, self.ranks)) else "")
            for phrase, value in measures
        ]
        shares = {
            "lookups": slow.lookup_seconds,
            "communication": slow.moving_seconds,
            "its all-reduce over its copies": slow.sync_seconds,
            "its id maps' remaps": slow.remap_seconds,
        }
        mostly = max(shares, key=shares.__getitem__)  # ties: the first
        return (
            f"rank {slow.rank}, {1e3 * slow.seconds:.3f} ms a step estimated "
            f"({_times_mean(lambda r: r.seconds, slow, self.ranks)} rank's), mostly {mostly}: "
            f"it {', '.join(parts)}; it holds {', '.join(slow.shards) or 'nothing'}"
        )

    def to_text(self, max_ranks: int = 64) -> str:
        steps = self.batches
        counts = self.ranks[0].counts.sent // steps
        hosts = -(-self.world_size // self.ranks_per_host)
        groups = ""
        if self.group_size:
            replicas = self.world_size // self.group_size
            groups = (
                f" as {replicas} sharding groups of {self.group_size}, one simulated (its "
                "copies in the others see the same kind of traffic)"
            )
        lines = [
            f"{self.config} on {self.world_size} ranks, {plural(hosts, 'host')} of "
            f"{self.ranks_per_host}{groups} (plan: {self.plan_source}), {steps} "
            f"batches of {self.batch_size} samples per rank ({self.data}): simulated in "
            f"{self.seconds_taken:.1f} s ({self.mode} mode)",
            f"per rank and step, mean of {steps}; a2a: bytes sent/received, the pooled one "
            f"backward in reverse; counts a2a: {format_bytes(counts)} each way; inside host "
            "and across hosts: the ids, pooled and gradient a2a's bytes sent/received",
            f"{'rank':>5} {'ids in':>9} {'bags in':>8} {'looked up':>10} {'ids a2a':>21} "
            f"{'pooled a2a':>21} {'inside host':>21} {'across hosts':>21} {'weights':>10} "
            f"{'opt state':>10} {'buffers':>10} {'est ms':>7}",
        ]
        for r in self.ranks[:max_ranks]:
            lines.append(
                f"{r.rank:>5} {r.ids_received // steps:>9} {r.bags_received // steps:>8} "
                f"{format_bytes(r.lookup_bytes / steps):>10} {_pair(r.ids, steps):>21} "
                f"{_pair(r.pooled, steps):>21} {_pair(r.inside, steps):>21} "
                f"{_pair(r.across, steps):>21} {format_bytes(r.weights):>10} "
                f"{format_bytes(r.optimizer_state):>10} {format_bytes(r.buffers):>10} "
                f"{1e3 * r.seconds:>7.3f}"
            )
        if len(self.ranks) > max_ranks:
            lines.append(f"  ... {len(self.ranks) - max_ranks} more ranks")
        inside = sum(r.inside.sent for r in self.ranks) / steps
        across = sum(r.across.sent for r in self.ranks) / steps
        lines.append(
            f"all ranks together send {format_bytes(inside)} a step inside hosts and "
            f"{format_bytes(across)} across hosts"
        )
        if self.group_size:
            synced = [r.sync_bytes for r in self.ranks]
            where = "across hosts" if any(r.sync_across for r in self.ranks) else "inside hosts"
            lines.append(
                f"each rank's all-reduce over its copies sends {format_bytes(min(synced))} to "
                f"{format_bytes(max(synced))} a step {where} (weights and optimizer state as "
                "float32), in est ms"
            )
        lines.append(f"slowest: {self.why_slowest()}")
        lines += self._dynamic_lines(max_ranks)
        if self.check is not None:
            c = self.check
            lines.append(
                f"check ({'passed' if c.passed else 'FAILED'}): forward, backward and "
                f"{plural(c.steps, 'fused update')} against the unsharded TorchRec module on "
                f"the global batch, tables cut to at most {c.rows} rows, {c.batch_size} samples "
                f"per rank: "
                f"largest difference {c.forward:.1e} in the output, {c.weights:.1e} "
                f"in the weights (tolerance {CHECK_TOLERANCE:.0e})"
            )
        return "\n".join(lines)

    def _dynamic_lines(self, max_ranks: int) -> list[str]:
        """Per rank and dynamic table it holds: ids live at the end of the batches
        (of its rows), admitted, evicted and overflowing over them; then each table's
        totals, every rank of its first column block once. None without dynamic
        tables."""
        names = sorted({n for r in self.ranks for n in r.dynamic_rows})
        if not names:
            return []
        repeats = any(r.dynamic_repeats for r in self.ranks)
        marked = (
            "; *: later column blocks only, as the first block's (not in the totals)"
            if repeats
            else ""
        )
        lines = [
            f"dynamic tables over the {_batches(self.batches)}: ids live at the end "
            f"(of the rows held), admitted, evicted, overflowing (found their bucket full){marked}",
            f"{'rank':>5} {'table':<16} {'live':>21} {'admitted':>9} {'evicted':>9} "
            f"{'overflow':>9} {'id maps':>10}",
        ]
        for r in self.ranks[:max_ranks]:
            for name, rows in sorted(r.dynamic_rows.items()):
                d = r.dynamic[name]
                shown = f"{name}*" if name in r.dynamic_repeats else name
                lines.append(
                    f"{r.rank:>5} {shown:<16} {f'{d.live} of {rows}':>21} {d.admitted:>9} "
                    f"{d.evicted:>9} {d.overflow:>9} {format_bytes(r.id_maps[name]):>10}"
                )
        for name in names:
            held = [
                r for r in self.ranks if name in r.dynamic_rows and name not in r.dynamic_repeats
            ]
            total = [sum(getattr(r.dynamic[name], k) for r in held) for k in _DYNAMIC_COUNTS]
            rows = sum(r.dynamic_rows[name] for r in held)
            lines.append(
                f"table {name}: {total[3]} ids live of {rows} rows, {total[0]} admitted, "
                f"{total[1]} evicted, {total[2]} overflowing"
            )
        return lines


_DYNAMIC_COUNTS = ("admitted", "evicted", "overflow", "live")


def _batches(count: int) -> str:
    return "batch" if count == 1 else f"{count} batches"


def _times_mean(
    value: Callable[[RankReport], float], rank: RankReport, ranks: list[RankReport]
) -> str:
    mean = sum(value(r) for r in ranks) / len(ranks)
    return f"{value(rank) / mean if mean else 1.0:.1f}x the mean"


def _pair(traffic: Traffic, steps: int) -> str:
    return f"{format_bytes(traffic.sent / steps)}/{format_bytes(traffic.received / steps)}"


def _simulate_rank(
    config: TrainConfig,
    routes: Routes,
    batches: int,
    ranks_per_host: int,
    progress: Callable[[int], None],
    tables: Mapping[str, ShardedTable],
    dynamic: Mapping[str, IdMapSpec],
) -> RankReport:
    """One rank's input stage over ``batches`` of its own data (a thread's work),
    counted from the counts exchange, the TBE offsets its ids unpacked into and its own
    batch (the lookups in copies); its ``dynamic`` tables' keys are remapped by their id
    maps as in training, without rows to write. Rank 0 reports every rank's step done."""
    rank, world = dist.get_rank(), dist.get_world_size()
    input_dist = InputDistribution(routes, rank, Scratch(), torch.device("cpu"))
    maps, shards = rank_maps(config, routes, tables, dynamic, rank)
    feed = Feed(build_data(config, rank, world))
    feed.next_epoch()
    widths = pooled_widths(routes)
    report = RankReport(rank)
    for _ in range(batches):
        in_flight = start_input_dist(feed.take().sparse, input_dist, None)
        if in_flight.error is not None:
            raise in_flight.error
        indices, offsets, _ = input_dist.arrived(in_flight)
        counts = in_flight.counts
        batch = sum(counts.batch_sizes)
        maps.remap(indices, offsets, None, batch)
        # Slot s holds bags s * batch ... (s + 1) * batch - 1 of the TBE's input.
        slot_ids = offsets[::batch].diff().tolist() if batch else [0] * len(routes.slots[rank])
        sizes = (counts.send_sizes, counts.recv_sizes)
        step = step_report(
            routes,
            rank,
            counts.batch_sizes,
            widths,
            slot_ids,
            Traffic(*map(sum, sizes)),
            Traffic(*(across_hosts(s, rank, ranks_per_host) for s in sizes)),
            copies_looked_up(routes, in_flight.batch),
            ranks_per_host,
        )
        report.add_step(step)
        if rank == 0:
            progress(world)
    record_maps(report, maps, shards, dynamic)
    return report


def _plan(
    config: TrainConfig,
    world_size: int,
    plan_path: str | None,
    ranks_per_host: int,
    group_size: int | str | None,
) -> tuple[ShardingPlan, str, int]:
    """The plan to simulate, where it came from (the file, the config's, the planner's)
    and the ranks of a sharding group it is for: ``group_size``, else the config's
    ``sharding_group_size``, else the world; ``auto`` is the planner's choice."""
    size = config.sharding_group_size if group_size is None else group_size
    if size == "auto" and (plan_path is not None or config.sharding_plan() is not None):
        raise SimulationError("sharding group size auto is the planner's choice: give no plan")
    if size not in (None, "auto") and (size < 1 or world_size % size):
        raise SimulationError(f"sharding group size {size} does not divide the {world_size} ranks")
    group = world_size if size in (None, "auto") else size
    tables = config.embedding_bag_configs()
    if plan_path is not None:  # its errors name the file
        return ShardingPlan.load(plan_path, tables, group), plan_path, group
    plan = config.sharding_plan()
    if plan is not None:
        return plan, "the config's", group
    plan, report = plan_job(config, world_size, ranks_per_host=ranks_per_host, group_size=size)
    return plan, "the planner's", report.group.size if report.group else world_size


def _fill_memory(
    ranks: list[RankReport],
    plan: ShardingPlan,
    config: TrainConfig,
    topology: Topology,
) -> None:
    """Weights and optimizer state by the planner's memory model (SGD keeps no state);
    the id maps (``IdMapSpec.bytes_per_row`` a row) are the rank's own count."""
    optimizer, tables, batch = config.sparse_optimizer.type, config.tables, config.batch_size
    weights = plan_loads(plan, tables, topology, batch, "sgd")
    total = plan_loads(plan, tables, topology, batch, optimizer)
    for r, w, t in zip(ranks, weights, total):
        r.weights, r.optimizer_state, r.shards = w.memory, t.memory - w.memory, t.shards


def _price_sync(
    ranks: list[RankReport], plan: ShardingPlan, config: TrainConfig, job: Topology, group: int
) -> None:
    """Each group rank's all-reduce over its copies, as the planner prices it: a ring
    over the replicas of its float32 weights and optimizer state."""
    topology = group_topology(job, group)
    replicas = job.world_size // group
    buffers = sync_bytes(plan, config.tables, topology, config.sparse_optimizer.type)
    for r, nbytes in zip(ranks, buffers):
        r.sync_bytes = round(ring_bytes(replicas, nbytes))
        r.sync_across = spans_hosts(job, group, r.rank)
        r.sync_seconds = sync_seconds(job, group, r.rank, nbytes)


def _estimate(r: RankReport, topology: Topology, steps: int) -> None:
    """Seconds per step at the planner's prices: every looked-up byte read forward and
    read and written backward, the bytes moved, inside the host and across, and the
    ids its dynamic tables' maps remapped."""
    r.lookup_seconds = r.lookup_bytes * LOOKUP_PASSES / topology.lookup_bandwidth / steps
    r.moving_seconds = topology.seconds(r.moved - r.moved_across, r.moved_across) / steps
    r.remap_seconds = r.dynamic_ids / topology.remap_rate / steps


def simulate(
    config_path: str,
    world_size: int,
    plan_path: str | None = None,
    batches: int = 8,
    check: bool = False,
    ranks_per_host: int | None = None,
    mode: str | None = None,
    memory_limit: int | None = None,
    progress: Callable[[int], None] | None = None,
    group_size: int | str | None = None,
) -> Simulation:
    """Run ``batches`` steps of the input distribution of CONFIG's model on
    ``world_size`` simulated ranks, each on its own part of the config's data, the
    ranks ``ranks_per_host`` a host (default: the config's topology); with ``check``,
    the numerics of a small copy of the model too.

    ``mode`` "full" runs every rank as a thread, "streamed" one sending rank at a time
    (the same report; default: full up to FULL_MODE_MAX_RANKS ranks). A run whose
    estimated memory exceeds ``memory_limit`` (default: what the system has available)
    is refused before it starts. ``progress`` is told of every rank's step done.

    In sharding groups (``group_size``, else the config's ``sharding_group_size``;
    ``auto``: the planner's choice), the plan is one group's and the ranks simulated
    are the first group's, each with its all-reduce over its copies priced."""
    if world_size < 1 or batches < 1:
        raise SimulationError(f"need at least 1 rank and 1 batch, got {world_size} and {batches}")
    if mode is not None and mode not in MODES:
        raise SimulationError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    config = load_config(config_path, use="simulate")
    if check:  # the small copy trains on the CPU
        check_sparse_optimizer(config, config_path, "cpu")
    job = topology_for(config, world_size, ranks_per_host=ranks_per_host)
    plan, source, group = _plan(config, world_size, plan_path, job.ranks_per_host, group_size)
    topology = group_topology(job, group)
    configs, dynamic = config.embedding_bag_configs(), config.id_maps()
    tables = plan.resolve(configs, group)
    check_dynamic(dynamic, configs, tables)
    buckets = {n: (s.buckets, s.rows_per_bucket) for n, s in dynamic.items()}
    routes = build_routes(configs, tables, group, weighted=False, dynamic=buckets)
    mode = mode or default_mode(group)
    if dynamic and group < world_size:
        raise SimulationError(
            f"dynamic tables ({', '.join(sorted(dynamic))}) are simulated without sharding "
            f"groups: their maps take every group's keys, and one group of {group} runs here"
        )
    if dynamic and check:
        raise SimulationError(
            f"dynamic tables ({', '.join(sorted(dynamic))}) are simulated without --check: "
            "its oracle, the unsharded module, has no id maps"
        )
    _refuse_what_cannot_fit(config, tables, routes, mode, check, batches, memory_limit)
    start = time.perf_counter()
    with _single_threaded_ops():
        # One group of world_size // group runs: each of its steps stands for as many.
        told = progress or _ignore
        args = (
            config,
            routes,
            batches,
            topology.ranks_per_host,
            _scaled(told, world_size // group),
        )
        run = partial(run_ranks, group, _simulate_rank) if mode == "full" else stream_ranks
        ranks = run(*args, tables, dynamic)
        taken = time.perf_counter() - start
        checked = _check(config, plan, group, batches) if check else None
    _fill_memory(ranks, plan, config, topology)
    for r in ranks:
        _estimate(r, topology, batches)
    if group < world_size:
        _price_sync(ranks, plan, config, job, group)
    data = config.data
    return Simulation(
        config=config_path,
        world_size=world_size,
        batches=batches,
        batch_size=config.batch_size,
        data="synthetic data" if data.type == "synthetic" else f"Criteo data from {data.path}",
        plan_source=source,
        ranks_per_host=job.ranks_per_host,
        mode=mode,
        ranks=ranks,
        seconds_taken=taken,
        check=checked,
        group_size=group if group < world_size else None,
    )


def _scaled(progress: Callable[[int], None], factor: int) -> Callable[[int], None]:
    return progress if factor == 1 else lambda done: progress(done * factor)


def _ignore(done: int) -> None:
    """No progress to show."""


def _refuse_what_cannot_fit(
    config: TrainConfig,
    tables: Mapping[str, ShardedTable],
    routes: Routes,
    mode: str,
    check: bool,
    batches: int,
    limit: int | None,
) -> None:
    """A SimulationError when the estimated memory of the input stage, or of
    ``check``'s threads, exceeds ``limit`` (default: the system's available memory),
    saying how many ranks would fit."""
    available = available_memory() if limit is None else limit
    if available is None:
        return
    world, have = routes.world_size, format_bytes(available)
    need = input_need(config, tables, routes, mode, batches)
    if need.total > available:
        if mode == "full":  # at this world's need per rank (smaller in smaller worlds)
            full = ranks_that_fit(lambda n: replace(need, world_size=n), available, world)
            streamed = input_need(config, tables, routes, "streamed", batches).total
            fits = (
                f"--mode streamed needs {format_bytes(streamed)}; full mode fits about {full} ranks"
            )
        else:
            fits = "fewer features, a smaller batch_size or fewer batches would fit"
        raise SimulationError(
            f"simulating {world} ranks in {mode} mode needs about {format_bytes(need.total)}, "
            f"more than the {have} available: {fits}"
        )

    def checking(ranks: int) -> MemoryNeed:
        return check_need(config, CHECK_ROWS, CHECK_BATCH, ranks)

    if check and checking(world).total > available:
        raise SimulationError(
            f"--check runs the small model on {world} threads and needs about "
            f"{format_bytes(checking(world).total)}, more than the {have} available: it fits "
            f"about {ranks_that_fit(checking, available, world)} ranks"
        )


@contextlib.contextmanager
def _single_threaded_ops() -> Iterator[None]:
    """One intra-op thread each while the ranks' threads share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check(config: TrainConfig, plan: ShardingPlan, world_size: int, steps: int) -> Check:
    """The oracle tests' ``run_case`` on the config's tables cut to CHECK_ROWS rows,
    sharded as planned, with the config's fused optimizer."""
    from embshard.testing.oracle import Case, Table, run_case

    tables = tuple(
        Table(t.name, min(t.num_embeddings, CHECK_ROWS), t.embedding_dim, tuple(t.features),
              mean=t.pooling == "mean")
        for t in config.tables
    )  # fmt: skip
    rows = {t.name: t.num_embeddings for t in config.tables}
    small = ShardingPlan({t.name: plan.tables[t.name].shrunk(rows[t.name], t.rows) for t in tables})
    case = Case(
        tables,
        small,
        (CHECK_BATCH,) * world_size,
        optimizer=fused_optimizer(config.sparse_optimizer),
        steps=steps,
        seed=config.seed,
    )
    worst = run_ranks(world_size, run_case, case)
    return Check(
        forward=max(w["forward"] for w in worst),
        weights=max(w["weights"] for w in worst),
        rows=CHECK_ROWS,
        batch_size=CHECK_BATCH,
        steps=steps,
    )
