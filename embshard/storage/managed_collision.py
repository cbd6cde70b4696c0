"""TorchRec's managed-collision (MCH) modules in front of tables sharded by embshard.

A ``ManagedCollisionEmbeddingBagCollection``'s tables are sharded as any others; its
``MCHManagedCollisionModule``s run as TorchRec's sharded managed-collision collection
runs them. The sender applies a module's ``input_hash_func``; the raw ids then travel
whole, by input range: with a table's row blocks (those with rows, in row order)
``0..n-1``, ids ``[k * ceil(input_size / n), +ceil(input_size / n))`` go to block
``k``, whatever its rows (``Routes.feature_ranges``), as TorchRec's sharded collection
routes them to its shards, even or not. The owner of a block holds the module rebuilt for its
rows (``rebuild_with_output_id_range``, TorchRec's own method): it profiles the ids
(training only) and remaps them into its rows, misses to its last row. Rows the
module evicts go back to their initial value and their optimizer state to zero,
before the step's lookup, as TorchRec's sharded module resets them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from embshard.errors import PlanError
from embshard.plan.specs import ShardedTable, TableShard
from embshard.runtime.routes import Slot
from embshard.storage.dynamic import id_tags, remapped_table_problem
from embshard.storage.init import ROW_BLOCK, init_bounds, init_shard
from embshard.storage.lookup import LookupModule


def _blocks(table: ShardedTable) -> list[TableShard]:
    """The table's row blocks with rows, in row order."""
    return sorted((s for s in table.shards if s.rows), key=lambda s: s.row_offset)


@dataclass(frozen=True)
class ManagedCollisions:
    """The managed-collision modules of a collection, by table: what the sender applies
    (``preprocess``), how ids are routed (``ranges``), and the modules the owners rebuild."""

    modules: Mapping[str, MCHManagedCollisionModule]
    # The collection's ``need_preprocess``: whether the modules' input_hash_func runs.
    hashing: bool = True

    def check(
        self,
        configs: Sequence[BaseEmbeddingConfig],
        tables: Mapping[str, ShardedTable],
        replicas: int = 1,
    ) -> None:
        """Raise a one-line error unless every table's module can run sharded as
        planned: a fresh MCH module of the table's rows, the table's features feeding it
        alone, laid out table-wise or row-wise (a block a rank, of any rows), on a mesh
        without replicas. Reads only the
        modules and the plan: the same on every rank, before anything is allocated."""
        by_name = {c.name: c for c in configs}
        for name, module in self.modules.items():
            problem = _problem(name, module, by_name, tables, replicas)
            if problem:
                raise PlanError(f"managed-collision table {name!r}: {problem}")

    def ranges(self, tables: Mapping[str, ShardedTable]) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Per table, (input size, its row blocks' first rows): ``Routes.feature_ranges``."""
        return {
            name: (module.input_size(), tuple(s.row_offset for s in _blocks(tables[name])))
            for name, module in self.modules.items()
        }

    def preprocess(self, features: KeyedJaggedTensor, feature_table: Mapping[str, str]) -> object:
        """``features`` with each module's ``input_hash_func`` applied to its table's
        ids (``feature_table``: each feature's table), on the sender, as TorchRec's
        sharded collection does (one host read: the ids' count). A batch whose lengths
        do not hold its ids is left as it is, for the batch check to refuse on every
        rank."""
        hashed = {
            f: m
            for f, t in feature_table.items()
            if (m := self.modules.get(t)) is not None and m._input_hash_func is not None
        }
        if not hashed or not self.hashing or not isinstance(features, KeyedJaggedTensor):
            return features
        keys, values, lengths = features.keys(), features.values(), features.lengths()
        if not keys or lengths.numel() % len(keys):
            return features
        per_key = lengths.view(len(keys), -1).sum(1)
        if (lengths < 0).any() or int(per_key.sum()) != values.numel():
            return features
        feature = torch.repeat_interleave(torch.arange(len(keys), device=values.device), per_key)
        values = values.to(torch.int64, copy=True)  # hashes may not fit int32 ids
        for index, key in enumerate(keys):
            if key in hashed:
                mine = feature == index
                module = hashed[key]
                values[mine] = module._input_hash_func(values[mine], module.input_size())
        return KeyedJaggedTensor(
            keys=keys,
            values=values,
            lengths=lengths,
            weights=features.weights_or_none(),
            stride=features.stride(),
        )


def _problem(
    name: str,
    module: object,
    configs: Mapping[str, BaseEmbeddingConfig],
    tables: Mapping[str, ShardedTable],
    replicas: int,
) -> str | None:
    if name not in configs:
        return f"not a table of the module (its tables: {sorted(configs)})"
    if not isinstance(module, MCHManagedCollisionModule):
        return (
            f"its module is a {type(module).__name__}: embshard runs TorchRec's "
            "MCHManagedCollisionModule only"
        )
    config, table = configs[name], tables[name]
    if module.output_size() != config.num_embeddings:
        return (
            f"its module's zch_size {module.output_size()} is not its {config.num_embeddings} rows"
        )
    if int(module._current_iter_tensor.item()) != 0:
        return "its module has trained already: embshard starts from a fresh one"
    problem = remapped_table_problem("managed-collision", config, configs, table)
    if problem:
        return problem
    if replicas > 1:
        return "a mesh with replicas (2-D) is not supported for managed-collision tables"
    return None


@dataclass(frozen=True)
class _Shard:
    """A managed-collision shard of this rank: its MCH module, rebuilt for its rows,
    and the views of its rows and optimizer state in the lookup."""

    tag: int  # its slots' tag in ManagedTables' per-id tags
    name: str
    shard: TableShard
    module: MCHManagedCollisionModule
    config: BaseEmbeddingConfig
    weights: torch.Tensor | None  # None: served, remapped only
    states: tuple[torch.Tensor, ...]
    seed: int

    def remap(self, ids: torch.Tensor, learn: bool) -> torch.Tensor:
        """The local rows of ``ids``: profiled first when ``learn`` (TorchRec's
        training mode), then remapped; evicted rows reset."""
        self.module.train(learn)
        features = {self.name: JaggedTensor(values=ids.long(), lengths=ids.new_tensor([len(ids)]))}
        remapped = self.module.remap(self.module.profile(features))[self.name].values()
        evicted = self.module.evict()
        if evicted is not None:
            self.reset(evicted.long() - self.shard.row_offset)
        return remapped - self.shard.row_offset

    def reset(self, rows: torch.Tensor) -> None:
        """Rows (local) back to their initial value: the seeded initialization of those
        rows where the config's ``init_fn`` is TorchRec's default (the same uniform
        bounds, but the same values whatever the plan), else its ``init_fn`` applied, as
        TorchRec's sharded module does; their optimizer state to zero (FBGEMM's
        initial state)."""
        if not len(rows):
            return
        with torch.no_grad():
            if _default_init(self.config):
                self.weights[rows] = self._seeded(rows + self.shard.row_offset)
            else:
                self.weights[rows] = self.config.init_fn(self.weights[rows]).to(self.weights.dtype)
            for state in self.states:
                state[rows] = 0

    def _seeded(self, rows: torch.Tensor) -> torch.Tensor:
        """The seeded initialization (``init_shard``) of global ``rows``, block by block."""
        out = torch.empty(len(rows), self.weights.shape[1], dtype=self.weights.dtype)
        cpu_rows = rows.cpu()
        for block in torch.unique(cpu_rows // ROW_BLOCK).tolist():
            start = block * ROW_BLOCK
            values = torch.empty(
                min(ROW_BLOCK, self.config.num_embeddings - start), out.shape[1], dtype=out.dtype
            )
            init_shard(values, self.config, start, 0, self.seed)
            mine = cpu_rows // ROW_BLOCK == block
            out[mine] = values[cpu_rows[mine] - start]
        return out.to(self.weights.device)


def _default_init(config: BaseEmbeddingConfig) -> bool:
    """Whether ``init_fn`` is the one TorchRec's config gives when none is set: uniform
    within ``init_bounds``, which the seeded initialization draws from too."""
    init = config.init_fn
    low, high = init_bounds(config)
    return (
        isinstance(init, functools.partial)
        and init.func is torch.nn.init.uniform_
        and not init.args
        and init.keywords == {"a": low, "b": high}
    )


class ManagedTables:
    """This rank's managed-collision shards and the remap of the ids arriving for them.

    ``shards``: the rank's lookup tables, ``slots``: its lookup features
    (``Routes.slots[rank]``)."""

    def __init__(
        self,
        managed: ManagedCollisions,
        configs: Sequence[BaseEmbeddingConfig],
        tables: Mapping[str, ShardedTable],
        shards: Sequence[tuple[str, TableShard]],
        slots: Sequence[Slot],
        lookup: LookupModule | None,
        device: torch.device,
        seed: int,
    ) -> None:
        by_name = {c.name: c for c in configs}
        weights = lookup.split_embedding_weights() if lookup is not None else []
        states = lookup.split_optimizer_states() if lookup is not None else []
        self._shards: list[_Shard] = []
        tags = [0] * len(shards)
        for index, (name, shard) in enumerate(shards):
            if name not in managed.modules:
                continue
            config = by_name[name]
            segments = [s.row_offset for s in _blocks(tables[name])] + [config.num_embeddings]
            module = managed.modules[name].rebuild_with_output_id_range(
                (shard.row_offset, shard.row_offset + shard.rows), segments, device
            )
            tags[index] = len(self._shards) + 1
            self._shards.append(
                _Shard(
                    tag=tags[index],
                    name=name,
                    shard=shard,
                    module=module,
                    config=config,
                    weights=weights[index],
                    states=tuple(s.view(s.shape[0], -1) for s in states[index]) if states else (),
                    seed=seed,
                )
            )
        self._slot_tags = torch.tensor([tags[s.tbe_table] for s in slots], device=device)

    @property
    def modules(self) -> dict[str, MCHManagedCollisionModule]:
        """This rank's MCH modules, by table (TorchRec's, rebuilt for its rows)."""
        return {s.name: s.module for s in self._shards}

    def rows(self, name: str) -> tuple[torch.Tensor, ...]:
        """Table ``name``'s block on this rank: its weights and optimizer states (views
        into the lookup, a row each, rows local to the block), for a checkpoint's load to
        move ids' rows within and between blocks."""
        shard = next(s for s in self._shards if s.name == name)
        return (shard.weights, *shard.states)

    def serve(self) -> None:
        """Drop the views of the rows and optimizer state: the lookup was replaced by a
        serving one, which only remaps ids (``remap`` without ``learn``)."""
        self._shards = [replace(s, weights=None, states=()) for s in self._shards]

    def remap(
        self, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int, learn: bool = True
    ) -> torch.Tensor:
        """The lookup's indices (bags slot by slot, each ``batch_size`` bags) with every
        managed-collision shard's raw ids remapped to its rows: all of a shard's ids in
        one call of its module, as TorchRec's sharded collection calls it. Without
        ``learn`` (a module in eval mode) the ids are only looked up."""
        if not self._shards:
            return indices
        tags = id_tags(self._slot_tags, offsets, batch_size, indices.numel())
        for shard in self._shards:
            mine = (tags == shard.tag).nonzero()[:, 0]
            indices[mine] = shard.remap(indices[mine], learn).to(indices.dtype)
        return indices
