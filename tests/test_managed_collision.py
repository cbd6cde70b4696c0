"""TorchRec's ManagedCollisionEmbeddingBagCollection and ManagedCollisionEmbeddingCollection,
sharded, against a reference made of TorchRec's pieces only: per row block of a table (in
row order) an MCH module made by ``rebuild_with_output_id_range`` for its rows (the
unsharded module itself when one block holds the whole table), fed the global batch's ids
of its input range (every id, repeats too), then the unsharded EmbeddingBagCollection or
EmbeddingCollection. That is what TorchRec's sharded managed-collision collection
computes; at one rank it is TorchRec's unsharded MC-EBC or MC-EC (its managed-collision
collection, then its tables). Rows a module evicts are reset before the lookup (a
constant ``init_fn``, or with TorchRec's default one the row's initial value) with their
optimizer state, as TorchRec's sharded module resets them. Plain SGD, Adagrad and
row-wise Adagrad on autograd's gradients of the global batch's loss over the world size."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import random
from dataclasses import dataclass

import pytest
import torch
from test_forward import gloo_collectives
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor

import embshard
from embshard import (
    SGD,
    Adagrad,
    InputError,
    PlanError,
    RowWiseAdagrad,
    ShardingPlan,
    row_wise,
    table_wise,
)
from embshard.storage.shards import gather_table

TOL = 1e-5
DIM = 4
FEATURES = {"t": ("f1", "f2"), "u": ("g",)}
ROWS = {"t": 10, "u": 6}


def fold(ids: torch.Tensor, size: int) -> torch.Tensor:
    """An input_hash_func: raw ids of any size into ``[0, size)``."""
    return (ids * 7 + 3) % size


@dataclass(frozen=True)
class Case:
    world: int
    plan: dict  # table -> spec
    policy: str  # "lfu", "lru" or "dlfu" (DistanceLFU)
    optimizer: object
    steps: int = 14
    interval: int = 2
    input_size: int = 48
    hashed: bool = False  # input_hash_func=fold, raw ids up to 10**6
    # The configs' init_fn: a constant (else TorchRec's default, uniform: evicted rows
    # get the seeded initialization's values, the initial ones of a module on meta).
    init_fn: bool = False
    meta: bool = False  # shard a module on meta (the seeded initialization)
    evaluate: bool = False  # after each step, the next step's batch in eval mode
    seed: int = 0
    sequence: bool = False  # a ManagedCollisionEmbeddingCollection (a row per id)


POLICIES = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "dlfu": functools.partial(DistanceLFU_EvictionPolicy, decay_exponent=1.5),
}


def configs(case: Case) -> list[EmbeddingBagConfig] | list[EmbeddingConfig]:
    init_fn = functools.partial(nn.init.constant_, val=0.25) if case.init_fn else None
    if case.sequence:
        return [
            EmbeddingConfig(
                name=t,
                embedding_dim=DIM,
                num_embeddings=ROWS[t],
                feature_names=list(FEATURES[t]),
                init_fn=init_fn,
            )
            for t in FEATURES
        ]
    return [
        EmbeddingBagConfig(
            name=t,
            embedding_dim=DIM,
            num_embeddings=ROWS[t],
            feature_names=list(FEATURES[t]),
            init_fn=init_fn,
            pooling=PoolingType.MEAN if t == "u" else PoolingType.SUM,
        )
        for t in FEATURES
    ]


def tables_of(
    case: Case, device: str = "cpu", tables=None
) -> EmbeddingBagCollection | EmbeddingCollection:
    """The unsharded tables (of ``tables``, the case's configs): an EmbeddingCollection
    for a sequence case."""
    kind = EmbeddingCollection if case.sequence else EmbeddingBagCollection
    return kind(tables=tables or configs(case), device=torch.device(device))


def mc_ebc(
    case: Case, device: str = "cpu"
) -> ManagedCollisionEmbeddingBagCollection | ManagedCollisionEmbeddingCollection:
    """The MC-EBC, or for a sequence case the MC-EC, of the case's tables."""
    tables = configs(case)
    ebc = tables_of(case, device, tables)
    policy = POLICIES[case.policy]
    modules = {
        c.name: MCHManagedCollisionModule(
            zch_size=c.num_embeddings,
            device=torch.device("cpu"),
            eviction_policy=policy(),
            eviction_interval=case.interval,
            input_hash_size=case.input_size,
            input_hash_func=fold if case.hashed else None,
        )
        for c in tables
    }
    kind = (
        ManagedCollisionEmbeddingCollection
        if case.sequence
        else ManagedCollisionEmbeddingBagCollection
    )
    return kind(ebc, ManagedCollisionCollection(modules, tables))


def stream(case: Case) -> list[list[tuple[list[list[list[int]]], torch.Tensor]]]:
    """Per step, per rank: every feature's bags of raw ids (skewed: low ids hot) and
    the upstream gradient of its output."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    top = 10**6 if case.hashed else case.input_size
    steps = []
    for _ in range(case.steps + 1):
        ranks = []
        for _ in range(case.world):
            batch = rng.randint(1, 3)
            bags = [
                [
                    [int(top * rng.random() ** 2) for _ in range(rng.randint(0, 3))]
                    for _ in range(batch)
                ]
                for _ in ("f1", "f2", "g")
            ]
            ranks.append((bags, torch.randn(batch, 2 * DIM, generator=gen)))
        steps.append(ranks)
    return steps


def kjt(bags: list[list[list[int]]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["f1", "f2", "g"],
        values=torch.tensor(
            [i for feature in bags for bag in feature for i in bag], dtype=torch.long
        ),
        lengths=torch.tensor([len(bag) for feature in bags for bag in feature], dtype=torch.int32),
    )


def global_kjt(ranks) -> KeyedJaggedTensor:
    """The global batch: every rank's bags of each feature, in rank order."""
    return kjt([[bag for bags, _ in ranks for bag in bags[f]] for f in range(3)])


def blocks(case: Case, table: str) -> list[tuple[int, int]]:
    """The table's row blocks with rows, (first row, rows), in row order."""
    sharded = ShardingPlan(case.plan).resolve(configs(case), case.world)[table]
    return sorted((s.row_offset, s.rows) for s in sharded.shards if s.rows)


def weights_of(tables: EmbeddingBagCollection | EmbeddingCollection) -> dict[str, nn.Parameter]:
    """The unsharded tables' weights, by table."""
    held = tables.embeddings if isinstance(tables, EmbeddingCollection) else tables.embedding_bags
    return {t: m.weight for t, m in held.items()}


def outputs(case: Case, ranks, found, head=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each rank's output of the global batch's (its bags of every feature: pooled, or
    its ids' rows in feature order), and the sum of the ranks' losses: ``head`` of the
    output where given, else of the output and the rank's upstream gradient."""
    outs, loss = [], 0
    if case.sequence:
        rows = {f: found[f].values() for f in ("f1", "f2", "g")}
        at = dict.fromkeys(rows, 0)
        for bags, _ in ranks:
            parts = []
            for f, feature in zip(rows, bags):
                n = sum(map(len, feature))
                parts.append(rows[f][at[f] : at[f] + n])
                at[f] += n
            out = torch.cat(parts)
            outs.append(out.detach().clone())
            loss = loss + (head or sequence_loss)(out)
        return outs, loss
    whole = torch.cat([found["f1"], found["f2"], found["g"]], 1)
    at = 0
    for bags, upstream in ranks:
        out = whole[at : at + len(bags[0])]
        at += len(bags[0])
        outs.append(out.detach().clone())
        if head is not None:
            loss = loss + head(out)
        else:
            loss = loss + (out[:, : 2 * DIM] * upstream).sum() + out[:, 2 * DIM :].sum()
    return outs, loss


def sequence_loss(rows: torch.Tensor) -> torch.Tensor:
    """A rank's loss of its ids' rows: each id's gradient depends on its row."""
    return (rows**2).sum() + rows[:, :2].sum()


class Reference:
    """TorchRec's pieces: per table, an MCH module per row block fed the ids of its
    input range; the unsharded EBC (EC) with evicted rows reset; plain optimizer
    steps."""

    def __init__(self, case: Case, module: ManagedCollisionEmbeddingBagCollection, initial) -> None:
        self.case = case
        self.initial = {t: w.clone() for t, w in initial.items()}
        self.ebc = tables_of(case)
        self.weights = weights_of(self.ebc)
        for t, w in initial.items():
            self.weights[t].data.copy_(w)
        self.state = {t: torch.zeros_like(w) for t, w in initial.items()}
        own = module._managed_collision_collection._managed_collision_modules
        self.own = own
        self.mchs = {}
        self.evicted = 0
        for t in FEATURES:
            cuts = blocks(case, t)
            segments = [start for start, _ in cuts] + [ROWS[t]]
            self.mchs[t] = (
                [own[t]]
                if len(cuts) == 1
                else [own[t].rebuild_with_output_id_range((s, s + n), segments) for s, n in cuts]
            )

    def forward(self, ranks, learn: bool, head=None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every rank's output of this step's global batch; the loss to differentiate
        (``outputs``')."""
        features = global_kjt(ranks)
        values, lengths = features.values().clone(), features.lengths()
        per_feature = features.length_per_key()
        starts = [sum(per_feature[:i]) for i in range(4)]
        for t, names in FEATURES.items():
            first = ["f1", "f2", "g"].index(names[0])
            span = slice(starts[first], starts[first + len(names)])
            whole = {
                t: JaggedTensor(values=values[span], lengths=torch.tensor([span.stop - span.start]))
            }
            ids = self.own[t].preprocess(whole)[t].values()
            width = math.ceil(self.case.input_size / len(self.mchs[t]))
            out = ids.clone()
            for k, mch in enumerate(self.mchs[t]):
                mine = (ids // width).clamp(max=len(self.mchs[t]) - 1) == k
                mch.train(learn)
                jt = {t: JaggedTensor(values=ids[mine], lengths=torch.tensor([int(mine.sum())]))}
                out[mine] = mch.remap(mch.profile(jt))[t].values()
                evicted = mch.evict()
                if evicted is not None:
                    self.reset(t, evicted.long())
            values[span] = out
        remapped = KeyedJaggedTensor(keys=features.keys(), values=values, lengths=lengths)
        return outputs(self.case, ranks, self.ebc(remapped), head)

    def reset(self, table: str, rows: torch.Tensor) -> None:
        self.evicted += len(rows)
        weight = self.weights[table]
        with torch.no_grad():
            if self.case.init_fn:
                weight[rows] = 0.25
            else:
                weight[rows] = self.initial[table][rows]
            self.state[table][rows] = 0

    def step(self, ranks, head=None) -> list[torch.Tensor]:
        outs, loss = self.forward(ranks, learn=True, head=head)
        (loss / len(ranks)).backward()
        opt = self.case.optimizer
        with torch.no_grad():
            for t in FEATURES:
                weight = self.weights[t]
                grad = weight.grad
                if isinstance(opt, SGD):
                    weight -= opt.lr * grad
                else:
                    touched = grad.abs().sum(1, keepdim=True) > 0
                    if isinstance(opt, RowWiseAdagrad):  # one accumulator a row
                        self.state[t] += (grad**2).mean(1, keepdim=True).expand_as(grad)
                    else:
                        self.state[t] += grad**2
                    update = opt.lr * grad / (self.state[t].sqrt() + opt.eps)
                    weight -= torch.where(touched, update, 0)
                weight.grad = None
        return outs


def _output(sharded, bags, upstream) -> tuple[torch.Tensor, torch.Tensor]:
    found, remapped = sharded(kjt(bags))
    assert remapped is None
    if isinstance(found, dict):  # an MC-EC's: a JaggedTensor a feature
        for f, feature in zip(("f1", "f2", "g"), bags):
            assert found[f].lengths().tolist() == [len(bag) for bag in feature]
        out = torch.cat([found[f].values() for f in ("f1", "f2", "g")])
        return out, sequence_loss(out)
    out = torch.cat([found["f1"], found["f2"], found["g"]], 1)
    return out, (out[:, : 2 * DIM] * upstream).sum() + out[:, 2 * DIM :].sum()


def sharded_tables(sharded):
    """The sharded collection inside a sharded MC-EBC or MC-EC."""
    if hasattr(sharded, "embedding_collection"):
        return sharded.embedding_collection
    return sharded.embedding_bag_collection


def _run_case(case: Case) -> dict:
    """On every rank: the sharded MC-EBC and the reference side by side; the largest gaps
    of this rank's outputs and of the tables after the last step."""
    torch.manual_seed(0)
    module = mc_ebc(case, "meta" if case.meta else "cpu")
    rank = torch.distributed.get_rank()
    sharded = embshard.shard(module, ShardingPlan(case.plan), optimizer=case.optimizer)
    if case.meta:
        initial = {t: gather_table(w) for t, w in sharded_tables(sharded).weights.items()}
    else:
        initial = {t: w.detach() for t, w in weights_of(module._embedding_module).items()}
    ref = Reference(case, module, initial)
    out_gap = 0.0
    steps = stream(case)
    for ranks, following in itertools.pairwise(steps):
        bags, upstream = ranks[rank]
        out, loss = _output(sharded, bags, upstream)
        loss.backward()
        expected = ref.step(ranks)[rank]
        out_gap = max(out_gap, (out.detach() - expected).abs().max().item())
        if case.evaluate:
            bags, upstream = following[rank]
            with torch.no_grad():
                out, _ = _output(sharded.eval(), bags, upstream)
                expected = ref.forward(following, learn=False)[0][rank]
            sharded.train()
            out_gap = max(out_gap, (out - expected).abs().max().item())
    # The tables under the unsharded module's keys, not the MCH modules' state.
    tables = {k for k in module.state_dict() if k.startswith("_embedding_module.")}
    assert set(sharded.state_dict()) == tables, sorted(sharded.state_dict())
    weights = sharded_tables(sharded).weights
    table_gap = max(
        (gather_table(weights[t]) - ref.weights[t]).abs().max().item() for t in FEATURES
    )
    return {"out_gap": out_gap, "table_gap": table_gap, "evicted": ref.evicted}


CASES = {
    "w1_table_wise_lfu_sgd_init_fn": Case(
        1, {"t": table_wise(0), "u": table_wise(0)}, "lfu", SGD(lr=0.1), init_fn=True
    ),
    "w1_table_wise_lru_adagrad_seeded_evaluated": Case(
        1,
        {"t": table_wise(0), "u": table_wise(0)},
        "lru",
        Adagrad(lr=0.1),
        meta=True,
        evaluate=True,
    ),
    "w2_row_wise_lfu_sgd_hashed": Case(
        2, {"t": row_wise(), "u": row_wise()}, "lfu", SGD(lr=0.1), hashed=True, meta=True
    ),
    "w2_row_wise_lru_init_fn_evaluated": Case(
        2, {"t": row_wise(), "u": table_wise(1)}, "lru", SGD(lr=0.1), init_fn=True, evaluate=True
    ),
    "w3_row_wise_lru_adagrad_ranks_reordered": Case(
        3,
        {"t": row_wise(ranks=[2, 0, 1]), "u": table_wise(1)},
        "lru",
        Adagrad(lr=0.1),
        interval=3,
        init_fn=True,
    ),
    "w3_row_wise_lfu_rowwise_adagrad_seeded": Case(
        3,
        {"t": row_wise(), "u": row_wise()},
        "lfu",
        RowWiseAdagrad(lr=0.1),
        meta=True,
        input_size=50,
    ),
}

# Uneven row blocks: each block takes an equal input range whatever its rows, as TorchRec's
# sharded collection gives its shards (blocks without rows take none).
CASES |= {
    "w2_uneven_lfu_adagrad_evaluated": Case(
        2,
        {"t": row_wise([3, 7]), "u": row_wise([4, 2])},
        "lfu",
        Adagrad(lr=0.1),
        meta=True,
        evaluate=True,
    ),
    "w3_uneven_lru_sgd_ranks_reordered_hashed": Case(
        3,
        {"t": row_wise([2, 5, 3], ranks=[1, 2, 0]), "u": row_wise([0, 4, 2])},
        "lru",
        SGD(lr=0.1),
        interval=3,
        hashed=True,
        init_fn=True,
    ),
    "w3_uneven_dlfu_rowwise_adagrad_many_steps": Case(
        3,
        {"t": row_wise([6, 1, 3]), "u": row_wise([1, 2, 3])},
        "dlfu",
        RowWiseAdagrad(lr=0.1),
        steps=30,
        meta=True,
        input_size=50,
    ),
}

# DistanceLFU over many steps of evictions: at one rank TorchRec's unsharded module,
# at two per row block.
CASES |= {
    "w1_table_wise_dlfu_adagrad_many_steps_evaluated": Case(
        1,
        {"t": table_wise(0), "u": table_wise(0)},
        "dlfu",
        Adagrad(lr=0.1),
        steps=40,
        meta=True,
        evaluate=True,
    ),
    "w2_row_wise_dlfu_sgd_many_steps_hashed": Case(
        2,
        {"t": row_wise(), "u": row_wise()},
        "dlfu",
        SGD(lr=0.1),
        steps=40,
        interval=3,
        hashed=True,
        init_fn=True,
    ),
}

# The same cases for a ManagedCollisionEmbeddingCollection, and many steps of evictions.
SEQUENCE_CASES = {
    **{name: dataclasses.replace(case, sequence=True) for name, case in CASES.items()},
    "w2_row_wise_lfu_adagrad_many_steps_evaluated": Case(
        2,
        {"t": row_wise(), "u": row_wise()},
        "lfu",
        Adagrad(lr=0.1),
        steps=40,
        meta=True,
        evaluate=True,
        sequence=True,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_mc_ebc_equals_torchrec_pieces(world, name: str) -> None:
    _check_case(world, CASES[name])


@pytest.mark.parametrize("name", list(SEQUENCE_CASES))
def test_sharded_mc_ec_equals_torchrec_pieces(world, name: str) -> None:
    _check_case(world, SEQUENCE_CASES[name])


def _check_case(world, case: Case) -> None:
    results = world(case.world).run(_run_case, case)
    for r in results:
        assert r["out_gap"] < TOL, r
        assert r["table_gap"] < TOL, r
    assert results[0]["evicted"] > 0, "the stream must evict"


def _raises(fn) -> str:
    try:
        fn()
    except (PlanError, ValueError, TypeError, InputError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class _NotMCH(nn.Module):
    def output_size(self) -> int:
        return ROWS["t"]


def _refusals() -> dict[str, str]:
    case = Case(2, {"t": row_wise(), "u": row_wise()}, "lfu", SGD(lr=0.1))
    plan = ShardingPlan(case.plan)

    def with_module(change) -> str:
        module = mc_ebc(case)
        change(module)
        return _raises(lambda: embshard.shard(module, plan))

    def other_kind(module) -> None:
        module._managed_collision_collection._managed_collision_modules["t"] = _NotMCH()

    def trained(module) -> None:
        module._managed_collision_collection._managed_collision_modules[
            "u"
        ]._current_iter_tensor += 3

    def remapped(module) -> None:
        module._return_remapped_features = True

    def bad_plan(specs) -> str:
        return _raises(lambda: embshard.shard(mc_ebc(case), ShardingPlan(specs)))

    sharded = embshard.shard(mc_ebc(case), plan)
    outside = kjt([[[5]], [[case.input_size]], [[1]]])
    sequence = dataclasses.replace(case, sequence=True)
    mc_ec = mc_ebc(sequence)
    mc_ec._return_remapped_features = True
    return {
        "kind": with_module(other_kind),
        "trained": with_module(trained),
        "remapped": with_module(remapped),
        "hot_rows": bad_plan({"t": row_wise(hot_rows=2), "u": row_wise()}),
        "dynamic": _raises(
            lambda: embshard.shard(mc_ebc(case), plan, dynamic={"t": embshard.IdMapSpec(2, 5)})
        ),
        "outside": _raises(lambda: sharded(outside)),
        "mc_ec_remapped": _raises(lambda: embshard.shard(mc_ec, plan)),
        "mc_ec_dynamic": _raises(
            lambda: embshard.shard(mc_ebc(sequence), plan, dynamic={"u": embshard.IdMapSpec(2, 3)})
        ),
    }


def test_refusals_are_one_line_on_every_rank(world) -> None:
    results = world(2).run(_refusals)
    assert results[0] == results[1]
    r = results[0]
    for name, message in r.items():
        assert message != "no error", r
        # A bad batch's InputError names every rank's problem, a line each.
        assert "\n" not in message or name == "outside", r
    assert "PlanError: managed-collision table 't': its module is a _NotMCH" in r["kind"]
    assert "table 'u': its module has trained already" in r["trained"]
    assert "return_remapped_features=True is not supported" in r["remapped"]
    assert "its row_wise layout is refused" in r["hot_rows"]
    assert r["dynamic"].startswith("PlanError: dynamic tables ['t']")
    assert r["outside"].startswith("InputError")
    assert "rank 1: feature 'f2' (table 't'): id 48 is outside [0, 48)" in r["outside"]
    assert (
        "ValueError: return_remapped_features=True is not supported: the sharded "
        "ManagedCollisionEmbeddingCollection returns (embeddings, None)"
    ) in r["mc_ec_remapped"]
    assert ("PlanError: dynamic tables ['u']: a ManagedCollisionEmbeddingCollection's tables") in r[
        "mc_ec_dynamic"
    ]


class _Model(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.sparse = mc_ebc(case, "meta")
        self.dense = nn.Linear(DIM if case.sequence else 3 * DIM, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        found, _ = self.sparse(features)
        if isinstance(found, dict):  # an MC-EC's rows, a JaggedTensor a feature
            return self.dense(torch.cat([found[f].values() for f in found])).sum()
        return self.dense(torch.cat([found["f1"], found["f2"], found["g"]], 1)).sum()


def _through_shard_model(sequence: bool) -> dict:
    """A model holding an MC-EBC (MC-EC) through ``shard_model``, against the reference
    of TorchRec's pieces with the model's dense layer on top: each rank's loss (its
    relative gap), and the tables and the dense layer after the last step."""
    case = Case(
        2,
        {"t": row_wise(), "u": table_wise(0)},
        "lru",
        SGD(lr=0.1),
        hashed=True,
        sequence=sequence,
    )
    torch.manual_seed(0)
    unsharded = _Model(case)
    head, module = copy.deepcopy(unsharded.dense), unsharded.sparse
    model = embshard.shard_model(
        unsharded,
        ShardingPlan(case.plan),
        optimizer=case.optimizer,
        # An MC-EC's rows travel in fp32 whatever the pooled all-to-all's precision.
        comm_precision="fp16" if sequence else None,
    )
    dense = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = torch.distributed.get_rank()
    sparse = model.module.sparse
    initial = {t: gather_table(w) for t, w in sharded_tables(sparse).weights.items()}
    ref = Reference(case, module, initial)
    ref_dense = torch.optim.SGD(head.parameters(), lr=0.1)
    loss_gap = 0.0
    for step, ranks in enumerate(stream(case)):
        batch = kjt(ranks[rank][0])
        if step % 2:  # a pipeline's prefetch: the forward takes it up (ids hashed once)
            embshard.prefetch(model, batch)
        loss = model(batch)
        assert not sharded_tables(sparse).is_prefetched(batch)
        loss.backward()
        dense.step()
        dense.zero_grad()
        expected = head(ref.step(ranks, head=lambda out: head(out).sum())[rank]).sum()
        ref_dense.step()
        ref_dense.zero_grad()
        loss_gap = max(loss_gap, abs(loss.item() - expected.item()) / max(1, abs(expected.item())))
    weights = sharded_tables(sparse).weights
    return {
        "kind": type(sparse).__name__,
        "tables": sorted(sparse.managed_collision_modules()),
        "loss_gap": loss_gap,
        "table_gap": max(
            (gather_table(weights[t]) - ref.weights[t]).abs().max().item() for t in FEATURES
        ),
        "dense_gap": (model.module.dense.weight - head.weight).abs().max().item(),
        "evicted": ref.evicted,
    }


@pytest.mark.parametrize("sequence", [False, True])
def test_shard_model_trains_a_model_with_an_mc_ebc_or_mc_ec(world, sequence: bool) -> None:
    results = world(2).run(_through_shard_model, sequence)
    expected = (
        "ManagedCollisionEmbeddingCollection"
        if sequence
        else ("ManagedCollisionEmbeddingBagCollection")
    )
    assert [r["kind"] for r in results] == [f"Sharded{expected}"] * 2
    assert [r["tables"] for r in results] == [["t", "u"], ["t"]]
    for r in results:
        assert r["loss_gap"] < TOL and r["table_gap"] < TOL and r["dense_gap"] < TOL, r
    assert results[0]["evicted"] > 0, "the stream must evict"


def _collectives(sequence: bool) -> list[int]:
    """Backend collectives (gloo's profiler events) of each forward plus backward."""
    case = Case(
        2,
        {"t": row_wise(), "u": table_wise(1)},
        "lfu",
        SGD(lr=0.1),
        hashed=True,
        sequence=sequence,
    )
    torch.manual_seed(0)
    sharded = embshard.shard(mc_ebc(case), ShardingPlan(case.plan))
    rank = torch.distributed.get_rank()
    return [  # evicting every second step
        gloo_collectives(lambda ranks=ranks: _output(sharded, *ranks[rank])[1].backward())
        for ranks in stream(case)[:6]
    ]


@pytest.mark.parametrize("sequence", [False, True])
def test_a_step_keeps_the_collections_collectives(world, sequence: bool) -> None:
    # The counts exchange, the ids and pooled (rows') all-to-alls, the gradient's.
    for counts in world(2).run(_collectives, sequence):
        assert counts == [4] * 6
