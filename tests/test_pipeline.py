"""TrainPipeline: batch i+1's input distribution ahead of batch i's step, same results."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle import Case, Table, local_batches
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

import embshard
from embshard import ShardingPlan, column_wise, row_wise, table_wise
from embshard.modules.pipeline import TrainPipeline

TABLES = (
    Table("a", 40, 8, ("f_a",)),
    Table("b", 30, 12, ("f_b",), mean=True),
    Table("c", 25, 16, ("f_a", "f_c")),
)
SEQUENCE = EmbeddingConfig(name="s", num_embeddings=40, embedding_dim=4, feature_names=["f_a"])
PLAN = ShardingPlan(
    {"a": table_wise(1), "b": row_wise(), "c": column_wise([1, 0, 1, 0]), "s": row_wise()}
)
STEPS = 4


@dataclass
class Batch:
    features: KeyedJaggedTensor
    labels: torch.Tensor


class Ranker(nn.Module):
    """Pooled embeddings and a sequence feature's rows (summed per sample) into a linear
    head; returns (loss, output) as TorchRec's pipelines expect. Both collections get
    the whole batch, as in TorchRec's models."""

    def __init__(self, transform=None) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[t.config() for t in TABLES], device="meta")
        self.ec = EmbeddingCollection(tables=[SEQUENCE], device="meta")
        dims = sum(t.dim * len(t.features) for t in TABLES) + SEQUENCE.embedding_dim
        self.head = nn.Linear(dims, 1)
        self.transform = transform

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.transform(batch.features) if self.transform else batch.features
        rows = self.ec(features)["f_a"]
        samples = torch.arange(len(rows.lengths())).repeat_interleave(rows.lengths())
        history = rows.values().new_zeros(len(rows.lengths()), SEQUENCE.embedding_dim)
        history.index_add_(0, samples, rows.values())
        logits = self.head(torch.cat([self.ebc(features).values(), history], 1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits


def batches(case: Case, rank: int, bad_step: int | None = None) -> list[Batch]:
    out = []
    for step in range(STEPS):
        features = local_batches(case, step)[rank]
        if step == bad_step and rank == 1:
            ids = features.values().clone()
            ids[0] = 10_000
            features = KeyedJaggedTensor(features.keys(), ids, lengths=features.lengths())
        labels = torch.rand(len(features.lengths()) // len(features.keys()))
        out.append(Batch(features, labels.round()))
    return out


def sharded_ranker(case: Case, transform=None) -> nn.Module:
    torch.manual_seed(0)
    return embshard.shard_model(Ranker(transform), case.plan, optimizer=embshard.SGD(lr=0.1))


def pipeline_and_plain_loop(case: Case) -> dict:
    rank = dist.get_rank()
    results = {}
    for how in ("plain", "pipeline"):
        model = sharded_ranker(case)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        outputs, data = [], batches(case, rank)
        if how == "pipeline":
            pipeline = TrainPipeline(model, optimizer, data)
            for step in range(STEPS):
                outputs.append(pipeline.progress().detach())
                # The next batch's input distribution is under way before its step.
                ahead = data[step + 1].features if step + 1 < STEPS else None
                results.setdefault("ahead", []).append(
                    ahead is None
                    or (
                        model.module.ebc.is_prefetched(ahead)
                        and model.module.ec.is_prefetched(ahead)
                    )
                )
            with pytest.raises(StopIteration):
                pipeline.progress()
        else:
            for batch in data:
                optimizer.zero_grad()
                loss, output = model(batch)
                loss.backward()
                optimizer.step()
                outputs.append(output.detach())
        tables = {
            k: embshard.gather_table(v)
            for collection in (model.module.ebc, model.module.ec)
            for k, v in collection.state_dict().items()
        }
        results[how] = (outputs, tables, model.module.head.weight.detach().clone())
    return results


def test_pipeline_is_bit_exact_with_the_plain_loop(world):
    check_pipeline_bit_exact(world)


def check_pipeline_bit_exact(world) -> None:
    """On ``world(2)``: the pipeline's outputs, tables and dense weights equal the plain
    loop's, bit for bit, with each next batch distributed a step ahead."""
    case = Case(TABLES, PLAN, (5, 3))
    for result in world(2).run(pipeline_and_plain_loop, case):
        (plain_out, plain_tables, plain_head) = result["plain"]
        (piped_out, piped_tables, piped_head) = result["pipeline"]
        assert len(piped_out) == STEPS and all(result["ahead"])
        assert all(torch.equal(a, b) for a, b in zip(plain_out, piped_out))
        assert all(torch.equal(plain_tables[k], piped_tables[k]) for k in plain_tables)
        assert torch.equal(plain_head, piped_head)
        # Training moved the tables, so the comparison is not of untouched weights.
        assert not torch.equal(plain_out[0], plain_out[-1])


def bad_batch_in_the_pipeline(case: Case) -> dict:
    rank = dist.get_rank()
    model = sharded_ranker(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = TrainPipeline(model, optimizer, batches(case, rank, bad_step=2))
    steps_done, error = 0, None
    try:
        while True:
            pipeline.progress()
            steps_done += 1
    except embshard.InputError as e:
        error = str(e)
    model(batches(case, rank)[0])[0].backward()  # the world is still in step
    return {"steps_done": steps_done, "error": error}


def test_a_bad_next_batch_raises_at_the_step_that_uses_it(world):
    check_bad_next_batch(world)


def check_bad_next_batch(world) -> None:
    """On ``world(2)``: a bad batch distributed a step ahead raises on every rank at the
    step that uses it, not before."""
    case = Case(TABLES, PLAN, (5, 3))
    reports = world(2).run(bad_batch_in_the_pipeline, case)
    # Steps 0 and 1 ran, although step 2's batch was distributed during step 1.
    assert [r["steps_done"] for r in reports] == [2, 2]
    assert reports[0]["error"] == reports[1]["error"]
    assert "rank 1: feature 'f_a'" in reports[0]["error"]
    assert "id 10000 is outside" in reports[0]["error"]


def transformed_features(case: Case) -> str:
    rank = dist.get_rank()
    model = sharded_ranker(case, transform=lambda kjt: kjt.permute([0, 1, 2]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="was not given the batch's KeyedJaggedTensor") as e:
        TrainPipeline(model, optimizer, batches(case, rank)).progress()
    return str(e.value)


def test_a_model_that_transforms_the_features_is_refused(world):
    case = replace(Case(TABLES, PLAN, (5, 3)), steps=1)
    messages = world(2).run(transformed_features, case)
    assert "module.ebc" in messages[0]


def uneven_batch_counts(case: Case, counts: tuple[int, ...]) -> dict:
    rank = dist.get_rank()
    model = sharded_ranker(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(case, rank)[: counts[rank]]
    pipeline = TrainPipeline(model, optimizer, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = sum(1 for _ in pipeline)
    model(batches(case, rank)[0])[0].backward()  # the world is still in step
    return {"steps": steps, "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("counts", [(3, 2), (0, 2), (2, 2)])
def test_uneven_batch_counts_stop_every_rank_after_the_same_step(world, counts):
    case = Case(TABLES, PLAN, (5, 3))
    reports = world(2).run(uneven_batch_counts, case, counts)
    assert [r["steps"] for r in reports] == [min(counts)] * 2
    if len(set(counts)) == 1:
        assert all(r["warnings"] == [] for r in reports)
    else:
        short = counts.index(min(counts))
        expected = (
            f"TrainPipeline: every rank stops after {min(counts)} steps: ranks [{short}] "
            "ran out of batches; the other ranks' remaining batches are not trained"
        )
        assert all(r["warnings"] == [expected] for r in reports), reports


def batches_missing_a_feature(case: Case) -> str:
    rank = dist.get_rank()
    model = sharded_ranker(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [replace(b, features=b.features.permute([0, 1])) for b in batches(case, rank)]
    with pytest.raises(ValueError, match="the batch holds no KeyedJaggedTensor") as e:
        TrainPipeline(model, optimizer, data).progress()
    model(batches(case, rank)[0])[0].backward()  # nothing was started: the world is in step
    return str(e.value)


def test_batches_that_do_not_feed_every_collection_are_refused_before_any_collective(world):
    case = Case(TABLES, PLAN, (5, 3))
    messages = world(2).run(batches_missing_a_feature, case)
    assert messages[0] == messages[1] and "of module.ebc (['f_a', 'f_b', 'f_c'])" in messages[0]
