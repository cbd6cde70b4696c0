"""Stage 3, the output distribution: one all-to-all sends each requester the pooled
rows a rank owns for its samples (forward) and their gradients back (backward), and
the requester places their columns and sums row-wise partials in one kernel
(``ColumnPlacement``); MEAN bags are divided by the module."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from embshard.runtime.columns import ColumnPlacement
from embshard.runtime.scratch import Scratch

COMM_DTYPES = {
    None: torch.float32,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class OutputLayout:
    """What the pooled all-to-all needs besides the batch sizes, fixed at sharding:
    where every rank's pooled block and the local lookup's land in the output, where
    this rank stands, and the precision the pooled rows and their gradients travel in."""

    placement: ColumnPlacement
    rank: int
    group: dist.ProcessGroup | None
    scratch: Scratch
    comm_precision: str | None = None

    def __post_init__(self) -> None:
        if self.comm_precision not in COMM_DTYPES:
            raise ValueError(
                f"comm_precision must be one of {list(COMM_DTYPES)}, got {self.comm_precision!r}"
            )

    @property
    def block_dims(self) -> tuple[int, ...]:
        """Every rank's pooled block width (the placement's last block is the local
        lookup's)."""
        return self.placement.block_dims[:-1]

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
    # The placement's sources: the received blocks, then the local lookup's, flat.
    received_size = sum(recv_splits)
    sources = layout.scratch.take("pooled", (received_size + local.numel(),), pooled)
    received = sources[:received_size]
    if layout.comm_dtype != pooled.dtype:
        received = layout.scratch.take("pooled_wire", (received_size,), pooled, layout.comm_dtype)
    pooled_all_to_all(received, send, recv_splits, send_splits, layout)
    if received.dtype != pooled.dtype:
        sources[:received_size].copy_(received)
    if local.numel():
        sources[received_size:].view_as(local).copy_(local)
    return layout.placement.place(sources, local_batch, layout.scratch)


class PooledAllToAll(torch.autograd.Function):
    """Each rank's pooled rows go back to the ranks whose samples they are, and land
    in their output columns, beside the local lookup's (data-parallel tables, hot rows).

    Forward: [global batch, this rank's slot dims] -> [local batch, output dims]: the
    all-to-all, then one kernel places every block's columns and sums those that land
    in the same output column (row-wise partials, hot rows' local partial sums).
    Backward: one kernel gives every block its output columns' gradient, the
    all-to-all runs in reverse, and the result is divided by the world size, so the
    sparse gradients are averaged over ranks as DDP averages the dense ones.
    ``anchor`` requires grad on every rank, so every rank joins the backward
    all-to-all even when it holds no shards.

    Both all-to-alls carry ``layout.comm_dtype``: with fp16 or bf16, each value is
    rounded once on the wire and back to float32 on arrival, before row-wise partials
    are added and before the division.
    """

    @staticmethod
    def forward(ctx, anchor, pooled, local, batch_sizes, layout):  # type: ignore[override]
        send_splits, recv_splits, _ = _splits(pooled, batch_sizes, layout)
        ctx.save_for_backward(anchor)
        ctx.splits = (send_splits, recv_splits, pooled.shape, local.shape)
        ctx.layout = layout
        return send_home(pooled, local, batch_sizes, layout)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        send_splits, recv_splits, pooled_shape, local_shape = ctx.splits
        layout = ctx.layout
        received_size = sum(recv_splits)
        gradients = layout.placement.gradients(grad, layout.scratch)
        send = layout.to_wire("grad_out_wire", gradients[:received_size])
        grad_local = gradients[received_size:].view(local_shape)
        received = layout.scratch.take("grad_pooled", pooled_shape, grad, layout.comm_dtype)
        pooled_all_to_all(received.view(-1), send, send_splits, recv_splits, layout)
        grad_pooled = layout.from_wire("grad_pooled_fp32", received, grad.dtype)
        grad_pooled.div_(dist.get_world_size(layout.group))
        return None, grad_pooled, grad_local, None, None


def pooled_all_to_all(
    received: torch.Tensor,
    send: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    layout: OutputLayout,
) -> None:
    """``send`` into ``received`` through one of stage 3's all-to-alls; on one rank
    nothing travels, so no collective runs: a copy."""
    if len(layout.block_dims) == 1:
        received.copy_(send)
    else:
        dist.all_to_all_single(received, send, out_splits, in_splits, group=layout.group)
