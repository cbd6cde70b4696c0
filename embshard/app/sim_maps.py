"""The dynamic tables' id maps in ``embshard simulate``: each rank's maps are built as
in training (``DynamicTables``, without rows to write), fed the keys its slots receive
at each step, and reported: live ids, admissions, evictions, overflow, ids remapped.

The full mode feeds them from the ids each rank unpacks. The streamed mode cannot: a
step's keys for one rank come from every sender, and the senders are taken one after
another, each through all its steps. So ``StreamedKeys`` keeps what each sender routed
to the dynamic slots, step by step, and the maps run once every sender is done; a
map's decisions depend on the keys of each step and their counts, not on their order,
so the result is the full mode's.

A column-wise or grid table has a map in every block. A rank reports the map of the
first column block it holds; one holding later blocks only reports theirs, which count
what the first block's maps of the same rows count, and the table's totals skip it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate

import torch

from embshard.app.config import TrainConfig
from embshard.app.rank_report import RankReport
from embshard.plan.specs import ShardedTable, TableShard, local_shards
from embshard.runtime.routes import Routes
from embshard.storage.dynamic import DynamicTables
from embshard.storage.id_map import IdMapSpec


def rank_maps(
    config: TrainConfig,
    routes: Routes,
    tables: Mapping[str, ShardedTable],
    dynamic: Mapping[str, IdMapSpec],
    rank: int,
) -> tuple[DynamicTables, list[tuple[str, TableShard]]]:
    """``rank``'s id maps, and its lookup's shards. The maps count, per table, the first
    column block the rank holds (``_reported_blocks``)."""
    shards = local_shards(tables, rank)
    configs = config.embedding_bag_configs()
    cpu = torch.device("cpu")
    maps = DynamicTables(
        dynamic,
        configs,
        shards,
        routes.slots[rank],
        None,
        cpu,
        counted=_reported_blocks(shards, dynamic),
    )
    return maps, shards


def _reported_blocks(
    shards: Sequence[tuple[str, TableShard]], dynamic: Mapping[str, IdMapSpec]
) -> dict[str, int]:
    """Per dynamic table among a rank's ``shards``, the column offset of the first column
    block it holds: its maps there are the ones the rank reports. A later column block's
    maps see the keys of the first block's, so they count what the first block's maps of
    the same rows count; 0: the table's first block, whose counts are the table's."""
    first: dict[str, int] = {}
    for name, shard in shards:
        if name in dynamic:
            first[name] = min(first.get(name, shard.col_offset), shard.col_offset)
    return first


def id_map_bytes(
    shards: Sequence[tuple[str, TableShard]], dynamic: Mapping[str, IdMapSpec]
) -> dict[str, int]:
    """Per dynamic table, the bytes of the id maps a rank holding ``shards`` keeps: one
    over the rows of each of its blocks, every column block's too
    (``IdMapSpec.bytes_per_row`` a row, as the planner prices them)."""
    held: dict[str, int] = {}
    for name, shard in shards:
        if name in dynamic:
            held[name] = held.get(name, 0) + shard.rows * dynamic[name].bytes_per_row()
    return held


def record_maps(
    report: RankReport,
    maps: DynamicTables,
    shards: Sequence[tuple[str, TableShard]],
    dynamic: Mapping[str, IdMapSpec],
) -> None:
    """What ``maps`` (``rank_maps``') did over the batches, and their bytes, into
    ``report``: per table, the counts of the first column block the rank holds and the
    rows they cover; the tables where that is a later block (its counts equal to those
    of the first block's ranks) are left out of the table's totals."""
    reported = _reported_blocks(shards, dynamic)
    report.dynamic = maps.local_stats()
    report.dynamic_rows = {name: 0 for name in reported}
    for name, shard in shards:
        if reported.get(name) == shard.col_offset:
            report.dynamic_rows[name] += shard.rows
    report.dynamic_repeats = sorted(name for name, offset in reported.items() if offset)
    report.id_maps = id_map_bytes(shards, dynamic)
    report.dynamic_ids = maps.keys_remapped


class StreamedKeys:
    """The keys every sender routes to the dynamic tables' slots, step by step.

    A sender's routed batch (a bag per lengths-table row) gives, for each dynamic slot
    (in ``Routes.send_rows`` order: destination by destination), the keys it sends
    there; ``add`` keeps them with their counts; ``run`` remaps them rank by rank."""

    def __init__(
        self, routes: Routes, dynamic: Mapping[str, IdMapSpec], send_rows: torch.Tensor
    ) -> None:
        self.routes, self.dynamic = routes, dynamic
        slots = [slot for rank_slots in routes.slots for slot in rank_slots]
        tables = [routes.embeddings[s.embedding].table for s in slots]
        positions = [i for i, table in enumerate(tables) if table in dynamic]
        self._positions = torch.tensor(positions, dtype=torch.long)
        self._rows = send_rows.long()[self._positions]
        # Each rank's dynamic slots: where they are among its slots, and among
        # ``positions`` (a contiguous range, as the positions go destination by
        # destination).
        starts = list(accumulate(map(len, routes.slots), initial=0))
        self._mine = [
            [p - starts[r] for p in positions if starts[r] <= p < starts[r + 1]]
            for r in range(routes.world_size)
        ]
        self._steps: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __bool__(self) -> bool:
        return bool(len(self._positions))

    def routed(self, lengths: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The keys a sender's routed batch (``lengths``: a bag per row) sends to the
        dynamic slots, slot after slot, and how many each slot gets."""
        bounds = torch.zeros(lengths.numel() + 1, dtype=torch.long)
        torch.cumsum(lengths.reshape(-1), 0, out=bounds[1:])
        starts, counts = bounds[self._rows], bounds[self._rows + 1] - bounds[self._rows]
        total = int(counts.sum())
        within = torch.arange(total) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts, output_size=total
        )
        where = torch.repeat_interleave(starts, counts, output_size=total) + within
        return values.long()[where], counts

    def add(self, step: int, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """A sender's keys for ``step`` (``routed``'s)."""
        self._steps.setdefault(step, []).append((keys, counts))

    def run(
        self,
        config: TrainConfig,
        tables: Mapping[str, ShardedTable],
        reports: Sequence[RankReport],
        workers: int,
    ) -> None:
        """Every rank's maps fed its slots' keys, step after step, into ``reports``."""
        steps = [self._by_slot(self._steps.pop(step)) for step in sorted(self._steps)]
        starts = list(accumulate((len(self._mine[r]) for r in range(len(self._mine))), initial=0))

        def remap(rank: int) -> None:
            maps, shards = rank_maps(config, self.routes, tables, self.dynamic, rank)
            slots = len(self.routes.slots[rank])
            mine = torch.tensor(self._mine[rank], dtype=torch.long)
            for keys, counts, bounds in steps if len(mine) else ():
                first, last = starts[rank], starts[rank + 1]
                per_slot = torch.zeros(slots, dtype=torch.long)
                per_slot[mine] = counts[first:last]
                offsets = torch.zeros(slots + 1, dtype=torch.long)
                torch.cumsum(per_slot, 0, out=offsets[1:])
                # A bag per slot, the slots in order: what the lookup's remap reads.
                ids = keys[bounds[first] : bounds[last]].clone()
                maps.remap(ids, offsets, None, 1)
            record_maps(reports[rank], maps, shards, self.dynamic)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(remap, range(self.routes.world_size)))

    def _by_slot(
        self, sent: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """One step's keys of every sender grouped by dynamic slot (senders in any
        order within a slot), each slot's count, and the slots' bounds in them."""
        keys = torch.cat([k for k, _ in sent])
        counts = torch.stack([c for _, c in sent])  # [senders, dynamic slots]
        slot = torch.arange(counts.shape[1]).repeat(counts.shape[0])
        order = torch.repeat_interleave(slot, counts.reshape(-1), output_size=len(keys))
        keys = keys[torch.sort(order, stable=True)[1]]
        per_slot = counts.sum(0)
        return keys, per_slot, [0, *accumulate(per_slot.tolist())]
