"""Where the pooled blocks' columns land in the output: one kernel each way.

Every column of every pooled block (each rank's, then the local lookup's) lands in one
output column, and the columns that land in the same one are summed there (row-wise
partial sums, a table's hot rows). Forward, one kernel builds the output: an
``index_select`` of every output run's block run into a kept buffer, or, when some
output runs sum several block runs, an ``embedding_bag`` whose bags are those runs
(summed in block order, the same order on every run: deterministic). Backward, one
``index_select`` gives every block run its output run's gradient. Both index runs of
``width`` columns rather than single values, built once per batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from math import gcd

import torch
import torch.nn.functional as F

from embshard.runtime.scratch import Scratch, kept


@dataclass(frozen=True)
class RunIndices:
    """A placement's indices for one batch size, on one device, in runs of its width:
    the forward's bags (every block run, ordered by the output run it lands in, and
    where each output run's bag starts) and the backward's gather (the output run of
    every block run, in block order)."""

    bags: torch.Tensor
    bag_starts: torch.Tensor
    targets: torch.Tensor


@dataclass(frozen=True)
class ColumnPlacement:
    """The output column of every column of every pooled block, fixed at sharding
    (``Routes.column_targets``); each block holds ``[batch, len(targets)]`` values,
    one block after another."""

    targets: tuple[tuple[int, ...], ...]
    output_dim: int
    _indices: dict[tuple[int, torch.device], RunIndices] = field(
        default_factory=dict, compare=False, repr=False
    )

    @cached_property
    def block_dims(self) -> tuple[int, ...]:
        return tuple(len(t) for t in self.targets)

    @cached_property
    def width(self) -> int:
        """The widest run of columns that lands in the output as one: it divides every
        block's width, the output's, and every place where a block's next column is not
        the output column after its last."""
        width = self.output_dim
        for columns in self.targets:
            width = gcd(width, len(columns))
            for i, column in enumerate(columns):
                if i == 0 or column != columns[i - 1] + 1:
                    width = gcd(width, i, column)
        return max(width, 1)

    @cached_property
    def identity(self) -> bool:
        """Whether the blocks, one after another, are the output as it is: one block
        holds every output column in order and the others are empty."""
        return [t for t in self.targets if t] == [tuple(range(self.output_dim))]

    @cached_property
    def sums(self) -> bool:
        """Whether some output column sums several blocks' columns."""
        columns = [c for block in self.targets for c in block]
        return len(set(columns)) < len(columns)

    def place(self, sources: torch.Tensor, batch: int, scratch: Scratch) -> torch.Tensor:
        """The ``[batch, output_dim]`` output of ``sources``, every block flat, one
        after another, in one kernel: an ``index_select`` into scratch ``out`` when no
        output column sums several, else an ``embedding_bag`` (which cannot write into
        a kept buffer); none when the blocks are the output as it is."""
        shape = (batch, self.output_dim)
        if self.identity:
            return _own(sources, shape)
        runs = self.runs(batch, sources.device)
        rows = sources.view(-1, self.width)
        if self.sums:
            return _own(F.embedding_bag(runs.bags, rows, runs.bag_starts, mode="sum"), shape)
        out = scratch.take("out", shape, sources)
        torch.index_select(rows, 0, runs.bags, out=out.view(-1, self.width))
        return out

    def gradients(self, grad: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """Every block's gradient, flat, one block after another, from the output's
        ``grad``: one ``index_select`` into scratch ``grad_blocks`` (``grad`` itself when
        the blocks are the output as it is). A ``grad`` that is not contiguous (a sum's
        is expanded) is copied into scratch first: a gather from strided memory costs
        ten times one from contiguous memory."""
        if not grad.is_contiguous():
            grad = scratch.take("grad_in", grad.shape, grad).copy_(grad)
        if self.identity:
            return grad.view(-1)
        batch = grad.shape[0]
        out = scratch.take("grad_blocks", (batch * sum(self.block_dims),), grad)
        runs = self.runs(batch, grad.device)
        rows = grad.view(-1, self.width)
        torch.index_select(rows, 0, runs.targets, out=out.view(-1, self.width))
        return out

    def runs(self, batch: int, device: torch.device) -> RunIndices:
        """The indices for ``batch`` samples on ``device``, built at its first use and
        kept for the last few batch sizes."""
        return kept(self._indices, (batch, device), lambda: self._build(batch, device))

    def _build(self, batch: int, device: torch.device) -> RunIndices:
        width, runs_per_sample = self.width, self.output_dim // self.width
        samples = torch.arange(batch)[:, None] * runs_per_sample
        targets = torch.cat(
            [
                (samples + torch.tensor(columns[::width], dtype=torch.long) // width).flatten()
                for columns in self.targets
            ]
        )
        counts = torch.bincount(targets, minlength=batch * runs_per_sample)
        return RunIndices(
            bags=torch.argsort(targets, stable=True).to(device),
            bag_starts=(counts.cumsum(0) - counts).to(device),
            targets=targets.to(device),
        )


def _own(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``values`` as ``shape``, not a view to autograd, so that the caller may modify
    an output in place."""
    return values.new_empty(0).set_(values.untyped_storage(), values.storage_offset(), shape)
