"""Both libraries' sharded modules, built alike with the same weights, and what the
bench reads of their outputs: the loss it trains on and the outputs' difference."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .workloads import collection

if TYPE_CHECKING:
    import torch

LIBRARIES = ["embshard", "torchrec"]


def build_torchrec(configs, plan, world: int, comm_precision: str = "fp32", device=None):
    """TorchRec's DMP of ``configs`` by ``plan`` (converted), on ``device`` (default CPU)."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec import EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    import embshard

    device = torch.device("cpu") if device is None else torch.device(device)

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = collection(configs, torch.device("meta"))

        def forward(self, features):
            return self.tables(features)

    holder = Holder()
    sequence = isinstance(holder.tables, EmbeddingCollection)
    # FBGEMM's bounds check off, as in embshard's TBE (which checks ids before sending
    # them), so that both run the same kernels; TorchRec's default is WARNING.
    sharder = (EmbeddingCollectionSharder if sequence else EmbeddingBagCollectionSharder)(
        fused_params={
            "optimizer": EmbOptimType.EXACT_SGD,
            "learning_rate": 0.01,
            "bounds_check_mode": BoundsCheckMode.NONE,
        },
        qcomm_codecs_registry=get_qcomm_codecs_registry(
            QCommsConfig(CommType(comm_precision), CommType(comm_precision)),
            device=device,
        ),
    )
    module_plan = embshard.to_torchrec_plan(plan, configs, world, device_type=device.type)
    return DistributedModelParallel(
        holder,
        device=device,
        plan=ShardingPlan({"tables": module_plan}),
        sharders=[sharder],
    )


def build(library: str, configs, plan, world: int, comm_precision: str = "fp32", device=None):
    """One library's sharded module on this rank, as the bench builds it: TorchRec's on
    ``device`` (default CPU); embshard's where its mesh puts it (CUDA under NCCL)."""
    import embshard

    if library == "torchrec":
        return build_torchrec(configs, plan, world, comm_precision, device)
    if library != "embshard":
        raise ValueError(f"library must be one of {LIBRARIES}, got {library!r}")
    return embshard.shard(collection(configs, "meta"), plan, comm_precision=comm_precision)


def copy_weights(ours, theirs) -> None:
    """TorchRec's local shards take embshard's values, matched by global offsets."""
    import torch

    state = theirs.state_dict()
    for name, weight in ours.weights.items():
        local = weight.to_local()
        mine = (
            dict(zip(map(tuple, local.local_offsets()), local.local_shards()))
            if local.numel()
            else {}
        )
        target = state[f"tables.{ours.table_key(name)}.weight"]
        shards = target.local_shards() if hasattr(target, "local_shards") else []
        for shard in shards:
            offsets = tuple(shard.metadata.shard_offsets)
            if shard.tensor.numel():
                with torch.no_grad():
                    shard.tensor.copy_(mine[offsets])


def output(model, batch):
    """The model's output: a KeyedTensor of pooled rows (an EmbeddingBagCollection), or
    a JaggedTensor per feature holding each id's row (an EmbeddingCollection)."""
    out = model(batch)
    return out.wait() if hasattr(out, "wait") else out


def values(out) -> list[torch.Tensor]:
    """Every value of an ``output``, in as few tensors as it holds."""
    return [jagged.values() for jagged in out.values()] if isinstance(out, dict) else [out.values()]


def by_key(out) -> dict[str, torch.Tensor]:
    """An ``output``'s values per feature."""
    return dict(zip(out, values(out))) if isinstance(out, dict) else out.to_dict()


def loss(model, batch) -> torch.Tensor:
    """A training step's loss, the same for both libraries: the sum of every output value."""
    return sum(v.sum() for v in values(output(model, batch)))


def difference(ours, theirs, batch) -> tuple[float, float]:
    """Largest difference of the two outputs, key by key (TorchRec orders keys its own
    way), and the largest output value."""
    import torch

    with torch.no_grad():
        mine, other = by_key(output(ours, batch)), by_key(output(theirs, batch))
    gap = max((mine[k] - other[k]).abs().max().item() for k in mine)
    return gap, max(v.abs().max().item() for v in other.values())
