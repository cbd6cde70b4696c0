"""Storage on real gloo worlds: DTensor layouts, views, gather, init, state dicts, DCP.

The oracle is the unsharded TorchRec EmbeddingBagCollection (same seed on every
rank, so every rank holds the same full tables) and TorchRec's own shard metadata.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
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


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dtensor_layouts(world, world_size):
    # TorchRec's column_wise(size_per_rank) numbers blocks by position; ours by ranks.
    last = world_size - 1
    cw_ranks = [last, 0, last]
    for rank, report in enumerate(world(world_size).run(layout_on_rank)):
        expected = torchrec_local_shards(world_size, rank)
        cw_expected = [
            ((0, o), (6, w)) for r, o, w in zip(cw_ranks, [0, 8, 12], [8, 4, 12]) if r == rank
        ]
        expected["embedding_bags.cw.weight"] = cw_expected
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
