"""Shard an EmbeddingBagCollection, train one step, save it, reload it under another plan."""

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

import embshard
from embshard import checkpoint

dist.init_process_group("gloo")
rank = dist.get_rank()

tables = [
    EmbeddingBagConfig(name="user", num_embeddings=1000, embedding_dim=16, feature_names=["uid"]),
    EmbeddingBagConfig(name="item", num_embeddings=5000, embedding_dim=32, feature_names=["iid"]),
]
plan = embshard.ShardingPlan({"user": embshard.table_wise(rank=0), "item": embshard.row_wise()})
ebc = EmbeddingBagCollection(tables=tables, device="meta")  # nothing allocated on meta
sharded = embshard.shard(ebc, plan, optimizer=embshard.SGD(lr=0.5))

# Each rank brings its own batch, here of 2 samples:
# uid bags [rank] and [7], iid bags [4000 + rank] and [12, 13].
batch = KeyedJaggedTensor(
    keys=["uid", "iid"],
    values=torch.tensor([rank, 7, 4000 + rank, 12, 13]),
    lengths=torch.tensor([1, 1, 1, 2]),
)
pooled = sharded(batch)  # collective: every rank calls it; a KeyedTensor of this rank's samples
loss = pooled.values().pow(2).sum()
loss.backward()  # the fused SGD updates the owning ranks' rows: there is no optimizer.step()
print(f"rank {rank} {pooled.keys()} {tuple(pooled.values().shape)}: loss {loss.item():.6f}")

checkpoint.save("runs/quickstart", sharded, step=1)  # collective: each rank writes its shards
other_plan = embshard.ShardingPlan(
    {"user": embshard.row_wise(), "item": embshard.column_wise(ranks=[1, 0])}
)
other = embshard.shard(EmbeddingBagCollection(tables=tables, device="meta"), other_plan)
step = checkpoint.load("runs/quickstart", other)  # its latest checkpoint, resharded
loss = other(batch).values().pow(2).sum()
print(f"rank {rank} reloaded step {step} under another plan: loss {loss.item():.6f}")
embshard.shutdown()  # last, on every rank: destroys the process group and ends the process
