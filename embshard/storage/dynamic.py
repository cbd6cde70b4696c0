"""Dynamic tables on a rank: the id maps of its dynamic shards, and the remap that turns
the keys arriving for them into rows of its lookup.

A dynamic table's shard on a rank is a whole range of buckets (its plan cuts rows on
bucket boundaries), so the shard's local rows are its ``IdMap``'s: bucket ``b`` of the
range owns rows ``[(b - first) * rows_per_bucket, +rows_per_bucket)``. After the ids
all-to-all the rank remaps each dynamic shard's keys, writes the initial rows of the ids
it admitted (and resets their optimizer state), and drops the ids left without a row
from the lookup's bags: they add nothing to their bag and take no update.

A column-wise or grid table has a shard per column block (and row block): every column
block's owner gets the keys of its bucket range, as a static column-wise table's ids go
to every block, and runs its own map over them. The maps of one bucket range see the
same keys with the same counts, so they stay equal without a collective, and a row holds
the same id in every column block. The counts and the saved maps are the first column
block's (``col_offset`` 0): each table counts once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from embshard.errors import PlanError
from embshard.plan.specs import ShardedTable, TableShard
from embshard.runtime.keys import initial_rows, write_initial_rows
from embshard.runtime.routes import Slot
from embshard.storage.id_map import IdMap, IdMapSpec, RemapResult
from embshard.storage.init import init_bounds
from embshard.storage.lookup import LookupModule

# The counts kept per dynamic table, in this order.
STATS = ("admitted", "evicted", "overflow")


def id_tags(
    slot_tags: torch.Tensor, offsets: torch.Tensor, batch_size: int, count: int
) -> torch.Tensor:
    """Each of a lookup's ``count`` ids tagged as its slot is (``slot_tags``, a tag a
    slot; the lookup's bags slot by slot, ``batch_size`` a slot, by ``offsets``)."""
    lengths = offsets[1:] - offsets[:-1]
    bag_tags = slot_tags.repeat_interleave(batch_size)
    return bag_tags.repeat_interleave(lengths, output_size=count)


def _cut(ids: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The ids in ``ranges`` (in order): a view of one range."""
    if len(ranges) == 1:
        return ids[ranges[0][0] : ranges[0][1]]
    return torch.cat([ids[start:end] for start, end in ranges])


def _paste(ids: torch.Tensor, ranges: list[tuple[int, int]], values: torch.Tensor) -> None:
    """Write ``values`` over the ids in ``ranges`` (``_cut``'s order)."""
    for (start, end), part in zip(ranges, values.split([end - start for start, end in ranges])):
        ids[start:end] = part


@dataclass(frozen=True)
class DynamicStats:
    """A dynamic table's counts over every rank since sharding (continuing a loaded
    checkpoint's): ids given a row (``admitted``), live ids that lost theirs
    (``evicted``), ids due a row that found none in their bucket (``overflow``), and
    ids holding a row now (``live``)."""

    admitted: int
    evicted: int
    overflow: int
    live: int


def check_dynamic(
    dynamic: Mapping[str, IdMapSpec],
    configs: Sequence[BaseEmbeddingConfig],
    tables: Mapping[str, ShardedTable],
) -> None:
    """Raise a one-line PlanError unless every dynamic table can be sharded as planned:
    a table of the module whose rows are its buckets' (``buckets * rows_per_bucket``),
    whose features feed it alone, laid out table-wise, row-wise, column-wise or grid with
    rows cut on bucket boundaries and no copies of its rows. Reads only the plan: the
    same on every rank, before anything is allocated or sent."""
    by_name = {c.name: c for c in configs}
    for name, spec in dynamic.items():
        problem = _problem(name, spec, by_name, tables)
        if problem:
            raise PlanError(f"dynamic table {name!r}: {problem}")


def shared_feature_problem(
    config: BaseEmbeddingConfig, configs: Mapping[str, BaseEmbeddingConfig]
) -> str | None:
    """A feature of a table whose raw ids are remapped on their owner that feeds another
    table too: its raw ids are no rows there."""
    others = {f for c in configs.values() if c is not config for f in c.feature_names}
    shared = [f for f in config.feature_names if f in others]
    if shared:
        return f"its feature {shared[0]!r} feeds another table too (its raw ids are no rows there)"
    return None


def remapped_table_problem(
    kind: str,
    config: BaseEmbeddingConfig,
    configs: Mapping[str, BaseEmbeddingConfig],
    table: ShardedTable,
) -> str | None:
    """What keeps a table whose raw ids are remapped on their owner (``kind``:
    managed-collision) from its plan: a feature that feeds another table too, or a
    layout other than table-wise or row-wise (whole rows, a block a rank) without hot
    rows."""
    shared = shared_feature_problem(config, configs)
    if shared:
        return shared
    ranks = [s.rank for s in table.shards if s.rows]
    whole_rows = all(s.cols == table.embedding_dim and not s.replica for s in table.shards)
    if table.replicated_rows or not whole_rows or len(ranks) != len(set(ranks)):
        return (
            f"its {table.kind} layout is refused: a {kind} table is table-wise or row-wise "
            "without hot rows"
        )
    return None


def _copies_problem(table: ShardedTable) -> str | None:
    """Why a dynamic table cannot have copies of its rows on several ranks of a sharding
    group: each copy's map would have to see every id that any copy's rank looks up, and
    only the rows' owners do."""
    if table.replicated:
        return (
            "data-parallel is refused: each rank's copy of the id map would need every "
            "rank's ids to stay equal to the others (an all-gather of the ids a step)"
        )
    if table.hot_rows:
        return (
            "row_wise hot_rows are refused: hot rows copy fixed row numbers to every rank, "
            "and a dynamic table's rows change ids"
        )
    return None


def _problem(
    name: str,
    spec: object,
    configs: Mapping[str, BaseEmbeddingConfig],
    tables: Mapping[str, ShardedTable],
) -> str | None:
    if name not in configs:
        return f"not a table of the module (its tables: {sorted(configs)})"
    if not isinstance(spec, IdMapSpec):
        return f"expected an IdMapSpec, got {type(spec).__name__}"
    config, table, rows = configs[name], tables[name], spec.rows_per_bucket
    if config.num_embeddings != spec.buckets * rows:
        return (
            f"num_embeddings {config.num_embeddings} is not buckets x rows_per_bucket "
            f"= {spec.buckets} x {rows} = {spec.buckets * rows}"
        )
    problem = shared_feature_problem(config, configs) or _copies_problem(table)
    if problem:
        return problem
    cut = next((s.row_offset for s in table.shards if s.row_offset % rows), None)
    if cut is not None:
        return f"the plan cuts its rows at {cut}, not a multiple of rows_per_bucket {rows}"
    return None


def bucket_range(spec: IdMapSpec, shard: TableShard) -> tuple[int, int]:
    """The buckets ``[first, last)`` of a dynamic table's row block ``shard``."""
    rows = spec.rows_per_bucket
    return shard.row_offset // rows, (shard.row_offset + shard.rows) // rows


def map_ranges(
    shards: Sequence[tuple[str, TableShard]], specs: Mapping[str, IdMapSpec]
) -> dict[str, tuple[int, int]]:
    """Per dynamic table of ``specs`` among a rank's ``shards``, the buckets ``[first,
    last)`` covering all its row and column blocks there: the one range of its maps a
    rank saves in an artifact and loads from a checkpoint."""
    ranges: dict[str, tuple[int, int]] = {}
    for name, shard in shards:
        if name in specs and shard.rows:
            first, last = bucket_range(specs[name], shard)
            low, high = ranges.get(name, (first, last))
            ranges[name] = (min(low, first), max(high, last))
    return ranges


@dataclass(frozen=True)
class _Shard:
    """A dynamic shard of this rank: its table's index in the stats, its id map, the
    views of its rows and optimizer state in the lookup, and its columns of the table's
    rows (``columns``, of ``dim``); ``counted``: the table's first column block, whose
    map gives the table's counts and is saved (the other blocks' maps equal it)."""

    stat: int
    tag: int  # its slots' tag in DynamicTables' _slot_tags
    name: str
    spec: IdMapSpec
    idmap: IdMap
    weights: torch.Tensor | None  # None: no rows to write (a simulation counts ids only)
    states: tuple[torch.Tensor, ...]
    bounds: tuple[float, float]
    dim: int
    columns: slice
    counted: bool

    def admit(self, result: RemapResult) -> None:
        """Write the admitted ids' initial rows (this block's columns of them) and reset
        their rows' optimizer state (FBGEMM's starts at zero): an evicted id's row starts
        afresh for its new id."""
        rows, keys = result.admitted, result.admitted_keys
        if not len(rows) or self.weights is None:
            return
        seed, name, bounds = self.spec.seed, self.name, self.bounds
        if write_initial_rows(
            self.weights, rows, keys, self.columns, seed, name, bounds, self.states
        ):
            return
        start = initial_rows(keys, self.dim, seed, name, bounds)
        with torch.no_grad():
            self.weights.index_copy_(0, rows, start[:, self.columns].to(self.weights.dtype))
            for state in self.states:
                state.index_fill_(0, rows, 0)


class DynamicTables:
    """This rank's dynamic shards and the remap of their keys; every rank has one (with
    no shards where it holds none), as the forward count is every rank's step.

    ``specs``: every dynamic table's id map spec; ``shards``: the rank's lookup tables,
    ``slots``: its lookup features (``Routes.slots[rank]``); ``lookup``: their TBE, None
    where there is none (a rank without shards, or ``embshard simulate``'s maps alone).
    ``counted``: per table, the column offset of the blocks whose maps count it (default
    0, the table's first column block: what ``dynamic_stats`` sums over ranks)."""

    def __init__(
        self,
        specs: Mapping[str, IdMapSpec],
        configs: Sequence[BaseEmbeddingConfig],
        shards: Sequence[tuple[str, TableShard]],
        slots: Sequence[Slot],
        lookup: LookupModule | None,
        device: torch.device,
        replicas: dist.ProcessGroup | None = None,
        counted: Mapping[str, int] | None = None,
    ) -> None:
        self.names = sorted(specs)
        self._replicas = replicas
        self.keys_remapped = 0  # ids of this rank's dynamic shards remapped so far
        self.specs = dict(specs)
        self.step = 0
        self._device = device
        bounds = {c.name: init_bounds(c) for c in configs}
        dims = {c.name: c.embedding_dim for c in configs}
        weights = lookup.split_embedding_weights() if lookup is not None else [None] * len(shards)
        states = lookup.split_optimizer_states() if lookup is not None else []
        self._shards: list[_Shard] = []
        tags = [0] * len(shards)
        for index, (name, shard) in enumerate(shards):
            if name not in specs:
                continue
            spec = specs[name]
            idmap = IdMap(spec, *bucket_range(spec, shard), str(device))
            tags[index] = len(self._shards) + 1
            self._shards.append(
                _Shard(
                    stat=self.names.index(name),
                    tag=tags[index],
                    name=name,
                    spec=spec,
                    idmap=idmap,
                    weights=weights[index],
                    states=tuple(s.view(s.shape[0], -1) for s in states[index]) if states else (),
                    bounds=bounds[name],
                    dim=dims[name],
                    columns=slice(shard.col_offset, shard.col_offset + shard.cols),
                    counted=shard.col_offset == (counted or {}).get(name, 0),
                )
            )
        self._slot_tags = torch.tensor([tags[s.tbe_table] for s in slots], device=device)
        self._map_ranges = map_ranges(shards, specs)
        self._counts = torch.zeros(len(self.names), len(STATS), dtype=torch.int64, device=device)
        # Per table: overflow not yet raised of the tables that evict nothing.
        self._refused = torch.zeros(len(self.names), dtype=torch.int64, device=device)

    def remap(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        batch_size: int,
        learn: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The lookup's input (indices, offsets, per-id weights; bags slot by slot, each
        ``batch_size`` bags) with every dynamic shard's keys remapped at this step to
        its rows, and the ids left without a row dropped from their bags. Counts a
        step on every rank, shards or none. Without ``learn`` (a module in eval mode)
        the keys are only looked up: the maps, the rows and the step stay as they are."""
        step = self.step
        if learn:
            self.step += 1
        if not self._shards:
            return indices, offsets, weights
        # A slot's ids are one range: slices, from one host read of the slots' bounds.
        slots = len(self._slot_tags)
        bounds = offsets[::batch_size].tolist() if batch_size else [0] * (slots + 1)
        selected = [
            (shard, [(bounds[s], bounds[s + 1]) for s in mine])
            for shard, mine in zip(self._shards, self._shard_slots)
        ]
        if learn:
            if self._learn(indices, selected, step):
                return indices, offsets, weights  # every key got a row: none to drop
        else:
            for shard, ranges in selected:
                keys = _cut(indices, ranges)
                self.keys_remapped += len(keys)
                _paste(indices, ranges, shard.idmap.lookup(keys))
        kept = indices >= 0
        # FBGEMM's cumulative sum: torch's costs several times more on CPU.
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(kept.long())[offsets]
        return (
            indices.masked_select(kept),
            offsets,
            None if weights is None else weights.masked_select(kept),
        )

    @cached_property
    def _shard_slots(self) -> list[list[int]]:
        """Each dynamic shard's slots of the lookup, from their tags (read once)."""
        tags = self._slot_tags.tolist()
        return [[s for s, tag in enumerate(tags) if tag == shard.tag] for shard in self._shards]

    def _learn(
        self,
        indices: torch.Tensor,
        selected: list[tuple[_Shard, list[tuple[int, int]]]],
        step: int,
    ) -> bool:
        """Remap each shard's keys (the ``indices`` of its ranges) at ``step``, admitting
        and evicting, with its copies' keys on a 2-D mesh; count what the maps did.
        Whether every key is known to have got a row (the CPU kernel counts them): then
        no id needs dropping."""
        shared = self._with_replicas([_cut(indices, ranges) for _, ranges in selected])
        complete = True
        for (shard, ranges), (keys, start) in zip(selected, shared):
            self.keys_remapped += len(keys)
            result = shard.idmap.remap(keys, step)
            complete = complete and result.missing == 0
            mine = sum(last - first for first, last in ranges)
            _paste(indices, ranges, result.rows[start : start + mine])
            shard.admit(result)
            if not shard.counted:  # the table's first column block counts it
                continue
            admitted = torch.tensor(len(result.admitted), device=self._device)
            self._counts[shard.stat] += torch.stack([admitted, result.evicted, result.overflow])
            if shard.spec.policy == "none":
                self._refused[shard.stat] += result.overflow
        return complete

    def _with_replicas(self, keys: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        """Each shard's ``keys`` with its copies' in the other sharding groups (the
        replica group's, in its rank order), and where this rank's start among them:
        every copy remaps the same keys, so its map stays the others' and a row holds
        the same id in every copy. Two all-gathers over the replica group and one host
        read; on a 1-D mesh, the keys as they are."""
        group = self._replicas
        if group is None:
            return [(k, 0) for k in keys]
        size, me = dist.get_world_size(group), dist.get_rank(group)
        counts = torch.tensor([len(k) for k in keys], dtype=torch.int64, device=self._device)
        every = [torch.empty_like(counts) for _ in range(size)]
        dist.all_gather(every, counts, group=group)
        table = torch.stack(every).tolist()
        ours = torch.cat(keys)
        sent = ours.new_zeros(max(map(sum, table)))
        sent[: len(ours)] = ours
        gathered = [torch.empty_like(sent) for _ in range(size)]
        dist.all_gather(gathered, sent, group=group)
        shared = []
        for index in range(len(keys)):
            firsts = [sum(row[:index]) for row in table]
            pieces = [gathered[r][f : f + table[r][index]] for r, f in enumerate(firsts)]
            shared.append((torch.cat(pieces), sum(table[r][index] for r in range(me))))
        return shared

    def serve(self) -> None:
        """Drop the views of the rows and optimizer state: the lookup was replaced by a
        serving one, which only looks ids up (``remap`` without ``learn``)."""
        self._shards = [dataclasses.replace(s, weights=None, states=()) for s in self._shards]

    def fine(self) -> torch.Tensor:
        """No id of a table with policy ``"none"`` found its bucket full (0-dim bool)."""
        return (self._refused == 0).all()

    def take(self) -> str | None:
        """What overflowed, since the last call, in the tables that evict nothing."""
        refused = self._refused.tolist()
        self._refused.zero_()
        found = [
            f"dynamic table {name!r}: {count} ids found their bucket full and got no row "
            "(policy 'none' evicts nothing): give it more rows or an eviction policy"
            for name, count in zip(self.names, refused)
            if count
        ]
        return "; ".join(found) or None

    def stats(self, group: dist.ProcessGroup | None) -> dict[str, DynamicStats]:
        """Every dynamic table's counts, summed over the ranks of ``group``
        (collective where it has several ranks)."""
        table = self._table()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)
        return self._by_name(table)

    def local_stats(self) -> dict[str, DynamicStats]:
        """Every dynamic table's counts on this rank alone (no collective)."""
        return self._by_name(self._table())

    def _table(self) -> torch.Tensor:
        live = torch.zeros(len(self.names), 1, dtype=torch.int64, device=self._device)
        for shard in self._shards:
            if shard.counted:
                live[shard.stat] += shard.idmap.slots.occupied.sum()
        return torch.cat([self._counts, live], 1)

    def _by_name(self, table: torch.Tensor) -> dict[str, DynamicStats]:
        return {name: DynamicStats(*row) for name, row in zip(self.names, table.tolist())}

    def maps(self) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
        """The id maps this rank saves, by table: the first bucket of the map's range and
        its tensors (``IdMap.state_dict()``), what a checkpoint saves beside the rows.
        Only the first column block's: one copy of each bucket range."""
        return {s.name: (s.idmap.first, s.idmap.state_dict()) for s in self._shards if s.counted}

    def map_ranges(self) -> dict[str, tuple[int, int]]:
        """The buckets ``[first, last)`` whose maps this rank loads, by table: the range
        of all its column and row blocks of the table (``restore`` gives each its part)."""
        return dict(self._map_ranges)

    def restore(
        self,
        maps: Mapping[str, tuple[int, Mapping[str, torch.Tensor]]],
        step: int,
        counts: Mapping[str, Sequence[int]],
    ) -> None:
        """Continue from a checkpoint: each shard's map from its part of ``maps`` (by
        table: the first bucket and the tensors of the range ``map_ranges()`` gives), the
        forward count ``step`` (every map last remapped at the step before), and this
        rank's share of each table's counts (``STATS``)."""
        for shard in self._shards:
            first, state = maps[shard.name]
            part = slice(shard.idmap.first - first, shard.idmap.last - first)
            shard.idmap.load_state_dict({n: t[part] for n, t in state.items()})
            shard.idmap.step = step - 1 if step else None
        self.step = step
        for name, values in counts.items():
            self._counts[self.names.index(name)] = torch.tensor(list(values))
        self._refused.zero_()
