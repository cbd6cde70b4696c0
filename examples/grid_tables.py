"""A grid: a table cut into column blocks, each split by rows over its own ranks."""

import copy

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

import embshard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

tables = [
    EmbeddingBagConfig(name="ads", num_embeddings=10000, embedding_dim=64, feature_names=["ad"]),
    EmbeddingBagConfig(name="user", num_embeddings=1000, embedding_dim=16, feature_names=["uid"]),
]
plan = embshard.ShardingPlan(
    {
        # Columns 0:16 over ranks 0 and 1, the hot first 1000 rows alone on rank 0;
        # columns 16:64 whole on rank 1.
        "ads": embshard.grid(
            column_blocks=[16, 48], ranks=[[0, 1], [1]], sizes=[[1000, 9000], [10000]]
        ),
        "user": embshard.table_wise(rank=0),
    }
)

torch.manual_seed(0)  # the same weights on every rank: the unsharded module checks ours
ebc = EmbeddingBagCollection(tables=tables)
sharded = embshard.shard(copy.deepcopy(ebc), plan)

for key, table in sharded.state_dict().items():
    local = table.to_local()  # rank 1 holds rows 1000+ of one block, all rows of the other
    shards = zip(local.local_offsets(), local.local_sizes()) if local.numel() else []
    where = [f"rows {o[0]}+{s[0]}, cols {o[1]}+{s[1]}" for o, s in shards]
    print(f"rank {rank} {key} {tuple(table.shape)} {table.placements}: {where}")


def batch(ranks):
    """Two samples a rank: rank r looks up ads r and 5000 + r, users r and 10 + r."""
    ads = [i for r in ranks for i in (r, 5000 + r)]
    users = [i for r in ranks for i in (r, 10 + r)]
    ones = torch.ones(len(ads) + len(users), dtype=torch.long)
    return KeyedJaggedTensor(keys=["ad", "uid"], values=torch.tensor(ads + users), lengths=ones)


pooled = sharded(batch([rank])).values()
expected = ebc(batch(range(world))).values()[2 * rank : 2 * rank + 2]
print(f"rank {rank} pooled {tuple(pooled.shape)} equals unsharded: {torch.equal(pooled, expected)}")
ads = embshard.gather_table(sharded.weights["ads"])  # collective: the whole table
same = torch.equal(ads, ebc.embedding_bags["ads"].weight)
print(f"rank {rank} gathered ads table {tuple(ads.shape)} equals unsharded: {same}")
embshard.shutdown()
