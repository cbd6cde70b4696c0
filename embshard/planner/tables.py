"""The tables as the planner sees them (``PlannedTable``: shape, bags and ids a sample,
weight bytes, a dynamic table's buckets and map), made from TorchRec's configs with
their mean pooling, measured traffic and id maps (``planned_tables``), and the limits
a user puts on a table's sharding (``TableConstraint``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig

from embshard.errors import PlanningError
from embshard.planner.traffic import TableTraffic, TrafficStats
from embshard.storage.id_map import IdMapSpec


@dataclass(frozen=True)
class TableConstraint:
    """Limits on one table's sharding: allowed types (``table_wise``, ``row_wise``,
    ``column_wise``, ``data_parallel``), the ranks its shards may use, a fixed number of
    column blocks."""

    types: tuple[str, ...] | None = None
    ranks: tuple[int, ...] | None = None
    column_blocks: int | None = None


@dataclass(frozen=True)
class PlannedTable:
    """What the cost model needs of a table: its shape, and per sample its bags (one
    per feature) and ids (the features' mean pooling, summed); ``sequence`` for an
    EmbeddingCollection's table, which returns a row per id, not per bag; the bytes of
    a weight (2 for FP16 tables). A dynamic table (``dynamic``) has ``rows_per_bucket``
    rows a bucket, kept whole by its row cuts, and its id map's ``map_bytes`` a row on
    the rank holding it (each column block holds a map of its rows); it is table-wise,
    row-wise or column-wise, with no hot rows or copies."""

    name: str
    num_embeddings: int
    embedding_dim: int
    bags_per_sample: int
    ids_per_sample: float
    sequence: bool = False
    weight_bytes: int = 4
    dynamic: bool = False
    rows_per_bucket: int = 1
    map_bytes: int = 0

    @property
    def buckets(self) -> int:
        """The units its row blocks are whole multiples of: a static table's rows."""
        return self.num_embeddings // self.rows_per_bucket

    def row_blocks(self, blocks: int) -> list[int]:
        """``blocks`` row block sizes as even as whole buckets allow (differing by a
        bucket at most), the larger first."""
        base, extra = divmod(self.buckets, blocks)
        return [(base + (i < extra)) * self.rows_per_bucket for i in range(blocks)]


@runtime_checkable
class DescribedTable(Protocol):
    """A table that brings its own TorchRec config and mean pooling (a training
    config's table)."""

    mean_pooling: float

    def torchrec_config(self) -> EmbeddingBagConfig | EmbeddingConfig: ...


AnyTable = EmbeddingBagConfig | EmbeddingConfig | DescribedTable


def as_config(table: AnyTable) -> EmbeddingBagConfig | EmbeddingConfig:
    return table.torchrec_config() if isinstance(table, DescribedTable) else table


def planned_tables(
    tables: Sequence[AnyTable],
    mean_pooling: Mapping[str, float] | None = None,
    stats: TrafficStats | None = None,
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> list[PlannedTable]:
    """The tables as the cost model sees them. ``mean_pooling`` gives the mean ids per
    bag by feature or by table name (a feature's own entry wins); 1.0 where it says
    nothing, or a ``TableConfig``'s own ``mean_pooling``. Measured ``stats`` win over
    both: a table's ids per sample are then those counted. ``dynamic``: the dynamic
    tables' id maps by table, as ``shard`` takes them."""
    pooling = dict(mean_pooling or {})
    maps = dict(dynamic or {})
    configs = [
        (as_config(t), t.mean_pooling if isinstance(t, DescribedTable) else 1.0) for t in tables
    ]
    known = {c.name for c, _ in configs} | {f for c, _ in configs for f in c.feature_names}
    unknown = sorted(set(pooling) - known)
    if unknown:
        raise PlanningError(f"mean_pooling names no table or feature of the model: {unknown}")
    bad = {k: v for k, v in pooling.items() if not isinstance(v, int | float) or v < 0}
    if bad:
        raise PlanningError(f"mean_pooling must be non-negative numbers, got {bad}")
    measured = _traffic(stats, [c for c, _ in configs])
    _check_maps(maps, [c for c, _ in configs])
    planned = []
    for config, default in configs:
        own = pooling.get(config.name, default)
        ids = sum(pooling.get(f, own) for f in config.feature_names)
        if config.name in measured:
            traffic = measured[config.name]
            ids = traffic.lookups / max(traffic.samples, 1)
        planned.append(
            PlannedTable(
                config.name,
                config.num_embeddings,
                config.embedding_dim,
                len(config.feature_names),
                float(ids),
                isinstance(config, EmbeddingConfig),
                2 if config.data_type == DataType.FP16 else 4,
                *_dynamic_fields(maps.get(config.name)),
            )
        )
    return planned


def _dynamic_fields(spec: IdMapSpec | None) -> tuple[bool, int, int]:
    """``PlannedTable``'s ``dynamic``, ``rows_per_bucket`` and ``map_bytes``."""
    if spec is None:
        return False, 1, 0
    return True, spec.rows_per_bucket, spec.bytes_per_row()


def _check_maps(
    maps: Mapping[str, IdMapSpec], configs: Sequence[EmbeddingBagConfig | EmbeddingConfig]
) -> None:
    """Every id map names a table whose rows are its buckets'."""
    rows = {c.name: c.num_embeddings for c in configs}
    unknown = sorted(set(maps) - set(rows))
    if unknown:
        raise PlanningError(f"dynamic names no table of the model: {unknown}")
    wrong = {
        n: (rows[n], s.buckets, s.rows_per_bucket)
        for n, s in maps.items()
        if rows[n] != s.buckets * s.rows_per_bucket
    }
    if wrong:
        raise PlanningError(
            "dynamic tables whose num_embeddings is not buckets x rows_per_bucket "
            f"(num_embeddings, buckets, rows_per_bucket): {wrong}"
        )


def _traffic(
    stats: TrafficStats | None, configs: Sequence[EmbeddingBagConfig | EmbeddingConfig]
) -> dict[str, TableTraffic]:
    """The measured traffic by table, checked against the tables' rows."""
    if stats is None:
        return {}
    rows = {c.name: c.num_embeddings for c in configs}
    wrong = {
        n: (t.num_embeddings, rows.get(n))
        for n, t in stats.tables.items()
        if rows.get(n) != t.num_embeddings or (len(t.ids) and t.ids[-1] >= t.num_embeddings)
    }
    if wrong:
        raise PlanningError(
            f"traffic stats do not match the tables (measured rows, table rows): {wrong}"
        )
    return dict(stats.tables)
