"""Serving: quantized tables against TorchRec's quantized EmbeddingBagCollection
(``torchrec.quant``'s ``from_float``) on the same float weights, the exported model in a
process that does not import embshard, and the commands."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from click.testing import CliRunner
from torch.ao import quantization as quant
from torch.distributed.checkpoint.metadata import MetadataIndex
from torchmetrics.functional.classification import binary_auroc
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchRecQuantEBC
from torchrec.quant.embedding_modules import EmbeddingCollection as TorchRecQuantEC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard import ShardingPlan, row_wise, table_wise
from embshard import checkpoint as ckpt
from embshard.app.cli import main as cli
from embshard.app.config import load_config
from embshard.app.data import CriteoData, SyntheticData
from embshard.app.serve import load_program, serving_model
from embshard.app.train import build_model, train
from embshard.errors import ConfigError, InputError
from embshard.serving.collection import (
    QuantizedEmbeddingBagCollection,
    QuantizedEmbeddingCollection,
)
from embshard.serving.model import quantize_model
from embshard.serving.precision import Precision
from embshard.serving.sharded import shard_quantized

# TorchRec's quantization config for each precision: float activations (pooled output).
TORCH_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.half}
PRECISIONS = list(TORCH_DTYPES)


def _tables(pooling_of_b: PoolingType = PoolingType.MEAN) -> list[EmbeddingBagConfig]:
    """Mixed dims and poolings, a table two features share."""
    return [
        EmbeddingBagConfig(name="a", num_embeddings=97, embedding_dim=16, feature_names=["fa"]),
        EmbeddingBagConfig(
            name="b",
            num_embeddings=53,
            embedding_dim=8,
            feature_names=["fb", "fb2"],
            pooling=pooling_of_b,
        ),
        EmbeddingBagConfig(name="c", num_embeddings=11, embedding_dim=32, feature_names=["fc"]),
        EmbeddingBagConfig(
            name="d",
            num_embeddings=300,
            embedding_dim=4,
            feature_names=["fd"],
            pooling=PoolingType.MEAN,
        ),
    ]


def _float_ebc(tables: list[EmbeddingBagConfig], seed: int = 0) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=tables)
    for bag in ebc.embedding_bags.values():  # rows of different ranges: scales differ
        bag.weight.data = torch.randn_like(bag.weight) * torch.rand(bag.weight.shape[0], 1) * 3
    return ebc


def _batch(tables: list[EmbeddingBagConfig], size: int, seed: int = 1) -> KeyedJaggedTensor:
    """Random bags of 0 to 5 ids (empty bags included) for every feature."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            bags = torch.randint(0, 6, (size,), generator=g)
            keys.append(f)
            lengths.append(bags)
            values.append(torch.randint(0, t.num_embeddings, (int(bags.sum()),), generator=g))
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def torchrec_quantized(module: torch.nn.Module, precision: str, kind=TorchRecQuantEBC):
    """The oracle: TorchRec's own quantized collection (``kind``) of ``module``."""
    module.qconfig = quant.QConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
        weight=quant.PlaceholderObserver.with_args(dtype=TORCH_DTYPES[precision]),
    )
    return kind.from_float(module)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mean", [False, True])
def test_pooled_rows_equal_torchrec_quantized(precision: str, mean: bool):
    tables = _tables(PoolingType.MEAN if mean else PoolingType.SUM)
    ebc = _float_ebc(tables)
    ours = QuantizedEmbeddingBagCollection.from_float(ebc, precision)
    oracle = torchrec_quantized(ebc, precision)
    for size in (1, 7, 64):
        batch = _batch(tables, size, seed=size)
        got, want = ours(batch).to_dict(), oracle(batch).to_dict()
        assert list(got) == [f for t in tables for f in t.feature_names]
        for feature, value in want.items():
            assert torch.equal(got[feature], value), (precision, size, feature)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", PRECISIONS)
def test_pooled_rows_on_the_gpu_equal_torchrec_quantized_on_the_cpu(precision: str):
    """FBGEMM's CUDA inference kernels against TorchRec's module on the CPU: the same
    quantized rows, summed in another order (within float32 rounding)."""
    tables = _tables()
    ebc = _float_ebc(tables)
    oracle = torchrec_quantized(copy.deepcopy(ebc), precision)
    ours = QuantizedEmbeddingBagCollection.from_float(ebc.cuda(), precision)
    for size in (0, 1, 7, 64):
        batch = _batch(tables, size, seed=size)
        got, want = ours(batch.to("cuda")).to_dict(), oracle(batch).to_dict()
        for feature, value in want.items():
            torch.testing.assert_close(got[feature].cpu(), value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sequence_rows_equal_torchrec_quantized(precision: str):
    tables = [
        EmbeddingConfig(name="s", num_embeddings=40, embedding_dim=16, feature_names=["q", "r"]),
        EmbeddingConfig(name="t", num_embeddings=25, embedding_dim=16, feature_names=["u"]),
        EmbeddingConfig(name="v", num_embeddings=9, embedding_dim=16, feature_names=["w"]),
    ]
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=tables)
    ours = QuantizedEmbeddingCollection.from_float(ec, precision)
    oracle = torchrec_quantized(ec, precision, TorchRecQuantEC)
    for size in (1, 9):
        batch = _batch(tables, size, seed=size)
        got, want = ours(batch), oracle(batch)
        assert sorted(got) == sorted(want) == ["q", "r", "u", "w"]
        for feature, value in want.items():
            assert torch.equal(got[feature].values(), value.values()), (precision, feature)
            assert torch.equal(got[feature].lengths(), value.lengths())


def test_quantize_model_swaps_every_collection_and_keeps_the_dense_part():
    tables = _tables(PoolingType.SUM)
    for t in tables:
        t.embedding_dim = 8  # DLRM: one dim
    torch.manual_seed(4)
    model = DLRM(_float_ebc(tables), 5, [16, 8], [8, 1])
    oracle = copy.deepcopy(model)
    oracle.sparse_arch.embedding_bag_collection = torchrec_quantized(
        oracle.sparse_arch.embedding_bag_collection, "int4"
    )
    served = quantize_model(model, "int4")
    assert isinstance(served.sparse_arch.embedding_bag_collection, QuantizedEmbeddingBagCollection)
    assert not served.training and not any(p.requires_grad for p in served.parameters())
    batch, dense = _batch(tables, 12), torch.randn(12, 5)
    with torch.no_grad():
        assert torch.equal(served(dense, batch), oracle.eval()(dense, batch))


def test_weighted_features_equal_torchrec_quantized():
    tables = _tables()
    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=True)
    plain = _batch(tables, 16)
    weights = torch.rand(plain.values().numel())
    batch = KeyedJaggedTensor(
        keys=plain.keys(), values=plain.values(), lengths=plain.lengths(), weights=weights
    )
    ours = QuantizedEmbeddingBagCollection.from_float(ebc, "int8")
    want = torchrec_quantized(ebc, "int8")(batch).to_dict()
    got = ours(batch).to_dict()
    assert all(torch.equal(got[f], want[f]) for f in want)


def test_features_in_any_order():
    tables = _tables()
    ours = QuantizedEmbeddingBagCollection.from_float(_float_ebc(tables), "int4")
    batch = _batch(tables, 5)
    order = list(reversed(range(len(batch.keys()))))
    shuffled = ours(batch.permute(order)).to_dict()
    assert all(torch.equal(v, shuffled[k]) for k, v in ours(batch).to_dict().items())


def test_quantized_rows_are_close_to_the_float_rows():
    """Not the oracle: a sanity bound that the lookups are of the trained rows."""
    tables = _tables(PoolingType.SUM)
    ebc = _float_ebc(tables)
    batch = _batch(tables, 32)
    want = ebc(batch).values()
    for precision, bound in (("fp16", 1e-2), ("int8", 0.2), ("int4", 3.0)):
        got = QuantizedEmbeddingBagCollection.from_float(ebc, precision)(batch).values()
        assert (got - want).abs().max() < bound, precision


def test_table_bytes():
    tables = _tables()
    ebc = _float_ebc(tables)
    for precision in PRECISIONS:
        p = Precision.parse(precision)
        least = sum(t.num_embeddings * p.row_bytes(t.embedding_dim) for t in tables)
        got = QuantizedEmbeddingBagCollection.from_float(ebc, p).table_bytes()
        assert least <= got < least + 128 * len(tables)  # each table 128-byte aligned


def test_an_id_out_of_range_is_named():
    tables = _tables()
    ours = QuantizedEmbeddingBagCollection.from_float(_float_ebc(tables), "int8")
    batch = _batch(tables, 4)
    values = batch.values().clone()
    fd_start = int(batch.lengths()[: 4 * 4].sum())  # fd is the fifth feature
    values[fd_start] = 300
    bad = KeyedJaggedTensor(keys=batch.keys(), values=values, lengths=batch.lengths())
    with pytest.raises(
        InputError, match=r"^feature 'fd' \(table 'd'\): id 300 is out of range \[0, 300\)$"
    ):
        ours(bad)
    missing = KeyedJaggedTensor(keys=["fa"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(InputError, match="the batch has no feature 'fb'"):
        ours(missing)


def test_int4_cannot_pack_an_odd_dim():
    tables = [
        EmbeddingBagConfig(name="odd", num_embeddings=10, embedding_dim=5, feature_names=["f"])
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    with pytest.raises(
        ConfigError, match=r"^table 'odd': embedding_dim 5 cannot be packed as int4"
    ):
        QuantizedEmbeddingBagCollection.from_float(ebc, "int4")
    QuantizedEmbeddingBagCollection.from_float(ebc, "fp16")  # halves need no packing


def test_a_device_fbgemm_cannot_serve_on():
    ebc = _float_ebc(_tables())
    weights = {n: b.weight for n, b in ebc.embedding_bags.items()}
    with pytest.raises(
        ConfigError,
        match=r"^int8 tables on meta: FBGEMM's inference TBE runs them on cpu and cuda only$",
    ):
        QuantizedEmbeddingBagCollection(_tables(), weights, "int8", device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^int4 tables on cuda: torch sees no CUDA device$"):
            QuantizedEmbeddingBagCollection(_tables(), weights, "int4", device="cuda")


def test_unknown_precision():
    with pytest.raises(
        ConfigError,
        match=r"^unknown precision 'int3': FBGEMM's inference TBE serves fp16, int8, int4$",
    ):
        Precision.parse("int3")


# --- From a training job's checkpoint: export and predict -----------------------------

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from make_criteo_sample import sample_lines  # noqa: E402


def _train(path: str) -> dict:
    return train(load_config(path))


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory) -> dict[str, Path]:
    """The Criteo sample's DLRM trained a few steps by 2 ranks under its mixed plan
    (row-, column- and table-wise), checkpointed."""
    tmp = tmp_path_factory.mktemp("trained")
    data = yaml.safe_load((ROOT / "configs" / "criteo_sample.yaml").read_text())
    (tmp / "train.tsv").write_text("\n".join(sample_lines(2000, seed=0)) + "\n")
    (tmp / "eval.tsv").write_text("\n".join(sample_lines(700, seed=1)) + "\n")
    data["data"].update(path=str(tmp / "train.tsv"), eval_path=str(tmp / "eval.tsv"))
    data.update(steps=8, batch_size=64)
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": str(tmp / "ckpt")}
    config = tmp / "criteo.yaml"
    config.write_text(yaml.safe_dump(data))
    world(2).run(_train, str(config))
    return {"config": config, "ckpt": tmp / "ckpt", "eval": tmp / "eval.tsv", "tmp": tmp}


def _export(trained: dict[str, Path], out: Path, precision: str, config: Path | None = None):
    """``embshard export`` of the trained checkpoint."""
    config = config or trained["config"]
    args = ["export", str(trained["ckpt"]), str(out), "--config", str(config)]
    return CliRunner().invoke(cli, [*args, "--quantize", precision])


def _eval_batches(trained: dict[str, Path], size: int = 128) -> list:
    config = load_config(trained["config"], check_files=False)
    return list(CriteoData(str(trained["eval"]), None, config.tables, size, 0, 1).epoch_batches())


def _torchrec_serving_model(trained: dict[str, Path], precision: str) -> torch.nn.Module:
    """The oracle: TorchRec's DLRM with the checkpoint's whole tensors, its collection
    replaced by TorchRec's quantized one."""
    config = load_config(trained["config"], check_files=False)
    m = config.model
    ebc = EmbeddingBagCollection(tables=config.embedding_bag_configs())
    dense = (m.dense_in_features, m.dense_arch_layer_sizes, m.over_arch_layer_sizes)
    model = DLRM(ebc, *dense)
    model.load_state_dict(ckpt.read_tensors(ckpt.latest(trained["ckpt"]), "model."))
    model.sparse_arch.embedding_bag_collection = torchrec_quantized(ebc, precision)
    return model.eval()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_serving_model_from_a_two_rank_checkpoint_equals_torchrec_quantized(trained, precision):
    config = load_config(trained["config"], check_files=False)
    ours = serving_model(trained["ckpt"], config, precision)
    oracle = _torchrec_serving_model(trained, precision)
    assert not any(p.requires_grad for p in ours.parameters())
    with torch.no_grad():
        for batch in _eval_batches(trained):
            want = oracle(batch.dense, batch.sparse)
            assert torch.equal(ours(batch.dense, batch.sparse), want)


CLEAN_PROCESS = """
import sys

class Refuse:  # the predictor has no embshard, and needs no TorchRec
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("embshard", "torchrec"):
            raise ImportError(f"{name} is not importable here")

sys.meta_path.insert(0, Refuse())
import torch, fbgemm_gpu

program = torch.export.load(sys.argv[1]).module()
torch.save([program(*inputs) for inputs in torch.load(sys.argv[2])], sys.argv[3])
"""


def test_exported_artifact_runs_without_embshard_and_gives_the_same_outputs(trained):
    out = trained["tmp"] / "int4_artifact"
    result = _export(trained, out, "int4")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {out}: 26 features, tables int4 ")
    config = load_config(trained["config"], check_files=False)
    ours = serving_model(trained["ckpt"], config, "int4")
    batches = _eval_batches(trained, 100)  # 700 lines: 7 batches; then one of one sample
    batches.append(_eval_batches(trained, 1)[0])
    inputs = [(b.dense, b.sparse.values(), b.sparse.lengths()) for b in batches]
    torch.save(inputs, trained["tmp"] / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    files = [
        str(out / "model.pt2"),
        *(str(trained["tmp"] / f) for f in ("inputs.pt", "outputs.pt")),
    ]
    run = subprocess.run(
        [sys.executable, "-c", CLEAN_PROCESS, *files],
        capture_output=True,
        text=True,
        env=env,
        cwd=trained["tmp"],
    )
    assert run.returncode == 0, run.stderr
    outputs = torch.load(trained["tmp"] / "outputs.pt")
    with torch.no_grad():
        for batch, got in zip(batches, outputs, strict=True):
            assert torch.equal(got, ours(batch.dense, batch.sparse))
    manifest = json.loads((out / "serving.json").read_text())
    assert manifest["precision"] == "int4" and manifest["extra"]["step"] == 8


def test_predict_scores_a_criteo_file(trained):
    out = trained["tmp"] / "int8_artifact"
    assert _export(trained, out, "int8").exit_code == 0
    scores = trained["tmp"] / "scores.txt"
    args = ["predict", str(out), str(trained["eval"]), "--batch-size", "128"]
    result = CliRunner().invoke(cli, [*args, "--out", str(scores), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert "scoring" in result.stderr  # the progress bar
    config = load_config(trained["config"], check_files=False)
    ours = serving_model(trained["ckpt"], config, "int8")
    batches = _eval_batches(trained)
    with torch.no_grad():
        logits = torch.cat([ours(b.dense, b.sparse).reshape(-1) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    written = torch.tensor([float(v) for v in scores.read_text().split()])
    assert figures["samples"] == len(labels) == len(written) == 700
    assert torch.allclose(written, logits, rtol=1e-5, atol=1e-6)  # printed to 6 digits
    assert figures["auc"] == pytest.approx(
        float(binary_auroc(torch.sigmoid(logits), labels.long()))
    )
    assert figures["samples_per_s"] > 0
    assert figures["batch_latency_ms_p99"] >= figures["batch_latency_ms_p50"] > 0


def test_predict_refuses_data_of_another_kind_than_the_training_job_read(trained):
    out = trained["tmp"] / "int8_artifact"
    if not out.exists():
        assert _export(trained, out, "int8").exit_code == 0
    result = CliRunner().invoke(cli, ["predict", str(out), "synthetic"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {out}'s model was trained on criteo data: DATA must be a Criteo TSV file\n"
    )


def _refused_export(trained, name: str, change) -> str:
    """What exporting the trained checkpoint with its config changed by ``change``
    prints; it must fail and write nothing."""
    data = yaml.safe_load(trained["config"].read_text())
    data.pop("plan")
    change(data)
    config = trained["tmp"] / f"{name}.yaml"
    config.write_text(yaml.safe_dump(data))
    out = trained["tmp"] / f"never_{name}"
    result = _export(trained, out, "int8", config)
    assert result.exit_code == 1
    assert not out.exists()
    return result.output


def test_a_checkpoint_without_a_table_of_the_config_is_named(trained):
    output = _refused_export(trained, "renamed", lambda d: d["tables"][2].update(name="t9"))
    step = ckpt.latest(trained["ckpt"])
    assert output == (
        f"Error: {step}: the checkpoint has no table 't9' "
        "(no sparse_arch.embedding_bag_collection.embedding_bags.t9.weight)\n"
    )


def test_a_config_with_a_dynamic_table_the_checkpoint_has_no_map_of_is_named(trained):
    def dynamic(data: dict) -> None:
        data["tables"][2]["dynamic"] = {"buckets": 1}
        data.pop("checkpoint")

    output = _refused_export(trained, "dynamic", dynamic)
    name = yaml.safe_load(trained["config"].read_text())["tables"][2]["name"]
    assert output == (
        f"Error: {ckpt.latest(trained['ckpt'])}: table '{name}': dynamic in the config, but "
        "the checkpoint holds no id map for it\n"
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_predict_scores_the_synthetic_held_out_batches_of_a_plain_dcp_checkpoint(tmp_path):
    """A DCP checkpoint of a plain state dict (no embshard description) of the demo's
    model, served and scored on the job's synthetic held-out batches."""
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(batch_size=256)
    data["eval"] = {"every": 10, "batches": 3}
    config_path = tmp_path / "small.yaml"
    config_path.write_text(yaml.safe_dump(data))
    config = load_config(config_path, check_files=False)
    torch.manual_seed(5)
    model = DLRM(
        EmbeddingBagCollection(tables=config.embedding_bag_configs()),
        config.model.dense_in_features,
        config.model.dense_arch_layer_sizes,
        config.model.over_arch_layer_sizes,
    )
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    out = tmp_path / "fp16"
    args = ["export", str(tmp_path / "ckpt"), str(out), "--config", str(config_path)]
    assert CliRunner().invoke(cli, [*args, "--quantize", "fp16"]).exit_code == 0
    result = CliRunner().invoke(cli, ["predict", str(out), "synthetic", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    batches = [
        SyntheticData(config.tables, 13, 256, config.seed, 0).batch(i, "eval") for i in range(3)
    ]
    served = quantize_model(model, "fp16")
    with torch.no_grad():
        logits = torch.cat([served(b.dense, b.sparse).reshape(-1) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    assert figures["samples"] == 768
    assert figures["auc"] == pytest.approx(
        float(binary_auroc(torch.sigmoid(logits), labels.long()))
    )


# --- The checkpoint carries its config; sharded artifacts --------------------------------


def test_export_takes_the_config_the_checkpoint_carries(trained):
    out = trained["tmp"] / "carried"
    args = ["export", str(trained["ckpt"]), str(out), "--quantize", "int8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    given = trained["tmp"] / "given"
    assert _export(trained, given, "int8").exit_code == 0
    carried = load_config(out / "config.yaml", check_files=False)
    assert carried.tables == load_config(trained["config"], check_files=False).tables
    assert carried.model == load_config(trained["config"], check_files=False).model
    program, reference = load_program(out), load_program(given)
    for batch in _eval_batches(trained)[:2]:
        inputs = (batch.dense, batch.sparse.values(), batch.sparse.lengths())
        assert torch.equal(program(*inputs), reference(*inputs))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_a_checkpoint_without_its_config_asks_for_it(tmp_path):
    ebc = EmbeddingBagCollection(tables=_tables())
    dcp.save(ebc.state_dict(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    args = ["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--quantize", "int8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {tmp_path / 'ckpt'} does not carry its training config (saved before "
        "embshard kept it, or not by `embshard train`): pass --config\n"
    )


def test_a_changed_byte_in_the_carried_config_is_caught(trained, tmp_path):
    step = ckpt.latest(trained["ckpt"])
    copy = tmp_path / step.name
    shutil.copytree(step, copy)
    where = ckpt.read_metadata(copy).storage_data[MetadataIndex(ckpt.META)]
    data = bytearray((copy / where.relative_path).read_bytes())
    found = data.find(b"embedding_dim", where.offset, where.offset + where.length)
    assert found >= 0  # the config is in the description's bytes
    data[found] ^= 0x20
    (copy / where.relative_path).write_bytes(bytes(data))
    result = CliRunner().invoke(
        cli, ["export", str(copy), str(tmp_path / "out"), "--quantize", "int8"]
    )
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {copy}: corrupt checkpoint"), result.output
    assert "embshard" in result.output
    assert not (tmp_path / "out").exists()


def _predict(trained: dict[str, Path], artifact: Path, *extra: str) -> tuple[dict, torch.Tensor]:
    """``embshard predict`` of the eval file: its figures and logits."""
    out = artifact.with_suffix(".logits")
    args = ["predict", str(artifact), str(trained["eval"]), "--json", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--batch-size", "100", *extra])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    return figures, torch.tensor([float(v) for v in out.read_text().split()])


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_sharded_artifact_scores_as_the_one_host_one(trained, precision):
    """Exported for 2 ranks under the config's mixed plan (row-, column-, table-wise),
    scored by 2 processes, against the one-host artifact. fp16: the same logits up to
    the float summation order of row-wise partial sums. int8: a column block's rows are
    quantized on their own (their own scale and bias), so the logits move by that
    rounding, and the AUC by less than 1e-3."""
    one_host, sharded = trained["tmp"] / f"one-{precision}", trained["tmp"] / f"two-{precision}"
    assert _export(trained, one_host, precision).exit_code == 0
    args = ["export", str(trained["ckpt"]), str(sharded), "--quantize", precision]
    result = CliRunner().invoke(cli, [*args, "--world-size", "2"])
    assert result.exit_code == 0, result.output
    assert f"tables {precision} over 2 ranks" in result.output
    manifest = json.loads((sharded / "serving.json").read_text())
    assert manifest["sharded"]["world_size"] == 2
    one, one_logits = _predict(trained, one_host)
    two, two_logits = _predict(trained, sharded, "--nproc", "2")
    assert two["samples"] == one["samples"] == 700
    if precision == "fp16":
        torch.testing.assert_close(two_logits, one_logits, rtol=1e-5, atol=1e-5)
    else:
        assert 0 < (two_logits - one_logits).abs().max() < 0.05
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-3)
    wrong = CliRunner().invoke(cli, ["predict", str(sharded), "synthetic", "--nproc", "3"])
    assert wrong.exit_code == 1
    assert "sharded over 2 ranks: --nproc must be 2" in wrong.output


def _served_from_checkpoint(config_path: str, root: str, eval_path: str) -> list:
    """This rank's first eval batches and their logits from the model sharded over this
    world (table- and row-wise), its weights from the 2-rank checkpoint, int8."""
    config = load_config(config_path, check_files=False)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    plan = ShardingPlan(
        {
            t.name: table_wise(i % world) if i % 2 else row_wise()
            for i, t in enumerate(config.tables)
        }
    )
    served = shard_quantized(build_model(config), plan, "int8", checkpoint_path=root)
    data = CriteoData(eval_path, None, config.tables, 50, rank, world, epochs=1)
    batches = list(data.epoch_batches())[:3]  # every rank has 3: the forward is collective
    return [(b.dense, b.sparse, served(b.dense, b.sparse).reshape(-1)) for b in batches]


def test_a_model_served_over_3_ranks_from_a_2_rank_checkpoint_equals_torchrec(world, trained):
    """The checkpoint layer reshards the 2-rank checkpoint (mixed plan) onto 3 ranks
    (table- and row-wise: rows quantized as the whole table's), then each rank's tables
    are quantized: every rank's logits are those of TorchRec's DLRM with its quantized
    collection, up to the float summation order of row-wise partial sums."""
    paths = (str(trained[k]) for k in ("config", "ckpt", "eval"))
    results = world(3).run(_served_from_checkpoint, *paths)
    oracle = _torchrec_serving_model(trained, "int8")
    for batches in results:
        assert len(batches) == 3
        for dense, sparse, logits in batches:
            with torch.no_grad():
                want = oracle(dense, sparse).reshape(-1)
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
