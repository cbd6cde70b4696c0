"""Whole sharded models (DLRM, DLRM-DCN, TorchRec's TestSparseNN) train like the unsharded ones."""

from __future__ import annotations

import copy
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle import Case, Table, global_batch, local_batches, weight_gap
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.test_utils import test_model as torchrec_test_model
from torchrec.models.dlrm import DLRM, DLRM_DCN

import embshard
from embshard import ShardingPlan, column_wise, row_wise, table_wise
from embshard.modules.shard_model import _ddp_settings, sharded_collections

TABLES = (
    Table("a", 40, 8, ("f_a",)),
    Table("b", 30, 8, ("f_b1", "f_b2")),
    Table("c", 25, 8, ("f_c",), mean=True),
)
DENSE_IN = 5
MIXED = ShardingPlan({"a": row_wise(), "b": row_wise(), "c": table_wise(0)})


def build(kind: str, device: str | None = None) -> torch.nn.Module:
    ebc = EmbeddingBagCollection(tables=[t.config() for t in TABLES], device=device)
    if kind == "dcn":
        return DLRM_DCN(ebc, DENSE_IN, [16, 8], [16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    return DLRM(ebc, DENSE_IN, [16, 8], [16, 1])


def dense_and_labels(step: int, batch_sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + step)
    return [
        (
            torch.randn(b, DENSE_IN, generator=generator),
            torch.randint(0, 2, (b,), generator=generator).float(),
        )
        for b in batch_sizes
    ]


def train_dlrm(kind: str, steps: int, lr: float):
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = ShardingPlan({"a": table_wise(world - 1), "b": row_wise(), "c": column_wise([1, 0])})
    case = Case(TABLES, plan, (4, 6)[:world], seed=3)
    torch.manual_seed(0)
    oracle = build(kind)
    model = embshard.shard_model(copy.deepcopy(oracle), plan, optimizer=embshard.SGD(lr=lr))
    dense_opt = torch.optim.SGD(model.parameters(), lr=lr)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=lr)
    offsets = [sum(case.batch_sizes[:r]) for r in range(world + 1)]
    curves = []
    for step in range(steps):
        batches = local_batches(case, step)
        dense = dense_and_labels(step, case.batch_sizes)
        logits = model(dense[rank][0], batches[rank]).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, dense[rank][1])
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()

        all_logits = oracle(torch.cat([d for d, _ in dense]), global_batch(batches)).squeeze(1)
        losses = [
            F.binary_cross_entropy_with_logits(all_logits[offsets[r] : offsets[r + 1]], dense[r][1])
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        oracle_opt.step()
        oracle_opt.zero_grad()
        curves.append((float(loss), float(losses[rank])))
    dense_names = [n for n, _ in model.module.named_parameters()]
    return curves, model_gap(model.module, oracle), dense_names


def model_gap(model: nn.Module, oracle: nn.Module) -> float:
    """The largest difference between any dense parameter or gathered table and the oracle's."""
    oracle_params = dict(oracle.named_parameters())
    dense = [(p - oracle_params[n]).abs().max().item() for n, p in model.named_parameters()]
    tables = [
        weight_gap(s, oracle.get_submodule(path)) for path, s in sharded_collections(model).items()
    ]
    return max(dense + tables)


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
def test_sharded_dlrm_trains_like_unsharded(world, kind):
    for curves, worst, dense_names in world(2).run(train_dlrm, kind, 5, 0.5):
        assert worst < 1e-5
        assert all(abs(ours - theirs) < 1e-5 for ours, theirs in curves), curves
        assert curves[-1][0] != curves[0][0]
        assert not any("embedding_bag" in n for n in dense_names)


def meta_model_shards():
    model = embshard.shard_model(build("dcn", device="meta"), MIXED)
    params = list(model.parameters())
    return all(not p.is_meta for p in params), len(params)


def test_model_built_on_meta(world):
    for materialized, count in world(2).run(meta_model_shards):
        assert materialized and count > 0


def shard_model_with_bad_plan():
    try:
        embshard.shard_model(build("dlrm"), ShardingPlan({"a": row_wise(), "zz": row_wise()}))
    except embshard.PlanError as e:
        return str(e)
    return None


def test_shard_model_plan_errors_name_tables(world):
    for message in world(2).run(shard_model_with_bad_plan):
        assert "table 'b': no entry in the plan" in message
        assert "table 'zz': the plan names it but the model has no such table" in message


# TorchRec's TestSparseNN as its model-parallel tests build it (test_model_parallel.py):
# four tables, two more sharing features 0 and 1, two weighted tables in a second EBC.
FLOATS, BATCH, TOL = 10, 4, 1e-5
SHARED = ("feature_0", "feature_1")


def sparsenn_tables(weighted: bool):
    def bag(i: int, name: str, feature: str, unit: int) -> EmbeddingBagConfig:
        return EmbeddingBagConfig(
            num_embeddings=(i + 1) * 10,
            embedding_dim=(i + 2) * unit,
            name=name,
            feature_names=[feature],
        )

    tables = [bag(i, f"table_{i}", f"feature_{i}", 8) for i in range(4)]
    tables += [bag(i, f"table_{i + 4}", f"feature_{i}", 8) for i in range(2)]
    weighted_tables = (
        [bag(i, f"weighted_table_{i}", f"weighted_feature_{i}", 4) for i in range(2)]
        if weighted
        else []
    )
    groups = {
        "group_0": [f"{f}@{t.name}" if f in SHARED else f for t in tables for f in t.feature_names]
    }
    return tables, weighted_tables, groups


def sparsenn_plan(world: int, names: set[str]) -> ShardingPlan:
    """Every sharding type, over the tables of both EBCs; column blocks FBGEMM can take."""
    last = world - 1
    specs = {
        "table_0": table_wise(last),
        "table_1": row_wise(),
        "table_2": column_wise([last, 0]),
        "table_3": table_wise(0),
        "table_4": row_wise(),
        "table_5": column_wise([0, last], [8, 16]),
        "weighted_table_0": row_wise(),
        "weighted_table_1": column_wise([last, 0], [4, 8]),
    }
    return ShardingPlan({n: s for n, s in specs.items() if n in names})


def train_side_by_side(model, oracle, inputs, lr: float) -> tuple[list, float]:
    """One SGD step per (global, per-rank) input pair of TorchRec's ``ModelInput``: the
    sharded model on this rank's batch, the unsharded oracle on the global one. The
    ranks' mean losses beside the oracle's, and the largest prediction gap."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dense_opt = torch.optim.SGD(model.parameters(), lr=lr)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=lr)
    curves, pred_gap = [], 0.0
    for global_input, local_inputs in inputs:
        loss, pred = model(local_inputs[rank])
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        oracle_loss, oracle_pred = oracle(global_input)
        oracle_loss.backward()
        oracle_opt.step()
        oracle_opt.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        curves.append((mean_loss.item() / world, oracle_loss.item()))
        mine = oracle_pred[rank * BATCH : (rank + 1) * BATCH]
        pred_gap = max(pred_gap, (pred - mine).abs().max().item())
    return curves, pred_gap


def generated_inputs(steps: int, tables, weighted_tables, **options):
    """TorchRec's ModelInput.generate for every step: the global batch, and each
    rank's part of it."""
    return (
        torchrec_test_model.ModelInput.generate(
            batch_size=BATCH,
            world_size=dist.get_world_size(),
            num_float_features=FLOATS,
            tables=tables,
            weighted_tables=weighted_tables,
            random_seed=step,
            **options,
        )
        for step in range(steps)
    )


def changes(initial: nn.Module, trained: nn.Module) -> dict[str, float]:
    """How far training moved each parameter: its largest change, by name."""
    now = dict(trained.named_parameters())
    return {n: (p - now[n]).abs().max().item() for n, p in initial.named_parameters()}


def train_sparsenn(weighted: bool, ddp_kwargs, steps: int, lr: float):
    """TestSparseNN sharded next to the unsharded one trained on the global batches.

    With equal local batches the global mean loss is the mean of the ranks' losses, so
    its gradients are the averaged ones that DDP and embshard's sparse backward apply.
    """
    world = dist.get_world_size()
    tables, weighted_tables, groups = sparsenn_tables(weighted)
    torch.manual_seed(0)
    oracle = torchrec_test_model.TestSparseNN(
        tables=tables,
        weighted_tables=weighted_tables,
        num_float_features=FLOATS,
        embedding_groups=groups,
    )
    initial = copy.deepcopy(oracle)
    plan = sparsenn_plan(world, {t.name for t in tables + weighted_tables})
    model = embshard.shard_model(
        copy.deepcopy(oracle), plan, optimizer=embshard.SGD(lr=lr), ddp_kwargs=ddp_kwargs
    )
    inputs = generated_inputs(steps, tables, weighted_tables)
    curves, pred_gap = train_side_by_side(model, oracle, inputs, lr)
    unmoved = sorted(n for n, change in changes(initial, oracle).items() if change < 10 * TOL)
    return curves, pred_gap, model_gap(model.module, oracle), unmoved


@pytest.mark.parametrize(
    "size, weighted, ddp_kwargs",
    [
        (2, True, None),
        (2, False, None),
        (2, True, {"static_graph": False, "find_unused_parameters": True}),
        (1, True, None),
        (3, True, None),
    ],
)
def test_sharded_sparsenn_trains_like_unsharded(world, size, weighted, ddp_kwargs):
    for curves, pred_gap, gap, unmoved in world(size).run(
        train_sparsenn, weighted, ddp_kwargs, 4, 0.5
    ):
        assert pred_gap < TOL and gap < TOL, (pred_gap, gap)
        assert all(abs(ours - theirs) < TOL for ours, theirs in curves), curves
        # Every table and dense layer moved well past the tolerance, but for the
        # parameter that never gets a gradient (the one plain DDP fails on).
        assert unmoved == ["dense.dummy_param"]


# TorchRec's DefaultDataParallelWrapper: static graph, no unused-parameter search,
# broadcast_buffers=False, bucket-view grads. DDP reads broadcast_buffers alike on
# every torch: an attribute before 2.13, a property over forward_sync_buffers since.
TORCHREC_DDP = {
    "static_graph": True,
    "find_unused_parameters": False,
    "broadcast_buffers": False,
    "gradient_as_bucket_view": True,
}


def ddp_settings(ddp_kwargs):
    model = embshard.shard_model(build("dlrm"), MIXED, ddp_kwargs=ddp_kwargs)
    return {n: getattr(model, n) for n in TORCHREC_DDP}


def test_ddp_settings_are_torchrecs_unless_overridden(world):
    assert world(2).run(ddp_settings, None) == [TORCHREC_DDP] * 2
    overridden = {"static_graph": False, "broadcast_buffers": True}
    expected = {**TORCHREC_DDP, "static_graph": False, "broadcast_buffers": True}
    assert world(2).run(ddp_settings, overridden) == [expected] * 2


class DDPWithoutForwardSync(DistributedDataParallel):
    """torch 2.11's DDP, in the arguments embshard passes: no forward_sync_buffers, and
    broadcast_buffers=False skips the buffer broadcast at construction too."""

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        broadcast_buffers: bool = True,
        process_group=None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        with warnings.catch_warnings():  # torch 2.13 deprecates broadcast_buffers
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(
                module,
                device_ids,
                broadcast_buffers=broadcast_buffers,
                process_group=process_group,
                find_unused_parameters=find_unused_parameters,
                gradient_as_bucket_view=gradient_as_bucket_view,
                static_graph=static_graph,
            )
        self.given_broadcast_buffers = broadcast_buffers


def buffers_after_wrapping(without_forward_sync: bool):
    rank = dist.get_rank()
    model = build("dlrm")
    model.register_buffer("shared", torch.full((3,), float(rank + 1)))
    model.register_buffer("own", torch.full((2,), float(rank + 1)))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["own"])
    ddp = DDPWithoutForwardSync if without_forward_sync else DistributedDataParallel
    with mock.patch("embshard.modules.shard_model.DistributedDataParallel", ddp):
        wrapped = embshard.shard_model(model, MIXED)
    at_construction = (model.shared.tolist(), model.own.tolist())
    # No broadcast before a forward: a rank's change stays its own.
    model.shared.fill_(10.0 * (rank + 1))
    case = Case(TABLES, MIXED, (4, 6), seed=3)
    wrapped(torch.randn(case.batch_sizes[rank], DENSE_IN), local_batches(case, 0)[rank])
    given = getattr(wrapped, "given_broadcast_buffers", None)
    return at_construction, model.shared.tolist(), given


@pytest.mark.parametrize("without_forward_sync", [False, True])
def test_buffers_synced_once_at_construction_on_either_ddp(world, without_forward_sync):
    results = world(2).run(buffers_after_wrapping, without_forward_sync)
    for rank, (at_construction, after_forward, given) in enumerate(results):
        assert at_construction == ([1.0] * 3, [rank + 1.0] * 2)
        assert after_forward == [10.0 * (rank + 1)] * 3
        assert given == (False if without_forward_sync else None)


class DDPWithForwardSync:
    """torch 2.13's DDP, in the arguments embshard passes: both buffer flags."""

    def __init__(
        self,
        module: nn.Module,
        broadcast_buffers: bool | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        pass


def test_ddp_arguments_chosen_by_ddp_signature():
    with_sync = {**TORCHREC_DDP, "forward_sync_buffers": False}
    del with_sync["broadcast_buffers"]
    assert _ddp_settings({}, DDPWithForwardSync) == (with_sync, False)
    assert _ddp_settings({}, DDPWithoutForwardSync) == (TORCHREC_DDP, True)
    # The caller's broadcast_buffers is DDP's own meaning on both: no extra broadcast.
    for ddp in (DDPWithForwardSync, DDPWithoutForwardSync):
        for value in (True, False):
            expected = {**TORCHREC_DDP, "broadcast_buffers": value}
            assert _ddp_settings({"broadcast_buffers": value}, ddp) == (expected, False)
    # forward_sync_buffers=True also broadcasts at construction on DDP without it.
    given = {"forward_sync_buffers": True}
    expected = {**TORCHREC_DDP, "broadcast_buffers": True}
    assert _ddp_settings(given, DDPWithoutForwardSync) == (expected, False)


def own_wrapper():
    seen = []

    def wrap(module: nn.Module) -> nn.Module:
        seen.append(module)
        return module

    model = build("dlrm")
    wrapped = embshard.shard_model(model, MIXED, data_parallel_wrapper=wrap)
    ebcs = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    return seen == [model], wrapped is model, len(sharded_collections(model)), len(ebcs)


def test_own_data_parallel_wrapper_gets_the_sharded_model(world):
    for called, returned, sharded, unsharded in world(2).run(own_wrapper):
        assert called and returned and (sharded, unsharded) == (1, 0)


def test_data_parallel_arguments_checked_first():
    # Raised before any collective: no process group needed.
    with pytest.raises(TypeError, match="data_parallel_wrapper must be a callable"):
        embshard.shard_model(
            build("dlrm"), MIXED, data_parallel_wrapper=DefaultDataParallelWrapper()
        )
    with pytest.raises(ValueError, match="ddp_kwargs configure the default DDP wrapper"):
        embshard.shard_model(
            build("dlrm"),
            MIXED,
            ddp_kwargs={"static_graph": False},
            data_parallel_wrapper=nn.Identity(),
        )


def train_mixed_sparse_arch(steps: int, lr: float):
    """TorchRec's TestMixedEmbeddingSparseArch (an EmbeddingBagCollection and an
    EmbeddingCollection, each given every feature) sharded by shard_model next to the
    unsharded model trained on the global batches."""
    from torchrec import EmbeddingConfig

    world = dist.get_world_size()
    tables = [
        EmbeddingBagConfig(name="bag_0", num_embeddings=40, embedding_dim=8, feature_names=["f0"]),
        EmbeddingBagConfig(name="bag_1", num_embeddings=30, embedding_dim=16, feature_names=["f1"]),
        EmbeddingConfig(name="seq_0", num_embeddings=50, embedding_dim=8, feature_names=["s0"]),
        EmbeddingConfig(name="seq_1", num_embeddings=20, embedding_dim=8, feature_names=["s1"]),
    ]
    torch.manual_seed(0)
    oracle = torchrec_test_model.TestMixedEmbeddingSparseArch(
        tables=tables, num_float_features=FLOATS
    )
    plan = ShardingPlan(
        {
            "bag_0": table_wise(world - 1),
            "bag_1": column_wise([world - 1, 0]),
            "seq_0": row_wise(),
            "seq_1": table_wise(0),
        }
    )
    initial = copy.deepcopy(oracle)
    model = embshard.shard_model(copy.deepcopy(oracle), plan, optimizer=embshard.SGD(lr=lr))
    inputs = generated_inputs(steps, tables, [], max_feature_lengths=[20] * len(tables))
    _, worst = train_side_by_side(model, oracle, inputs, lr)
    moved = {
        n.split(".")[-2]: change
        for n, change in changes(initial, oracle).items()
        if n.startswith(("ebc.", "ec."))
    }
    return worst, model_gap(model.module, oracle), moved


@pytest.mark.parametrize("size", [1, 2])
def test_torchrec_mixed_bag_and_sequence_model_trains_like_unsharded(world, size):
    for pred_gap, gap, moved in world(size).run(train_mixed_sparse_arch, 3, 0.5):
        assert pred_gap < TOL and gap < TOL, (pred_gap, gap)
        # Every table, pooled and sequence, learned well past the tolerance.
        assert sorted(moved) == ["bag_0", "bag_1", "seq_0", "seq_1"], moved
        assert min(moved.values()) > 10 * TOL, moved
