"""A whole sharded DLRM trains like the unsharded one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle import Case, Table, global_batch, local_batches
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM, DLRM_DCN

import embshard
from embshard import ShardingPlan, column_wise, row_wise, table_wise

TABLES = (
    Table("a", 40, 8, ("f_a",)),
    Table("b", 30, 8, ("f_b1", "f_b2")),
    Table("c", 25, 8, ("f_c",), mean=True),
)
DENSE_IN = 5


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
    curves, worst = [], 0.0
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
    oracle_params = dict(oracle.named_parameters())
    dense_names = [n for n, _ in model.module.named_parameters()]
    for name, param in model.module.named_parameters():
        worst = max(worst, float((param - oracle_params[name]).abs().max()))
    for path, sharded in embshard.model.sharded_collections(model.module).items():
        for table, weight in sharded.weights.items():
            expected = oracle.get_submodule(path).embedding_bags[table].weight
            worst = max(worst, float((embshard.gather_table(weight) - expected).abs().max()))
    return curves, worst, dense_names


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
def test_sharded_dlrm_trains_like_unsharded(world, kind):
    for curves, worst, dense_names in world(2).run(train_dlrm, kind, 5, 0.5):
        assert worst < 1e-5
        assert all(abs(ours - theirs) < 1e-5 for ours, theirs in curves), curves
        assert curves[-1][0] != curves[0][0]
        assert not any("embedding_bag" in n for n in dense_names)


def meta_model_shards():
    model = embshard.shard_model(
        build("dcn", device="meta"),
        ShardingPlan({"a": row_wise(), "b": row_wise(), "c": table_wise(0)}),
    )
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
