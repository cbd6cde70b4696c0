"""Train a sharded EmbeddingBagCollection for a few steps under torchrun."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import embshard

# A finite timeout: a rank that dies ends the job with an error, not a hang.
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()

tables = [
    EmbeddingBagConfig(name="user", num_embeddings=1000, embedding_dim=16, feature_names=["uid"]),
    EmbeddingBagConfig(
        name="item",
        num_embeddings=5000,
        embedding_dim=32,
        feature_names=["iid", "last_iid"],  # two features share the table
        pooling=PoolingType.MEAN,
    ),
]
plan = embshard.ShardingPlan({"user": embshard.table_wise(rank=0), "item": embshard.row_wise()})
ebc = EmbeddingBagCollection(tables=tables, device="meta")
sharded = embshard.shard(ebc, plan, optimizer=embshard.RowWiseAdagrad(lr=0.5))

rows = {"uid": 1000, "iid": 5000, "last_iid": 5000}
generator = torch.Generator().manual_seed(rank)
fixed_batch = []
for name, n in rows.items():
    batch_size = 64 + 8 * rank  # local batch sizes may differ between ranks
    lengths = torch.randint(0, 4, (batch_size,), generator=generator)
    fixed_batch.append(
        (name, lengths, torch.randint(0, n, (int(lengths.sum()),), generator=generator))
    )
kjt = KeyedJaggedTensor(
    keys=[name for name, _, _ in fixed_batch],
    lengths=torch.cat([lengths for _, lengths, _ in fixed_batch]),
    values=torch.cat([ids for _, _, ids in fixed_batch]),
)
target = torch.ones(16 + 32 + 32)

for step in range(5):
    pooled = sharded(kjt)  # KeyedTensor of this rank's batch: uid, iid, last_iid
    loss = (pooled.values() - target).pow(2).mean()
    loss.backward()  # the fused optimizer updates the owning ranks' rows: no optimizer.step()
    losses = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(losses, loss.detach().reshape(1))
    if rank == 0:
        print(
            f"step {step} keys {pooled.keys()} loss per rank {[round(float(x), 4) for x in losses]}"
        )
embshard.shutdown()
