"""Sharded serving against TorchRec's own quantized collections, one host, unsharded.

The oracle is ``torchrec.quant``'s ``from_float`` of the float tables; a column-wise
table's blocks are quantized on their own (each row of a block gets its own scale and
bias, as TorchRec's sharded quantized column-wise tables do), so its oracle is TorchRec's
quantized collection of each column slice, the slices' outputs side by side.

Outputs are compared within ``RTOL``/``ATOL``, not bit for bit: a row-wise table's bag
is summed in parts on its rows' ranks and the parts summed on arrival (another float
summation order), and a mean-pooled bag is divided by its length where FBGEMM's MEAN
multiplies by the reciprocal. The quantized rows are the same: the tests also show that
quantizing a column-wise table whole instead would miss by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.ao import quantization as quant
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchRecQuantEBC
from torchrec.quant.embedding_modules import EmbeddingCollection as TorchRecQuantEC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard import ShardingPlan, column_wise, data_parallel, grid, row_wise, table_wise
from embshard.errors import InputError
from embshard.serving.sharded import shard_quantized

TORCH_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.half}
PRECISIONS = list(TORCH_DTYPES)
RTOL, ATOL = 1e-5, 1e-6
# (name, rows, dim, features, mean pooled); EmbeddingCollection tables share dim 8.
BAG_TABLES = (
    ("a", 40, 8, ("fa",), False),
    ("b", 30, 16, ("fb1", "fb2"), True),
    ("c", 25, 8, ("fc",), False),
    ("d", 20, 16, ("fd",), False),
)
SEQUENCE_TABLES = tuple((n, rows, 8, f, False) for n, rows, _, f, _ in BAG_TABLES)
PLANS = ("table_wise", "row_wise", "column_wise", "mixed", "copies")


def widths(plan: str, dim: int, table: int) -> list[int]:
    """The column blocks ``plans`` gives table number ``table`` of width ``dim``."""
    if plan == "column_wise":
        return [4, dim - 4]
    if plan == "mixed" and table >= 2:  # c column-wise, d a grid of two blocks
        return [dim // 2, dim // 2]
    return [dim]


def plans(name: str, world: int, tables: tuple) -> ShardingPlan:
    last, everyone = world - 1, list(range(world))
    dims = {t[0]: t[2] for t in tables}
    sequence = tables == SEQUENCE_TABLES
    by_plan = {
        "table_wise": {n: table_wise(i % world) for i, n in enumerate(dims)},
        "row_wise": {n: row_wise() for n in dims},
        "column_wise": {
            n: column_wise([i % world, (i + 1) % world], widths("column_wise", dims[n], i))
            for i, n in enumerate(dims)
        },
        "mixed": {
            "a": table_wise(last),
            "b": row_wise(ranks=everyone[::-1]),  # row blocks out of rank order
            "c": column_wise([0, last]),
            "d": grid(2, [everyone, [last]]),
        },
        # Copies on every rank (data-parallel, hot rows) beside shards.
        "copies": {
            "a": data_parallel(),
            "b": row_wise() if sequence else row_wise(hot_rows=4),  # hot rows: bags only
            "c": row_wise(),
            "d": table_wise(last),
        },
    }
    return ShardingPlan(by_plan[name])


def float_module(tables: tuple, sequence: bool, weighted: bool = False) -> torch.nn.Module:
    """Seeded float tables, the same on every rank."""
    torch.manual_seed(0)
    if sequence:
        configs = [
            EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=list(f))
            for n, r, d, f, _ in tables
        ]
        module = EmbeddingCollection(tables=configs)
    else:
        configs = [
            EmbeddingBagConfig(
                name=n,
                num_embeddings=r,
                embedding_dim=d,
                feature_names=list(f),
                pooling=PoolingType.MEAN if mean else PoolingType.SUM,
            )
            for n, r, d, f, mean in tables
        ]
        module = EmbeddingBagCollection(tables=configs, is_weighted=weighted)
    for p in module.parameters():
        torch.nn.init.normal_(p.data)
    return module


def local_batch(tables: tuple, rank: int, weighted: bool = False) -> KeyedJaggedTensor:
    """Rank ``rank``'s batch: ranks' batch sizes differ (rank 1's is empty)."""
    size = [5, 0, 3, 6][rank]
    g = torch.Generator().manual_seed(100 + rank)
    keys, lengths, values = [], [], []
    for _, rows, _, features, _ in tables:
        for f in features:
            bags = torch.randint(0, 5, (size,), generator=g)
            keys.append(f)
            lengths.append(bags)
            values.append(torch.randint(0, rows, (int(bags.sum()),), generator=g))
    values = torch.cat(values)
    weights = torch.rand(len(values), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.cat(lengths), weights=weights)


def torchrec_quantized(module: torch.nn.Module, precision: str) -> torch.nn.Module:
    module.qconfig = quant.QConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
        weight=quant.PlaceholderObserver.with_args(dtype=TORCH_DTYPES[precision]),
    )
    kind = TorchRecQuantEC if isinstance(module, EmbeddingCollection) else TorchRecQuantEBC
    return kind.from_float(module)


def oracle(
    module: torch.nn.Module, blocks: dict[str, list[int]], precision: str, batch: KeyedJaggedTensor
) -> dict[str, torch.Tensor]:
    """Each feature's output (pooled bags, or rows of ids) from TorchRec's quantized
    collection of each table's column blocks, side by side."""
    sequence = isinstance(module, EmbeddingCollection)
    configs = module.embedding_configs() if sequence else module.embedding_bag_configs()
    tables = module.embeddings if sequence else module.embedding_bags
    out = {}
    for config in configs:
        features = KeyedJaggedTensor.from_jt_dict({f: batch[f] for f in config.feature_names})
        parts, start = [], 0
        for width in blocks[config.name]:
            block = dataclasses.replace(config, embedding_dim=width)
            if sequence:
                one = EmbeddingCollection([block])
            else:
                one = EmbeddingBagCollection([block], is_weighted=module.is_weighted())
            weight = tables[config.name].weight.detach()[:, start : start + width]
            (one.embeddings if sequence else one.embedding_bags)[config.name].weight.data.copy_(
                weight
            )
            got = torchrec_quantized(one, precision)(features)
            parts.append(
                {f: (got[f].values() if sequence else got[f]) for f in config.feature_names}
            )
            start += width
        for f in config.feature_names:
            out[f] = torch.cat([p[f] for p in parts], dim=1)
    return out


def outputs(result, sequence: bool) -> dict[str, torch.Tensor]:
    if sequence:
        return {f: jt.values() for f, jt in result.items()}
    return result.to_dict()


def serve_case(plan: str, precision: str, sequence: bool, weighted: bool = False) -> dict:
    """One rank: the served collection's output for its batch against the oracle's.
    ``weighted``: SUM-pooled features with a weight per id."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tables = SEQUENCE_TABLES if sequence else BAG_TABLES
    if weighted:
        tables = tuple((*t[:4], False) for t in tables)
    module = float_module(tables, sequence, weighted)
    served = shard_quantized(module, plans(plan, world, tables), precision)
    batch = local_batch(tables, rank, weighted)
    got = outputs(served(batch), sequence)
    blocks = {t[0]: widths(plan, t[2], i) for i, t in enumerate(tables)}
    want = oracle(module, blocks, precision, batch)
    whole = oracle(module, {t[0]: [t[2]] for t in tables}, precision, batch)
    assert set(got) == set(want)
    worst = max(((got[f] - want[f]).abs().max().item() if got[f].numel() else 0.0) for f in got)
    for f in got:
        torch.testing.assert_close(got[f], want[f], rtol=RTOL, atol=ATOL, msg=f"feature {f}")
        assert got[f].grad_fn is None and not got[f].requires_grad
    sharded = served.sharded
    return {
        "worst": worst,
        "off_if_whole": max(
            ((want[f] - whole[f]).abs().max().item() if want[f].numel() else 0.0) for f in got
        ),
        "optimizer_state": len(sharded.optimizer_state()),
        "float_tables": len(sharded.weights),
        "bytes": served.table_bytes(),
        "buffers": sum(b.numel() * b.element_size() for b in served.buffers()),
        "params": sum(1 for _ in served.parameters()),
        "lookups": len(served.lookups),
    }


@pytest.mark.parametrize("sequence", [False, True], ids=["ebc", "ec"])
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_outputs_equal_torchrec_quantized(world, world_size, plan, sequence):
    for precision in PRECISIONS:
        results = world(world_size).run(serve_case, plan, precision, sequence)
        for r in results:
            assert r["optimizer_state"] == r["float_tables"] == r["params"] == 0, r
            assert r["buffers"] >= r["bytes"]
        assert sum(r["bytes"] for r in results) > 0
        if plan == "copies":  # every rank looks its copies up in a quantized lookup too
            assert all(r["lookups"] == 2 for r in results), results
        if precision != "fp16" and plan == "column_wise":
            # Quantizing each block on its own is what makes these equal.
            assert max(r["off_if_whole"] for r in results) > 100 * ATOL


@pytest.mark.parametrize("plan", ["mixed", "copies"])
def test_weighted_features(world, plan):
    for precision in PRECISIONS:
        world(2).run(serve_case, plan, precision, False, True)


def test_four_ranks_mixed_int4(world):
    for sequence in (False, True):
        world(4).run(serve_case, "mixed", "int4", sequence)


def bad_id(sequence: bool) -> str:
    tables = SEQUENCE_TABLES if sequence else BAG_TABLES
    module = float_module(tables, sequence)
    served = shard_quantized(module, plans("mixed", dist.get_world_size(), tables), "int8")
    batch = local_batch(tables, dist.get_rank())
    if dist.get_rank() == 0:
        values = batch.values().clone()
        values[0] = 1000
        batch = KeyedJaggedTensor(keys=batch.keys(), values=values, lengths=batch.lengths())
    with pytest.raises(InputError) as caught:
        served(batch)
    return str(caught.value)


@pytest.mark.parametrize("sequence", [False, True], ids=["ebc", "ec"])
def test_an_id_out_of_range_is_named_on_every_rank(world, sequence):
    errors = world(2).run(bad_id, sequence)
    assert errors[0] == errors[1]
    assert "rank 0: feature 'fa' (table 'a'): id 1000 is outside [0, 40)" in errors[0]
