"""Adam and LAMB, FBGEMM's CUDA-only fused optimizers, on a GPU: against the oracle's
plain torch Adam and LAMB on the unsharded TorchRec module, and resumed from a
checkpoint bit-exactly (their moments and step count saved). Marked ``cuda``: skipped
where torch sees no GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import Case, Table, local_batches, run_case
from test_cuda import EVERY_LAYOUT_TABLES, TOL
from test_forward import plans, tables_for
from torchrec import EmbeddingBagCollection

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, grid, row_wise, table_wise
from embshard import checkpoint as ckpt
from embshard.modules.mesh import world_mesh

pytestmark = pytest.mark.cuda

# lr large enough that three steps move the rows well past TOL; eps well above the
# float32 rounding of a gradient, so the steps do not hang on its last bits.
OPTIMIZERS = {
    "adam": embshard.Adam(lr=0.01, eps=1e-4),
    "lamb": embshard.Lamb(lr=0.1, eps=1e-4),
    "adam_decay": embshard.Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-4, weight_decay=0.1),
    "lamb_decay": embshard.Lamb(lr=0.1, beta1=0.8, beta2=0.99, eps=1e-4, weight_decay=0.1),
}

# test_cuda's every layout on one rank but the copies (data-parallel, hot rows), which
# Adam and LAMB refuse: table-wise, row-wise (SUM and MEAN), four column blocks, a grid.
SPARSE_TABLES = tuple(t for t in EVERY_LAYOUT_TABLES if t.name != "dp")
SPARSE_LAYOUTS = ShardingPlan(
    {
        "tw": table_wise(0),
        "rw": row_wise(),
        "uneven": row_wise([25]),  # MEAN pooled
        "cw": column_wise([0, 0, 0, 0]),
        "grid": grid(2, [[0], [0]]),
    }
)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_sparse_layout_trains_like_unsharded(cuda_world, optimizer):
    case = Case(SPARSE_TABLES, SPARSE_LAYOUTS, (6,), optimizer=OPTIMIZERS[optimizer])
    [worst] = cuda_world(1).run(run_case, case)
    assert worst["forward"] < TOL and worst["weights"] < TOL, worst
    assert worst["output"] > 0.1 and worst["update"] > 1e-3, worst  # real rows, real updates


@pytest.mark.parametrize("plan", ["mixed", "grid_mixed"])
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_two_ranks_sharing_the_gpu_train_like_unsharded(cuda_world, optimizer, plan):
    case = Case(
        tables_for(plan),
        plans(2)[plan],
        (5, 2),  # test_cuda holds a rank with an empty batch on its own
        optimizer=OPTIMIZERS[optimizer],
        device="cuda",
    )
    for worst in cuda_world(2).run(run_case, case):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst
        assert worst["update"] > 1e-3, worst


def shard_copies(optimizer) -> str | None:
    """The error sharding a data-parallel table and a hot-rows one with ``optimizer``."""
    configs = [Table("dp", 12, 8, ("f_a",)).config(), Table("hot", 30, 12, ("f_b",)).config()]
    plan = ShardingPlan({"dp": data_parallel(), "hot": row_wise(hot_rows=5)})
    ebc = EmbeddingBagCollection(tables=configs, device="meta")
    try:
        embshard.shard(ebc, plan, mesh=world_mesh("cuda"), optimizer=optimizer)
    except embshard.PlanError as e:
        return str(e)
    return None


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_copies_are_refused_on_every_rank(cuda_world, optimizer):
    kind = OPTIMIZERS[optimizer].KIND
    refusal = (
        f"tables ['dp', 'hot']: data-parallel tables and hot rows cannot use the fused "
        f"optimizer {kind}: their copies take a gradient in every row each step, zero in "
        "rows no rank looked up, and it would move those rows (the unsharded table keeps "
        "them); shard them table-wise, column-wise or row-wise without hot rows"
    )
    assert cuda_world(2).run(shard_copies, OPTIMIZERS[optimizer]) == [refusal, refusal]


RESUMED_TABLES = (
    Table("a", 30, 16, ("f_a",)),
    Table("b", 30, 16, ("f_b",)),
    Table("c", 24, 16, ("f_c",)),
)
RESUMED_PLANS = {
    1: ShardingPlan({"a": table_wise(0), "b": row_wise(), "c": column_wise([0, 0])}),
    2: ShardingPlan({"a": row_wise(), "b": column_wise([1, 0]), "c": grid(2, [[0, 1], [1, 0]])}),
}


def _sharded(optimizer, seed: int):
    configs = [t.config() for t in RESUMED_TABLES]
    ebc = EmbeddingBagCollection(tables=configs, device="meta")
    plan = RESUMED_PLANS[dist.get_world_size()]
    return embshard.shard(ebc, plan, mesh=world_mesh("cuda"), optimizer=optimizer, seed=seed)


def _train(sharded, steps: range) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    case = Case(RESUMED_TABLES, sharded.plan, (6,) * world)
    device = embshard.gather_table(sharded.weights["a"]).device
    for step in steps:
        batch = local_batches(case, step)[rank].to(device)
        sharded(batch).values().pow(2).sum().backward()


def _everything(sharded) -> dict[str, torch.Tensor | None]:
    """Every table (``<table_key>.weight``), its optimizer state and the step count
    (``steps``, None for an optimizer without one), whole, on the CPU."""
    weights = {f"{sharded.table_key(n)}.weight": w for n, w in sharded.weights.items()}
    tables = weights | sharded.optimizer_state()
    whole = {k: embshard.gather_table(v).cpu() for k, v in tables.items()}
    return whole | {"steps": sharded.optimizer_steps()}


def uninterrupted_and_resumed(optimizer, root: str) -> tuple[dict, dict]:
    """Four steps in one go; and two, saved, loaded into a model of other weights, and
    two more."""
    straight = _sharded(optimizer, seed=0)
    _train(straight, range(4))
    first = _sharded(optimizer, seed=0)
    _train(first, range(2))
    ckpt.save(root, first, step=2)
    resumed = _sharded(optimizer, seed=9)
    _train(resumed, range(1))  # its own count must not survive the load
    assert ckpt.load(root, resumed) == 2
    _train(resumed, range(2, 4))
    return _everything(straight), _everything(resumed)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("optimizer", ["adam_decay", "lamb_decay"])
def test_a_resumed_run_continues_bit_exactly(cuda_world, tmp_path, optimizer, world_size):
    runs = cuda_world(world_size).run(
        uninterrupted_and_resumed, OPTIMIZERS[optimizer], str(tmp_path)
    )
    for straight, resumed in runs:
        assert straight.keys() == resumed.keys()
        for key in straight:
            assert torch.equal(straight[key], resumed[key]), key
        assert int(straight["steps"]) == 4
        assert straight["embedding_bags.a.momentum2"].abs().sum() > 0  # real state
    # Each table's moments and step count, as `embshard ckpt inspect` reads them.
    info = ckpt.describe(tmp_path)
    for t in RESUMED_TABLES:
        saved = info["tables"][f"embedding_bags.{t.name}"]
        shape = [t.rows, t.dim]
        assert saved["optimizer"] == OPTIMIZERS[optimizer].KIND
        assert saved["optimizer_state"] == {"momentum1": shape, "momentum2": shape}
        assert saved["optimizer_step"] == 2


def load_into(optimizer, root: str) -> dict[str, torch.Tensor]:
    sharded = _sharded(optimizer, seed=9)
    _train(sharded, range(1))
    ckpt.load(root, sharded)
    return _everything(sharded)


def save_with(optimizer, root: str) -> None:
    sharded = _sharded(optimizer, seed=0)
    _train(sharded, range(2))
    ckpt.save(root, sharded, step=2)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [("adam", "rowwise_adagrad"), ("rowwise_adagrad", "adam"), ("adam", "lamb")],
)
def test_a_checkpoint_of_another_optimizer_loads_its_weights_and_zero_state(
    cuda_world, tmp_path, saved, loaded
):
    optimizers = OPTIMIZERS | {"rowwise_adagrad": embshard.RowWiseAdagrad(lr=0.1)}
    cuda_world(1).run(save_with, optimizers[saved], str(tmp_path))
    [state] = cuda_world(1).run(load_into, optimizers[loaded], str(tmp_path))
    weights = ckpt.read_tensors(ckpt.resolve(tmp_path), "model.")
    for key, value in state.items():
        if key.endswith(".weight"):
            assert torch.equal(value, weights[key].to(value.device)), key
        elif key != "steps":
            assert not value.any(), key  # the state starts again from zero
    assert state["steps"] is None or int(state["steps"]) == 0
