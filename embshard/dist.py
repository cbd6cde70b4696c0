"""Input and output distribution: the collectives of a training step.

Forward: one all-to-all of counts (payload sizes, batch sizes, and a status that
lets a rank with a bad batch stop everyone), one all-to-all of the packed ids
(lengths, ids and weights of every slot, all sharding types together), and one
all-to-all of pooled embeddings. Backward: that last one in reverse. Four in all,
whatever the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from embshard.inputs import InputError, LocalBatch
from embshard.routes import ColumnMove, Routes

_OK, _BAD = 0, 1


def exchange_counts(
    send_sizes: list[int], batch_size: int, ok: bool, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Tell every rank how much this rank sends it, its batch size, and whether its
    batch is good; returns [world_size, 3] as received from each rank."""
    status = _OK if ok else _BAD
    counts = torch.tensor([[size, batch_size, status] for size in send_sizes], dtype=torch.long)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


def raise_if_any_failed(
    counts: torch.Tensor, problem: str | None, group: dist.ProcessGroup | None
) -> None:
    """Every rank raises the same InputError when any rank's batch was bad; only then
    does it cost a collective, to learn what each bad rank found."""
    if not (counts[:, 2] != _OK).any():
        return
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
    raise InputError("bad input batch:\n  " + "\n  ".join(found))


def _to_bits(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weights.view(torch.int32).to(dtype)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.int().view(torch.float32)


class Scratch:
    """Buffers kept from step to step. On CPU, glibc hands large freed blocks back to
    the kernel, so a fresh buffer each step page-faults on its first touch: a third of
    a row-wise step on workload (b) (`tools/profile_step.py`). A buffer is handed out
    again only when no tensor holds it any more, so neither a gradient that autograd
    has not consumed yet nor an output the caller still holds is ever overwritten;
    two buffers a name let an output alternate while the caller holds the last one.
    CUDA's caching allocator already reuses memory: there every call gets a new
    tensor."""

    def __init__(self) -> None:
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``like``'s dtype and device. Not a view
        to autograd: the caller may modify an output built in it in place."""
        if like.device.type != "cpu":
            return like.new_empty(shape)
        numel = math.prod(shape)
        kept = self._buffers.setdefault(name, [])
        in_use = [_held_elsewhere(b) for b in kept]
        held = [b for b, used in zip(kept, in_use) if used]
        fits = [
            b
            for b, used in zip(kept, in_use)
            if not used and b.numel() >= numel and b.dtype == like.dtype
        ]
        if fits:
            buffer = fits[0]
        else:
            # Room to spare once sizes are seen to change (ids vary from step to step).
            room = numel // 4 if kept and kept[-1].numel() != numel else 0
            buffer = like.new_empty(numel + room)
            kept[:] = [*held[-1:], buffer]
        return like.new_empty(0).set_(buffer.untyped_storage(), 0, shape)


def _held_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether a tensor other than ``buffer`` uses its memory (views included)."""
    storage = buffer.untyped_storage()
    # Counted: ``buffer`` itself and ``storage`` here.
    return torch._C._storage_Use_Count(storage._cdata) > 2


@dataclass
class Outgoing:
    payload: torch.Tensor
    sizes: list[int]


class InputDistribution:
    """Packs a local batch into one buffer for all destinations, and unpacks what a
    rank receives into its TBE's indices, offsets and weights."""

    def __init__(self, routes: Routes, rank: int, scratch: Scratch) -> None:
        self.routes = routes
        self.rank = rank
        world = routes.world_size
        self.slots_per_rank = [len(s) for s in routes.slots]
        self.send_rows = routes.send_rows().int()
        rw_features = [routes.embeddings[e].feature for e in routes.rw_embeddings]
        self.rw_features = torch.tensor(rw_features, dtype=torch.int32)
        # When every feature is row-wise, in order, the batch needs no permuting.
        self.rw_is_batch = rw_features == list(range(len(routes.features)))
        dtype = routes.id_dtype
        self.rw_bounds = [torch.tensor(b, dtype=dtype) for b in routes.rw_boundaries]
        # Only used by FBGEMM when boundaries are absent; the boundaries rule.
        self.rw_block_sizes = torch.tensor(
            [max(1, b[1] - b[0]) for b in routes.rw_boundaries], dtype=dtype
        )
        self.world = world
        self.scratch = scratch

    def pack(self, batch: LocalBatch) -> Outgoing:
        lengths, values, weights = batch.lengths, batch.values, batch.weights
        batch_size = batch.batch_size
        if len(self.rw_features):
            rw_lengths, rw_values, rw_weights = (
                (lengths, values, weights)
                if self.rw_is_batch
                else torch.ops.fbgemm.permute_2D_sparse_data(
                    self.rw_features, lengths, values, weights
                )
            )
            bucket_lengths, bucket_values, bucket_weights, _, _ = (
                torch.ops.fbgemm.block_bucketize_sparse_features(
                    rw_lengths.view(-1),
                    rw_values,
                    False,
                    False,
                    self.rw_block_sizes,
                    self.world,
                    rw_weights,
                    None,
                    -1,
                    self.rw_bounds,
                )
            )
            lengths = torch.cat(
                [lengths, bucket_lengths.view(self.world * len(self.rw_features), batch_size)]
            )
            values = torch.cat([values, bucket_values])
            if weights is not None:
                weights = torch.cat([weights, bucket_weights])
        lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
            self.send_rows, lengths, values, weights
        )
        rows = lengths.split(self.slots_per_rank)
        ids_per_dest = [int(r.sum()) for r in rows]
        id_chunks = values.split(ids_per_dest)
        weight_chunks = weights.split(ids_per_dest) if weights is not None else None
        pieces = []
        for dest, dest_lengths in enumerate(rows):
            pieces += [dest_lengths.reshape(-1), id_chunks[dest]]
            if weight_chunks is not None:
                pieces.append(_to_bits(weight_chunks[dest], values.dtype))
        sizes = [
            n * batch_size + ids * (2 if weights is not None else 1)
            for n, ids in zip(self.slots_per_rank, ids_per_dest)
        ]
        return Outgoing(torch.cat(pieces), sizes)

    def exchange(
        self, outgoing: Outgoing, recv_sizes: list[int], group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        received = self.scratch.take("ids", (sum(recv_sizes),), outgoing.payload)
        dist.all_to_all_single(received, outgoing.payload, recv_sizes, outgoing.sizes, group=group)
        return received

    def unpack(
        self, received: torch.Tensor, recv_sizes: list[int], batch_sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """TBE input for the global batch: every slot's bags, sources in rank order."""
        slots = self.slots_per_rank[self.rank]
        lengths, ids, weights = [], [], []
        for chunk, batch_size in zip(received.split(recv_sizes), batch_sizes):
            source_lengths = chunk[: slots * batch_size]
            count = int(source_lengths.sum())
            lengths.append(source_lengths)
            ids.append(chunk[slots * batch_size : slots * batch_size + count])
            if self.routes.weighted:
                weights.append(_from_bits(chunk[slots * batch_size + count :]))
        bag_lengths, values = torch.cat(lengths), torch.cat(ids)
        bag_weights = torch.cat(weights) if self.routes.weighted else None
        if self.world > 1:
            order = _slot_major_order(slots, batch_sizes)
            bag_lengths, values, bag_weights = torch.ops.fbgemm.permute_1D_sparse_data(
                order, bag_lengths, values, bag_weights
            )
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(bag_lengths)
        return values, offsets, bag_weights


def _slot_major_order(slots: int, batch_sizes: list[int]) -> torch.Tensor:
    """Bags arrive as (source, slot, sample); the TBE wants (slot, source, sample)."""
    sizes = torch.tensor(batch_sizes, dtype=torch.long)
    starts = torch.cumsum(sizes, 0) - sizes
    source = torch.repeat_interleave(torch.arange(len(batch_sizes)), sizes)
    sample = torch.arange(int(sizes.sum())) - starts[source]
    slot = torch.arange(slots)[:, None]
    return (slots * starts[source] + slot * sizes[source] + sample).reshape(-1).int()


def _column_runs(t: torch.Tensor, start: int, step: int, move: ColumnMove) -> torch.Tensor:
    """The [rows, count, width] view of ``move``'s column runs in 2-D ``t``."""
    rows, columns = t.stride()
    return t.as_strided(
        (t.shape[0], move.count, move.width),
        (rows, step * columns, columns),
        t.storage_offset() + start * columns,
    )


@dataclass(frozen=True)
class OutputLayout:
    """What the pooled all-to-all needs besides the batch sizes, fixed at sharding:
    every rank's pooled block width, the column moves into the output, and where
    this rank stands."""

    block_dims: list[int]
    moves: list[ColumnMove]
    output_dim: int
    rank: int
    group: dist.ProcessGroup | None
    scratch: Scratch


class PooledAllToAll(torch.autograd.Function):
    """Each rank's pooled rows go back to the ranks whose samples they are, and land
    in their output columns.

    Forward: [global batch, this rank's slot dims] -> [local batch, output dims]: the
    all-to-all, then every slot's columns copied to (or, for row-wise partials, added
    into) their output columns. Backward: each slot takes its output columns' gradient,
    the all-to-all runs in reverse, and the result is divided by the world size, so
    the sparse gradients are averaged over ranks as DDP averages the dense ones.
    ``anchor`` requires grad on every rank, so every rank joins the backward
    all-to-all even when it holds no shards.
    """

    @staticmethod
    def forward(ctx, anchor, pooled, batch_sizes, layout):  # type: ignore[override]
        local_batch = batch_sizes[layout.rank]
        send_splits = [b * pooled.shape[1] for b in batch_sizes]
        recv_splits = [local_batch * d for d in layout.block_dims]
        received = layout.scratch.take("pooled", (sum(recv_splits),), pooled)
        dist.all_to_all_single(
            received, pooled.contiguous().view(-1), recv_splits, send_splits, group=layout.group
        )
        blocks = _blocks(received, recv_splits, local_batch, layout.block_dims)
        out = layout.scratch.take("out", (local_batch, layout.output_dim), pooled)
        for m in layout.moves:
            piece = _column_runs(blocks[m.rank], m.source, m.source_step, m)
            target = _column_runs(out, m.target, m.target_step, m)
            if m.add:
                target.add_(piece)
            else:
                target.copy_(piece)
        ctx.save_for_backward(anchor)
        ctx.splits = (send_splits, recv_splits, local_batch, pooled.shape)
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (send_splits, recv_splits, local_batch, pooled_shape), layout = ctx.splits, ctx.layout
        send = layout.scratch.take("grad_out", (sum(recv_splits),), grad)
        blocks = _blocks(send, recv_splits, local_batch, layout.block_dims)
        for m in layout.moves:
            _column_runs(blocks[m.rank], m.source, m.source_step, m).copy_(
                _column_runs(grad, m.target, m.target_step, m)
            )
        grad_pooled = layout.scratch.take("grad_pooled", pooled_shape, grad)
        dist.all_to_all_single(
            grad_pooled.view(-1), send, send_splits, recv_splits, group=layout.group
        )
        grad_pooled.div_(dist.get_world_size(layout.group))
        return None, grad_pooled, None, None


def _blocks(
    flat: torch.Tensor, splits: list[int], rows: int, dims: list[int]
) -> list[torch.Tensor]:
    """Every rank's [rows, dim] block of an all-to-all buffer."""
    return [c.view(rows, d) for c, d in zip(flat.split(splits), dims)]
