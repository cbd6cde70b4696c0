"""Pictures of a plan: each table's layout as text, per-rank memory and cost as a PNG."""

from __future__ import annotations

import string
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from embshard.plan import ColumnWise, Grid, ShardedTable, TableShard, plural
from embshard.planner import RankLoad, format_bytes

_SYMBOLS = string.digits + string.ascii_lowercase + string.ascii_uppercase


def _symbol(rank: int | None) -> str:
    """Symbols repeat every 62 ranks, so neighbouring ranks always differ; ``*`` (rank
    None) marks rows copied on every rank."""
    return "*" if rank is None else _SYMBOLS[rank % len(_SYMBOLS)]


def _bar(extents: Sequence[tuple[int | None, int]], total: int, width: int) -> str:
    """``width`` characters split by (rank, length) in order, by rounding the running
    totals, so the bar is exact; a non-empty piece gets at least one while there are
    enough characters for all, else the pieces stay proportional and small ones vanish."""
    ends, running = [], 0
    for _, length in extents:
        running += length
        ends.append(round(width * running / total))
    cells = [end - start for start, end in zip([0, *ends], ends)]
    if sum(1 for _, length in extents if length) > width:
        return "".join(_symbol(rank) * n for (rank, _), n in zip(extents, cells))
    for i, (_, length) in enumerate(extents):
        if length and not cells[i]:
            cells[i] = 1
            cells[cells.index(max(cells))] -= 1
    return "".join(_symbol(rank) * n for (rank, _), n in zip(extents, cells))


def draw_table(table: ShardedTable, width: int = 60, sequence: bool = False) -> list[str]:
    """One bar along the split dimension (rows, or columns for column-wise; for a grid,
    the rows of each column block), a symbol per rank (0-9, a-z, A-Z, repeating), then
    each shard's exact rows and columns. A data-parallel table: one line. ``sequence``
    marks an EmbeddingCollection's table."""
    by_columns = isinstance(table.spec, ColumnWise)
    kind = type(table.spec).__name__
    shards: list[TableShard] = [s for s in table.shards if s.rows and s.cols]
    mark = " (sequence)" if sequence else ""
    lines = [f"{table.name}{mark} ({table.num_embeddings} x {table.embedding_dim}) {kind}"]
    if table.replicated:
        ranks = sorted({s.rank for s in shards})
        lines.append(f"  every row and column on each of {plural(len(ranks), 'rank')}")
        return lines
    if by_columns:
        extents = [(s.rank, s.cols) for s in shards]
        lines.append(f"  cols |{_bar(extents, table.embedding_dim, width)}|")
    elif isinstance(table.spec, Grid):
        blocks = sorted({(s.col_offset, s.cols) for s in table.shards})
        labels = [f"cols {start}:{start + cols}" for start, cols in blocks]
        pad = max(map(len, labels))
        for label, (start, _) in zip(labels, blocks):
            extents = [(s.rank, s.rows) for s in shards if s.col_offset == start]
            lines.append(f"  {label:<{pad}} rows |{_bar(extents, table.num_embeddings, width)}|")
    else:
        hot = table.copied_rows
        shards = [s for s in shards if not s.copy]
        extents: list[tuple[int | None, int]] = [(None, hot)] if hot else []
        extents += [(s.rank, s.rows) for s in shards]
        lines.append(f"  rows |{_bar(extents, table.num_embeddings, width)}|")
        if hot:
            ranks = plural(len({s.rank for s in table.shards if s.copy}), "rank")
            lines.append(f"    *: hot rows 0:{hot}, copied on each of {ranks}")
    lines += [
        f"    rank {s.rank}: rows {s.row_offset}:{s.row_offset + s.rows}, "
        f"cols {s.col_offset}:{s.col_offset + s.cols}"
        for s in shards
    ]
    return lines


def draw_plan(
    tables: Mapping[str, ShardedTable], width: int = 60, sequence: Collection[str] = ()
) -> str:
    """Every table drawn by ``draw_table``; ``sequence`` names the sequence tables."""
    return "\n".join(
        line for t in tables.values() for line in draw_table(t, width, t.name in sequence)
    )


def byte_unit(size: float) -> tuple[str, int]:
    """The largest binary unit (B to TiB) that ``size`` reaches, and its size in bytes."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return unit, scale
    return "B", 1


def plot_loads(loads: Sequence[RankLoad], path: str | Path, title: str) -> None:
    """Bars of per-rank memory and estimated step cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [load.rank for load in loads]
    unit, scale = byte_unit(max(load.memory for load in loads))
    figure, (memory, cost) = plt.subplots(2, 1, figsize=(max(6, len(ranks) * 0.25), 6), sharex=True)
    memory.bar(ranks, [load.memory / scale for load in loads], color="tab:blue")
    memory.set_ylabel(f"memory ({unit})")
    memory.set_title(title)
    cost.bar(ranks, [1e3 * load.cost for load in loads], color="tab:orange")
    cost.set_ylabel("estimated cost (ms/step)")
    cost.set_xlabel("rank")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def summary(loads: Sequence[RankLoad]) -> str:
    most = max(loads, key=lambda load: load.memory)
    slowest = max(loads, key=lambda load: load.cost)
    return (
        f"most memory: rank {most.rank} with {format_bytes(most.memory)}; "
        f"slowest: rank {slowest.rank} at {1e3 * slowest.cost:.3f} ms/step"
    )
