"""The bench's cells: its workloads (tables, bags and batch), id laws, plans and comm
precisions, and each rank's tables, plan and inputs for one of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

# torch is imported inside the functions, so that `embshard bench --help` is quick.
if TYPE_CHECKING:
    import torch

CRITEO_KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip

# MLPerf DLRMv2 (DCNv2 on Criteo 1TB) multi-hot sizes: ids in every bag of each of the
# 26 features, in Criteo's feature order (facebookresearch/dlrm,
# torchrec_dlrm/scripts/materialize_synthetic_multihot_dataset.py).
MLPERF_MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27,
                          10, 3, 1, 1]  # fmt: skip


def width_by_rows(rows: int) -> int:
    """Workload (d)'s dimensions: wider for bigger tables, as production models size them."""
    return 16 if rows < 1_000 else 32 if rows < 100_000 else 64


# Workload (e), a sequence model over user histories: an item-id table big and hot, then
# smaller ones (categories, creators, ...), one dim (TorchRec's EmbeddingCollection takes
# one), and the mean length of each table's sequences (~150 ids a sample in all).
SEQUENCE_ROWS = [400_000, 200_000, 100_000, 50_000, 20_000, 10_000, 5_000, 1_000]
SEQUENCE_MEANS = [50, 30, 20, 20, 10, 10, 5, 5]

# Each table is (rows, dim, pooling). Bags: "mean" draws each bag's size uniformly from
# 1 to 2 * pooling - 1; "fixed" gives every bag exactly pooling ids (MLPerf's multi-hot).
# A "sequence" workload is an EmbeddingCollection (a row per id; its "bags" are
# sequences); the others are EmbeddingBagCollections.
WORKLOADS = {
    "a": {"tables": [(100_000, 64, 20)] * 8, "bags": "mean", "batch": 1024},
    "b": {"tables": [(10_000, 32, 5)] * 64, "bags": "mean", "batch": 1024},
    "c": {
        "tables": [(min(r, 1_000_000), 64, 1) for r in CRITEO_KAGGLE_ROWS],
        "bags": "mean",
        "batch": 1024,
    },
    "d": {
        "tables": [
            (min(r, 400_000), width_by_rows(r), hot)
            for r, hot in zip(CRITEO_KAGGLE_ROWS, MLPERF_MULTI_HOT_SIZES)
        ],
        "bags": "fixed",
        "batch": 512,
    },
    "e": {
        "tables": [(rows, 64, mean) for rows, mean in zip(SEQUENCE_ROWS, SEQUENCE_MEANS)],
        "bags": "mean",
        "batch": 512,
        "sequence": True,
    },
}
ID_LAWS = ["uniform", "power-law"]
PLANS = ["table_wise", "row_wise", "column_wise", "mixed"]
COMM_PRECISIONS = ["fp32", "fp16", "bf16"]


def spec_of(workload: str | dict) -> dict:
    """A workload by its name in ``WORKLOADS``, or one given as a dict of the same
    shape (the tests' small ones)."""
    return WORKLOADS[workload] if isinstance(workload, str) else workload


def table_configs(workload: str | dict):
    """The workload's tables: EmbeddingConfigs for a sequence workload, else
    EmbeddingBagConfigs (the configs' type picks the module in both libraries)."""
    from torchrec import EmbeddingBagConfig, EmbeddingConfig

    spec = spec_of(workload)
    config = EmbeddingConfig if spec.get("sequence") else EmbeddingBagConfig
    return [
        config(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
        for i, (rows, dim, _) in enumerate(spec["tables"])
    ]


def collection(configs, device: str | torch.device):
    """TorchRec's unsharded module of ``configs``: an EmbeddingCollection of
    EmbeddingConfigs, an EmbeddingBagCollection of EmbeddingBagConfigs."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig

    if all(isinstance(c, EmbeddingConfig) for c in configs):
        return EmbeddingCollection(tables=configs, device=device)
    return EmbeddingBagCollection(tables=configs, device=device)


def make_plan(name: str, configs, world: int):
    import embshard

    def spec(i: int, kind: str):
        if kind == "table_wise":
            return embshard.table_wise(i % world)
        if kind == "row_wise":
            return embshard.row_wise()
        blocks = world if configs[i].embedding_dim % (4 * world) == 0 else 1
        return embshard.column_wise([(i + b) % world for b in range(blocks)])

    kinds = ["table_wise", "row_wise", "column_wise"]
    return embshard.ShardingPlan(
        {c.name: spec(i, kinds[i % 3] if name == "mixed" else name) for i, c in enumerate(configs)}
    )


def make_inputs(workload: str | dict, rank: int, steps: int, ids: str = "uniform"):
    """The rank's batches: ids uniform over each table's rows, or ``"power-law"`` as
    embshard's synthetic data draws them (low ids hot)."""
    import torch
    from torchrec import KeyedJaggedTensor

    from embshard.app.data import power_law_ids

    if ids not in ID_LAWS:
        raise ValueError(f"ids must be one of {ID_LAWS}, got {ids!r}")
    spec = spec_of(workload)
    batch = spec["batch"]
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(steps):
        lengths, values = [], []
        for rows, _, pooling in spec["tables"]:
            if spec["bags"] == "fixed":
                bag = torch.full((batch,), pooling)
            else:
                bag = torch.randint(1, 2 * pooling, (batch,), generator=generator)
            lengths.append(bag)
            count = int(bag.sum())
            if ids == "uniform":
                values.append(torch.randint(0, rows, (count,), generator=generator))
            else:
                values.append(power_law_ids(rows, count, generator))
        keys = [f"f{i}" for i in range(len(spec["tables"]))]
        batches.append(
            KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
        )
    return batches
