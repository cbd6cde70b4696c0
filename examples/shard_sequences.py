"""Shard an EmbeddingCollection (one row per id), its table as a grid, and train it."""

import copy

import torch
import torch.distributed as dist
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

import embshard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

item = EmbeddingConfig(name="item", num_embeddings=5000, embedding_dim=8, feature_names=["history"])
# Two column blocks of 4, each split by rows over both ranks (TorchRec's grid).
plan = embshard.ShardingPlan({"item": embshard.grid(column_blocks=[4, 4], ranks=[[0, 1], [0, 1]])})
torch.manual_seed(0)  # the same weights on every rank: the unsharded module checks ours
ec = EmbeddingCollection(tables=[item])
sharded = embshard.shard(copy.deepcopy(ec), plan, optimizer=embshard.SGD(lr=0.5))


def histories(ranks):
    """Two users a rank, with 3 and 1 items: rank r's 100r + 1, 100r + 2, 4000 + r and 7."""
    items = [i for r in ranks for i in (100 * r + 1, 100 * r + 2, 4000 + r, 7)]
    lengths = torch.tensor([3, 1] * len(ranks))
    return KeyedJaggedTensor(["history"], torch.tensor(items), lengths=lengths)


for step in range(2):
    rows = sharded(histories([rank]))["history"]  # a JaggedTensor: a row per id, a bag per user
    expected = ec(histories(range(world)))["history"].values()  # the global batch's rows
    same = torch.allclose(rows.values(), expected[4 * rank : 4 * rank + 4])
    loss = rows.values().pow(2).sum()
    print(f"rank {rank} step {step} rows {tuple(rows.values().shape)} loss {loss:.6f} same: {same}")
    loss.backward()  # the fused SGD updates the owners' rows
    (expected.pow(2).sum() / world).backward()  # the unsharded module: loss averaged over ranks
    with torch.no_grad():
        weight = ec.embeddings["item"].weight
        weight -= 0.5 * weight.grad
        weight.grad = None
embshard.shutdown()
