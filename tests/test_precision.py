"""Lower precision: FP16 tables and fp16/bf16 all-to-alls, with their error measured.

FP16 tables: FBGEMM sums the float16 rows in float32 into a float32 output, so the
oracle is a float32 module holding the same float16 values (``oracle.float32_twin``),
which updates in float32 and rounds its weights to float16 after every step. FBGEMM's
CPU SGD and Adagrad round the step to float16 before adding it, a second rounding the
oracle does not make: each step may leave a weight one float16 ulp away from the
oracle's (row-wise Adagrad rounds once, as the oracle). Gradients do not depend on the
weights (pooling is linear), so those ulps only add up, one per step at most.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from oracle import Case, Table, global_batch, local_batches, max_abs, max_diff, run_case
from torchrec import EmbeddingBagCollection
from torchrec.modules.embedding_configs import DataType

import embshard
from embshard import ShardingPlan, column_wise, row_wise, table_wise
from embshard import checkpoint as ckpt
from tools.bench import CollectiveBytes

FP16 = DataType.FP16
# Unit roundoff: half an ulp, relative, of rounding to nearest.
UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8}
# One float16 ulp is at most this fraction of the value: 2**-10.
ULP16 = 2.0**-10

TABLES = (
    Table("a", 40, 8, ("f_a",), data_type=FP16),
    Table("b", 30, 12, ("f_b1", "f_b2"), data_type=FP16),
    Table("c", 25, 16, ("f_c",), mean=True, data_type=FP16),
    Table("d", 20, 16, ("f_a", "f_d"), data_type=FP16),
)


def mixed_plan(world: int) -> ShardingPlan:
    last = world - 1
    return ShardingPlan(
        {
            "a": table_wise(last),
            "b": row_wise(),
            "c": row_wise([10] + [0] * (world - 2) + [15]),
            "d": column_wise([last, 0, last, 0]),
        }
    )


def batch_sizes(world: int) -> tuple[int, ...]:
    return (5, 0, 3, 6)[:world]


def fp32(tables) -> tuple[Table, ...]:
    return tuple(dataclasses.replace(t, data_type=DataType.FP32) for t in tables)


# FP16 tables: forward against TorchRec's own FP16 module, training against the oracle.


def forward_against_torchrec(case: Case) -> tuple[float, float]:
    """Largest difference from TorchRec's FP16 EmbeddingBagCollection over two batches,
    and the largest weight."""
    rank = dist.get_rank()
    torch.manual_seed(case.seed)
    module = EmbeddingBagCollection(tables=[t.config() for t in case.tables])
    sharded = embshard.shard(copy.deepcopy(module), case.plan)
    start = sum(case.batch_sizes[:rank])
    worst = 0.0
    for step in range(2):
        batches = local_batches(case, step)
        out = sharded(batches[rank]).values()
        expected = module(global_batch(batches)).values()[start : start + len(out)]
        assert out.dtype == expected.dtype == torch.float32
        worst = max(worst, max_diff(out, expected))
    return worst, max(max_abs(b.weight) for b in module.embedding_bags.values())


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_forward_matches_torchrec_fp16_module(world, world_size):
    # TorchRec pools FP16 tables in float16 (F.embedding_bag, then .float()): each of
    # the <= max_pooling additions (and MEAN's division) rounds a value at most
    # max_pooling * max|w| by half an ulp. A wrong row is off by ~max|w| (0.2 here).
    case = Case(TABLES, mixed_plan(world_size), batch_sizes(world_size), seed=world_size)
    results = world(world_size).run(forward_against_torchrec, case)
    for worst, weight in results:
        tolerance = (case.max_pooling + 1) * UNIT["fp16"] * case.max_pooling * weight
        assert worst <= tolerance, (worst, tolerance)
    assert max(worst for worst, _ in results) > 0  # TorchRec's float16 sums did round


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "optimizer",
    [embshard.SGD(lr=0.1), embshard.RowWiseAdagrad(lr=0.1, eps=1e-4), embshard.Adagrad(lr=0.1)],
    ids=["sgd", "rowwise_adagrad", "adagrad"],
)
def test_fp16_training_matches_float32_oracle_rounded(world, world_size, optimizer):
    case = Case(TABLES, mixed_plan(world_size), batch_sizes(world_size), optimizer=optimizer)
    check_fp16_training(world(world_size).run(run_case, case), case, 1e-5)


def check_fp16_training(results: list[dict], case: Case, forward_slack: float) -> None:
    """Each rank's worst gaps from the float32 oracle rounded: at most one float16 ulp
    per step apart; a forward sums up to ``max_pooling`` such rows (plus
    ``forward_slack``, the float32 sums' own order)."""
    for worst in results:
        weights = case.steps * ULP16 * worst["weight"]
        assert worst["weights"] <= weights, (worst, weights)
        assert worst["forward"] <= forward_slack + case.max_pooling * weights, worst
        assert worst["update"] > 100 * weights, worst  # the updates are far above that


def test_fp16_weighted_features(world):
    # TorchRec's FP16 module refuses float32 per-sample weights ("Expected tensor for
    # argument #1 'weight' to have the same type as tensor for argument #1
    # 'per_sample_weights'"): only the float32 oracle checks these.
    tables = tuple(dataclasses.replace(t, mean=False) for t in TABLES)
    case = Case(tables, mixed_plan(3), batch_sizes(3), weighted=True)
    for worst in world(3).run(run_case, case):
        weights = case.steps * ULP16 * worst["weight"]
        assert worst["weights"] <= weights, worst
        assert worst["forward"] <= 1e-5 + case.max_pooling * weights, worst


def mixed_precision_error() -> str:
    tables = [TABLES[0].config(), dataclasses.replace(TABLES[1].config(), data_type=DataType.FP32)]
    module = EmbeddingBagCollection(tables=tables, device="meta")
    try:
        embshard.shard(module, ShardingPlan({"a": table_wise(0), "b": row_wise()}))
    except ValueError as e:
        return str(e)
    return "no error"


def test_mixed_data_types_in_one_collection_are_refused(world):
    for message in world(2).run(mixed_precision_error):
        assert "mixes table data types" in message, message
        assert "FP16: ['a']" in message and "FP32: ['b']" in message, message


# Storage: dtypes, the seeded init, state dicts and checkpoints.


def init_and_dtypes() -> dict[str, torch.Tensor]:
    """The FP16 tables next to the FP32 init under another plan, with the dtypes seen."""
    world = dist.get_world_size()
    plans = {
        "fp16": mixed_plan(world),
        "fp32": ShardingPlan({t.name: row_wise() for t in TABLES}),
    }
    found = {}
    for kind, tables in (("fp16", TABLES), ("fp32", fp32(TABLES))):
        ebc = EmbeddingBagCollection(tables=[t.config() for t in tables], device="meta")
        sharded = embshard.shard(ebc, plans[kind], seed=5, optimizer=embshard.Adagrad())
        for name, weight in sharded.weights.items():
            found[f"{kind}.{name}"] = embshard.gather_table(weight)
            found[f"{kind}.{name}.dtypes"] = [weight.dtype, weight.to_local().dtype]
        found[f"{kind}.state"] = {v.dtype for v in sharded.optimizer_state().values()}
    return found


def test_fp16_seeded_init_is_the_float32_init_rounded(world):
    for found in world(3).run(init_and_dtypes):
        for t in TABLES:
            assert found[f"fp16.{t.name}"].dtype == torch.float16
            # Table "a" lives on rank 2 alone: the others' empty parts say float16 too.
            assert found[f"fp16.{t.name}.dtypes"] == [torch.float16] * 2
            assert torch.equal(found[f"fp16.{t.name}"], found[f"fp32.{t.name}"].half()), t.name
        assert found["fp16.state"] == found["fp32.state"] == {torch.float32}


SAVE_PLAN = {
    "a": row_wise(),
    "b": column_wise([1, 0, 1]),
    "c": table_wise(1),
    "d": row_wise([5, 15]),
}
LOAD_PLAN = {
    "a": column_wise([2, 0]),
    "b": table_wise(1),
    "c": row_wise(),
    "d": column_wise([0, 1, 2, 0]),
}


def build(plan: dict, tables=TABLES, seed: int = 0):
    ebc = EmbeddingBagCollection(tables=[t.config() for t in tables], device="meta")
    return embshard.shard(ebc, ShardingPlan(plan), optimizer=embshard.Adagrad(lr=0.1), seed=seed)


def gathered(sharded) -> dict[str, torch.Tensor]:
    state = {k: embshard.gather_table(v) for k, v in sharded.optimizer_state().items()}
    return {n: embshard.gather_table(w) for n, w in sharded.weights.items()} | state


def save_fp16(root: str) -> dict[str, torch.Tensor]:
    sharded = build(SAVE_PLAN)
    case = Case(TABLES, sharded.plan, (6,) * dist.get_world_size())
    for step in range(2):
        sharded(local_batches(case, step)[dist.get_rank()]).values().pow(2).sum().backward()
    ckpt.save(root, sharded, step=2)
    return gathered(sharded)


def load_fp16(root: str, export: str) -> dict:
    sharded = build(LOAD_PLAN, seed=9)
    ckpt.load(root, sharded)
    loaded = gathered(sharded)
    exported = torch.load(export)
    # load_state_dict casts, as nn.Module's does: float32 tables arrive rounded.
    as_fp32 = {k: v.float() + 1e-4 for k, v in exported.items()}
    sharded.load_state_dict(as_fp32)
    from_fp32 = {n: embshard.gather_table(w) for n, w in sharded.weights.items()}
    try:
        ckpt.load(root, build(LOAD_PLAN, fp32(TABLES)))
        refused = "loaded"
    except ckpt.CheckpointError as e:
        refused = str(e)
    return {"loaded": loaded, "from_fp32": from_fp32, "as_fp32": as_fp32, "refused": refused}


def test_fp16_checkpoint_reshards_bit_exact_and_keeps_its_dtype(world, tmp_path):
    root, export = tmp_path / "ckpt", tmp_path / "export.pt"
    saved = world(2).run(save_fp16, str(root))[0]
    ckpt.export(root, export)
    exported = torch.load(export)
    info = ckpt.describe(root)
    for t in TABLES:
        assert exported[f"embedding_bags.{t.name}.weight"].dtype == torch.float16
        assert torch.equal(exported[f"embedding_bags.{t.name}.weight"], saved[t.name])
        assert info["tables"][f"embedding_bags.{t.name}"]["dtype"] == "float16"
    for result in world(3).run(load_fp16, str(root), str(export)):
        for key, value in saved.items():
            assert result["loaded"][key].dtype == value.dtype
            assert torch.equal(result["loaded"][key], value), key
        for t in TABLES:
            source = result["as_fp32"][f"embedding_bags.{t.name}.weight"]
            assert torch.equal(result["from_fp32"][t.name], source.half()), t.name
        assert "torch.float16, the model (40, 8) torch.float32" in result["refused"]


# Compressed all-to-alls.


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_compressed_all_to_alls_err_by_rounding_only(world, precision):
    # Each pooled partial and each gradient element is rounded once: relative to the
    # largest value, the error is at most one unit roundoff per row-wise partial summed
    # (3 ranks), and the weights' update error at most a few units (gradients of many
    # samples add up). A wrong row or a lost partial is off by O(1), relatively.
    tables = fp32(TABLES)
    case = Case(tables, mixed_plan(3), batch_sizes(3), comm_precision=precision)
    check_rounded_once(world(3).run(run_case, case), precision)


def check_rounded_once(results: list[dict], precision: str) -> None:
    """The outputs' and the updates' worst gaps, relative to the largest value: within
    a few units of ``precision``'s roundoff, and above zero (they were rounded)."""
    bound = 4 * UNIT[precision]
    forward = max(r["forward"] for r in results) / max(r["output"] for r in results)
    update = max(r["weights"] / r["update"] for r in results)
    assert 0 < forward <= bound and 0 < update <= bound, (forward, update, bound)


def one_step_bytes(precision: str) -> dict:
    """One step of the same model, uncompressed and compressed: collective bytes by
    dtype, and the compressed output's largest error relative to the largest value."""
    rank = dist.get_rank()
    case = Case(fp32(TABLES), mixed_plan(dist.get_world_size()), (6, 4))
    batch = local_batches(case, 0)[rank]
    found = {}
    outputs = {}
    for kind in ("fp32", precision):
        ebc = EmbeddingBagCollection(tables=[t.config() for t in case.tables], device="meta")
        sharded = embshard.shard(ebc, case.plan, comm_precision=kind)
        with CollectiveBytes() as counter:
            out = sharded(batch).values()
            out.sum().backward()
        found[kind] = counter.by_dtype
        outputs[kind] = out.detach()
    error = (outputs[precision] - outputs["fp32"]).abs().max() / outputs["fp32"].abs().max()
    return {"bytes": found, "error": float(error)}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_compressed_all_to_alls_halve_the_pooled_bytes(world, precision):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    for result in world(2).run(one_step_bytes, precision):
        full, compressed = result["bytes"]["fp32"], result["bytes"][precision]
        # Only the pooled rows and their gradients are floating point.
        pooled = full.pop(torch.float32)
        assert pooled > 0 and compressed.pop(dtype) * 2 == pooled
        assert compressed == full  # counts and ids unchanged
        assert 0 < result["error"] <= 2 * UNIT[precision], result["error"]


def bad_precision() -> str:
    ebc = EmbeddingBagCollection(tables=[t.config() for t in fp32(TABLES)], device="meta")
    try:
        embshard.shard(ebc, mixed_plan(dist.get_world_size()), comm_precision="fp8")
    except ValueError as e:
        return str(e)
    return "no error"


def test_unknown_comm_precision_is_refused(world):
    for message in world(2).run(bad_precision):
        assert "comm_precision must be one of [None, 'fp32', 'fp16', 'bf16'], got 'fp8'" in message


class TwoCollections(torch.nn.Module):
    """An FP32 and an FP16 collection side by side: precision is per collection."""

    def __init__(self) -> None:
        super().__init__()
        configs = [t.config() for t in fp32(TABLES[:2])] + [t.config() for t in TABLES[2:]]
        self.fp32 = EmbeddingBagCollection(tables=configs[:2], device="meta")
        self.fp16 = EmbeddingBagCollection(tables=configs[2:], device="meta")

    def forward(self, wide, half):
        return torch.cat([self.fp32(wide).values(), self.fp16(half).values()], dim=1)


def shard_model_precisions() -> dict:
    world = dist.get_world_size()
    model = embshard.shard_model(
        TwoCollections(),
        mixed_plan(world),
        comm_precision="bf16",
        data_parallel_wrapper=lambda m: m,
    )
    wide, half = (
        local_batches(Case(tables, mixed_plan(world), (6, 4)), 0)[dist.get_rank()]
        for tables in (TABLES[:2], TABLES[2:])
    )
    with CollectiveBytes() as counter:
        out = model(wide, half)
        out.sum().backward()
    tables = {n: w.dtype for m in (model.fp32, model.fp16) for n, w in m.weights.items()}
    return {"bytes": counter.by_dtype, "tables": tables, "out": out.dtype}


def test_shard_model_passes_comm_precision_and_keeps_each_collections_dtype(world):
    for found in world(2).run(shard_model_precisions):
        assert found["bytes"][torch.bfloat16] > 0 and torch.float32 not in found["bytes"]
        assert found["tables"] == {
            "a": torch.float32,
            "b": torch.float32,
            "c": torch.float16,
            "d": torch.float16,
        }
        assert found["out"] == torch.float32
