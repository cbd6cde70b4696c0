"""Stage 3, the output distribution: one all-to-all sends each requester the pooled
rows a rank owns for its samples (forward) and their gradients back (backward), and
the requester places column blocks, sums row-wise partials and divides MEAN bags."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from embshard.runtime.routes import ColumnMove
from embshard.runtime.scratch import Scratch


def _column_runs(t: torch.Tensor, start: int, step: int, move: ColumnMove) -> torch.Tensor:
    """The [rows, count, width] view of ``move``'s column runs in 2-D ``t``."""
    rows, columns = t.stride()
    return t.as_strided(
        (t.shape[0], move.count, move.width),
        (rows, step * columns, columns),
        t.storage_offset() + start * columns,
    )


COMM_DTYPES = {
    None: torch.float32,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class OutputLayout:
    """What the pooled all-to-all needs besides the batch sizes, fixed at sharding:
    every rank's pooled block width, the column moves into the output (those of the
    received blocks, and those of the local lookup's block), where this rank stands,
    and the precision the pooled rows and their gradients travel in."""

    block_dims: list[int]
    moves: list[ColumnMove]
    output_dim: int
    rank: int
    group: dist.ProcessGroup | None
    scratch: Scratch
    comm_precision: str | None = None
    local_moves: list[ColumnMove] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.comm_precision not in COMM_DTYPES:
            raise ValueError(
                f"comm_precision must be one of {list(COMM_DTYPES)}, got {self.comm_precision!r}"
            )

    @property
    def comm_dtype(self) -> torch.dtype:
        """What the pooled rows travel in; on one rank nothing travels, nothing is rounded."""
        return torch.float32 if len(self.block_dims) == 1 else COMM_DTYPES[self.comm_precision]

    def to_wire(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the comm dtype: themselves, or rounded into scratch ``name``."""
        if values.dtype == self.comm_dtype:
            return values
        return self.scratch.take(name, values.shape, values, self.comm_dtype).copy_(values)

    def from_wire(self, name: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``values`` as ``dtype``: themselves, or widened into scratch ``name``."""
        if values.dtype == dtype:
            return values
        return self.scratch.take(name, values.shape, values, dtype).copy_(values)


def _splits(
    pooled: torch.Tensor, batch_sizes: list[int], layout: OutputLayout
) -> tuple[list[int], list[int], int]:
    """The all-to-all's send and receive splits, and this rank's batch size."""
    local_batch = batch_sizes[layout.rank]
    send_splits = [b * pooled.shape[1] for b in batch_sizes]
    return send_splits, [local_batch * d for d in layout.block_dims], local_batch


def send_home(
    pooled: torch.Tensor, local: torch.Tensor, batch_sizes: list[int], layout: OutputLayout
) -> torch.Tensor:
    """The forward of ``PooledAllToAll`` alone, for lookups that need no gradient
    (evaluation, inference): [global batch, this rank's slot dims] ->
    [local batch, output dims]."""
    send_splits, recv_splits, local_batch = _splits(pooled, batch_sizes, layout)
    send = layout.to_wire("pooled_send", pooled.contiguous().view(-1))
    received = pooled_all_to_all("pooled", send, recv_splits, send_splits, layout)
    blocks = _blocks(received, recv_splits, local_batch, layout.block_dims)
    out = layout.scratch.take("out", (local_batch, layout.output_dim), pooled)
    moves = [(blocks[m.rank], m) for m in layout.moves]
    for source, m in moves + [(local, m) for m in layout.local_moves]:
        piece = _column_runs(source, m.source, m.source_step, m)
        target = _column_runs(out, m.target, m.target_step, m)
        if m.add:
            target.add_(piece)
        else:
            target.copy_(piece)
    return out


class PooledAllToAll(torch.autograd.Function):
    """Each rank's pooled rows go back to the ranks whose samples they are, and land
    in their output columns, beside the local lookup's (data-parallel tables).

    Forward: [global batch, this rank's slot dims] -> [local batch, output dims]: the
    all-to-all, then every slot's columns copied to (or, for row-wise partials, added
    into) their output columns, and ``local``'s copied to theirs (added, for hot rows'
    partial sums). Backward:
    each slot takes its output columns' gradient, the all-to-all runs in reverse, and
    the result is divided by the world size, so the sparse gradients are averaged over
    ranks as DDP averages the dense ones.
    ``anchor`` requires grad on every rank, so every rank joins the backward
    all-to-all even when it holds no shards.

    Both all-to-alls carry ``layout.comm_dtype``: with fp16 or bf16, each value is
    rounded once on the wire and back to float32 on arrival, before row-wise partials
    are added and before the division.
    """

    @staticmethod
    def forward(ctx, anchor, pooled, local, batch_sizes, layout):  # type: ignore[override]
        send_splits, recv_splits, local_batch = _splits(pooled, batch_sizes, layout)
        ctx.save_for_backward(anchor)
        ctx.splits = (send_splits, recv_splits, local_batch, pooled.shape, local.shape)
        ctx.layout = layout
        return send_home(pooled, local, batch_sizes, layout)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (send_splits, recv_splits, local_batch, pooled_shape, local_shape) = ctx.splits
        layout = ctx.layout
        grad_local = grad.new_empty(local_shape)
        for m in layout.local_moves:
            _column_runs(grad_local, m.source, m.source_step, m).copy_(
                _column_runs(grad, m.target, m.target_step, m)
            )
        send = layout.scratch.take("grad_out", (sum(recv_splits),), grad, layout.comm_dtype)
        blocks = _blocks(send, recv_splits, local_batch, layout.block_dims)
        for m in layout.moves:
            _column_runs(blocks[m.rank], m.source, m.source_step, m).copy_(
                _column_runs(grad, m.target, m.target_step, m)
            )
        received = pooled_all_to_all("grad_pooled", send, send_splits, recv_splits, layout)
        grad_pooled = layout.from_wire("grad_pooled_fp32", received.view(pooled_shape), grad.dtype)
        grad_pooled.div_(dist.get_world_size(layout.group))
        return None, grad_pooled, grad_local, None, None


def pooled_all_to_all(
    name: str, send: torch.Tensor, out_splits: list[int], in_splits: list[int], layout: OutputLayout
) -> torch.Tensor:
    """``send`` through one of stage 3's all-to-alls, into scratch ``name``; on one
    rank ``send`` itself: nothing travels, so no collective runs."""
    if len(layout.block_dims) == 1:
        return send
    received = layout.scratch.take(name, (sum(out_splits),), send)
    dist.all_to_all_single(received, send, out_splits, in_splits, group=layout.group)
    return received


def _blocks(
    flat: torch.Tensor, splits: list[int], rows: int, dims: list[int]
) -> list[torch.Tensor]:
    """Every rank's [rows, dim] block of an all-to-all buffer."""
    return [c.view(rows, d) for c, d in zip(flat.split(splits), dims)]
