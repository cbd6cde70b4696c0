"""The oracle for the sharded forward, backward and fused optimizers.

Every rank builds the same unsharded TorchRec EmbeddingBagCollection (or, for a
``sequence`` case, EmbeddingCollection) and the same
batches for all ranks, so it can run the oracle on the global batch (the ranks'
local batches concatenated) next to its own sharded step, and compare. The tests
use it, and so does ``embshard simulate --check``, whose ranks are threads of one
process: so nothing here draws from torch's global random generator.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.embedding_configs import DataType, PoolingType

from embshard.modules.mesh import ShardingMesh, sharding_mesh, world_mesh
from embshard.modules.shard import shard
from embshard.plan.specs import ShardingPlan
from embshard.storage.lookup import TrainingTBE
from embshard.storage.optimizers import SGD, Adagrad, Adam, Lamb
from embshard.storage.shards import gather_table


@dataclass(frozen=True)
class Table:
    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    mean: bool = False
    data_type: DataType = DataType.FP32

    def config(self, sequence: bool = False) -> EmbeddingBagConfig | EmbeddingConfig:
        """The table's TorchRec config: an EmbeddingCollection's for ``sequence``."""
        if sequence:
            return EmbeddingConfig(
                name=self.name,
                num_embeddings=self.rows,
                embedding_dim=self.dim,
                feature_names=list(self.features),
                data_type=self.data_type,
            )
        return EmbeddingBagConfig(
            name=self.name,
            num_embeddings=self.rows,
            embedding_dim=self.dim,
            feature_names=list(self.features),
            pooling=PoolingType.MEAN if self.mean else PoolingType.SUM,
            data_type=self.data_type,
        )


@dataclass(frozen=True)
class Case:
    tables: tuple[Table, ...]
    plan: ShardingPlan
    batch_sizes: tuple[int, ...]
    optimizer: object = field(default_factory=lambda: SGD(lr=0.1))
    weighted: bool = False
    steps: int = 3
    seed: int = 0
    max_pooling: int = 4
    comm_precision: str | None = None
    sequence: bool = False  # an EmbeddingCollection: one row per id, no pooling
    device: str | None = None  # the shards' device type; None: the default group's
    # Sharding groups of this many ranks (a 2-D mesh, the copies synced each step); the
    # oracle stays the global batch's, which only SGD's averaged step equals.
    group_size: int | None = None
    lookup: TrainingTBE = TrainingTBE()  # where the TBE keeps its tables


def features_of(tables) -> list[str]:
    names: list[str] = []
    for t in tables:
        names += [f for f in t.features if f not in names]
    return names


def feature_rows(tables) -> dict[str, int]:
    return {f: min(t.rows for t in tables if f in t.features) for f in features_of(tables)}


def local_batches(case: Case, step: int) -> list[KeyedJaggedTensor]:
    """Every rank's batch at ``step``: random bags, some empty, ids within range."""
    generator = torch.Generator().manual_seed(case.seed * 1000 + step)
    names, rows = features_of(case.tables), feature_rows(case.tables)
    batches = []
    for batch_size in case.batch_sizes:
        lengths, values, weights = [], [], []
        for name in names:
            bag = torch.randint(0, case.max_pooling + 1, (batch_size,), generator=generator)
            ids = torch.randint(0, rows[name], (int(bag.sum()),), generator=generator)
            lengths.append(bag)
            values.append(ids)
            weights.append(torch.rand(len(ids), generator=generator))
        batches.append(
            KeyedJaggedTensor(
                keys=names,
                values=torch.cat(values),
                lengths=torch.cat(lengths),
                weights=torch.cat(weights) if case.weighted else None,
            )
        )
    return batches


def global_batch(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The ranks' batches concatenated, feature by feature."""
    keys = batches[0].keys()
    lengths, values, weights = [], [], []
    for b in batches:
        per_feature = b.lengths().view(len(keys), -1)
        counts = per_feature.sum(1).tolist()
        lengths.append(per_feature)
        values.append(b.values().split(counts))
        if b.weights_or_none() is not None:
            weights.append(b.weights().split(counts))
    return KeyedJaggedTensor(
        keys=keys,
        lengths=torch.cat(lengths, dim=1).reshape(-1),
        values=torch.cat([v[f] for f in range(len(keys)) for v in values]),
        weights=torch.cat([w[f] for f in range(len(keys)) for w in weights]) if weights else None,
    )


def upstream(case: Case, step: int, rows: int, cols: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.seed * 7919 + step * 31 + rank)
    return torch.randn(rows, cols, generator=generator)


def tables_of(module: nn.Module) -> nn.ModuleDict:
    """The unsharded module's tables: an EmbeddingBagCollection's or EmbeddingCollection's."""
    if isinstance(module, EmbeddingCollection):
        return module.embeddings
    return module.embedding_bags


def oracle_step(ebc, case: Case, table_blocks, states) -> None:
    """The fused optimizers' update on the unsharded module's gradients. ``states`` holds
    their state by table from step to step (Adam's and LAMB's: the two moments and the
    steps taken, this one included, which their bias correction reads)."""
    opt = case.optimizer
    with torch.no_grad():
        for name, bag in tables_of(ebc).items():
            weight, grad = bag.weight, bag.weight.grad
            bag.weight.grad = None
            if isinstance(opt, SGD):
                weight -= opt.lr * grad
                continue
            touched = grad.abs().sum(1) > 0
            if isinstance(opt, Adam | Lamb):
                # Moments of the touched rows only: the others neither decay nor move.
                zeros = torch.zeros_like(weight)
                m1, m2, steps = states.get(name, (zeros, zeros, 0))
                m1 = torch.where(touched[:, None], opt.beta1 * m1 + (1 - opt.beta1) * grad, m1)
                m2 = torch.where(touched[:, None], opt.beta2 * m2 + (1 - opt.beta2) * grad**2, m2)
                steps += 1
                states[name] = m1, m2, steps
                m1_hat, m2_hat = m1 / (1 - opt.beta1**steps), m2 / (1 - opt.beta2**steps)
                step = m1_hat / (m2_hat.sqrt() + opt.eps) + opt.weight_decay * weight
                if isinstance(opt, Lamb):  # the trust ratio, per row of each column block
                    for start, width in table_blocks[name]:
                        cols = slice(start, start + width)
                        trust = weight[:, cols].norm(dim=1) / step[:, cols].norm(dim=1)
                        step[:, cols] *= trust[:, None]
                weight -= torch.where(touched[:, None], opt.lr * step, 0)
                continue
            if isinstance(opt, Adagrad):
                states[name] = states.get(name, torch.zeros_like(weight)) + grad.pow(2)
                step = opt.lr * grad / (states[name].sqrt() + opt.eps)
                weight -= torch.where(touched[:, None], step, 0)
                continue
            # Row-wise Adagrad keeps one accumulator per row of each column block.
            for start, width in table_blocks[name]:
                key = (name, start)
                g = grad[:, start : start + width]
                states[key] = states.get(key, torch.zeros(len(g))) + torch.where(
                    touched, g.pow(2).mean(1), 0
                )
                step = opt.lr * g / (states[key].sqrt() + opt.eps)[:, None]
                weight[:, start : start + width] -= torch.where(touched[:, None], step, 0)


def case_mesh(case: Case) -> ShardingMesh:
    """The whole world, or sharding groups of ``case.group_size``."""
    if case.group_size is None:
        return ShardingMesh.of(world_mesh(case.device))
    return ShardingMesh.of(sharding_mesh(case.group_size, case.device))


def column_blocks(case: Case) -> dict[str, list[tuple[int, int]]]:
    """Each table's column blocks (start, width) under the case's plan: row-wise
    Adagrad keeps an accumulator per row of each (one block unless column-wise or grid)."""
    world = case.group_size or len(case.batch_sizes)
    tables = case.plan.resolve([t.config(case.sequence) for t in case.tables], world)
    return {name: sorted({(s.col_offset, s.cols) for s in t.shards}) for name, t in tables.items()}


def unsharded(case: Case) -> EmbeddingBagCollection | EmbeddingCollection:
    """The oracle module, with TorchRec's initial distribution (uniform within
    1/sqrt(rows)) drawn from the case's own generator: the same weights on every
    rank, threads included."""
    generator = torch.Generator().manual_seed(case.seed)
    configs = [t.config(case.sequence) for t in case.tables]
    if case.sequence:
        module = EmbeddingCollection(tables=configs, device="meta")
    else:
        module = EmbeddingBagCollection(tables=configs, is_weighted=case.weighted, device="meta")
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        for t in case.tables:
            bound = t.rows**-0.5
            tables_of(module)[t.name].weight.uniform_(-bound, bound, generator=generator)
    return module


def float32_twin(
    module: EmbeddingBagCollection | EmbeddingCollection,
) -> EmbeddingBagCollection | EmbeddingCollection:
    """``module`` itself, or for FP16 tables a float32 module holding the same values:
    the oracle then sums and updates in float32, as FBGEMM does."""
    sequence = isinstance(module, EmbeddingCollection)
    configs = module.embedding_configs() if sequence else module.embedding_bag_configs()
    if all(c.data_type == DataType.FP32 for c in configs):
        return module
    configs = [dataclasses.replace(c, data_type=DataType.FP32) for c in configs]
    if sequence:
        twin = EmbeddingCollection(tables=configs)
    else:
        twin = EmbeddingBagCollection(tables=configs, is_weighted=module.is_weighted())
    with torch.no_grad():
        for name, table in tables_of(twin).items():
            table.weight.copy_(tables_of(module)[name].weight)
    return twin


def round_to_storage(oracle, module: EmbeddingBagCollection | EmbeddingCollection) -> None:
    """The oracle's updated weights rounded to nearest in ``module``'s dtypes."""
    with torch.no_grad():
        for name, table in tables_of(oracle).items():
            dtype = tables_of(module)[name].weight.dtype
            if dtype != table.weight.dtype:
                table.weight.copy_(table.weight.to(dtype))


def run_case(case: Case) -> dict[str, float]:
    """Train ``case`` sharded and with the oracle; the largest differences seen, and the
    largest oracle output, weight and weight update (to make them relative)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == len(case.batch_sizes)
    module = unsharded(case)
    mesh = case_mesh(case)
    sharded = shard(
        copy.deepcopy(module),
        case.plan,
        mesh=mesh.mesh,
        optimizer=case.optimizer,
        comm_precision=case.comm_precision,
        lookup=case.lookup,
    )
    oracle = float32_twin(module)
    initial = {n: b.weight.detach().clone() for n, b in oracle.embedding_bags.items()}
    offsets = [sum(case.batch_sizes[:r]) for r in range(world + 1)]
    blocks, states = column_blocks(case), {}
    worst = {"forward": 0.0, "weights": 0.0, "output": 0.0}
    for step in range(case.steps):
        batches = local_batches(case, step)
        out = sharded(batches[rank].to(mesh.device))
        if not sum(case.batch_sizes):
            # TorchRec's own module cannot take an empty global batch; nothing to learn.
            assert out.values().shape == (0, sum(out.length_per_key()))
            out.values().sum().backward()
            continue
        expected = oracle(global_batch(batches))
        assert out.keys() == expected.keys()
        assert out.length_per_key() == expected.length_per_key()
        mine = expected.values()[offsets[rank] : offsets[rank + 1]]
        assert out.values().shape == mine.shape
        worst["forward"] = max(worst["forward"], max_diff(out.values(), mine))
        worst["output"] = max(worst["output"], max_abs(mine))
        cols = mine.shape[1]
        grad = upstream(case, step, len(mine), cols, rank).to(mesh.device)
        (out.values() * grad).sum().backward()
        sharded.sync_replicas()
        loss = sum(
            (
                expected.values()[offsets[r] : offsets[r + 1]] * upstream(case, step, b, cols, r)
            ).sum()
            for r, b in enumerate(case.batch_sizes)
        )
        (loss / world).backward()
        oracle_step(oracle, case, blocks, states)
        round_to_storage(oracle, module)
    worst["weights"] = weight_gap(sharded, oracle)
    final = {n: b.weight.detach() for n, b in oracle.embedding_bags.items()}
    worst["weight"] = max(max_abs(w) for w in final.values())
    worst["update"] = max(max_diff(final[n], initial[n]) for n in final)
    return worst


def run_sequence_case(case: Case) -> dict[str, float]:
    """``run_case`` for an EmbeddingCollection (``case.sequence``): every id's row
    compared, and the weights after the fused updates."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert case.sequence and world == len(case.batch_sizes)
    module = unsharded(case)
    mesh = case_mesh(case)
    sharded = shard(copy.deepcopy(module), case.plan, mesh=mesh.mesh, optimizer=case.optimizer)
    oracle = float32_twin(module)
    initial = {n: t.weight.detach().clone() for n, t in tables_of(oracle).items()}
    blocks, states = column_blocks(case), {}
    worst = {"forward": 0.0, "weights": 0.0, "output": 0.0}
    for step in range(case.steps):
        batches = local_batches(case, step)
        out = sharded(batches[rank].to(mesh.device))
        expected = oracle(global_batch(batches))
        assert list(out) == list(expected)
        loss, mine = [], torch.zeros((), device=mesh.device)
        for f, (name, jt) in enumerate(expected.items()):
            # Rank r's ids of a feature follow those of the ranks before it.
            ids = [int(n.sum()) for n in jt.lengths().split(list(case.batch_sizes))]
            for r, part in enumerate(jt.values().split(ids)):
                grad = upstream(case, step * len(expected) + f, len(part), part.shape[1], r)
                loss.append((part * grad).sum())
                if r == rank:
                    assert out[name].values().shape == part.shape
                    lengths = out[name].lengths().cpu()
                    assert torch.equal(lengths, jt.lengths().split(case.batch_sizes)[r])
                    worst["forward"] = max(worst["forward"], max_diff(out[name].values(), part))
                    worst["output"] = max(worst["output"], max_abs(part))
                    mine = mine + (out[name].values() * grad.to(mesh.device)).sum()
        mine.backward()  # collective: every rank's sum holds its (maybe empty) outputs
        sharded.sync_replicas()
        (sum(loss) / world).backward()
        oracle_step(oracle, case, blocks, states)
        round_to_storage(oracle, module)
    worst["weights"] = weight_gap(sharded, oracle)
    final = {n: t.weight.detach() for n, t in tables_of(oracle).items()}
    worst["weight"] = max(max_abs(w) for w in final.values())
    worst["update"] = max(max_diff(final[n], initial[n]) for n in final)
    return worst


def weight_gap(sharded, oracle) -> float:
    """The largest difference between any sharded table, gathered, and the oracle's."""
    return max(
        max_diff(gather_table(weight), tables_of(oracle)[name].weight)
        for name, weight in sharded.weights.items()
    )


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise difference, compared on the CPU (either may be on CUDA)."""
    return float((a.detach().cpu() - b.detach().cpu()).abs().max()) if a.numel() else 0.0


def max_abs(t: torch.Tensor) -> float:
    return max_diff(t, torch.zeros_like(t))
