"""Storage on real gloo worlds: DTensor layouts, views, gather, init, state dicts, DCP.

The oracle is the unsharded TorchRec EmbeddingBagCollection (same seed on every
rank, so every rank holds the same full tables) and TorchRec's own shard metadata.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import (
    Case,
    Table,
    column_blocks,
    global_batch,
    local_batches,
    max_diff,
    oracle_step,
    unsharded,
    upstream,
    weight_gap,
)
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import sharding_plan as tr

import embshard
from embshard import LocalShardsWrapper, ShardingPlan, column_wise, row_wise, table_wise

WORLD_SIZES = [1, 2, 3, 4]


def tables() -> list[EmbeddingBagConfig]:
    shapes = {"tw": (11, 8), "rw": (13, 12), "uneven": (9, 4), "cw": (6, 24)}
    return [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"])
        for n, (r, d) in shapes.items()
    ]


def mixed_plan(world_size: int) -> ShardingPlan:
    """Every layout the issue names: table-wise off rank 0, even row-wise, uneven
    row-wise with an empty rank, column-wise with two non-adjacent blocks on the last
    rank and ranks out of order."""
    last = world_size - 1
    uneven = [9] if world_size == 1 else [4] + [0] * (world_size - 2) + [5]
    return ShardingPlan(
        {
            "tw": table_wise(last),
            "rw": row_wise(),
            "uneven": row_wise(uneven),
            "cw": column_wise([last, 0, last], [8, 4, 12]),
        }
    )


def other_plan(world_size: int) -> ShardingPlan:
    last = world_size - 1
    return ShardingPlan(
        {
            "tw": row_wise(),
            "rw": column_wise([last, 0, last]),
            "uneven": table_wise(0),
            "cw": row_wise([6] + [0] * last),
        }
    )


def real_ebc(seed: int) -> EmbeddingBagCollection:
    """The oracle: the same full tables on every rank."""
    torch.manual_seed(seed)
    return EmbeddingBagCollection(tables=tables())


def meta_ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=tables(), device="meta")


def full_weights(ebc: EmbeddingBagCollection) -> dict[str, torch.Tensor]:
    return {n: b.weight.detach() for n, b in ebc.embedding_bags.items()}


def gathered(sharded: embshard.ShardedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    return {n: embshard.gather_table(w) for n, w in sharded.weights.items()}


# ---- run on every rank ---------------------------------------------------------------


def layout_on_rank():
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sharded = embshard.shard(meta_ebc(), mixed_plan(world_size))
    report = {}
    for key, weight in sharded.state_dict().items():
        local = weight.to_local()
        shards = []
        if isinstance(local, LocalShardsWrapper):
            shards = [
                (tuple(o), tuple(s)) for o, s in zip(local.local_offsets(), local.local_sizes())
            ]
        report[key] = {
            "placements": [repr(p) for p in weight.placements],
            "mesh": weight.device_mesh.mesh.tolist(),
            "shape": tuple(weight.shape),
            "stride": weight.stride(),
            "shards": sorted(shards),
            "rank": rank,
        }
    return report


def gather_equals_source(seed: int):
    ebc = real_ebc(seed)
    sharded = embshard.shard(ebc, mixed_plan(dist.get_world_size()))
    source = full_weights(ebc)
    return {n: torch.equal(t, source[n]) for n, t in gathered(sharded).items()}


def lookup_equals_embedding_bag(seed: int):
    """Every local shard looked up in the rank's TBE equals F.embedding_bag on the same
    slice of the source table; then the same after writing new values through the
    state dict's DTensors (the wrapper is a view of the TBE's weights)."""
    ebc = real_ebc(seed)
    sharded = embshard.shard(ebc, mixed_plan(dist.get_world_size()))
    storage = sharded._storage
    if storage.tbe is None:
        return []

    def compare(source: dict[str, torch.Tensor]) -> list[float]:
        generator = torch.Generator().manual_seed(seed + dist.get_rank())
        batch = 5
        ids, offsets, expected = [], [0], []
        for name, s in storage.shards:
            lengths = torch.randint(0, 4, (batch,), generator=generator)
            table_ids = torch.randint(0, s.rows, (int(lengths.sum()),), generator=generator)
            ids.append(table_ids)
            offsets += (offsets[-1] + lengths.cumsum(0)).tolist()
            block = source[name][s.row_offset : s.row_offset + s.rows]
            block = block[:, s.col_offset : s.col_offset + s.cols]
            bag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
            expected.append(F.embedding_bag(table_ids, block, bag_offsets, mode="sum"))
        out = storage.tbe(torch.cat(ids), torch.tensor(offsets))
        return [(out - torch.cat(expected, dim=1)).abs().max().item()]

    errors = compare(full_weights(ebc))
    torch.manual_seed(seed + 1)
    new_source = {n: torch.randn_like(w) for n, w in full_weights(ebc).items()}
    for name, weight in sharded.state_dict().items():
        local = weight.to_local()
        if isinstance(local, LocalShardsWrapper) and local.local_shards():
            pieces = [
                new_source[name.split(".")[1]][o[0] : o[0] + s[0], o[1] : o[1] + s[1]]
                for o, s in zip(local.local_offsets(), local.local_sizes())
            ]
            local.copy_(torch.cat(pieces, dim=1))
    return errors + compare(new_source)


def seeded_tables(plan_name: str, seed: int):
    plan = {"mixed": mixed_plan, "other": other_plan}[plan_name](dist.get_world_size())
    return gathered(embshard.shard(meta_ebc(), plan, seed=seed))


def load_torchrec_state_dict(seed: int):
    ebc = real_ebc(seed)
    sharded = embshard.shard(meta_ebc(), mixed_plan(dist.get_world_size()), seed=seed + 1)
    result = sharded.load_state_dict(ebc.state_dict())
    source = full_weights(ebc)
    equal = {n: torch.equal(t, source[n]) for n, t in gathered(sharded).items()}
    return equal, (result.missing_keys, result.unexpected_keys)


def load_dtensors_of_another_plan(seed: int):
    ebc = real_ebc(seed)
    world_size = dist.get_world_size()
    source = embshard.shard(ebc, other_plan(world_size))
    target = embshard.shard(meta_ebc(), mixed_plan(world_size), seed=seed + 1)
    target.load_state_dict(source.state_dict())
    return {n: torch.equal(t, full_weights(ebc)[n]) for n, t in gathered(target).items()}


def failed_loads_change_nothing(seed: int):
    sharded = embshard.shard(meta_ebc(), mixed_plan(dist.get_world_size()), seed=seed)
    before = gathered(sharded)
    good = real_ebc(seed + 1).state_dict()
    messages = []
    bad_shape = dict(good, **{"embedding_bags.cw.weight": torch.zeros(6, 20)})
    missing = {k: v for k, v in good.items() if k != "embedding_bags.rw.weight"}
    unexpected = dict(good, **{"embedding_bags.nope.weight": torch.zeros(1, 4)})
    for state_dict in (bad_shape, missing, unexpected):
        try:
            sharded.load_state_dict(state_dict)
        except RuntimeError as e:
            messages.append(str(e))
    after = gathered(sharded)
    unchanged = {n: torch.equal(before[n], after[n]) for n in before}
    return messages, unchanged


def dcp_round_trip_across_plans(seed: int, path: str):
    ebc = real_ebc(seed)
    world_size = dist.get_world_size()
    dcp.save(embshard.shard(ebc, mixed_plan(world_size)).state_dict(), checkpoint_id=path)
    target = embshard.shard(meta_ebc(), other_plan(world_size), seed=seed + 1)
    state_dict = target.state_dict()
    dcp.load(state_dict, checkpoint_id=path)
    return {n: torch.equal(t, full_weights(ebc)[n]) for n, t in gathered(target).items()}


def shard_with_bad_plan():
    plan = ShardingPlan({"tw": table_wise(dist.get_world_size()), "rw": row_wise()})
    try:
        embshard.shard(meta_ebc(), plan)
    except embshard.PlanError as e:
        return str(e)
    return None


@dataclass
class RecordedLookup:
    """A built lookup that records the ids of every call, then makes it."""

    tbe: embshard.LookupModule
    calls: list[int]

    def __call__(self, indices, offsets, per_sample_weights=None):
        self.calls.append(len(indices))
        return self.tbe(indices, offsets, per_sample_weights=per_sample_weights)

    def split_embedding_weights(self):
        return self.tbe.split_embedding_weights()

    def split_optimizer_states(self):
        return self.tbe.split_optimizer_states()


@dataclass(frozen=True)
class RecordingBackend:
    """A lookup backend of the test's own: TrainingTBE, recording each build's shard
    shapes and calls."""

    inner: embshard.TrainingTBE = field(default_factory=embshard.TrainingTBE)
    built: list[tuple[list[tuple[int, int]], list[int]]] = field(default_factory=list)

    def check(self, optimizer, device):
        self.inner.check(optimizer, device)

    def build(self, shard_shapes, optimizer, device, feature_table_map=None, dtype=torch.float32):
        calls: list[int] = []
        self.built.append(([tuple(s) for s in shard_shapes], calls))
        return RecordedLookup(
            self.inner.build(shard_shapes, optimizer, device, feature_table_map, dtype), calls
        )


def trained_through_a_backend(seed: int):
    """Two Adagrad steps of a module sharded with the recording backend, against the
    unsharded TorchRec module on the global batch: the largest differences of the
    outputs, the weights and the optimizer state; what the backend built and saw."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    case = Case(
        tables=tuple(
            Table(c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names))
            for c in tables()
        ),
        plan=mixed_plan(world_size),
        batch_sizes=(3, 5, 2, 4)[:world_size],
        optimizer=embshard.Adagrad(lr=0.1),
        seed=seed,
    )
    oracle = unsharded(case)
    backend = RecordingBackend()
    sharded = embshard.shard(
        copy.deepcopy(oracle), case.plan, optimizer=case.optimizer, lookup=backend
    )
    starts = [sum(case.batch_sizes[:r]) for r in range(world_size + 1)]
    outputs, states = [], {}
    for step in range(2):
        batches = local_batches(case, step)
        expected = oracle(global_batch(batches)).values()
        out = sharded(batches[rank]).values()
        assert out.shape == (case.batch_sizes[rank], expected.shape[1])
        outputs.append(max_diff(out, expected[starts[rank] : starts[rank + 1]]))
        grads = [upstream(case, step, b, out.shape[1], r) for r, b in enumerate(case.batch_sizes)]
        (out * grads[rank]).sum().backward()
        loss = sum((expected[a:b] * g).sum() for a, b, g in zip(starts, starts[1:], grads))
        (loss / world_size).backward()
        oracle_step(oracle, case, column_blocks(case), states)
    state = {
        key.split(".")[1]: embshard.gather_table(value)
        for key, value in sharded.optimizer_state().items()
    }
    errors = {
        "outputs": max(outputs),
        "weights": weight_gap(sharded, oracle),
        "state": max(max_diff(state[n], states[n]) for n in states),
    }
    return errors, [(sorted(shapes), len(calls)) for shapes, calls in backend.built]


def shard_refused(location: str | None, optimizer):
    """The error every rank gets sharding with ``location`` and ``optimizer``, where
    rank 0 holds every table and the others none."""
    plan = ShardingPlan({c.name: table_wise(0) for c in tables()})
    lookup = embshard.TrainingTBE(location=location)
    try:
        embshard.shard(meta_ebc(), plan, optimizer=optimizer, lookup=lookup)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# ---- tests -------------------------------------------------------------------------------


def torchrec_local_shards(world_size: int, rank: int) -> dict[str, list]:
    """TorchRec's shard metadata for the same plan: the oracle for each rank's shards."""
    ebc = meta_ebc()
    last = world_size - 1
    uneven = [9] if world_size == 1 else [4] + [0] * (world_size - 2) + [5]
    plan = tr.construct_module_sharding_plan(
        ebc,
        {
            "tw": tr.table_wise(rank=last),
            "rw": tr.row_wise(),
            # TorchRec's uneven helper puts every block on rank 0: block i is rank i's.
            "uneven": tr.row_wise((uneven, "cpu")),
            "cw": tr.column_wise(ranks=[last, 0, last], size_per_rank=[8, 4, 12]),
        },
        world_size=world_size,
        local_size=world_size,
        device_type="cpu",
    )
    result = {}
    for name, sharding in plan.items():
        shards = sharding.sharding_spec.shards
        owners = list(range(len(shards))) if name == "uneven" else sharding.ranks
        result[f"embedding_bags.{name}.weight"] = sorted(
            (tuple(s.shard_offsets), tuple(s.shard_sizes))
            for s, owner in zip(shards, owners)
            if owner == rank and s.shard_sizes[0] > 0
        )
    return result


def mixed_plan_shards(world_size: int, rank: int) -> dict[str, list]:
    """Each table's shards on ``rank`` under ``mixed_plan``, (offsets, sizes): TorchRec's
    metadata, the column-wise blocks by hand (TorchRec's column_wise(size_per_rank)
    numbers blocks by position; ours by ranks)."""
    last = world_size - 1
    expected = torchrec_local_shards(world_size, rank)
    expected["embedding_bags.cw.weight"] = [
        ((0, o), (6, w)) for r, o, w in zip([last, 0, last], [0, 8, 12], [8, 4, 12]) if r == rank
    ]
    return expected


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dtensor_layouts(world, world_size):
    last = world_size - 1
    cw_ranks = [last, 0, last]
    for rank, report in enumerate(world(world_size).run(layout_on_rank)):
        expected = mixed_plan_shards(world_size, rank)
        for key, table in report.items():
            assert table["shards"] == expected[key], (key, rank)
            assert table["stride"] == (table["shape"][1], 1)
        assert report["embedding_bags.tw.weight"]["placements"] == ["Replicate()"]
        assert report["embedding_bags.tw.weight"]["mesh"] == [last]
        assert report["embedding_bags.rw.weight"]["placements"] == ["Shard(dim=0)"]
        assert report["embedding_bags.rw.weight"]["mesh"] == list(range(world_size))
        assert report["embedding_bags.uneven.weight"]["placements"] == ["Shard(dim=0)"]
        assert report["embedding_bags.cw.weight"]["placements"] == ["Shard(dim=1)"]
        assert report["embedding_bags.cw.weight"]["mesh"] == sorted(set(cw_ranks))
        shapes = {k: t["shape"] for k, t in report.items()}
        assert shapes == {
            f"embedding_bags.{c.name}.weight": (c.num_embeddings, c.embedding_dim) for c in tables()
        }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_table_equals_source(world, world_size):
    for equal in world(world_size).run(gather_equals_source, 3):
        assert equal == {"tw": True, "rw": True, "uneven": True, "cw": True}


@pytest.mark.parametrize("world_size", [1, 3])
def test_local_lookup_equals_embedding_bag_and_wrapper_is_a_view(world, world_size):
    results = world(world_size).run(lookup_equals_embedding_bag, 4)
    assert any(results)
    for errors in results:
        assert all(e < 1e-6 for e in errors), errors


def test_initialization_is_plan_and_world_independent(world):
    reference = world(1).run(seeded_tables, "mixed", 7)[0]
    for world_size in (2, 3, 4):
        for plan_name in ("mixed", "other"):
            for tables_on_rank in world(world_size).run(seeded_tables, plan_name, 7):
                for name, table in tables_on_rank.items():
                    assert torch.equal(table, reference[name]), (world_size, plan_name, name)
    for config in tables():
        bound = (1 / config.num_embeddings) ** 0.5
        table = reference[config.name]
        assert table.abs().max() <= bound
        assert table.std() > bound / 4  # spread over the range, not a constant
    assert not torch.equal(reference["tw"][:, :4], reference["uneven"][:9, :4])
    reseeded = world(2).run(seeded_tables, "mixed", 8)[0]
    assert not torch.equal(reseeded["rw"], reference["rw"])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_load_torchrec_state_dict(world, world_size):
    for equal, (missing, unexpected) in world(world_size).run(load_torchrec_state_dict, 5):
        assert all(equal.values()), equal
        assert missing == [] and unexpected == []


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_dtensors_of_another_plan(world, world_size):
    for equal in world(world_size).run(load_dtensors_of_another_plan, 6):
        assert all(equal.values()), equal


def test_failed_load_reports_and_changes_nothing(world):
    for messages, unchanged in world(3).run(failed_loads_change_nothing, 2):
        assert all(unchanged.values())
        assert len(messages) == 3
        assert "size mismatch for embedding_bags.cw.weight" in messages[0]
        assert "(6, 20), table 'cw' is (6, 24)" in messages[0]
        assert 'Missing key(s) in state_dict: "embedding_bags.rw.weight"' in messages[1]
        assert 'Unexpected key(s) in state_dict: "embedding_bags.nope.weight"' in messages[2]


@pytest.mark.parametrize("world_size", [2, 3])
def test_dcp_round_trip_through_chunk_protocol(world, world_size, tmp_path):
    for equal in world(world_size).run(dcp_round_trip_across_plans, 8, str(tmp_path)):
        assert all(equal.values()), equal


def test_bad_plan_fails_on_every_rank(world):
    messages = world(3).run(shard_with_bad_plan)
    assert all(m == messages[0] for m in messages)
    assert "table 'tw': rank 3 is outside the world of 3 ranks" in messages[0]
    assert "table 'uneven': no entry in the plan" in messages[0]


def test_shard_refuses_other_modules():
    with pytest.raises(TypeError, match="EmbeddingBagCollection"):
        embshard.shard(torch.nn.Linear(2, 2), ShardingPlan({}))


def random_plan_gather(configs, plan, seed):
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=configs)
    sharded = embshard.shard(ebc, plan)
    return all(torch.equal(gathered(sharded)[n], w) for n, w in full_weights(ebc).items())


@st.composite
def random_tables_and_plan(draw, world_size):
    specs, configs = {}, []
    for i in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 40))
        ranks = draw(st.lists(st.integers(0, world_size - 1), min_size=1, max_size=4))
        widths = draw(st.lists(st.integers(1, 3), min_size=len(ranks), max_size=len(ranks)))
        cuts = sorted(
            draw(st.lists(st.integers(0, rows), min_size=world_size - 1, max_size=world_size - 1))
        )
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows])]
        name = f"t{i}"
        kind = draw(st.sampled_from(["tw", "rw", "uneven", "cw"]))
        dim = 4 * sum(widths) if kind == "cw" else 4 * draw(st.integers(1, 4))
        configs.append(
            EmbeddingBagConfig(
                name=name, num_embeddings=rows, embedding_dim=dim, feature_names=[name]
            )
        )
        specs[name] = {
            "tw": table_wise(draw(st.integers(0, world_size - 1))),
            "rw": row_wise(),
            "uneven": row_wise(sizes),
            "cw": column_wise(ranks, [4 * w for w in widths]),
        }[kind]
    return configs, ShardingPlan(specs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_random_plans(world, world_size):
    @settings(max_examples=12, deadline=None)
    @given(random_tables_and_plan(world_size), st.integers(0, 2**16))
    def check(tables_and_plan, seed):
        configs, plan = tables_and_plan
        assert all(world(world_size).run(random_plan_gather, configs, plan, seed))

    check()


def test_a_lookup_backend_passed_to_shard_builds_and_trains_every_ranks_lookup(world):
    world_size = 2
    for rank, (errors, built) in enumerate(world(world_size).run(trained_through_a_backend, 9)):
        assert errors["outputs"] < 1e-6 and errors["weights"] < 1e-6, (rank, errors)
        assert errors["state"] < 1e-5, (rank, errors)  # float32 sums of squared gradients
        # One lookup per rank, for its shards of the plan, called once a forward.
        shards = mixed_plan_shards(world_size, rank).values()
        shapes = [size for table in shards for _, size in table]
        assert built == [(sorted(shapes), 2)], rank


@pytest.mark.parametrize(
    ("location", "optimizer", "message"),
    [
        (
            "device",
            embshard.SGD(),
            "ValueError: TrainingTBE(location='device') does not work on device cpu: "
            "a cpu device takes location 'host' or None",
        ),
        (
            None,
            torch.optim.SGD,
            "TypeError: optimizer must be embshard.SGD, RowWiseAdagrad, Adagrad, Adam or Lamb, "
            "got <class 'torch.optim.sgd.SGD'>",
        ),
        *(
            (
                None,
                optimizer,
                f"ValueError: the fused optimizer {optimizer.KIND} runs on cuda only: FBGEMM's "
                "CPU kernels lack it; on cpu use sgd, rowwise_adagrad or adagrad (device cpu)",
            )
            for optimizer in (embshard.Adam(), embshard.Lamb())
        ),
    ],
)
def test_a_lookup_the_device_cannot_serve_is_refused_on_every_rank(
    world, location, optimizer, message
):
    # Rank 1 holds no shard and builds nothing: it refuses all the same.
    assert world(2).run(shard_refused, location, optimizer) == [message, message]
