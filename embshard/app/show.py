"""Pictures of a plan: each table's layout as text; as a PNG, each rank's shards
against its memory, and its estimated cost."""

from __future__ import annotations

import string
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from embshard.plan.specs import ShardedTable, TableShard, plural
from embshard.planner.cost import CostModel
from embshard.planner.report import RankLoad
from embshard.planner.tables import PlannedTable
from embshard.planner.topology import Topology, byte_unit, format_bytes

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
    by_columns, by_rows = table.spec.SPLITS_COLUMNS, table.spec.SPLITS_ROWS
    kind = type(table.spec).__name__
    shards: list[TableShard] = [s for s in table.shards if s.rows and s.cols]
    mark = " (sequence)" if sequence else ""
    lines = [f"{table.name}{mark} ({table.num_embeddings} x {table.embedding_dim}) {kind}"]
    if table.replicated:
        ranks = sorted({s.rank for s in shards})
        lines.append(f"  every row and column on each of {plural(len(ranks), 'rank')}")
        return lines
    if by_columns and not by_rows:
        extents = [(s.rank, s.cols) for s in shards]
        lines.append(f"  cols |{_bar(extents, table.embedding_dim, width)}|")
    elif by_columns:  # a grid: each column block split by rows
        blocks = sorted({(s.col_offset, s.cols) for s in table.shards})
        labels = [f"cols {start}:{start + cols}" for start, cols in blocks]
        pad = max(map(len, labels))
        for label, (start, _) in zip(labels, blocks):
            extents = [(s.rank, s.rows) for s in shards if s.col_offset == start]
            lines.append(f"  {label:<{pad}} rows |{_bar(extents, table.num_embeddings, width)}|")
    else:
        hot = table.replicated_rows
        shards = [s for s in shards if not s.replica]
        extents: list[tuple[int | None, int]] = [(None, hot)] if hot else []
        extents += [(s.rank, s.rows) for s in shards]
        lines.append(f"  rows |{_bar(extents, table.num_embeddings, width)}|")
        if hot:
            ranks = plural(len({s.rank for s in table.shards if s.replica}), "rank")
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


@dataclass(frozen=True)
class Box:
    """One shard's rectangle in the picture: its rank, table and bytes (weights and
    optimizer state); ``replica`` for one of a table's copies on every rank."""

    rank: int
    table: str
    size: int
    replica: bool = False


def shard_boxes(
    tables: Mapping[str, ShardedTable], specs: Sequence[PlannedTable], model: CostModel
) -> list[Box]:
    """Every non-empty shard, table by table, sized by ``model.memory`` as
    ``plan_loads`` counts it."""
    return [
        Box(shard.rank, spec.name, model.memory(spec, shard.rows, shard.cols), shard.replica)
        for spec in specs
        for shard in tables[spec.name].shards
        if shard.rows and shard.cols
    ]


def _colours(names: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """A colour per table: tab10 up to 10 tables, else tab20, tab20b and tab20c
    (60 colours, repeating past them)."""
    from matplotlib import colormaps

    maps = ("tab10",) if len(names) <= 10 else ("tab20", "tab20b", "tab20c")
    palette = [c for m in maps for c in colormaps[m].colors]
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


_DPI = 100
_FONT = 8
_MARGIN = {"left": 1.0, "right": 1.0, "top": 0.55, "bottom": 0.55, "gap": 0.75}  # inches


def plot_plan(
    boxes: Sequence[Box],
    loads: Sequence[RankLoad],
    topology: Topology,
    base_cost: float,
    path: str | Path,
    title: str,
) -> None:
    """What ``embshard show`` draws, as a PNG: a column per rank stacking its shards'
    rectangles (a colour per table, named where the name fits, copies hatched)
    against the rank's memory, and under it each rank's estimated step cost, the base
    every rank pays below its own shards' cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    world, m = len(loads), _MARGIN
    width = min(max(5.0, 0.9 * world), 24.0)  # the axes' width in inches
    heights = (4.0, 2.4)
    size = (m["left"] + width + m["right"], m["bottom"] + sum(heights) + m["gap"] + m["top"])
    figure = plt.figure(figsize=size, dpi=_DPI)
    memory = _axes(figure, size, m["bottom"] + heights[1] + m["gap"], heights[0])
    cost = _axes(figure, size, m["bottom"], heights[1], sharex=memory)
    colours = _colours(list(dict.fromkeys(box.table for box in boxes)))
    rectangles = _draw_memory(memory, boxes, colours, loads, topology)
    _draw_cost(cost, loads, base_cost)
    figure.suptitle(title)
    if _name_rectangles(figure, memory, rectangles):
        # Some are too small for their name: a legend names every colour, right of
        # the axes, the figure widened for it.
        handles = [Patch(color=c, label=name) for name, c in colours.items()]
        if any(box.replica for box in boxes):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="a copy"))
        legend = figure.legend(
            handles=handles, loc="upper left", fontsize=_FONT, frameon=False,
            bbox_to_anchor=(size[0], size[1] - m["top"]), bbox_transform=figure.dpi_scale_trans,
            borderaxespad=0, ncols=1 + len(handles) // 30,
        )  # fmt: skip
        pixels = legend.get_window_extent(figure.canvas.get_renderer()).width
        _widen(figure, size, pixels / _DPI + 0.2)
    figure.savefig(path, dpi=_DPI)
    plt.close(figure)


def _draw_memory(axes, boxes, colours, loads, topology: Topology) -> list:
    """Each rank's boxes stacked, and its capacity: lines at its memory and at what
    the tables may use of it, or where those would flatten the boxes (the fullest rank
    under a quarter of it) a note; the right axis reads percent of the usable memory.
    Returns (patch, box) pairs."""
    fullest = max(load.memory for load in loads)
    usable, total = topology.usable_memory, topology.memory_per_rank
    in_range = fullest >= usable / 4
    unit, scale = byte_unit(max(fullest, total if in_range else 0))
    stacked = [0.0] * len(loads)
    rectangles = []
    for box in boxes:
        bar = axes.bar(
            box.rank,
            box.size / scale,
            bottom=stacked[box.rank],
            width=0.7,
            color=colours[box.table],
            edgecolor="white",
            linewidth=0.5,
            hatch="//" if box.replica else None,
        )
        stacked[box.rank] += box.size / scale
        rectangles.append((bar.patches[0], box))
    if in_range:
        axes.set_ylim(0, 1.06 * max(total, fullest) / scale)
        for line, colour, style, label in (
            (total, "black", "-", f"{format_bytes(total)} a rank"),
            (usable, "tab:red", "--", f"usable {format_bytes(usable)}"),
        ):
            axes.axhline(line / scale, color=colour, linestyle=style, linewidth=1)
            axes.text(
                -0.45, line / scale, label, color=colour, va="bottom", fontsize=_FONT,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1},
            )  # fmt: skip
    else:
        axes.set_ylim(0, 1.25 * max(fullest, 1) / scale)
        axes.text(
            0.01, 0.98, f"capacity off the scale: {format_bytes(usable)} usable a rank",
            transform=axes.transAxes, va="top", fontsize=_FONT, color="tab:red",
        )  # fmt: skip
    axes.secondary_yaxis(
        "right", functions=(lambda y: 100 * y * scale / usable, lambda p: p * usable / 100 / scale)
    ).set_ylabel("% of usable memory")
    axes.set_ylabel(f"memory ({unit})")
    share, fits = 100 * fullest / usable, fullest <= usable
    percent = f"{share:.0f}%" if share >= 1 else f"{share:.2g}%"
    axes.set_title(
        f"memory: {format_bytes(total)} a rank, {format_bytes(total - usable)} reserved; "
        f"the fullest holds {format_bytes(fullest)} ({percent} of usable"
        f"{'' if fits else ': does not fit'})",
        fontsize=9,
        color="black" if fits else "tab:red",
    )
    axes.tick_params(labelbottom=False)
    return rectangles


def _draw_cost(axes, loads: Sequence[RankLoad], base_cost: float) -> None:
    """Each rank's estimated step cost: the base every rank pays, its shards' on top;
    a tick per rank up to 32 ranks, else integer ticks."""
    from matplotlib.ticker import MaxNLocator

    ranks, base = [load.rank for load in loads], 1e3 * base_cost
    own = [1e3 * load.cost for load in loads]
    axes.bar(ranks, [base] * len(ranks), width=0.7, color="lightgray", label="base")
    bars = axes.bar(ranks, own, bottom=base, width=0.7, color="tab:gray", label="shards")
    if len(ranks) <= 16:
        axes.bar_label(bars, fmt="%.3f", label_type="center", color="white", fontsize=_FONT)
    slowest = max(loads, key=lambda load: load.cost)
    axes.set_title(
        f"estimated step cost: slowest rank {slowest.rank} at {1e3 * slowest.cost:.3f} ms "
        f"+ base {base:.3f} ms",
        fontsize=9,
    )
    axes.set_ylabel("ms/step")
    axes.set_xlabel("rank")
    axes.set_xlim(-0.5, len(ranks) - 0.5)
    if len(ranks) <= 32:
        axes.set_xticks(range(len(ranks)))
    else:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.legend(
        loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=_FONT, frameon=False, borderaxespad=0
    )


def _axes(figure, size: tuple[float, float], bottom: float, height: float, sharex=None):
    """Axes at fixed inches from the figure's bottom left, so they keep their size in
    pixels when the figure grows to the right for a legend."""
    rect = (
        _MARGIN["left"] / size[0],
        bottom / size[1],
        (size[0] - _MARGIN["left"] - _MARGIN["right"]) / size[0],
        height / size[1],
    )
    return figure.add_axes(rect, sharex=sharex)


def _widen(figure, size: tuple[float, float], extra: float) -> None:
    """Grow the figure by ``extra`` inches on the right, the axes keeping their place."""
    wider = size[0] + extra
    for axes in figure.axes:
        box = axes.get_position()
        axes.set_position(
            (box.x0 * size[0] / wider, box.y0, box.width * size[0] / wider, box.height)
        )
    figure.set_size_inches(wider, size[1])


def _name_rectangles(figure, axes, rectangles) -> bool:
    """Write each rectangle's table name in it where it fits; True if some did not."""
    renderer = figure.canvas.get_renderer()
    unnamed = False
    for patch, box in rectangles:
        x, y = patch.get_x() + patch.get_width() / 2, patch.get_y() + patch.get_height() / 2
        red, green, blue, _ = patch.get_facecolor()
        ink = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"
        text = axes.text(x, y, box.table, ha="center", va="center", fontsize=_FONT, color=ink)
        inner, room = text.get_window_extent(renderer), patch.get_window_extent(renderer)
        if inner.width > room.width - 4 or inner.height > room.height - 2:
            text.remove()
            unnamed = True
    return unnamed


def summary(loads: Sequence[RankLoad]) -> str:
    most = max(loads, key=lambda load: load.memory)
    slowest = max(loads, key=lambda load: load.cost)
    return (
        f"most memory: rank {most.rank} with {format_bytes(most.memory)}; "
        f"slowest: rank {slowest.rank} at {1e3 * slowest.cost:.3f} ms/step"
    )
