"""Sharding plans: which rank holds which rows and columns of every table.

A plan maps table names to specs (table-wise, row-wise, column-wise, grid,
data-parallel). Resolving it
against the tables' ``EmbeddingBagConfig``s and a world size gives every table's
concrete shards. Every problem is reported at once, each naming its table: a plan
read from YAML with the tables (and world size) at hand lists its malformed entries
and its misfits in one PlanError.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, TypeVar

import yaml
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embshard.errors import PlanError

T = TypeVar("T")

# FBGEMM's TBE kernels take only embedding dims that are multiples of 4.
FBGEMM_DIM_MULTIPLE = 4


@dataclass(frozen=True)
class TableWise:
    """The whole table on one rank."""

    rank: int


@dataclass(frozen=True)
class RowWise:
    """One row block per rank, in row order: block ``i`` on ``ranks[i]`` (rank ``i``
    when ``ranks`` is None), even (``sizes=None``) or ``sizes[i]`` rows. With
    ``hot_rows``, the first ``hot_rows`` rows are copied on every rank instead and the
    blocks split the rest."""

    sizes: tuple[int, ...] | None = None
    hot_rows: int = 0
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ColumnWise:
    """Column blocks in column order; ``ranks[i]`` holds block ``i`` (ranks may repeat)."""

    ranks: tuple[int, ...]
    widths: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DataParallel:
    """A full copy of the table on every rank, looked up locally: no ids or pooled rows
    travel for it, and its gradient is averaged over the ranks, as DDP's are."""


@dataclass(frozen=True)
class Grid:
    """Column blocks in column order, block ``i`` row-wise over the ranks ``ranks[i]``
    (its row blocks in row order on those ranks in the order given), even or
    ``sizes[i]``. ``column_blocks`` is the number of equal-width blocks, or their
    widths."""

    column_blocks: int | tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]
    sizes: tuple[tuple[int, ...], ...] | None = None


TableSpec = TableWise | RowWise | ColumnWise | Grid | DataParallel


def table_wise(rank: int) -> TableWise:
    """Place the whole table on ``rank``."""
    return TableWise(rank=rank)


def row_wise(
    sizes: Sequence[int] | None = None,
    hot_rows: int = 0,
    ranks: Sequence[int] | None = None,
) -> RowWise:
    """Split rows over all ranks: even blocks (as TorchRec: ceil-sized, the last ones
    smaller or empty) or ``sizes[i]`` rows in block ``i`` (zeros allowed), blocks in
    row order on ranks ``0, 1, ...`` (as TorchRec places them) or on ``ranks``, an
    order of all the world's ranks. An order other than the ranks' own spreads the
    tables' last (with ids numbered hottest first, their largest) blocks over the
    ranks instead of piling them on the last rank.

    ``hot_rows``: copy the table's first ``hot_rows`` rows to every rank and split only
    the rest (``sizes`` then sum to the rows left). Each rank looks its own batch's ids
    of those rows up in its copy, so the ids skewed traffic sends most often travel
    nowhere and load no one rank; their gradient is averaged over the ranks in the
    data-parallel tables' all-reduce. For ids numbered hottest first, as frequency
    remapping numbers them. EmbeddingBagCollections only."""
    return RowWise(
        sizes=None if sizes is None else tuple(sizes),
        hot_rows=hot_rows,
        ranks=None if ranks is None else tuple(ranks),
    )


def column_wise(ranks: Sequence[int], widths: Sequence[int] | None = None) -> ColumnWise:
    """Split columns into ``len(ranks)`` blocks, block ``i`` on ``ranks[i]``; equal
    widths unless ``widths`` gives them."""
    return ColumnWise(ranks=tuple(ranks), widths=None if widths is None else tuple(widths))


def data_parallel() -> DataParallel:
    """Replicate the table on every rank (TorchRec's data-parallel sharding)."""
    return DataParallel()


def grid(
    column_blocks: int | Sequence[int],
    ranks: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]] | None = None,
) -> Grid:
    """Split columns into ``column_blocks`` blocks (a count: equal widths; or the
    widths), block ``i`` row-wise over the ranks ``ranks[i]``, in that order: even
    blocks as ``row_wise()`` cuts them over the group, or ``sizes[i][j]`` rows on
    ``ranks[i][j]`` (zeros allowed). With one host's ranks as every group, this is
    TorchRec's grid sharding (table-row-wise with one block)."""
    blocks = column_blocks if isinstance(column_blocks, int) else tuple(column_blocks)
    return Grid(
        column_blocks=blocks,
        ranks=tuple(tuple(group) for group in ranks),
        sizes=None if sizes is None else tuple(tuple(group) for group in sizes),
    )


@dataclass(frozen=True)
class TableShard:
    """The rectangle ``[row_offset:row_offset+rows, col_offset:col_offset+cols]`` on ``rank``.

    A ``copy`` is one of identical rectangles on every rank (a data-parallel table, or
    a row-wise table's hot rows): looked up where the batch is, never sent ids."""

    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    copy: bool = False


@dataclass(frozen=True)
class ShardedTable:
    """A table with its resolved shards: column blocks in column order, each block's
    row blocks in row order."""

    name: str
    num_embeddings: int
    embedding_dim: int
    spec: TableSpec
    shards: tuple[TableShard, ...]

    def shards_on(self, rank: int) -> tuple[TableShard, ...]:
        return tuple(s for s in self.shards if s.rank == rank)

    @property
    def kind(self) -> str:
        """The spec's type as plan files name it: ``table_wise``, ``grid``, ..."""
        return _spec_to_dict(self.spec)["type"]

    @property
    def replicated(self) -> bool:
        """Data-parallel: every rank holds the whole table (one shard a rank)."""
        return isinstance(self.spec, DataParallel)

    @property
    def hot_rows(self) -> int:
        """A row-wise table's rows copied on every rank (``row_wise(hot_rows=...)``), else 0."""
        return self.spec.hot_rows if isinstance(self.spec, RowWise) else 0

    @property
    def copied_rows(self) -> int:
        """Rows ``[0, copied_rows)`` are copied on every rank: all of a data-parallel
        table's, a row-wise table's hot rows, else none."""
        return next((s.rows for s in self.shards if s.copy), 0)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Ranks that hold a non-empty part of the table, ascending."""
        return tuple(sorted({s.rank for s in self.shards if s.rows and s.cols}))


def local_shards(tables: Mapping[str, ShardedTable], rank: int) -> list[tuple[str, TableShard]]:
    """The non-empty shards on ``rank`` that the all-to-alls serve, in table then column
    order: its TBE's tables. Copies are not among them."""
    return [
        (n, s)
        for n, t in tables.items()
        for s in t.shards_on(rank)
        if s.rows and s.cols and not s.copy
    ]


def even_row_sizes(num_embeddings: int, world_size: int) -> tuple[int, ...]:
    """TorchRec's even row split: ceil-sized blocks, then the remainder, then zeros."""
    block = math.ceil(num_embeddings / world_size) if num_embeddings else 0
    sizes = []
    left = num_embeddings
    for _ in range(world_size):
        sizes.append(min(block, left))
        left -= sizes[-1]
    return tuple(sizes)


def yaml_problem(error: yaml.YAMLError, source: str) -> str:
    """PyYAML's error in one line, at its line and column: PyYAML's own text names the
    source "<unicode string>" and spans several lines."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"{source}: invalid YAML: {' '.join(str(error).split())}"
    start, context = getattr(error, "context_mark", None), getattr(error, "context", None)
    during = f" ({context} at line {start.line + 1})" if context and start else ""
    return f"{source}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {error.problem}{during}"


def plural(count: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``: counts in messages."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def raise_problems(heading: str, problems: Sequence[str]) -> None:
    if problems:
        raise PlanError(f"{heading}:\n  " + "\n  ".join(problems))


def _parse_entries(
    entries: Mapping[str, T], parse: Callable[[T], TableSpec]
) -> tuple[dict[str, TableSpec], list[str]]:
    """The entries that parse into well-formed specs, and every problem of the others,
    each naming its table."""
    specs, problems = {}, []
    for name, entry in entries.items():
        try:
            spec = parse(entry)
        except PlanError as e:
            problems.append(f"table {name!r}: {e}")
            continue
        own = _spec_problems(spec)
        problems += [f"table {name!r}: {p}" for p in own]
        if not own:
            specs[name] = spec
    return specs, problems


def plan_from_entries(
    entries: Mapping[str, T], parse: Callable[[T], TableSpec], heading: str
) -> ShardingPlan:
    """A plan of ``parse(entry)`` per table; every table's PlanError is reported together."""
    specs, problems = _parse_entries(entries, parse)
    raise_problems(heading, problems)
    return ShardingPlan(specs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _spec_problems(spec: Any) -> list[str]:
    """Problems a spec has on its own, before any table or world is known."""
    if isinstance(spec, TableWise):
        if not _is_int(spec.rank) or spec.rank < 0:
            return [f"rank must be a non-negative int, got {spec.rank!r}"]
        return []
    if isinstance(spec, RowWise):
        problems = []
        if spec.sizes is not None and not all(_is_int(s) and s >= 0 for s in spec.sizes):
            problems.append(f"row_wise sizes must be non-negative ints, got {list(spec.sizes)}")
        if not _is_int(spec.hot_rows) or spec.hot_rows < 0:
            problems.append(f"row_wise hot_rows must be a non-negative int, got {spec.hot_rows!r}")
        if spec.ranks is not None:
            if not all(_is_int(r) and r >= 0 for r in spec.ranks):
                problems.append(f"row_wise ranks must be non-negative ints, got {list(spec.ranks)}")
            elif len(set(spec.ranks)) != len(spec.ranks):
                problems.append(
                    f"row_wise ranks {list(spec.ranks)} repeat a rank (one block a rank)"
                )
            if spec.sizes is not None and len(spec.sizes) != len(spec.ranks):
                problems.append(
                    f"row_wise gives {plural(len(spec.sizes), 'size')} "
                    f"for {plural(len(spec.ranks), 'rank')}"
                )
        return problems
    if isinstance(spec, DataParallel):
        return []
    if isinstance(spec, ColumnWise):
        problems = []
        if not spec.ranks:
            problems.append("column_wise needs at least one rank")
        if not all(_is_int(r) and r >= 0 for r in spec.ranks):
            problems.append(f"column_wise ranks must be non-negative ints, got {list(spec.ranks)}")
        if spec.widths is not None:
            if len(spec.widths) != len(spec.ranks):
                problems.append(
                    f"column_wise gives {plural(len(spec.widths), 'width')} "
                    f"for {plural(len(spec.ranks), 'rank')}"
                )
            if not all(_is_int(w) and w > 0 for w in spec.widths):
                problems.append(
                    f"column_wise widths must be positive ints, got {list(spec.widths)}"
                )
        return problems
    if isinstance(spec, Grid):
        return _grid_problems(spec)
    return [
        "expected table_wise(...), row_wise(...), column_wise(...), grid(...) or "
        f"data_parallel(), got {spec!r}"
    ]


def _grid_problems(spec: Grid) -> list[str]:
    """A grid's own problems: its blocks, its groups of ranks and their sizes."""
    problems, blocks, groups = [], spec.column_blocks, spec.ranks
    count = None
    if _is_int(blocks) and blocks > 0:
        count = blocks
    elif isinstance(blocks, tuple) and blocks and all(_is_int(w) and w > 0 for w in blocks):
        count = len(blocks)
    else:
        problems.append(
            f"grid column_blocks must be a positive int or a list of positive widths, "
            f"got {blocks!r}"
        )
    if not groups:
        problems.append("grid needs a group of ranks for every column block, got none")
    for i, group in enumerate(groups):
        if not group:
            problems.append(f"grid block {i} has an empty group of ranks")
        elif not all(_is_int(r) and r >= 0 for r in group):
            problems.append(f"grid block {i}: ranks must be non-negative ints, got {list(group)}")
        elif len(set(group)) != len(group):
            problems.append(f"grid block {i}: ranks {list(group)} repeat a rank (one block a rank)")
    if count is not None and groups and count != len(groups):
        problems.append(
            f"grid has {plural(count, 'column block')} but {plural(len(groups), 'group')} of ranks"
        )
    if spec.sizes is not None:
        if len(spec.sizes) != len(groups):
            problems.append(
                f"grid gives {plural(len(spec.sizes), 'list')} of sizes "
                f"for {plural(len(groups), 'group')} of ranks"
            )
        for i, (group, sizes) in enumerate(zip(groups, spec.sizes)):
            if not all(_is_int(n) and n >= 0 for n in sizes):
                problems.append(
                    f"grid block {i}: sizes must be non-negative ints, got {list(sizes)}"
                )
            elif len(sizes) != len(group):
                problems.append(
                    f"grid block {i} gives {plural(len(sizes), 'size')} "
                    f"for {plural(len(group), 'rank')}"
                )
    return problems


def _column_widths(dim: int, spec: ColumnWise | Grid) -> tuple[int, ...] | None:
    """The column blocks' widths; None when equal widths do not split ``dim``."""
    if isinstance(spec, Grid):
        blocks = spec.column_blocks
        widths, count = (None, blocks) if isinstance(blocks, int) else (blocks, len(blocks))
    else:
        widths, count = spec.widths, len(spec.ranks)
    if widths is not None:
        return widths
    if dim % count:
        return None
    return (dim // count,) * count


def _group_sizes(rows: int, spec: Grid) -> tuple[tuple[int, ...], ...]:
    """Each column block's row sizes over its group: given, or even over the group."""
    if spec.sizes is not None:
        return spec.sizes
    return tuple(even_row_sizes(rows, len(group)) for group in spec.ranks)


def _table_problems(
    config: EmbeddingBagConfig, spec: TableSpec, world_size: int | None
) -> list[str]:
    """What keeps a well-formed spec from sharding its table; checks that need the world
    size are left out when it is None."""
    rows, dim = config.num_embeddings, config.embedding_dim

    def out_of_world(ranks: Sequence[int]) -> list[str]:
        bad = sorted({r for r in ranks if world_size is not None and r >= world_size})
        return [f"rank {r} is outside the world of {plural(world_size, 'rank')}" for r in bad]

    def fbgemm_dim(width: int, what: str) -> list[str]:
        if width % FBGEMM_DIM_MULTIPLE:
            return [
                f"{what} {width} is not a multiple of {FBGEMM_DIM_MULTIPLE}, which FBGEMM needs"
            ]
        return []

    if isinstance(spec, TableWise):
        return out_of_world([spec.rank]) + fbgemm_dim(dim, "embedding_dim")

    if isinstance(spec, DataParallel):
        return fbgemm_dim(dim, "embedding_dim")

    if isinstance(spec, RowWise):
        problems = fbgemm_dim(dim, "embedding_dim")
        sizes = spec.sizes
        if sizes is not None and world_size is not None and len(sizes) != world_size:
            problems.append(
                f"row_wise gives {plural(len(sizes), 'size')} "
                f"for a world of {plural(world_size, 'rank')}"
            )
        world = None if world_size is None else list(range(world_size))
        if spec.ranks is not None and world is not None and sorted(spec.ranks) != world:
            problems.append(
                f"row_wise ranks {list(spec.ranks)} are not an order of the world's "
                f"{plural(world_size, 'rank')} (each rank once)"
            )
        split = rows - spec.hot_rows
        if spec.hot_rows and split <= 0:
            problems.append(
                f"row_wise hot_rows {spec.hot_rows} leaves none of the table's "
                f"{plural(rows, 'row')} to split (data_parallel() copies a whole table)"
            )
        elif sizes is not None and sum(sizes) != split:
            left = f", the rows left after {spec.hot_rows} hot ones" if spec.hot_rows else ""
            problems.append(
                f"row_wise sizes {list(sizes)} sum to {sum(sizes)}, not {plural(split, 'row')}"
                + left
            )
        return problems

    kind = "grid" if isinstance(spec, Grid) else "column_wise"
    groups = spec.ranks if isinstance(spec, Grid) else (spec.ranks,)
    problems = out_of_world([r for group in groups for r in group])
    widths = _column_widths(dim, spec)
    if widths is None:
        count = len(spec.ranks)
        problems.append(f"embedding_dim {dim} does not split into {count} equal widths")
    elif sum(widths) != dim:
        problems.append(f"{kind} widths {list(widths)} sum to {sum(widths)}, not {dim}")
    for width in sorted(set(widths or ())):
        problems += fbgemm_dim(width, "column block width")
    if isinstance(spec, Grid):
        problems += [
            f"grid block {i} sizes {list(sizes)} sum to {sum(sizes)}, not {plural(rows, 'row')}"
            for i, sizes in enumerate(_group_sizes(rows, spec))
            if sum(sizes) != rows
        ]
    return problems


def _table_shards(
    config: EmbeddingBagConfig, spec: TableSpec, world_size: int
) -> tuple[TableShard, ...]:
    """The shards of a spec that fits its table (``_table_problems`` found nothing)."""
    rows, dim = config.num_embeddings, config.embedding_dim
    if isinstance(spec, TableWise):
        return (TableShard(spec.rank, 0, rows, 0, dim),)
    if isinstance(spec, DataParallel):
        return tuple(TableShard(r, 0, rows, 0, dim, copy=True) for r in range(world_size))
    if isinstance(spec, RowWise):
        hot, split = spec.hot_rows, rows - spec.hot_rows
        sizes = spec.sizes if spec.sizes is not None else even_row_sizes(split, world_size)
        ranks = spec.ranks if spec.ranks is not None else range(world_size)
        offsets = accumulate(sizes, initial=hot)
        copies = tuple(TableShard(r, 0, hot, 0, dim, copy=True) for r in range(world_size))
        blocks = tuple(TableShard(r, o, n, 0, dim) for r, o, n in zip(ranks, offsets, sizes))
        return (copies if hot else ()) + blocks
    widths = _column_widths(dim, spec)
    offsets = list(accumulate(widths, initial=0))
    if isinstance(spec, ColumnWise):
        return tuple(
            TableShard(r, 0, rows, offsets[i], w)
            for i, (r, w) in enumerate(zip(spec.ranks, widths))
        )
    return tuple(
        TableShard(rank, row, size, col, width)
        for group, sizes, col, width in zip(spec.ranks, _group_sizes(rows, spec), offsets, widths)
        for rank, row, size in zip(group, accumulate(sizes, initial=0), sizes)
    )


def _check_world_size(world_size: Any) -> None:
    if not _is_int(world_size) or world_size < 1:
        raise PlanError(f"world size must be a positive int, got {world_size!r}")


def _fit_problems(
    specs: Mapping[str, TableSpec],
    named: Collection[str],
    tables: Sequence[EmbeddingBagConfig],
    world_size: int | None,
) -> list[str]:
    """Tables missing from the plan, plan entries (``named``, well-formed or not) for
    tables the model lacks, and what keeps each spec from sharding its table."""
    names = [t.name for t in tables]
    problems = [f"table {n!r}: no entry in the plan" for n in names if n not in named]
    problems += [
        f"table {n!r}: the plan names it but the model has no such table (tables: {names})"
        for n in named
        if n not in names
    ]
    for config in tables:
        if config.name in specs:
            found = _table_problems(config, specs[config.name], world_size)
            problems += [f"table {config.name!r}: {p}" for p in found]
    return problems


@dataclass(frozen=True)
class ShardingPlan:
    """How every table of a model is sharded: a mapping of table name to spec."""

    tables: Mapping[str, TableSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", dict(self.tables))
        problems = [
            f"table {name!r}: {p}"
            for name, spec in self.tables.items()
            for p in _spec_problems(spec)
        ]
        raise_problems("invalid sharding plan", problems)

    def resolve(
        self, tables: Sequence[EmbeddingBagConfig], world_size: int
    ) -> dict[str, ShardedTable]:
        """Every table's shards on a world of ``world_size`` ranks, in the tables' order."""
        _check_world_size(world_size)
        problems = _fit_problems(self.tables, self.tables, tables, world_size)
        raise_problems("sharding plan does not fit the model", problems)
        return {
            t.name: ShardedTable(
                t.name,
                t.num_embeddings,
                t.embedding_dim,
                self.tables[t.name],
                _table_shards(t, self.tables[t.name], world_size),
            )
            for t in tables
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            {"tables": {name: _spec_to_dict(spec) for name, spec in self.tables.items()}},
            sort_keys=False,
            default_flow_style=None,
        )

    @classmethod
    def from_dict(
        cls,
        data: Any,
        tables: Sequence[EmbeddingBagConfig] | None = None,
        world_size: int | None = None,
    ) -> ShardingPlan:
        """A plan from its YAML form, ``{"tables": {name: {"type": ..., ...}}}``. Given
        the model's ``tables`` (and ``world_size``), it is checked against them too:
        every problem of every table, malformed entries and misfits alike, comes in one
        PlanError (without ``world_size``, the checks that need it wait for ``resolve``)."""
        if (
            not isinstance(data, dict)
            or set(data) != {"tables"}
            or not isinstance(data["tables"], dict)
        ):
            raise PlanError("a sharding plan file is a mapping with one key, 'tables'")
        if world_size is not None:
            _check_world_size(world_size)
        specs, problems = _parse_entries(data["tables"], _spec_from_dict)
        if tables is not None:
            problems += _fit_problems(specs, data["tables"], tables, world_size)
        raise_problems("invalid sharding plan", problems)
        return cls(specs)

    @classmethod
    def from_yaml(
        cls,
        text: str,
        tables: Sequence[EmbeddingBagConfig] | None = None,
        world_size: int | None = None,
    ) -> ShardingPlan:
        """A plan from YAML text; ``tables`` and ``world_size`` as in ``from_dict``."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PlanError(yaml_problem(e, "sharding plan")) from None
        return cls.from_dict(data, tables, world_size)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def load(
        cls,
        path: str | Path,
        tables: Sequence[EmbeddingBagConfig] | None = None,
        world_size: int | None = None,
    ) -> ShardingPlan:
        """A plan from a YAML file; ``tables`` and ``world_size`` as in ``from_dict``.
        Every problem is a PlanError naming the file."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"{path}: cannot read the plan: {e}") from None
        except yaml.YAMLError as e:
            raise PlanError(yaml_problem(e, str(path))) from None
        try:
            return cls.from_dict(data, tables, world_size)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None


_SPEC_FIELDS = {
    "table_wise": {"rank"},
    "row_wise": {"sizes", "hot_rows", "ranks"},
    "column_wise": {"ranks", "widths"},
    "grid": {"column_blocks", "ranks", "sizes"},
    "data_parallel": set(),
}


def _spec_to_dict(spec: TableSpec) -> dict[str, Any]:
    if isinstance(spec, TableWise):
        return {"type": "table_wise", "rank": spec.rank}
    if isinstance(spec, RowWise):
        sizes = {} if spec.sizes is None else {"sizes": list(spec.sizes)}
        hot = {"hot_rows": spec.hot_rows} if spec.hot_rows else {}
        ranks = {} if spec.ranks is None else {"ranks": list(spec.ranks)}
        return {"type": "row_wise"} | sizes | hot | ranks
    if isinstance(spec, Grid):
        blocks = spec.column_blocks
        return {
            "type": "grid",
            "column_blocks": blocks if isinstance(blocks, int) else list(blocks),
            "ranks": [list(group) for group in spec.ranks],
        } | ({} if spec.sizes is None else {"sizes": [list(s) for s in spec.sizes]})
    if isinstance(spec, DataParallel):
        return {"type": "data_parallel"}
    widths = {} if spec.widths is None else {"widths": list(spec.widths)}
    return {"type": "column_wise", "ranks": list(spec.ranks)} | widths


def _spec_from_dict(entry: Any) -> TableSpec:
    if not isinstance(entry, dict) or entry.get("type") not in _SPEC_FIELDS:
        raise PlanError(f"expected a mapping with type one of {list(_SPEC_FIELDS)}, got {entry!r}")
    kind = entry["type"]
    unknown = set(entry) - _SPEC_FIELDS[kind] - {"type"}
    if unknown:
        raise PlanError(f"unknown keys {sorted(unknown)} for {kind}")
    for key in ("sizes", "ranks", "widths"):
        if entry.get(key) is not None and not isinstance(entry[key], list):
            raise PlanError(f"{kind} {key} must be a list, got {entry[key]!r}")
    if kind == "table_wise":
        if "rank" not in entry:
            raise PlanError("table_wise needs a rank")
        return table_wise(entry["rank"])
    if kind == "row_wise":
        return row_wise(entry.get("sizes"), entry.get("hot_rows", 0), entry.get("ranks"))
    if kind == "grid":
        return _grid_from_dict(entry)
    if kind == "data_parallel":
        return data_parallel()
    if "ranks" not in entry:
        raise PlanError("column_wise needs ranks")
    return column_wise(entry["ranks"], entry.get("widths"))


def _grid_from_dict(entry: dict[str, Any]) -> Grid:
    missing = [key for key in ("column_blocks", "ranks") if key not in entry]
    if missing:
        raise PlanError(f"grid needs {' and '.join(missing)}")
    blocks = entry["column_blocks"]
    if not isinstance(blocks, int | list):
        raise PlanError(f"grid column_blocks must be a count or a list of widths, got {blocks!r}")
    for key in ("ranks", "sizes"):
        value = entry.get(key)
        if value is not None and not all(isinstance(v, list) for v in value):
            raise PlanError(
                f"grid {key} must be a list of lists, one per column block, got {value!r}"
            )
    return grid(blocks, entry["ranks"], entry.get("sizes"))
