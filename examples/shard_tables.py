"""Shard three TorchRec tables over the ranks of a torchrun job and look at the shards."""

import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import embshard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

tables = [
    EmbeddingBagConfig(name="user", num_embeddings=1000, embedding_dim=16, feature_names=["uid"]),
    EmbeddingBagConfig(name="item", num_embeddings=5000, embedding_dim=32, feature_names=["iid"]),
    EmbeddingBagConfig(name="ad", num_embeddings=300, embedding_dim=64, feature_names=["ad"]),
]
plan = embshard.ShardingPlan(
    {
        "user": embshard.table_wise(rank=0),
        "item": embshard.row_wise(),  # even row blocks over all ranks
        "ad": embshard.column_wise(ranks=[world - 1, 0], widths=[16, 48]),
    }
)
if rank == 0:
    print(plan.to_yaml())

# On meta, nothing is allocated: each rank creates and initializes only its own shards.
ebc = EmbeddingBagCollection(tables=tables, device="meta")
sharded = embshard.shard(ebc, plan, optimizer=embshard.RowWiseAdagrad(lr=0.05))

for key, table in sharded.state_dict().items():  # TorchRec's keys, DTensor values
    local = table.to_local()  # a LocalShardsWrapper of views of the TBE's weights
    shards = zip(local.local_offsets(), local.local_sizes()) if local.numel() else []
    where = [f"rows {o[0]}+{s[0]}, cols {o[1]}+{s[1]}" for o, s in shards]
    print(f"rank {rank} {key} {tuple(table.shape)} {table.placements}: {where}")

item = embshard.gather_table(sharded.weights["item"])  # collective: the whole table
print(f"rank {rank} gathered item table {tuple(item.shape)}, sum {item.sum():.4f}")
embshard.shutdown()
