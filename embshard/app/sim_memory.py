"""How much memory ``embshard simulate`` will need, estimated before it starts, so that
a simulation too big for the machine stops with a message, not the kernel's OOM killer.

The figures are measured ones (Criteo 1TB's config at 8 to 64 ranks, and its
``--check``), kept on the safe side: a full-mode rank holds its batch several times
over (made, checked, routed, packed, received, unpacked), the global batch's bags of
its slots, and a thread's own allocator arena.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from embshard.app.config import TrainConfig
from embshard.app.sim_maps import id_map_bytes
from embshard.app.streamed import WORKERS
from embshard.plan.specs import ShardedTable, local_shards
from embshard.runtime.routes import Routes

MODES = ("full", "streamed")
# Up to this many ranks the default is the full mode, every rank a thread running the
# whole input stage (collectives, packing, unpacking): at Criteo 1TB's batches it needs
# about 1.2 GB and seconds there. Beyond, the streamed mode: the same report, and
# memory that does not grow with the ranks.
FULL_MODE_MAX_RANKS = 16

_PROCESS = 512 << 20  # torch, TorchRec, FBGEMM and the plan: a simulation's floor
# A full-mode rank, fitted to Criteo 1TB's runs at 8 to 64 ranks (35 to 129 MiB a rank)
# and rounded up: its thread and allocator arena, and bytes per id of its own batch,
# per id it receives, per bag it receives (unpacked into the TBE's order) and per entry
# of its routed lengths table (ranks x features x batch per bucketizing pass).
_RANK = 8 << 20
_PER_OWN_ID = 40
_PER_RECEIVED_ID = 28
_PER_BAG = 256
_PER_LENGTH = 24
_STREAMED_PER_ID = 64  # per id of a sending rank's batch, routed with a bag per feature
# Per key a sender routes to a dynamic table, kept for every step until the maps run
# (the key, and its copy grouped by slot), and per key of one step while grouping.
_STREAMED_PER_KEY = 16
_STREAMED_PER_STEP_KEY = 40
# A --check rank (Criteo 1TB's: 23 MiB a rank at 8 to 16 ranks): its thread, and bytes
# per value of the small model's tables (its module, sharded copy, oracle, optimizer)
# and per id of the global batch, which every rank's oracle looks up.
_CHECK_RANK = 16 << 20
_CHECK_PER_WEIGHT = 16
_CHECK_PER_ID = 64


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a run needs: ``fixed`` whatever the ranks, and ``per_rank`` for each."""

    fixed: int
    per_rank: int
    world_size: int

    @property
    def total(self) -> int:
        return self.fixed + self.per_rank * self.world_size


def ranks_that_fit(need: Callable[[int], MemoryNeed], available: int, world_size: int) -> int:
    """The most ranks below ``world_size`` whose ``need(ranks)`` fits in ``available``
    bytes (0: none)."""
    low, high = 0, world_size  # need(low) fits (or low is 0), need(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if need(middle).total <= available else (low, middle)
    return low


def default_mode(world_size: int) -> str:
    return "full" if world_size <= FULL_MODE_MAX_RANKS else "streamed"


def input_need(
    config: TrainConfig,
    tables: Mapping[str, ShardedTable],
    routes: Routes,
    mode: str,
    batches: int,
) -> MemoryNeed:
    """What simulating ``routes``' input stage (of the plan's ``tables``) on ``batches``
    of the config's needs: in full mode, every rank's batch, routed lengths table,
    received ids and bags at once; streamed, a few sending ranks' batches and a few
    counters per rank and step, and every step's keys of the dynamic tables until their
    maps run. Ids are counted at the tables' mean pooling, spread evenly over a
    row-wise table's rows; the id maps at their full size, on every rank holding a
    block."""
    world, batch = routes.world_size, config.batch_size
    pooling = {f: t.mean_pooling for t in config.tables for f in t.features}
    own = batch * sum(pooling[f] for f in routes.features)
    if mode == "streamed":
        dynamic = config.id_maps()
        keys = batch * sum(
            t.mean_pooling * len(t.features) for t in config.tables if t.name in dynamic
        )
        in_flight = WORKERS * _STREAMED_PER_ID * round(own) + _STREAMED_PER_STEP_KEY * keys * world
        fixed = _PROCESS + in_flight + _maps_need(config, tables, world)
        return MemoryNeed(fixed, 256 + round(_STREAMED_PER_KEY * keys * batches), world)
    rows = {t.name: t.num_embeddings for t in config.tables}
    # Ids a rank receives on average: each slot gets its share of its feature's ids from
    # every rank's batch, the world's batches spread over the world's ranks.
    received = 0.0
    for slot in (s for slots in routes.slots for s in slots):
        e = routes.embeddings[slot.embedding]
        share = slot.shard.rows / rows[e.table] if e.row_wise else 1.0
        received += share * pooling[routes.features[e.feature]] * batch
    lengths = len(routes.bucket_passes) * routes.buckets * len(routes.features) * batch
    bags = sum(map(len, routes.slots)) * batch  # a rank's on average: its slots' global batch
    per_rank = (
        _RANK
        + _PER_OWN_ID * own
        + _PER_RECEIVED_ID * received
        + _PER_BAG * bags
        + _PER_LENGTH * lengths
    )
    return MemoryNeed(_PROCESS + _maps_need(config, tables, world), round(per_rank), world)


def _maps_need(config: TrainConfig, tables: Mapping[str, ShardedTable], world: int) -> int:
    """The dynamic tables' id maps, every rank's together (a map over the rows of each
    block a rank holds, every column block's), and their remap's temporaries (sorts over
    a rank's slots: as many bytes again at most)."""
    dynamic = config.id_maps()
    held = (id_map_bytes(local_shards(tables, rank), dynamic) for rank in range(world))
    return 2 * sum(sum(maps.values()) for maps in held)


def check_need(config: TrainConfig, rows: int, batch: int, world_size: int) -> MemoryNeed:
    """What ``--check`` needs: every rank a thread holding the small model (tables of
    at most ``rows`` rows), its sharded copy and the oracle, which runs on the global
    batch (``batch`` samples a rank): so a rank's share grows with the ranks."""
    values = sum(min(t.num_embeddings, rows) * t.embedding_dim for t in config.tables)
    ids = batch * world_size * sum(t.mean_pooling * len(t.features) for t in config.tables)
    per_rank = _CHECK_RANK + _CHECK_PER_WEIGHT * values + _CHECK_PER_ID * ids
    return MemoryNeed(_PROCESS, round(per_rank), world_size)


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of the memory that can be allocated without swapping
    (``MemAvailable``), None where it does not say."""
    try:
        lines = Path(meminfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # kB
    return None
