"""The rank's TBE and its fused optimizers against torch's EmbeddingBag and optimizers;
the lookup backend's placement; the optimizers' state layouts."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice
from torchrec import EmbeddingBagConfig

import embshard
from embshard.modules.collection import ShardedCollection
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
    with pytest.raises(TypeError, match="SGD, RowWiseAdagrad, Adagrad, Adam or Lamb"):
        build_tbe(SHAPES, torch.optim.SGD, torch.device("cpu"))


@pytest.mark.parametrize("optimizer", [embshard.Adam(), embshard.Lamb()])
def test_a_cuda_only_optimizer_is_refused_on_cpu_before_fbgemm_asserts(optimizer):
    with pytest.raises(ValueError) as refused:
        build_tbe(SHAPES, optimizer, torch.device("cpu"))
    assert str(refused.value) == (
        f"the fused optimizer {optimizer.KIND} runs on cuda only: FBGEMM's CPU kernels lack "
        "it; on cpu use sgd, rowwise_adagrad or adagrad (device cpu)"
    )


def test_default_lookup_keeps_the_tables_in_host_memory_on_cpu():
    for tbe in (
        build_tbe(SHAPES, embshard.SGD(), torch.device("cpu")),
        embshard.TrainingTBE().build(SHAPES, embshard.SGD(), torch.device("cpu")),
        embshard.TrainingTBE(location="host").build(SHAPES, embshard.SGD(), torch.device("cpu")),
    ):
        assert [tuple(spec) for spec in tbe.embedding_specs] == [
            (rows, cols, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, cols in SHAPES
        ]
    for entry in (embshard.shard, embshard.shard_model, ShardedCollection.__init__):
        assert inspect.signature(entry).parameters["lookup"].default == embshard.TrainingTBE()


@pytest.mark.parametrize("location", ["device", "managed", "managed_caching"])
def test_a_location_cpu_cannot_serve_is_refused(location):
    backend = embshard.TrainingTBE(location=location)
    message = (
        f"TrainingTBE(location='{location}') does not work on device cpu: "
        "a cpu device takes location 'host' or None"
    )
    with pytest.raises(ValueError) as refused:
        backend.check(embshard.SGD(), torch.device("cpu"))
    assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:
        backend.build(SHAPES, embshard.SGD(), torch.device("cpu"))
    assert str(refused.value) == message


def test_an_unknown_location_is_refused_at_construction():
    with pytest.raises(ValueError) as refused:
        embshard.TrainingTBE(location="ssd")
    assert str(refused.value) == (
        "TrainingTBE location must be None or one of "
        "['device', 'managed', 'managed_caching', 'host'], got 'ssd'"
    )


def test_the_backend_refuses_an_unknown_optimizer_with_the_builders_message():
    with pytest.raises(TypeError) as refused:
        embshard.TrainingTBE().check(torch.optim.SGD, torch.device("cpu"))
    assert str(refused.value) == (
        "optimizer must be embshard.SGD, RowWiseAdagrad, Adagrad, Adam or Lamb, "
        "got <class 'torch.optim.sgd.SGD'>"
    )


def test_each_optimizer_lays_out_its_state():
    configs = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[n])
        for n, r, d in (("cw", 6, 24), ("rw", 10, 4))
    ]
    plan = embshard.ShardingPlan(
        {"cw": embshard.column_wise([1, 0, 1], [8, 4, 12]), "rw": embshard.row_wise()}
    )
    cw, rw = plan.resolve(configs, 2).values()
    assert embshard.SGD.STATES == ()
    [(adagrad_name, adagrad)] = embshard.Adagrad.STATES
    [(rowwise_name, rowwise)] = embshard.RowWiseAdagrad.STATES
    assert adagrad_name == rowwise_name == "momentum1"  # the keys checkpoints have
    # Adam's and LAMB's two moments: per element, in FBGEMM's order.
    for moments in (embshard.Adam.STATES, embshard.Lamb.STATES):
        assert moments == (("momentum1", adagrad), ("momentum2", adagrad))
    # Per element: shaped like the table, each shard at its own offset.
    assert adagrad.shape(cw) == (6, 24)
    assert [adagrad.offset(cw, s) for s in cw.shards] == [(0, 0), (0, 8), (0, 12)]
    assert adagrad.shape(rw) == (10, 4)
    assert [adagrad.offset(rw, s) for s in rw.shards] == [(0, 0), (5, 0)]
    # Per row and column block: a column per block, in column order.
    assert rowwise.shape(cw) == (6, 3)
    assert [rowwise.offset(cw, s) for s in cw.shards] == [(0, 0), (0, 1), (0, 2)]
    assert rowwise.shape(rw) == (10, 1)
    assert [rowwise.offset(rw, s) for s in rw.shards] == [(0, 0), (5, 0)]
