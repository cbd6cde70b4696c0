"""Dynamic tables through checkpoints: trained at one world size and plan, saved, loaded
at others, trained on; against test_dynamic's plain reference model run uninterrupted
(its map is test_id_map's Python reference, not embshard's), in an EmbeddingBagCollection
and (test_dynamic_sequence's reference) an EmbeddingCollection. And what a load refuses:
a damaged map, another map spec, a table static on one side and dynamic on the other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from click.testing import CliRunner
from test_checkpoint import flip_a_byte
from test_dynamic import Case, RefModel, configs, kjt, stream
from test_dynamic_sequence import SequenceRef, sequence_stream, values
from test_dynamic_sequence import configs as sequence_configs
from test_dynamic_sequence import kjt as sequence_kjt
from test_train import ROOT, train_resuming
from torchrec import EmbeddingBagCollection, EmbeddingCollection

import embshard
from embshard import (
    SGD,
    Adagrad,
    IdMapSpec,
    RowWiseAdagrad,
    ShardingPlan,
    column_wise,
    grid,
    row_wise,
    table_wise,
)
from embshard import checkpoint as ckpt
from embshard.app.cli import main as cli
from embshard.storage.shards import gather_table

TOL = 1e-5
SAVED_AT = 6  # steps before the checkpoint, of Case.steps (12)


def _pooled(out) -> torch.Tensor:
    return out.values()


@dataclass(frozen=True)
class Collection:
    """One kind of collection with its test module's configs, stream, input, output and
    reference model."""

    make: Callable  # (tables=...) -> the unsharded collection
    tables: str  # its ModuleDict of tables
    configs: Callable
    stream: Callable
    kjt: Callable
    output: Callable  # the sharded module's output -> one tensor
    ref: type[RefModel]


BAGS = Collection(EmbeddingBagCollection, "embedding_bags", configs, stream, kjt, _pooled, RefModel)
SEQUENCES = Collection(
    EmbeddingCollection,
    "embeddings",
    sequence_configs,
    sequence_stream,
    sequence_kjt,
    values,
    SequenceRef,
)

# Saved at world size 2 under "saved", loaded at 3 and at 1 under those plans.
CASES = {
    "lru_adagrad_row_wise_to_others": (
        BAGS,
        Case(2, {"d": row_wise(), "s": row_wise()}, IdMapSpec(4, 3, "lru"), Adagrad(lr=0.1)),
        {
            3: {"d": row_wise([3, 6, 3]), "s": table_wise(2)},
            1: {"d": table_wise(0), "s": table_wise(0)},
        },
    ),
    "lfu_admit2_rowwise_adagrad_table_wise_to_others": (
        BAGS,
        Case(
            2,
            {"d": table_wise(1), "s": row_wise()},
            IdMapSpec(4, 2, "lfu", admit_after=2, seed=5),
            RowWiseAdagrad(lr=0.1),
            seed=1,
        ),
        {
            3: {"d": row_wise([2, 0, 6]), "s": row_wise()},
            1: {"d": row_wise([8]), "s": table_wise(0)},
        },
    ),
    # An EmbeddingCollection: each id's row; loaded with a rank holding no bucket.
    "sequence_lru_admit2_adagrad_row_wise_to_others": (
        SEQUENCES,
        Case(
            2,
            {"d": row_wise(), "s": table_wise(1)},
            IdMapSpec(4, 3, "lru", admit_after=2, seed=5),
            Adagrad(lr=0.1),
            seed=4,
        ),
        {
            3: {"d": row_wise([6, 0, 6]), "s": column_wise([0, 2])},
            1: {"d": table_wise(0), "s": table_wise(0)},
        },
    ),
    # Column blocks: their maps saved once, loaded into every block of the other plans.
    "admit2_adagrad_column_wise_to_grid_and_row_wise": (
        BAGS,
        Case(
            2,
            {"d": column_wise([1, 0]), "s": row_wise()},
            IdMapSpec(4, 3, "lru", admit_after=2),
            Adagrad(lr=0.1),
            seed=4,
        ),
        {
            3: {"d": grid(2, [[2, 0, 1], [1, 2]], [[3, 6, 3], [9, 3]]), "s": table_wise(0)},
            1: {"d": row_wise([12]), "s": table_wise(0)},
        },
    ),
    "sequence_lfu_adagrad_grid_to_column_wise_and_table_wise": (
        SEQUENCES,
        Case(
            2,
            {"d": grid(2, [[0, 1], [0, 1]], [[3, 9], [6, 6]]), "s": table_wise(1)},
            IdMapSpec(4, 3, "lfu"),
            Adagrad(lr=0.1),
            seed=3,
        ),
        {
            3: {"d": column_wise([2, 2]), "s": row_wise()},
            1: {"d": table_wise(0), "s": table_wise(0)},
        },
    ),
}


def steps_for(case: Case, world: int, kind: Collection = BAGS) -> list:
    """The global batches: the saving world's until the checkpoint, then ``world``'s."""
    return kind.stream(case)[:SAVED_AT] + kind.stream(replace(case, world=world))[SAVED_AT:]


def build(case: Case, plan: dict, spec: IdMapSpec | None = None, kind: Collection = BAGS):
    """The sharded model and the static table's initial rows (the same on every world)."""
    torch.manual_seed(0)
    module = kind.make(tables=kind.configs(case.rows))
    static = getattr(module, kind.tables)["s"].weight.detach().clone()
    dynamic = {"d": spec or case.spec} if spec is not False else {}
    mesh = embshard.sharding_mesh(case.group) if case.group else None
    sharded = embshard.shard(
        module, ShardingPlan(plan), mesh=mesh, optimizer=case.optimizer, dynamic=dynamic
    )
    return sharded, static


def train(sharded, ref: RefModel, steps: list, kind: Collection = BAGS) -> float:
    """Both models through ``steps``; the largest gap of this rank's outputs."""
    rank, gap = dist.get_rank(), 0.0
    for ranks in steps:
        dyn, stat, upstream = ranks[rank]
        out = kind.output(sharded(kind.kjt(dyn, stat)))
        (out * upstream).sum().backward()
        sharded.sync_replicas()
        expected = ref.forward_backward(ranks)[rank]
        gap = max(gap, (out.detach() - expected).abs().max().item() if out.numel() else 0)
    return gap


def compared(sharded, ref: RefModel) -> dict:
    """Every live row's weights and optimizer state, the static table, and the counts,
    against the reference (collective)."""
    table = gather_table(sharded.weights["d"])
    states = sharded.optimizer_state()
    state = states.get(f"{sharded.table_key('d')}.momentum1")  # None: SGD keeps none
    state = None if state is None else gather_table(state)
    stats = sharded.dynamic_stats()["d"]
    return {
        "row_gap": max((table[r] - v).abs().max().item() for r, v in ref.rows.items()),
        "state_gap": max(
            (
                (state[r] - v[: state.shape[1]]).abs().max().item()
                for r, v in ref.state.items()
                if state is not None
            ),
            default=0.0,
        ),
        "static_gap": (gather_table(sharded.weights["s"]) - ref.static).abs().max().item(),
        "stats": (stats.admitted, stats.evicted, stats.overflow, stats.live),
        "ref": (ref.admitted, ref.evicted, ref.overflow, len(ref.rows)),
    }


def looked_up(sharded, ref: RefModel, ranks: list, kind: Collection = BAGS) -> float:
    """The largest gap of this rank's output of ``ranks``' batch in eval mode (each raw
    id's row looked up as it is, nothing learned) from the reference's."""
    dyn, stat, _ = ranks[dist.get_rank()]
    with torch.no_grad():
        out = kind.output(sharded.eval()(kind.kjt(dyn, stat)))
    sharded.train()
    expected = ref.evaluate(ranks)[dist.get_rank()]
    return (out - expected).abs().max().item() if out.numel() else 0.0


def train_and_save(case: Case, root: str, kind: Collection = BAGS) -> dict:
    sharded, static = build(case, case.plan, kind=kind)
    ref = kind.ref(case, static)
    gap = train(sharded, ref, kind.stream(case)[:SAVED_AT], kind)
    ckpt.save(root, sharded, step=SAVED_AT)
    return {"out_gap": gap, **compared(sharded, ref)}


def load_and_continue(case: Case, plan: dict, root: str, kind: Collection = BAGS) -> dict:
    """The saved model loaded here under ``plan``, then trained to the end; the
    reference runs every step without a break."""
    world = dist.get_world_size()
    sharded, static = build(replace(case, world=world), plan, kind=kind)
    ref = kind.ref(case, static)
    steps = steps_for(case, world, kind)
    for ranks in steps[:SAVED_AT]:
        ref.forward_backward(ranks)
    step = ckpt.load(root, sharded)
    loaded = compared(sharded, ref) | {"looked_up": looked_up(sharded, ref, steps[SAVED_AT], kind)}
    gap = train(sharded, ref, steps[SAVED_AT:], kind)
    return {"step": step, "loaded": loaded, "out_gap": gap, **compared(sharded, ref)}


def assert_matches(result: dict) -> None:
    assert result["row_gap"] < TOL and result["state_gap"] < TOL, result
    assert result.get("looked_up", 0.0) < TOL, result
    assert result["static_gap"] < TOL, result
    assert result["stats"] == result["ref"], result


# Two sharding groups of 2 (with SGD the averaged copies step as the reference does),
# loaded into one world of 2 and into two groups again under other cuts.
TWO_GROUPS = Case(
    4, {"d": row_wise(), "s": table_wise(1)}, IdMapSpec(4, 3, "lru"), SGD(lr=0.1), group=2
)


def test_two_sharding_groups_save_load_and_reshard_their_maps(world, tmp_path):
    for result in world(4).run(train_and_save, TWO_GROUPS, str(tmp_path)):
        assert result["out_gap"] < TOL, result
        assert_matches(result)
    loads = (
        (2, {"d": table_wise(1), "s": row_wise()}, None),
        (4, {"d": row_wise([3, 9]), "s": table_wise(0)}, 2),
    )
    for size, plan, group in loads:
        case = replace(TWO_GROUPS, group=group)
        for result in world(size).run(load_and_continue, case, plan, str(tmp_path)):
            assert result["step"] == SAVED_AT
            assert_matches(result["loaded"])
            assert result["out_gap"] < TOL, result
            assert_matches(result)


@pytest.mark.parametrize("name", list(CASES))
def test_dynamic_tables_reshard_across_world_sizes_and_plans(world, tmp_path, name):
    kind, case, plans = CASES[name]
    saved = world(2).run(train_and_save, case, str(tmp_path), kind)
    for result in saved:
        assert result["out_gap"] < TOL, result
        assert_matches(result)
    assert saved[0]["ref"][1] > 0, "ids must be evicted before the checkpoint"
    for size, plan in plans.items():
        for result in world(size).run(load_and_continue, case, plan, str(tmp_path), kind):
            assert result["step"] == SAVED_AT
            assert_matches(result["loaded"])
            assert result["loaded"]["stats"][1] == saved[0]["stats"][1]  # totals continue
            assert result["out_gap"] < TOL, result
            assert_matches(result)
            assert result["ref"][1] > result["loaded"]["ref"][1], "and evicted after the load"


_, CASE, PLANS = CASES["lru_adagrad_row_wise_to_others"]


def load_refused(root: str, spec, plan: dict | None = None) -> tuple[str, bool]:
    """Loading ``root`` into the model with table 'd' dynamic by ``spec`` (False:
    static): the error, and whether the weights stayed as they were."""
    sharded, _ = build(CASE, plan or CASE.plan, spec)
    before = gather_table(sharded.weights["d"])
    try:
        ckpt.load(root, sharded)
        error = "no error"
    except ckpt.CheckpointError as e:
        error = str(e)
    return error, torch.equal(before, gather_table(sharded.weights["d"]))


def save_untrained(root: str, spec) -> None:
    """A checkpoint of the model with 'd' dynamic by ``spec`` (False: static), or with
    ``spec`` None the unsharded collection's plain DCP state dict."""
    if spec is None:
        torch.manual_seed(0)
        dcp.save(EmbeddingBagCollection(tables=configs(CASE.rows)).state_dict(), checkpoint_id=root)
        return
    ckpt.save(root, build(CASE, CASE.plan, spec)[0], step=1)


REFUSALS = {
    "another_policy": (
        CASE.spec,
        IdMapSpec(4, 3, "lfu"),
        "table 'd' (embedding_bags.d): the checkpoint's id map has policy 'lru', the model's "
        "policy 'lfu'",
    ),
    "other_buckets": (
        CASE.spec,
        IdMapSpec(6, 2, "lru"),
        "the checkpoint's id map has buckets 4, rows_per_bucket 3, the model's buckets 6, "
        "rows_per_bucket 2",
    ),
    "another_seed": (CASE.spec, IdMapSpec(4, 3, seed=1), "id map has seed 0, the model's seed 1"),
    "dynamic_into_static": (
        CASE.spec,
        False,
        "static in the model, but the checkpoint holds its id map (IdMapSpec(buckets=4, "
        "rows_per_bucket=3, policy='lru', ttl_steps=None, admit_after=1, seed=0))",
    ),
    "static_into_dynamic": (
        False,
        CASE.spec,
        "dynamic in the model, but the checkpoint holds no id map for it",
    ),
    "plain_state_dict_into_dynamic": (
        None,
        CASE.spec,
        "table 'd' (embedding_bags.d) is dynamic, and a plain state dict holds no id map",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_loads_that_do_not_match_the_map_are_refused_on_every_rank(world, tmp_path, name):
    saved, loaded, expected = REFUSALS[name]
    world(2).run(save_untrained, str(tmp_path / "ckpt"), saved)
    path = ckpt.resolve(tmp_path / "ckpt")
    results = world(2).run(load_refused, str(path), loaded, {"d": row_wise(), "s": row_wise()})
    for error, unchanged in results:
        assert error.startswith(f"{path}: ") and expected in error, error
        assert "\n" not in error and unchanged
    assert results[0] == results[1]


def test_a_flipped_byte_in_a_map_is_caught(world, tmp_path):
    world(2).run(train_and_save, CASE, str(tmp_path))
    path = ckpt.latest(tmp_path)
    report = ckpt.verify(path)
    assert report.ok and any(c.startswith("dynamic.") for c in _keys(path)), report.summary()
    bad = flip_a_byte(path, "dynamic.embedding_bags.d.keys")
    report = ckpt.verify(path)
    named = f"table 'd' (dynamic.embedding_bags.d.keys): {bad.file} at offset {bad.offset}"
    assert not report.ok and [str(c) for c in report.bad] == [str(bad)], report.summary()
    for error, unchanged in world(3).run(load_refused, str(path), CASE.spec, PLANS[3]):
        assert "corrupt checkpoint, 1 chunk not matching" in error and named in error, error
        assert unchanged


def _keys(path: Path) -> list[str]:
    return list(ckpt.read_metadata(path).state_dict_metadata)


def test_static_checkpoints_hold_no_dynamic_keys_and_inspect_shows_occupancy(world, tmp_path):
    world(2).run(save_untrained, str(tmp_path / "static"), False)
    static = ckpt.latest(tmp_path / "static")
    assert not any(k.startswith("dynamic") for k in _keys(static))
    assert "dynamic" not in ckpt.read_description(static)["tables"]["embedding_bags.d"]
    assert ckpt.describe(static)["tables"]["embedding_bags.d"]["dynamic"] is None

    saved = world(2).run(train_and_save, CASE, str(tmp_path / "dynamic"))[0]
    admitted, evicted, overflow, live = saved["stats"]
    info = ckpt.describe(tmp_path / "dynamic")["tables"]["embedding_bags.d"]["dynamic"]
    assert info == {
        "buckets": 4,
        "rows_per_bucket": 3,
        "policy": "lru",
        "ttl_steps": None,
        "admit_after": 1,
        "seed": 0,
        "rows": 12,
        "live": live,
        "admitted": admitted,
        "evicted": evicted,
        "overflow": overflow,
    }
    text = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path / "dynamic")]).output
    expected = (
        f"    id map: {live} of 12 rows live ({live / 12:.0%}), 4 buckets of 3 rows, lru; "
        f"admitted {admitted}, evicted {evicted}, overflow {overflow}"
    )
    assert expected in text, text


def dynamic_job(tmp: Path, name: str, steps: int, ckpt_dir: Path) -> str:
    """configs/small.yaml on drifting ids, its user table dynamic and small (ids keep
    being evicted), saving every 10 steps."""
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(steps=steps, batch_size=32)
    data["data"] = {"type": "synthetic", "drift": {"live_per_row": 4.0, "turnover_steps": 5}}
    data["tables"][0].update(num_embeddings=64, dynamic={"buckets": 8})
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": str(ckpt_dir), "every": 10, "keep": 2}
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_training_job_with_a_dynamic_table_stops_and_resumes(world, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    world(2).run(train_resuming, dynamic_job(tmp_path, "a.yaml", 20, straight), False)
    world(2).run(train_resuming, dynamic_job(tmp_path, "b.yaml", 10, interrupted), False)
    summaries = world(2).run(train_resuming, dynamic_job(tmp_path, "c.yaml", 20, interrupted), True)
    assert summaries[0]["steps"] == 20
    user = summaries[0]["dynamic"]["user"]
    assert user["evicted"] > 0 and user["live"] == user["admitted"] - user["evicted"]
    expected = ckpt.read_tensors(ckpt.latest(straight))
    resumed = ckpt.read_tensors(ckpt.latest(interrupted))
    assert ckpt.latest(interrupted).name == "step_00000020"
    assert expected.keys() == resumed.keys()
    assert "dynamic.sparse_arch.embedding_bag_collection.embedding_bags.user.keys" in expected
    for key, value in expected.items():
        assert torch.equal(value, resumed[key]), key
    # And on another world size, under the planner's plan for 3 ranks.
    on_three = world(3).run(train_resuming, dynamic_job(tmp_path, "d.yaml", 30, interrupted), True)
    assert on_three[0]["steps"] == 30 and ckpt.latest(interrupted).name == "step_00000030"
    user_after = on_three[0]["dynamic"]["user"]
    assert user_after["admitted"] > user["admitted"] and user_after["evicted"] > user["evicted"]
