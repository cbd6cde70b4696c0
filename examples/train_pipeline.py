"""Train a sharded DLRM with TrainPipeline: each step starts the next batch's ids on their way."""

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain

import embshard

dist.init_process_group("gloo")
rank = dist.get_rank()

tables = [
    EmbeddingBagConfig(name="user", num_embeddings=1000, embedding_dim=8, feature_names=["uid"]),
    EmbeddingBagConfig(name="item", num_embeddings=5000, embedding_dim=8, feature_names=["iid"]),
]
torch.manual_seed(0)  # the dense layers' weights; tables on meta get embshard's seeded init
dlrm = DLRM(
    embedding_bag_collection=EmbeddingBagCollection(tables=tables, device="meta"),
    dense_in_features=4,
    dense_arch_layer_sizes=[16, 8],
    over_arch_layer_sizes=[16, 1],
)
plan = embshard.ShardingPlan({"user": embshard.table_wise(rank=0), "item": embshard.row_wise()})
# DLRMTrain returns (loss, output), as a pipeline expects. The tables train with the fused
# row-wise Adagrad in the backward; the dense layers, wrapped in DDP, with the optimizer below.
model = embshard.shard_model(DLRMTrain(dlrm), plan, optimizer=embshard.RowWiseAdagrad(lr=0.1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)


def batch(step: int) -> Batch:
    """This rank's 8 samples: one user each (label 1 for users below 500), 0 to 3 items."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    users = torch.randint(0, 1000, (8,), generator=g)
    item_counts = torch.randint(0, 4, (8,), generator=g)
    items = torch.randint(0, 5000, (int(item_counts.sum()),), generator=g)
    features = KeyedJaggedTensor(
        keys=["uid", "iid"],
        values=torch.cat([users, items]),
        lengths=torch.cat([torch.ones(8, dtype=torch.long), item_counts]),
    )
    dense = torch.rand(8, 4, generator=g)
    return Batch(dense_features=dense, sparse_features=features, labels=(users < 500).float())


# Each step: the next batch's input distribution, then forward, backward, optimizer.step().
pipeline = embshard.TrainPipeline(model, optimizer, [batch(step) for step in range(4)])
for step, (loss, _logits, _labels) in enumerate(pipeline):  # DLRMTrain's output
    print(f"rank {rank} step {step} loss {loss.item():.6f}")
embshard.shutdown()  # last, on every rank: destroys the process group and ends the process
