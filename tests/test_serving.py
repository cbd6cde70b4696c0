"""Serving: quantized tables against TorchRec's quantized EmbeddingBagCollection
(``torchrec.quant``'s ``from_float``) on the same float weights, the exported model in a
process that does not import embshard, and the commands."""

from __future__ import annotations

import pytest
import torch
from torch.ao import quantization as quant
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchRecQuantEBC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.errors import ConfigError, InputError
from embshard.serving.collection import QuantizedEmbeddingBagCollection
from embshard.serving.precision import Precision

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


def torchrec_quantized(ebc: EmbeddingBagCollection, precision: str) -> TorchRecQuantEBC:
    """The oracle: TorchRec's own quantized collection of ``ebc``."""
    ebc.qconfig = quant.QConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
        weight=quant.PlaceholderObserver.with_args(dtype=TORCH_DTYPES[precision]),
    )
    return TorchRecQuantEBC.from_float(ebc)


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


def test_unknown_precision():
    with pytest.raises(
        ConfigError,
        match=r"^unknown precision 'int3': FBGEMM's inference TBE serves fp16, int8, int4$",
    ):
        Precision.parse("int3")
