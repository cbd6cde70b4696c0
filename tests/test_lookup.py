"""The rank's TBE and its fused optimizers against torch's EmbeddingBag and optimizers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import embshard
from embshard.storage.lookup import build_tbe

SHAPES = [(10, 8), (6, 4)]


def batch():
    generator = torch.Generator().manual_seed(0)
    # Two tables, batch of 4 each; ids repeat within and across bags.
    ids = [torch.tensor([1, 1, 3, 9, 0, 1]), torch.tensor([5, 2, 2, 0])]
    offsets = [torch.tensor([0, 2, 2, 5]), torch.tensor([0, 1, 3, 3])]
    upstream = torch.randn(4, sum(d for _, d in SHAPES), generator=generator)
    return ids, offsets, upstream


@pytest.mark.parametrize(
    "optimizer",
    [
        embshard.SGD(lr=0.1),
        embshard.Adagrad(lr=0.1, eps=1e-6),
        embshard.RowWiseAdagrad(lr=0.1, eps=1e-6),
    ],
)
def test_fused_step_matches_torch(optimizer):
    tbe = build_tbe(SHAPES, optimizer, torch.device("cpu"))
    torch.manual_seed(1)
    start = [torch.randn(r, d) for r, d in SHAPES]
    for view, values in zip(tbe.split_embedding_weights(), start):
        view.copy_(values)
    ids, offsets, upstream = batch()
    tbe_offsets = torch.cat(
        [offsets[0], offsets[1] + len(ids[0]), torch.tensor([len(ids[0]) + len(ids[1])])]
    )
    for _ in range(2):
        out = tbe(torch.cat(ids), tbe_offsets)
        (out * upstream).sum().backward()

    weights = [w.clone().requires_grad_() for w in start]
    torch_opt = {
        embshard.SGD: lambda p: torch.optim.SGD(p, lr=optimizer.lr),
        embshard.Adagrad: lambda p: torch.optim.Adagrad(p, lr=optimizer.lr, eps=optimizer.eps),
    }.get(type(optimizer))
    opt = torch_opt(weights) if torch_opt else None
    states = [torch.zeros(r) for r, _ in SHAPES]
    for _ in range(2):
        pooled = [F.embedding_bag(i, w, o, mode="sum") for i, w, o in zip(ids, weights, offsets)]
        grads = torch.autograd.grad((torch.cat(pooled, 1) * upstream).sum(), weights)
        with torch.no_grad():
            if opt:
                for w, g in zip(weights, grads):
                    w.grad = g
                opt.step()
            else:
                for k, (w, g) in enumerate(zip(weights, grads)):
                    touched = g.abs().sum(1) > 0
                    states[k] = states[k] + torch.where(touched, g.pow(2).mean(1), 0)
                    w -= torch.where(
                        touched[:, None],
                        optimizer.lr * g / (states[k].sqrt() + optimizer.eps)[:, None],
                        0,
                    )
    for view, expected in zip(tbe.split_embedding_weights(), weights):
        torch.testing.assert_close(view, expected.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(tbe.split_embedding_weights()[0], start[0])


def test_unknown_optimizer():
    with pytest.raises(TypeError, match="SGD, RowWiseAdagrad or Adagrad"):
        build_tbe(SHAPES, torch.optim.SGD, torch.device("cpu"))
