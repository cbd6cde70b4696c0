"""The CUDA path on a GPU: FBGEMM's CUDA kernels and NCCL, against the unsharded TorchRec
module on CPU. Marked ``cuda``: skipped where torch sees no GPU (tests/conftest.py).

One rank runs NCCL. Several ranks share the one GPU over gloo, which moves CUDA tensors
(NCCL refuses two ranks on one device): the same sharded code and CUDA kernels, another
transport."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import Case, Table, local_batches, run_case, run_sequence_case
from test_forward import ALL_PLANS, batch_sizes, plans, tables_for
from torchrec import EmbeddingBagCollection

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, grid, row_wise, table_wise
from embshard import checkpoint as ckpt

pytestmark = pytest.mark.cuda

# CUDA sums and updates in float32 in another order, with fused multiply-adds: within
# this of the CPU oracle; a wrong row or update is off by far more.
TOL = 1e-4

# Every layout on one rank, both poolings: several column blocks, hot rows, a grid.
EVERY_LAYOUT_TABLES = (
    Table("tw", 40, 8, ("f_a", "f_b")),
    Table("rw", 30, 12, ("f_a",)),
    Table("uneven", 25, 16, ("f_c",), mean=True),
    Table("cw", 20, 16, ("f_d",)),
    Table("dp", 12, 8, ("f_b", "f_d")),
    Table("grid", 24, 16, ("f_e",)),
)
EVERY_LAYOUT = ShardingPlan(
    {
        "tw": table_wise(0),
        "rw": row_wise(),
        "uneven": row_wise([15], hot_rows=10),
        "cw": column_wise([0, 0, 0, 0]),
        "dp": data_parallel(),
        "grid": grid(2, [[0], [0]]),
    }
)
OPTIMIZERS = {
    "sgd": embshard.SGD(lr=0.1),
    "rowwise_adagrad": embshard.RowWiseAdagrad(lr=0.1, eps=1e-4),
    "adagrad": embshard.Adagrad(lr=0.1, eps=1e-4),
}

# An EmbeddingCollection takes one dim for all its tables.
SEQUENCE_TABLES = (
    Table("a", 40, 8, ("f_a",)),
    Table("b", 30, 8, ("f_b1", "f_b2")),
    Table("c", 25, 8, ("f_c",)),
    Table("d", 20, 8, ("f_a", "f_d")),
)
SEQUENCE_PLAN = ShardingPlan(
    {"a": table_wise(0), "b": column_wise([0, 0]), "c": row_wise(), "d": grid(2, [[0], [0]])}
)


def where_it_ran() -> tuple[str, str]:
    """The default group's backend and the device the shards live on."""
    ebc = EmbeddingBagCollection(tables=[EVERY_LAYOUT_TABLES[0].config()], device="meta")
    sharded = embshard.shard(ebc, ShardingPlan({"tw": table_wise(0)}))
    return dist.get_backend(), str(embshard.gather_table(sharded.weights["tw"]).device)


def test_one_rank_runs_nccl_with_its_shards_on_the_gpu(cuda_world):
    [(backend, device)] = cuda_world(1).run(where_it_ran)
    assert backend == "nccl" and device.startswith("cuda"), (backend, device)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_layout_trains_like_unsharded(cuda_world, optimizer, weighted):
    tables = EVERY_LAYOUT_TABLES
    if weighted:  # TorchRec weighs SUM-pooled bags only
        tables = tuple(Table(t.name, t.rows, t.dim, t.features) for t in tables)
    case = Case(tables, EVERY_LAYOUT, (6,), optimizer=OPTIMIZERS[optimizer], weighted=weighted)
    [worst] = cuda_world(1).run(run_case, case)
    assert worst["forward"] < TOL and worst["weights"] < TOL, worst
    assert worst["output"] > 0.1 and worst["update"] > 1e-3, worst  # real rows, real updates


# Adam's and LAMB's rates as tests/test_cuda_optimizers.py sets them.
SEQUENCE_OPTIMIZERS = OPTIMIZERS | {
    "adam": embshard.Adam(lr=0.01, eps=1e-4),
    "lamb": embshard.Lamb(lr=0.1, eps=1e-4),
}


def test_an_empty_batch_at_one_rank_on_the_gpu(cuda_world):
    """No bags at all through the batch check, every layout's lookup and the update."""
    case = Case(EVERY_LAYOUT_TABLES, EVERY_LAYOUT, (0,), device="cuda")
    [worst] = cuda_world(1).run(run_case, case)
    assert worst["forward"] == 0 and worst["weights"] == 0 and worst["update"] == 0, worst


@pytest.mark.parametrize("optimizer", list(SEQUENCE_OPTIMIZERS))
def test_embedding_collection_trains_like_unsharded(cuda_world, optimizer):
    optimizer = SEQUENCE_OPTIMIZERS[optimizer]
    case = Case(SEQUENCE_TABLES, SEQUENCE_PLAN, (6,), optimizer=optimizer, sequence=True)
    [worst] = cuda_world(1).run(run_sequence_case, case)
    assert worst["forward"] < TOL and worst["weights"] < TOL, worst
    assert worst["output"] > 0.1 and worst["update"] > 1e-3, worst


CHECKPOINT_TABLES = (
    Table("a", 30, 16, ("f_a",)),
    Table("b", 30, 16, ("f_b",)),
    Table("c", 24, 16, ("f_c",)),
)
ADAGRAD = embshard.Adagrad(lr=0.1)
CHECKPOINT_PLANS = {
    1: ShardingPlan({"a": table_wise(0), "b": row_wise(), "c": column_wise([0, 0])}),
    2: ShardingPlan({"a": row_wise(), "b": column_wise([1, 0]), "c": table_wise(1)}),
}


def _sharded(seed: int, plan: ShardingPlan | None = None, optimizer=ADAGRAD):
    torch.manual_seed(seed)
    configs = [t.config() for t in CHECKPOINT_TABLES]
    ebc = EmbeddingBagCollection(tables=configs, device="meta")
    plan = plan or CHECKPOINT_PLANS[dist.get_world_size()]
    return embshard.shard(ebc, plan, optimizer=optimizer, seed=seed)


def _everything(sharded) -> dict[str, torch.Tensor]:
    """Every table and its optimizer state, whole, on the CPU."""
    tables = dict(sharded.weights) | sharded.optimizer_state()
    return {k: embshard.gather_table(v).cpu() for k, v in tables.items()}


def save_after_training(root: str, plan=None, optimizer=ADAGRAD) -> dict:
    sharded = _sharded(0, plan, optimizer)
    case = Case(CHECKPOINT_TABLES, sharded.plan, (6,) * dist.get_world_size())
    device = embshard.gather_table(sharded.weights["a"]).device
    for step in range(2):
        batch = local_batches(case, step)[dist.get_rank()].to(device)
        sharded(batch).values().pow(2).sum().backward()
    ckpt.save(root, sharded, step=2)
    return _everything(sharded)


def load_and_save(
    source: str, target: str | None, plan=None, optimizer=ADAGRAD
) -> dict[str, torch.Tensor]:
    sharded = _sharded(9, plan, optimizer)
    ckpt.load(source, sharded)
    if target is not None:
        ckpt.save(target, sharded, step=2)
    return _everything(sharded)


def test_checkpoint_saved_on_gpu_loads_on_cpu_and_back_bit_exact(cuda_world, world, tmp_path):
    on_gpu, on_cpu = str(tmp_path / "gpu"), str(tmp_path / "cpu")
    [saved] = cuda_world(1).run(save_after_training, on_gpu)
    # Two CPU ranks: resharded on the way, as well as moved.
    for loaded in world(2).run(load_and_save, on_gpu, on_cpu):
        assert saved.keys() == loaded.keys()
        for key in saved:
            assert torch.equal(saved[key], loaded[key]), key
    [back] = cuda_world(1).run(load_and_save, on_cpu, None)
    for key in saved:
        assert torch.equal(saved[key], back[key]), key
    assert any("momentum1" in k for k in saved)  # the optimizer's state travelled too


def test_rowwise_adagrad_state_merges_column_blocks_on_the_gpu(cuda_world, tmp_path):
    # Saved with c in two column blocks, loaded with c whole: c's state per row is the
    # mean of its two blocks' (equal widths), converted on the device that holds it.
    optimizer = embshard.RowWiseAdagrad(lr=0.1)
    whole = ShardingPlan({"a": table_wise(0), "b": row_wise(), "c": table_wise(0)})
    root = str(tmp_path / "ckpt")
    [saved] = cuda_world(1).run(save_after_training, root, None, optimizer)
    [loaded] = cuda_world(1).run(load_and_save, root, None, whole, optimizer)
    state = "embedding_bags.c.momentum1"
    assert saved[state].shape == (24, 2) and loaded[state].shape == (24, 1)
    assert saved[state].abs().sum() > 0  # trained: there is state to convert
    torch.testing.assert_close(loaded[state][:, 0], saved[state].mean(1), rtol=1e-6, atol=0)
    assert torch.equal(loaded["c"], saved["c"])


# Last: several processes on the one GPU.
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("plan", ALL_PLANS)
def test_ranks_sharing_the_gpu_train_like_unsharded(cuda_world, world_size, plan):
    sizes = (5, 2, 3, 6)[:world_size]  # every rank has samples; an empty one is below
    case = Case(tables_for(plan), plans(world_size)[plan], sizes, device="cuda")
    for worst in cuda_world(world_size).run(run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


def all_to_all_with_empty_sides() -> list[list[float]]:
    """gloo's all-to-all of CUDA tensors where rank 1 sends nothing (it receives 2
    from rank 0), then where no rank sends anything: what a rank with an empty batch
    asks of it."""
    rank = dist.get_rank()
    received = []
    for sent_by_0 in ([3, 2], [0, 0]):
        send = [sent_by_0, [0, 0]][rank]
        recv = [sent_by_0[rank], 0]
        values = torch.arange(sum(send), dtype=torch.float32, device="cuda")
        out = torch.empty(sum(recv), device="cuda")
        dist.all_to_all_single(out, values, recv, send)
        received.append(out.cpu().tolist())
    return received


def test_gloo_moves_empty_cuda_buffers_on_the_shared_gpu(cuda_world):
    assert cuda_world(2).run(all_to_all_with_empty_sides, timeout=30) == [
        [[0.0, 1.0, 2.0], []],
        [[3.0, 4.0], []],
    ]


@pytest.mark.parametrize("plan", ["table_wise", "mixed"])
def test_a_rank_with_an_empty_batch_on_the_shared_gpu(cuda_world, plan):
    assert batch_sizes(2)[1] == 0
    case = Case(tables_for(plan), plans(2)[plan], batch_sizes(2), device="cuda")
    for worst in cuda_world(2).run(run_case, case, timeout=60):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


def test_an_embedding_collection_with_an_empty_rank_on_the_shared_gpu(cuda_world):
    """The row-per-id path's routing and rows back, rank 1 with no samples."""
    optimizer = embshard.RowWiseAdagrad(lr=0.1, eps=1e-4)
    case = Case(
        SEQUENCE_TABLES, SEQUENCE_PLAN, (5, 0), optimizer=optimizer, sequence=True, device="cuda"
    )
    for worst in cuda_world(2).run(run_sequence_case, case, timeout=60):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst
