"""Serving dynamic tables and TorchRec's managed-collision collections.

The oracle of a served dynamic table is written here: raw id -> key (test_id_map's
plain splitmix64) -> a dict of the live keys' rows read off the map's state tensors,
then TorchRec's own quantized collection (``torchrec.quant``'s ``from_float``) on the
batch so remapped, the ids without a row dropped from their bags (they add nothing).
Sharded serving is held to the trained sharded module in eval mode."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_dynamic import DIM, configs
from test_id_map import ref_key
from test_managed_collision import Case as MCCase
from test_managed_collision import kjt as mc_kjt
from test_managed_collision import mc_ebc
from test_serving import CLEAN_PROCESS, PRECISIONS, ROOT, TorchRecQuantEC, torchrec_quantized
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import embshard
from embshard import SGD, IdMapSpec, ShardingPlan, row_wise, serving, table_wise
from embshard import checkpoint as ckpt
from embshard.app.cli import main as cli
from embshard.app.config import load_config
from embshard.app.data import SyntheticData
from embshard.app.serve import serving_model
from embshard.app.train import build_model, train
from embshard.errors import CheckpointError, ConfigError, InputError
from embshard.runtime.keys import hash_ids
from embshard.serving.collection import (
    QuantizedEmbeddingBagCollection,
    QuantizedEmbeddingCollection,
)
from embshard.serving.id_maps import ServedIdMap
from embshard.storage.id_map import IdMap

SPEC = IdMapSpec(buckets=4, rows_per_bucket=3, policy="lru")
UNKNOWN = [3, 10**12, 2**63 - 1, 2**40 + 7]  # never given to the map below


def ref_rows(state: dict[str, torch.Tensor]) -> dict[int, int]:
    """The live keys' rows (bucket * rows_per_bucket + slot), off the state tensors."""
    keys, occupied = state["keys"].tolist(), state["occupied"].tolist()
    return {
        key: bucket * len(row) + slot
        for bucket, row in enumerate(keys)
        for slot, key in enumerate(row)
        if occupied[bucket][slot]
    }


def trained_map() -> tuple[IdMap, list[int]]:
    """A map of SPEC after a few steps of 30 raw ids (4 buckets of 3 rows: ids are
    evicted), and the raw ids it was given."""
    given = [5 + 97 * i for i in range(30)] + [0, 2**62]
    idmap = IdMap(SPEC)
    for step in range(4):
        ids = given[step * 8 : step * 8 + 12]
        idmap.remap(hash_ids(torch.tensor(ids)), step)
    return idmap, given


def test_the_served_map_finds_the_rows_the_id_map_holds():
    idmap, given = trained_map()
    state = idmap.state_dict()
    served = ServedIdMap.from_state("d", SPEC, state)
    rows = ref_rows(state)
    raw = torch.tensor(given + UNKNOWN)
    want = [rows.get(ref_key(i), -1) for i in raw.tolist()]
    assert 0 < sum(r >= 0 for r in want) < len(given)  # some ids hold rows, some were evicted
    assert served(raw).tolist() == want
    assert served(raw).tolist() == idmap.lookup(hash_ids(raw)).tolist()
    assert served.live == len(rows)
    assert served(torch.tensor([-1, -5])).tolist() == [-1, -1]  # no key: a miss
    empty = ServedIdMap.from_state("d", SPEC, IdMap(SPEC).state_dict())
    assert empty(raw).tolist() == [-1] * len(raw)


def _float_ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=configs(SPEC.buckets * SPEC.rows_per_bucket))
    for bag in ebc.embedding_bags.values():
        bag.weight.data = torch.randn_like(bag.weight) * torch.rand(bag.weight.shape[0], 1) * 3
    return ebc


def _bags(given: list[int], size: int, seed: int) -> list[list[list[int]]]:
    """Bags of 0 to 4 raw ids, known and unknown, for f_d1, f_d2; static ids for f_s."""
    g = torch.Generator().manual_seed(seed)
    pool = given + UNKNOWN

    def bag(ids: list[int]) -> list[int]:
        return [
            ids[int(i)]
            for i in torch.randint(
                0, len(ids), (int(torch.randint(0, 5, (1,), generator=g)),), generator=g
            )
        ]

    dyn = [[bag(pool) for _ in range(size)] for _ in range(2)]
    static = [[bag(list(range(10))) for _ in range(size)]]
    return [*dyn, *static]


def _kjt(bags: list[list[list[int]]], features=("f_d1", "f_d2", "f_s")) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=list(features),
        values=torch.tensor([i for f in bags for b in f for i in b], dtype=torch.long),
        lengths=torch.tensor([len(b) for f in bags for b in f], dtype=torch.long),
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_dynamic_bags_equal_torchrec_quantized_on_the_remapped_batch(precision: str):
    idmap, given = trained_map()
    rows = ref_rows(idmap.state_dict())
    ebc = _float_ebc()
    weights = {n: b.weight for n, b in ebc.embedding_bags.items()}
    served = QuantizedEmbeddingBagCollection(
        ebc.embedding_bag_configs(),
        weights,
        precision,
        id_maps={"d": ServedIdMap.from_state("d", SPEC, idmap.state_dict())},
    )
    oracle = torchrec_quantized(ebc, precision)
    for size, seed in ((1, 0), (9, 1), (40, 2)):
        bags = _bags(given, size, seed)
        remapped = [
            [[rows[ref_key(i)] for i in b if ref_key(i) in rows] for b in f] for f in bags[:2]
        ]
        got, want = served(_kjt(bags)).to_dict(), oracle(_kjt([*remapped, bags[2]])).to_dict()
        for feature, value in want.items():
            assert torch.equal(got[feature], value), (precision, size, feature)
    unknown = [[UNKNOWN[:3]], [[]], [[1]]]  # a bag of unknown ids only adds nothing
    assert not served(_kjt(unknown)).to_dict()["f_d1"].any()


def test_bad_ids_and_maps_are_one_line_errors():
    idmap, _ = trained_map()
    ebc = _float_ebc()
    weights = {n: b.weight for n, b in ebc.embedding_bags.items()}
    served_map = ServedIdMap.from_state("d", SPEC, idmap.state_dict())
    served = QuantizedEmbeddingBagCollection(
        ebc.embedding_bag_configs(), weights, "int8", id_maps={"d": served_map}
    )
    with pytest.raises(InputError, match=r"^feature 'f_d2' \(table 'd'\): raw id -5 is negative$"):
        served(_kjt([[[7]], [[-5]], [[1]]]))
    with pytest.raises(
        InputError, match=r"^feature 'f_s' \(table 's'\): id 10 is out of range \[0, 10\)$"
    ):
        served(_kjt([[[7]], [[2**63 - 1]], [[10]]]))
    with pytest.raises(ConfigError, match=r"^an id map for 'x', which is no table here"):
        QuantizedEmbeddingBagCollection(
            ebc.embedding_bag_configs(), weights, "int8", id_maps={"x": served_map}
        )
    small = IdMapSpec(buckets=2, rows_per_bucket=3)
    with pytest.raises(
        CheckpointError,
        match=r"^table 'd': id map keys of shape \(4, 3\), its spec needs \(2, 3\)$",
    ):
        ServedIdMap.from_state("d", small, idmap.state_dict())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_dynamic_sequence_rows_equal_torchrec_quantized_or_zeros(precision: str):
    idmap, given = trained_map()
    rows = ref_rows(idmap.state_dict())
    tables = _sequence_configs()
    torch.manual_seed(1)
    ec = EmbeddingCollection(tables=tables)
    weights = {n: e.weight for n, e in ec.embeddings.items()}
    served = QuantizedEmbeddingCollection(
        tables,
        weights,
        precision,
        id_maps={"d": ServedIdMap.from_state("d", SPEC, idmap.state_dict())},
    )
    oracle = torchrec_quantized(ec, precision, TorchRecQuantEC)
    bags = _bags(given, 12, 3)
    # The oracle looks every hit up at its row and every miss at row 0, then zeros it.
    remapped = [[[rows.get(ref_key(i), 0) for i in b] for b in f] for f in bags[:2]]
    got, want = served(_kjt(bags)), oracle(_kjt([*remapped, bags[2]]))
    for f, feature in enumerate(("f_d1", "f_d2", "f_s")):
        expected = want[feature].values()
        if f < 2:
            hit = torch.tensor([ref_key(i) in rows for b in bags[f] for i in b], dtype=torch.bool)
            assert hit.any() and not hit.all()
            expected = torch.where(hit[:, None], expected, torch.zeros_like(expected))
        assert torch.equal(got[feature].values(), expected), (precision, feature)
        assert torch.equal(got[feature].lengths(), want[feature].lengths())


class _MCModel(torch.nn.Module):
    """A TorchRec managed-collision bag collection and a dense layer on its output."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = mc_ebc(MCCase(1, {}, "lru", SGD(lr=0.1)))
        self.over = torch.nn.Linear(3 + 3 * 4, 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.sparse(features)
        return self.over(torch.cat([dense, pooled.values()], 1))


def _mc_batches() -> list[tuple[torch.Tensor, KeyedJaggedTensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for size in (1, 6, 17):
        bags = [
            [
                torch.randint(0, 48, (int(n),), generator=g).tolist()
                for n in torch.randint(0, 4, (size,), generator=g)
            ]
            for _ in range(3)
        ]
        out.append((torch.randn(size, 3, generator=g), mc_kjt(bags)))
    return out


def test_a_managed_collision_model_quantized_and_exported_equals_torchrec_pieces(tmp_path):
    """TorchRec's MC-EBC trained a few steps (its modules admit and evict), then served:
    against TorchRec's managed-collision collection in eval mode (remap only) feeding
    TorchRec's quantized EBC of the same weights, and the exported program in a fresh
    process against that."""
    torch.manual_seed(0)
    model = _MCModel()
    for dense, features in _mc_batches() * 3:  # training mode: profile, evict every 2
        model(dense, features).sum().backward()
    model.eval()
    mc = model.sparse
    oracle_ebc = torchrec_quantized(copy.deepcopy(mc._embedding_module), "int8")
    served = serving.quantize_model(copy.deepcopy(model), "int8")
    serving.export_model(served, tmp_path, dense_in=3)
    batches = _mc_batches()
    inputs = [(d, f.values(), f.lengths().long()) for d, f in batches]
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    files = [tmp_path / "model.pt2", tmp_path / "inputs.pt", tmp_path / "out.pt"]
    run = subprocess.run(
        [sys.executable, "-c", CLEAN_PROCESS, *map(str, files)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    with torch.no_grad():
        for (dense, features), exported in zip(batches, torch.load(files[2]), strict=True):
            pooled = oracle_ebc(mc._managed_collision_collection(features)).values()
            want = model.over(torch.cat([dense, pooled], 1))
            assert torch.equal(served(dense, features), want)
            assert torch.equal(exported, want)


def test_a_managed_collision_model_from_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^.*: sparse is a TorchRec ManagedCollisionEmbeddingBagCollection, whose "
        r"modules the checkpoint holds per row block: serve it sharded",
    ):
        serving.from_checkpoint(tmp_path, _MCModel(), "int8")


# --- A dynamic training job exported and run in a fresh process ------------------------


def _train(path: str) -> dict:
    return train(load_config(path))


@pytest.fixture(scope="module")
def dynamic_job(world, tmp_path_factory) -> dict:
    """configs/dynamic.yaml, smaller, trained 6 steps by 2 ranks, checkpointed."""
    tmp = tmp_path_factory.mktemp("dynamic_job")
    data = yaml.safe_load((ROOT / "configs" / "dynamic.yaml").read_text())
    for table in data["tables"]:
        table["num_embeddings"] = min(table["num_embeddings"], 2048)
        if "dynamic" in table:
            table["dynamic"]["buckets"] = 64
    data.update(steps=6, batch_size=128)
    data["data"]["drift"]["turnover_steps"] = 4
    data["eval"] = {"every": 0, "batches": 3}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": str(tmp / "ckpt")}
    config = tmp / "dynamic.yaml"
    config.write_text(yaml.safe_dump(data))
    world(2).run(_train, str(config))
    return {"config": config, "ckpt": tmp / "ckpt", "tmp": tmp}


def _oracle(job: dict, precision: str):
    """TorchRec's DLRM with the checkpoint's whole tensors, its collection TorchRec's
    quantized one; and each dynamic feature's raw id -> row, from the saved maps."""
    config = load_config(job["config"], check_files=False)
    m = config.model
    ebc = EmbeddingBagCollection(tables=config.embedding_bag_configs())
    model = DLRM(ebc, m.dense_in_features, m.dense_arch_layer_sizes, m.over_arch_layer_sizes)
    step = ckpt.latest(job["ckpt"])
    model.load_state_dict(ckpt.read_tensors(step, "model."))
    model.sparse_arch.embedding_bag_collection = torchrec_quantized(ebc, precision)
    prefix = "dynamic.sparse_arch.embedding_bag_collection.embedding_bags."
    maps = {
        f: ref_rows(ckpt.read_tensors(step, f"{prefix}{t.name}."))
        for t in config.tables
        if t.dynamic is not None
        for f in t.features
    }
    return model.eval(), maps


def _remapped(sparse: KeyedJaggedTensor, maps: dict[str, dict[int, int]]) -> KeyedJaggedTensor:
    """The batch with each dynamic feature's raw ids replaced by their rows, the ids
    without one dropped; and how many ids hit."""
    values, lengths = [], []
    for feature, jt in sparse.to_dict().items():
        for bag in jt.to_dense():
            ids = bag.tolist()
            if feature in maps:
                ids = [maps[feature][ref_key(i)] for i in ids if ref_key(i) in maps[feature]]
            values += ids
            lengths.append(len(ids))
    return KeyedJaggedTensor(
        keys=sparse.keys(), values=torch.tensor(values), lengths=torch.tensor(lengths)
    )


def test_an_exported_dynamic_job_runs_in_a_fresh_process_as_the_oracle(dynamic_job):
    out = dynamic_job["tmp"] / "int8"
    args = ["export", str(dynamic_job["ckpt"]), str(out), "--quantize", "int8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    config = load_config(dynamic_job["config"], check_files=False)
    data = SyntheticData(
        config.tables, config.dense_in_features, 128, config.seed, 0, config.data.drift
    )
    batches = data.eval_batches(3, step=6)  # the stream at the checkpoint's step
    inputs = [(b.dense, b.sparse.values(), b.sparse.lengths()) for b in batches]
    torch.save(inputs, dynamic_job["tmp"] / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    files = [out / "model.pt2", dynamic_job["tmp"] / "inputs.pt", dynamic_job["tmp"] / "out.pt"]
    run = subprocess.run(
        [sys.executable, "-c", CLEAN_PROCESS, *map(str, files)],
        capture_output=True,
        text=True,
        env=env,
        cwd=dynamic_job["tmp"],
    )
    assert run.returncode == 0, run.stderr
    outputs = torch.load(files[2])
    oracle, maps = _oracle(dynamic_job, "int8")
    hits = misses = 0
    for batch, got in zip(batches, outputs, strict=True):
        with torch.no_grad():
            want = oracle(batch.dense, _remapped(batch.sparse, maps))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for feature, table in maps.items():
            ids = batch.sparse[feature].values().tolist()
            hits += sum(ref_key(i) in table for i in ids)
            misses += sum(ref_key(i) not in table for i in ids)
    assert hits and misses  # the eval batches hold known and unknown raw ids
    manifest = json.loads((out / "serving.json").read_text())
    user = ckpt.describe(ckpt.latest(dynamic_job["ckpt"]))["tables"]
    saved = {k.rpartition(".")[2]: v["dynamic"]["live"] for k, v in user.items() if v["dynamic"]}
    assert {t: m["live"] for t, m in manifest["id_maps"].items()} == saved
    assert all(m["bytes"] == 16 * (m["live"] + 1) for m in manifest["id_maps"].values())
    printed = "".join(f", id map {t} {n:,} live ids" for t, n in saved.items())
    assert result.output.startswith(f"wrote {out}: 6 features, tables int8 ")
    assert result.output.endswith(f"x float32){printed}\n")
    # predict scores the job's held-out batches as they were at the checkpoint's step
    logits = dynamic_job["tmp"] / "logits.txt"
    args = ["predict", str(out), "synthetic", "--json", "--out", str(logits)]
    scored = CliRunner().invoke(cli, args)
    assert scored.exit_code == 0, scored.output
    written = torch.tensor([float(v) for v in logits.read_text().split()])
    torch.testing.assert_close(written, torch.cat(outputs).reshape(-1), rtol=1e-5, atol=1e-6)


def _predict(artifact, *extra: str) -> torch.Tensor:
    """``embshard predict`` of the job's synthetic held-out batches: the logits."""
    out = artifact.with_suffix(".logits")
    args = ["predict", str(artifact), "synthetic", "--out", str(out), *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return torch.tensor([float(v) for v in out.read_text().split()])


def test_a_sharded_artifact_of_a_dynamic_job_scores_as_the_one_host_one(dynamic_job):
    """Exported for 2 ranks in row blocks and whole tables (each rank's maps: its
    buckets), scored by 2 processes: the one-host artifact's logits (row blocks
    quantize as the whole table's rows), up to the float summation order. By the
    planner's plan, which may cut a table in column blocks: close."""
    one_host, sharded = dynamic_job["tmp"] / "one_int8", dynamic_job["tmp"] / "two_int8"
    args = ["export", str(dynamic_job["ckpt"]), "--quantize", "int8"]
    assert CliRunner().invoke(cli, [args[0], args[1], str(one_host), *args[2:]]).exit_code == 0
    rows_plan = dynamic_job["tmp"] / "row_blocks.yaml"
    row_tables = {
        **{t: {"type": "row_wise", "sizes": [1024, 1024]} for t in ("user", "item")},
        **{t: {"type": "table_wise", "rank": 1} for t in ("category", "city", "device")},
    }
    rows_plan.write_text(yaml.safe_dump({"tables": row_tables}))
    result = CliRunner().invoke(
        cli,
        [args[0], args[1], str(sharded), *args[2:], "--world-size", "2", "--plan", str(rows_plan)],
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((sharded / "serving.json").read_text())
    assert sorted(manifest["sharded"]["dynamic"]) == ["item", "user"]
    torch.testing.assert_close(
        _predict(sharded, "--nproc", "2"), _predict(one_host), rtol=1e-5, atol=1e-5
    )
    planned = dynamic_job["tmp"] / "planned_int8"
    result = CliRunner().invoke(
        cli, [args[0], args[1], str(planned), *args[2:], "--world-size", "2"]
    )
    assert result.exit_code == 0, result.output
    torch.testing.assert_close(
        _predict(planned, "--nproc", "2"), _predict(one_host), rtol=0, atol=5e-4
    )
    # A grid: each rank holds a row block of each column block, two bucket ranges. A
    # column block's rows quantize with scales of their own: close, not equal.
    gridded, grid_plan = dynamic_job["tmp"] / "grid_int8", dynamic_job["tmp"] / "grid.yaml"
    grid_tables = {
        "user": {"type": "grid", "column_blocks": 2, "ranks": [[0, 1], [1, 0]]},
        **{t: {"type": "table_wise", "rank": 1} for t in ("item", "category", "city", "device")},
    }
    grid_plan.write_text(yaml.safe_dump({"tables": grid_tables}))
    exported = CliRunner().invoke(
        cli,
        [args[0], args[1], str(gridded), *args[2:], "--world-size", "2", "--plan", str(grid_plan)],
    )
    assert exported.exit_code == 0, exported.output
    torch.testing.assert_close(
        _predict(gridded, "--nproc", "2"), _predict(one_host), rtol=0, atol=5e-4
    )
    plan = dynamic_job["tmp"] / "off_buckets.yaml"
    tables = {
        "item": {"type": "row_wise", "sizes": [1000, 1048]},
        **{t: {"type": "table_wise", "rank": 0} for t in ("user", "category", "city", "device")},
    }
    plan.write_text(yaml.safe_dump({"tables": tables}))
    bad = CliRunner().invoke(
        cli,
        [
            args[0],
            args[1],
            str(dynamic_job["tmp"] / "never"),
            *args[2:],
            "--world-size",
            "2",
            "--plan",
            str(plan),
        ],
    )
    assert bad.exit_code == 1
    assert bad.output == (
        "Error: dynamic table 'item': the plan cuts its rows at 1000, not a multiple of "
        "rows_per_bucket 32\n"
    )


# --- Sharded serving: the trained sharded module in eval mode ---------------------------


def _sequence_configs() -> list[EmbeddingConfig]:
    """test_dynamic's tables as sequence tables."""
    return [
        EmbeddingConfig(
            name=c.name,
            num_embeddings=c.num_embeddings,
            embedding_dim=DIM,
            feature_names=c.feature_names,
        )
        for c in configs(SPEC.buckets * SPEC.rows_per_bucket)
    ]


def _values(out) -> torch.Tensor:
    """A collection's output as one tensor: pooled values, or every feature's rows."""
    out = out[0] if isinstance(out, tuple) else out  # a managed-collision collection's
    if isinstance(out, dict):
        return torch.cat([out[f].values() for f in sorted(out)])
    return out.values()


def _served_sharded(kind: str, sequence: bool, precision: str) -> list:
    """A collection sharded over this world and trained 4 steps, then this rank's eval
    output of a batch, by the quantized module and by the float one in eval mode."""
    rank = torch.distributed.get_rank()
    meta = torch.device("meta")
    if kind == "dynamic":
        module = (
            EmbeddingCollection(tables=_sequence_configs(), device=meta)
            if sequence
            else EmbeddingBagCollection(tables=configs(12), device=meta)
        )
        plan = ShardingPlan({"d": row_wise(), "s": table_wise(0)})
        sharded = embshard.shard(module, plan, optimizer=SGD(lr=0.5), dynamic={"d": SPEC})
        features, ids, unknown = ("f_d1", "f_d2", "f_s"), trained_map()[1], UNKNOWN[:2]
    else:
        module = mc_ebc(MCCase(2, {}, "lru", SGD(lr=0.1), sequence=sequence), "meta")
        plan = ShardingPlan({"t": row_wise(), "u": table_wise(1)})
        sharded = embshard.shard(module, plan, optimizer=SGD(lr=0.5))
        features, ids, unknown = ("f1", "f2", "g"), list(range(48)), [47, 46]
    for step in range(4):
        bags = [[[ids[(step * 7 + rank * 3 + j) % len(ids)] for j in range(3)]] for _ in range(2)]
        _values(sharded(_kjt([*bags, [[1, 2]]], features))).sum().backward()
    batch = _kjt([[ids[rank:6], unknown], [ids[4:9], []], [[1], [3]]], features)
    sharded.eval()
    with torch.no_grad():
        want = _values(sharded(batch))
    served = serving.quantize_sharded(sharded, precision)
    served.train()  # serving stays in eval mode: nothing is admitted or evicted
    return [_values(served(batch)), want]


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("kind", ["dynamic", "managed"])
def test_sharded_serving_looks_ids_up_as_the_trained_module_in_eval_mode(
    world, kind: str, sequence: bool
):
    for precision, tolerance in (("fp16", 1e-2), ("int8", 0.05)):
        for got, want in world(2).run(_served_sharded, kind, sequence, precision):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


@pytest.mark.parametrize(
    "change, said",
    [
        (
            lambda user: user["dynamic"].update(buckets=32),
            "the checkpoint's id map is IdMapSpec(buckets=64, rows_per_bucket=32, "
            "policy='lru', ttl_steps=None, admit_after=1, seed=0), the config's "
            "IdMapSpec(buckets=32, rows_per_bucket=64, policy='lru', ttl_steps=None, "
            "admit_after=1, seed=0)",
        ),
        (
            lambda user: user.pop("dynamic"),
            "static in the config, but the checkpoint holds its id map",
        ),
    ],
)
def test_a_config_whose_dynamic_tables_differ_from_the_checkpoint_is_named(
    dynamic_job, change, said: str
):
    data = yaml.safe_load(dynamic_job["config"].read_text())
    change(next(t for t in data["tables"] if t["name"] == "user"))
    config = dynamic_job["tmp"] / "changed.yaml"
    config.write_text(yaml.safe_dump(data))
    out = dynamic_job["tmp"] / "never_changed"
    args = ["export", str(dynamic_job["ckpt"]), str(out), "--quantize", "int8"]
    result = CliRunner().invoke(cli, [*args, "--config", str(config)])
    assert result.exit_code == 1
    step = ckpt.latest(dynamic_job["ckpt"])
    assert result.output == f"Error: {step}: table 'user': {said}\n"
    assert not out.exists()


def _served_from_dynamic_checkpoint(config_path: str, root: str) -> list:
    """This rank's held-out batch and its logits from the model sharded over this world
    (the item table's buckets cut 32 / 16 / 16, the user table whole on the last rank),
    its weights and id maps from the 2-rank checkpoint, int8."""
    config = load_config(config_path, check_files=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    plan = ShardingPlan(
        {
            "item": row_wise([1024, 512, 512]),
            "user": table_wise(world - 1),
            **{t.name: table_wise(0) for t in config.tables if t.dynamic is None},
        }
    )
    served = serving.shard_quantized(
        build_model(config), plan, "int8", checkpoint_path=root, dynamic=config.id_maps()
    )
    data = SyntheticData(
        config.tables, config.dense_in_features, 64, config.seed, rank, config.data.drift
    )
    batch = data.batch(0, "eval", 6)
    return [(batch.dense, batch.sparse, served(batch.dense, batch.sparse).reshape(-1))]


def test_a_dynamic_job_served_over_3_ranks_equals_the_one_host_model(world, dynamic_job):
    """The checkpoint layer reshards the 2-rank checkpoint's tables and id maps onto 3
    ranks by bucket range; every rank's logits are the one-host served model's."""
    results = world(3).run(
        _served_from_dynamic_checkpoint, str(dynamic_job["config"]), str(dynamic_job["ckpt"])
    )
    config = load_config(dynamic_job["config"], check_files=False)
    one_host = serving_model(dynamic_job["ckpt"], config, "int8")
    for batches in results:
        for dense, sparse, logits in batches:
            with torch.no_grad():
                want = one_host(dense, sparse).reshape(-1)
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def _mc_served_from_checkpoint(root: str) -> list:
    """_MCModel sharded over this world and trained 6 steps, checkpointed; then a fresh
    one on meta served from that checkpoint (its modules loaded per row block): this
    rank's logits of a batch by both, the trained one in eval mode."""
    rank = torch.distributed.get_rank()
    plan = ShardingPlan({"t": row_wise(), "u": table_wise(1)})
    torch.manual_seed(0)
    trained = embshard.shard_model(
        _MCModel(), plan, optimizer=SGD(lr=0.5), data_parallel_wrapper=lambda m: m
    )
    for dense, features in [_mc_batches()[rank]] * 6:
        trained(dense, features).sum().backward()
    ckpt.save(root, trained, step=6)
    fresh = _MCModel()
    fresh.sparse = mc_ebc(MCCase(1, {}, "lru", SGD(lr=0.1)), "meta")
    served = serving.shard_quantized(fresh, plan, "fp16", checkpoint_path=root)
    dense, features = _mc_batches()[1]
    with torch.no_grad():
        return [served(dense, features), trained.eval()(dense, features)]


def test_a_managed_collision_model_is_served_sharded_from_its_checkpoint(world, tmp_path):
    for got, want in world(2).run(_mc_served_from_checkpoint, str(tmp_path / "ckpt")):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
