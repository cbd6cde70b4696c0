"""Dynamic tables, sharded, against a plain reference model written here: the id map's
reference of test_id_map (Python slots per bucket, the same policies and ties), rows
kept in a dict by row, initialized by the documented formula, and plain SGD / Adagrad /
row-wise Adagrad on autograd's gradients of the global batch's loss over the world
size (the sharded backward averages over ranks, as DDP does)."""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_forward import gloo_collectives
from test_id_map import Reference, ref_bucket, ref_initial, ref_key
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import embshard
from embshard import (
    SGD,
    Adagrad,
    IdMapSpec,
    InputError,
    PlanError,
    RowWiseAdagrad,
    ShardingPlan,
    column_wise,
    data_parallel,
    grid,
    row_wise,
    table_wise,
)
from embshard.modules.mesh import sharding_mesh, world_mesh
from embshard.storage.shards import gather_table

TOL = 1e-5
DIM = 8
DYN_FEATURES = ("f_d1", "f_d2")  # both look up the dynamic table "d"
STATIC_ROWS = 10
EXTREMES = [0, 1, 2**63 - 1, 2**63 - 2, 2**62]


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    plan: dict  # table -> spec
    spec: IdMapSpec
    optimizer: object
    steps: int = 12
    pool: int = 40  # distinct raw ids the stream draws from
    seed: int = 0
    weighted: bool = False  # every id weighted by ``weight(id)``
    mean: bool = False  # the dynamic table pools by MEAN
    evaluate: bool = False  # after each step, the next step's batch in eval mode
    # Sharding groups of this many ranks (a 2-D mesh), the copies averaged every step:
    # with SGD that is the reference's step on the global batch.
    group: int | None = None
    device: str = "cpu"  # "cuda": the shards on the GPU, the reference on the CPU

    @property
    def rows(self) -> int:
        return self.spec.buckets * self.spec.rows_per_bucket


def weight(i: int) -> float:
    """An id's weight in weighted cases: ids differ, so a weight off its id shows."""
    return 0.25 + (i % 13) / 8


def configs(rows: int, mean: bool = False) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="d",
            embedding_dim=DIM,
            num_embeddings=rows,
            feature_names=list(DYN_FEATURES),
            pooling=PoolingType.MEAN if mean else PoolingType.SUM,
        ),
        EmbeddingBagConfig(
            name="s", embedding_dim=DIM, num_embeddings=STATIC_ROWS, feature_names=["f_s"]
        ),
    ]


def stream(case: Case) -> list[list[tuple[list[list[int]], list[list[int]], torch.Tensor]]]:
    """Per step, per rank: each feature's bags (lists of ids) and the upstream gradient
    of the rank's output, drawn from ``case.seed``: the same on every rank."""
    rng = random.Random(case.seed)
    pool = EXTREMES + [rng.randrange(2**63) for _ in range(case.pool - len(EXTREMES))]
    generator = torch.Generator().manual_seed(case.seed)
    steps = []
    for step in range(case.steps):
        # A window that drifts over the pool: old ids fall out of use, new ones arrive.
        window = pool[step * 2 % len(pool) :] + pool[: step * 2 % len(pool)]
        ranks = []
        for rank in range(case.world):
            batch = rng.randrange(0, 4) if rank else rng.randrange(1, 4)
            dyn = [
                [
                    [rng.choice(window[:16]) for _ in range(rng.randrange(0, 4))]
                    for _ in range(batch)
                ]
                for _ in DYN_FEATURES
            ]
            static = [
                [rng.randrange(STATIC_ROWS) for _ in range(rng.randrange(0, 3))]
                for _ in range(batch)
            ]
            upstream = torch.randn(batch, DIM * 3, generator=generator)
            ranks.append((dyn, [static], upstream))
        steps.append(ranks)
    return steps


def kjt(
    dyn: list[list[list[int]]], static: list[list[list[int]]], weighted: bool = False
) -> KeyedJaggedTensor:
    bags = [*dyn, *static]
    lengths = [len(bag) for feature in bags for bag in feature]
    values = [i for feature in bags for bag in feature for i in bag]
    return KeyedJaggedTensor.from_lengths_sync(
        [*DYN_FEATURES, "f_s"],
        torch.tensor(values, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
        weights=torch.tensor([weight(i) for i in values]) if weighted else None,
    )


class RefModel:
    """The unsharded model: a map of keys to rows, the dynamic table's live rows by row
    (and their optimizer state), the static table as a tensor."""

    def __init__(self, case: Case, static: torch.Tensor) -> None:
        self.case = case
        self.map = Reference(case.spec, 0, case.spec.buckets)
        self.rows: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        self.static = static.clone()
        self.static_state = torch.zeros_like(static)
        self.admitted = self.evicted = self.overflow = 0
        self.step = 0
        bound = math.sqrt(1 / case.rows)
        self.bounds = (-bound, bound)
        # Each table's column blocks' widths: row-wise Adagrad keeps an accumulator a
        # row and block.
        self.widths = {name: column_widths(spec) for name, spec in case.plan.items()}

    def row(self, key: int) -> int:
        """The key's row in the map now, -1 for none."""
        bucket, rows = ref_bucket(key, self.case.spec.buckets), self.case.spec.rows_per_bucket
        slots = self.map.slots[bucket]
        return next((bucket * rows + i for i, e in enumerate(slots) if e and e.key == key), -1)

    def evaluate(self, ranks) -> list[torch.Tensor]:
        """Every rank's output for this batch in eval mode: the live ids' rows, as they
        are; no sighting, admission, eviction or update."""
        keys = [
            ref_key(i) for dyn, _, _ in ranks for feature in dyn for bag in feature for i in bag
        ]
        return self._outputs(ranks, {k: self.row(k) for k in keys}, self.rows, self.static)

    def _outputs(self, ranks, row_of: dict, rows: dict, static: torch.Tensor) -> list:
        """Every rank's pooled output, from ``rows`` and ``static`` (autograd's leaves
        or plain rows); each is ``[batch, 3 * DIM]``."""
        w = weight if self.case.weighted else (lambda i: 1.0)

        def dynamic_bag(bag: list[int]) -> torch.Tensor:
            """Ids without a row add nothing; MEAN divides by the whole bag's length."""
            found = [(w(i), row_of[ref_key(i)]) for i in bag]
            pooled = sum((a * rows[r] for a, r in found if r >= 0), torch.zeros(DIM))
            return pooled / len(bag) if self.case.mean and bag else pooled

        def static_bag(bag: list[int]) -> torch.Tensor:
            return sum((w(i) * static[i] for i in bag), torch.zeros(DIM))

        outs = []
        for dyn, stat, _ in ranks:
            columns = [[dynamic_bag(bag) for bag in feature] for feature in dyn]
            columns.append([static_bag(bag) for bag in stat[0]])
            outs.append(
                torch.cat([torch.stack(c) if c else torch.zeros(0, DIM) for c in columns], 1)
            )
        return outs

    def forward_backward(self, ranks) -> list[torch.Tensor]:
        """Every rank's output for this step, then the optimizer's update."""
        dyn_keys = [
            ref_key(i) for dyn, _, _ in ranks for feature in dyn for bag in feature for i in bag
        ]
        rows, admitted, evicted, overflow = self.map.remap(dyn_keys, self.step)
        self.step += 1
        self.admitted += len(admitted)
        self.evicted += evicted
        self.overflow += overflow
        for row, key in admitted:
            self.rows[row] = torch.tensor(
                ref_initial(key, DIM, self.case.spec.seed, "d", *self.bounds)
            )
            self.state[row] = torch.zeros(DIM)
        row_of = dict(zip(dyn_keys, rows))
        live = {r: self.rows[r].clone().requires_grad_() for r in set(rows) if r >= 0}
        static = self.static.clone().requires_grad_()
        outs, loss = [], 0
        for out, (_, _, upstream) in zip(self._outputs(ranks, row_of, live, static), ranks):
            outs.append(out.detach())
            loss = loss + (out * upstream).sum()
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            # The sharded backward averages the sparse gradients over ranks, as DDP
            # averages the dense ones: the loss of the global batch over the world size.
            (loss / len(ranks)).backward()
        with torch.no_grad():
            for row, param in live.items():
                if param.grad is not None:
                    self.rows[row], self.state[row] = self._update(
                        param, param.grad, self.state[row], self.widths["d"]
                    )
            if static.grad is not None:
                touched = static.grad.abs().sum(1) > 0
                new, state = self._update(static, static.grad, self.static_state, self.widths["s"])
                self.static = torch.where(touched[:, None], new, self.static)
                self.static_state = torch.where(touched[:, None], state, self.static_state)
        return outs

    def _update(self, weight, grad, state, widths: tuple[int, ...]):
        opt = self.case.optimizer
        weight = weight.detach()
        if isinstance(opt, SGD):
            return weight - opt.lr * grad, state
        if isinstance(opt, Adagrad):
            state = state + grad**2
            return weight - opt.lr * grad / (state.sqrt() + opt.eps), state
        # Row-wise Adagrad: one accumulator per row and column block, the mean of the
        # squared gradient over the block's columns.
        squares = [(g**2).mean(-1, keepdim=True).expand_as(g) for g in grad.split(widths, -1)]
        state = state + torch.cat(squares, -1)
        return weight - opt.lr * grad / (state.sqrt() + opt.eps), state


def column_widths(spec) -> tuple[int, ...]:
    """The widths of a table's column blocks under ``spec`` (one block of DIM unless it
    splits columns)."""
    return spec.column_widths(DIM) if spec.SPLITS_COLUMNS else (DIM,)


def _run_case(case: Case) -> dict:
    """On every rank: the sharded model and the reference side by side; the largest
    gaps of this rank's outputs and of every live row, and the stats."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=configs(case.rows, case.mean), is_weighted=case.weighted)
    static = ebc.embedding_bags["s"].weight.detach().clone()
    rank = torch.distributed.get_rank()
    device = torch.device(case.device)
    sharded = embshard.shard(
        ebc,
        ShardingPlan(case.plan),
        mesh=sharding_mesh(case.group, device.type) if case.group else world_mesh(device.type),
        optimizer=case.optimizer,
        dynamic={"d": case.spec},
    )
    ref = RefModel(case, static)
    out_gap = 0.0
    steps = stream(case)
    for ranks, following in zip(steps, [*steps[1:], None]):
        dyn, stat, upstream = ranks[rank]
        out = sharded(kjt(dyn, stat, case.weighted).to(device)).values()
        (out * upstream.to(device)).sum().backward()
        sharded.sync_replicas()
        expected = ref.forward_backward(ranks)[rank]
        out = out.detach().cpu()
        out_gap = max(out_gap, (out - expected).abs().max().item() if out.numel() else 0)
        if case.evaluate and following is not None:  # ids not seen yet: looked up only
            dyn, stat, _ = following[rank]
            with torch.no_grad():
                out = sharded.eval()(kjt(dyn, stat, case.weighted).to(device)).values().cpu()
            sharded.train()
            expected = ref.evaluate(following)[rank]
            out_gap = max(out_gap, (out - expected).abs().max().item() if out.numel() else 0)
    return {"out_gap": out_gap, **tables_against(sharded, ref)}


def tables_against(sharded, ref: RefModel) -> dict:
    """The largest gaps of the live rows and of the static table from the reference's,
    and both models' counts (admitted, evicted, overflow, live); collective."""
    table = gather_table(sharded.weights["d"]).cpu()
    row_gap = max(((table[r] - v).abs().max().item() for r, v in ref.rows.items()), default=0)
    static_gap = (gather_table(sharded.weights["s"]).cpu() - ref.static).abs().max().item()
    stats = sharded.dynamic_stats()["d"]
    return {
        "row_gap": row_gap,
        "static_gap": static_gap,
        "stats": (stats.admitted, stats.evicted, stats.overflow, stats.live),
        "ref": (ref.admitted, ref.evicted, ref.overflow, len(ref.rows)),
    }


CASES = {
    "w1_table_wise_lru": Case(
        1, {"d": table_wise(0), "s": table_wise(0)}, IdMapSpec(4, 3, "lru"), SGD(lr=0.1)
    ),
    "w2_row_wise_lru_admit2_rowwise_adagrad": Case(
        2,
        {"d": row_wise(), "s": row_wise()},
        IdMapSpec(4, 3, "lru", admit_after=2, seed=5),
        RowWiseAdagrad(lr=0.1),
    ),
    "w2_table_wise_ttl_adagrad": Case(
        2,
        {"d": table_wise(1), "s": table_wise(0)},
        IdMapSpec(4, 3, "ttl", ttl_steps=2),
        Adagrad(lr=0.1),
    ),
    "w3_uneven_row_wise_lfu": Case(
        3,
        {"d": row_wise([6, 0, 6]), "s": row_wise()},
        IdMapSpec(4, 3, "lfu"),
        SGD(lr=0.1),
    ),
    "w3_row_wise_ttl_admit2_static_column_wise": Case(
        3,
        {"d": row_wise([3, 6, 3]), "s": column_wise([0, 2])},
        IdMapSpec(4, 3, "ttl", ttl_steps=3, admit_after=2),
        Adagrad(lr=0.1),
    ),
    "w2_weighted_row_wise_lru_admit2": Case(
        2,
        {"d": row_wise(), "s": table_wise(1)},
        IdMapSpec(4, 3, "lru", admit_after=2),
        SGD(lr=0.1),
        weighted=True,
    ),
    "w2_row_wise_lru_evaluated_between_steps": Case(
        2,
        {"d": row_wise(), "s": table_wise(0)},
        IdMapSpec(4, 3, "lru", admit_after=2),
        Adagrad(lr=0.1),
        evaluate=True,
    ),
    "w2_mean_table_wise_lfu_admit2": Case(
        2,
        {"d": table_wise(0), "s": row_wise()},
        IdMapSpec(4, 3, "lfu", admit_after=2),
        SGD(lr=0.1),
        mean=True,
    ),
    "w4_two_groups_row_wise_lru_admit2": Case(
        4,
        {"d": row_wise(), "s": table_wise(1)},
        IdMapSpec(4, 3, "lru", admit_after=2),
        SGD(lr=0.1),
        group=2,
    ),
    "w4_two_groups_column_wise_lru": Case(
        4,
        {"d": column_wise([0, 1]), "s": row_wise()},
        IdMapSpec(4, 3, "lru"),
        SGD(lr=0.1),
        group=2,
    ),
    "w4_two_groups_table_wise_lfu_evaluated_between_steps": Case(
        4,
        {"d": table_wise(1), "s": row_wise()},
        IdMapSpec(4, 3, "lfu"),
        SGD(lr=0.1),
        evaluate=True,
        group=2,
    ),
    "w4_uneven_row_wise_lru_adagrad": Case(
        4,
        {"d": row_wise([3, 0, 6, 3]), "s": table_wise(2)},
        IdMapSpec(4, 3, "lru"),
        Adagrad(lr=0.1),
    ),
    # Column blocks: every block's owner remaps the same keys with a map of its own.
    "w2_column_wise_lru_admit2_rowwise_adagrad": Case(
        2,
        {"d": column_wise([1, 0]), "s": row_wise()},
        IdMapSpec(4, 3, "lru", admit_after=2, seed=5),
        RowWiseAdagrad(lr=0.1),
    ),
    "w3_column_wise_two_blocks_on_a_rank_lfu_sgd_evaluated": Case(
        3,
        {"d": column_wise([2, 2]), "s": column_wise([0, 1])},
        IdMapSpec(4, 3, "lfu"),
        SGD(lr=0.1),
        evaluate=True,
    ),
    "w2_grid_lru_adagrad_evaluated": Case(
        2,
        {"d": grid(2, [[0, 1], [1, 0]]), "s": table_wise(1)},
        IdMapSpec(4, 3, "lru"),
        Adagrad(lr=0.1),
        evaluate=True,
    ),
    # Row blocks cut differently in each column block; the static table column-wise.
    "w3_grid_lru_admit2_rowwise_adagrad": Case(
        3,
        {"d": grid(2, [[0, 1, 2], [2, 0]], [[3, 6, 3], [9, 3]]), "s": column_wise([1, 2])},
        IdMapSpec(4, 3, "lru", admit_after=2),
        RowWiseAdagrad(lr=0.1),
    ),
    "w2_row_wise_lru_static_data_parallel": Case(
        2,
        {"d": row_wise(), "s": data_parallel()},
        IdMapSpec(4, 3, "lru"),
        SGD(lr=0.1),
    ),
    "w3_table_wise_lfu_static_hot_rows_rowwise_adagrad": Case(
        3,
        {"d": table_wise(2), "s": row_wise(hot_rows=4)},
        IdMapSpec(4, 3, "lfu"),
        RowWiseAdagrad(lr=0.1),
    ),
    "w4_weighted_grid_ttl_adagrad": Case(
        4,
        {"d": grid([4, 4], [[3, 1, 0], [0, 2]], [[6, 0, 6], [3, 9]]), "s": row_wise()},
        IdMapSpec(4, 3, "ttl", ttl_steps=2),
        Adagrad(lr=0.1),
        weighted=True,
    ),
}


def _check(results: list[dict], tol: float = TOL) -> None:
    for r in results:
        assert r["out_gap"] < tol, r
        assert r["row_gap"] < tol, r
        assert r["static_gap"] < tol, r
        assert r["stats"] == r["ref"], r
    assert results[0]["ref"][1] > 0, "the stream must evict"


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_dynamic_table_equals_the_reference(world, name: str) -> None:
    case = CASES[name]
    _check(world(case.world).run(_run_case, case))


def _collectives(case: Case, dynamic: bool) -> list[int]:
    """Backend collectives (gloo's profiler events) of each step's forward and backward,
    with table "d" dynamic or static (its raw ids then folded onto its rows)."""
    torch.manual_seed(0)
    sharded = embshard.shard(
        EmbeddingBagCollection(tables=configs(case.rows)),
        ShardingPlan(case.plan),
        optimizer=case.optimizer,
        dynamic={"d": case.spec} if dynamic else None,
    )

    def step(features: KeyedJaggedTensor, upstream: torch.Tensor) -> None:
        (sharded(features).values() * upstream).sum().backward()

    rank, counts = torch.distributed.get_rank(), []
    for ranks in stream(case):
        dyn, stat, upstream = ranks[rank]
        if not dynamic:
            dyn = [[[i % case.rows for i in bag] for bag in feature] for feature in dyn]
        counts.append(gloo_collectives(functools.partial(step, kjt(dyn, stat), upstream)))
    return counts


@pytest.mark.parametrize("name", ["w3_uneven_row_wise_lfu", "w2_table_wise_ttl_adagrad"])
def test_a_dynamic_table_adds_no_collective_to_a_step(world, name: str) -> None:
    # The counts exchange, the ids and pooled all-to-alls and the pooled gradient's, as
    # with the table static: the remaps run on the ids each owner received.
    case = CASES[name]
    dynamic = world(case.world).run(_collectives, case, True)
    static = world(case.world).run(_collectives, case, False)
    assert dynamic == static == [[4] * case.steps] * case.world


# On the GPU: NCCL at one rank, gloo over CUDA tensors for ranks sharing it. FBGEMM's
# CUDA kernels sum and update in another order than the CPU reference: within 1e-4.
GPU_CASES = [
    "w1_table_wise_lru",
    "w2_row_wise_lru_admit2_rowwise_adagrad",
    "w2_column_wise_lru_admit2_rowwise_adagrad",
    "w2_grid_lru_adagrad_evaluated",
    "w4_two_groups_row_wise_lru_admit2",
]


@pytest.mark.cuda
@pytest.mark.parametrize("name", GPU_CASES)
def test_dynamic_tables_on_the_gpu_equal_the_reference(cuda_world, name: str) -> None:
    case = dataclasses.replace(CASES[name], device="cuda")
    _check(cuda_world(case.world).run(_run_case, case), tol=1e-4)


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@example(seed=1, world_size=1, policy="lfu", admit_after=2, pool=30, buckets=3)
@example(seed=2, world_size=4, policy="ttl", admit_after=1, pool=60, buckets=6)
@given(
    seed=st.integers(0, 2**31),
    world_size=st.sampled_from([1, 2, 3, 4]),
    policy=st.sampled_from(["lru", "lfu", "ttl"]),
    admit_after=st.integers(1, 3),
    pool=st.integers(len(EXTREMES), 60),
    buckets=st.sampled_from([1, 3, 6]),
)
def test_drawn_id_streams_equal_the_reference(
    world, seed: int, world_size: int, policy: str, admit_after: int, pool: int, buckets: int
) -> None:
    """Any stream, any row-wise cut on bucket boundaries: buckets go to ranks in blocks."""
    spec = IdMapSpec(
        buckets, 2, policy, ttl_steps=2 if policy == "ttl" else None, admit_after=admit_after
    )
    cuts = sorted(random.Random(seed).choices(range(buckets + 1), k=world_size - 1))
    sizes = [2 * (b - a) for a, b in zip([0, *cuts], [*cuts, buckets])]
    case = Case(
        world_size, {"d": row_wise(sizes), "s": row_wise()}, spec, SGD(lr=0.1), seed=seed, pool=pool
    )
    for result in world(world_size).run(_run_case, case):
        assert result["out_gap"] < TOL and result["row_gap"] < TOL, result
        assert result["stats"] == result["ref"], result


def _raises(fn) -> str:
    try:
        fn()
    except (InputError, PlanError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def bag_module(rows: int) -> EmbeddingBagCollection:
    """The cases' collection on meta, its dynamic table of ``rows`` rows."""
    return EmbeddingBagCollection(tables=configs(rows), device=torch.device("meta"))


def _negative_raw_id(module=bag_module) -> list[str]:
    """Rank 1 sends a negative raw id at the second step."""
    rank = torch.distributed.get_rank()
    sharded = embshard.shard(
        module(12),
        ShardingPlan({"d": row_wise(), "s": table_wise(0)}),
        dynamic={"d": IdMapSpec(4, 3)},
    )
    messages = []
    for raw in (5, -5 if rank == 1 else 7):
        messages.append(_raises(lambda raw=raw: sharded(kjt([[[raw]], [[]]], [[[1]]]))))
    return messages


def check_negative_raw_ids_refused(results: list[list[str]]) -> None:
    for ok, refused in results:
        assert ok == "no error"
        assert refused.startswith("InputError: bad input batch")
        assert "rank 1: feature 'f_d1' (table 'd'): raw id -5 is negative" in refused
        assert "rank 0" not in refused


def test_negative_raw_ids_are_refused_on_every_rank(world) -> None:
    check_negative_raw_ids_refused(world(2).run(_negative_raw_id))


def _overflow_without_eviction(module=bag_module, layout=None) -> list[str]:
    """Policy "none": 2 buckets of 2 rows, ``layout`` (row-wise if None); step 0 brings
    12 distinct ids."""
    rank = torch.distributed.get_rank()
    sharded = embshard.shard(
        module(4),
        ShardingPlan({"d": layout or row_wise(), "s": table_wise(0)}),
        dynamic={"d": IdMapSpec(2, 2, "none")},
    )
    ids = [[list(range(rank * 6, rank * 6 + 6))], [[]]]
    return [_raises(lambda: sharded(kjt(ids, [[[1]]]))) for _ in range(4)]


def check_overflow_raised_at_the_next_step(results: list[list[str]]) -> None:
    for first, second, third, fourth in results:
        assert first == "no error"  # the step that overflowed ran, its extra ids without rows
        assert second.startswith("InputError: bad input batch")
        assert "dynamic table 'd':" in second and "policy 'none'" in second
        assert third == "no error"  # raised once; this step overflows again,
        assert fourth == second  # and the next raises again
    # Each rank names what its own buckets refused; the message is the same everywhere.
    assert results[0][1] == results[1][1]


def test_overflow_with_no_eviction_raises_on_every_rank_at_the_next_step(world) -> None:
    check_overflow_raised_at_the_next_step(world(2).run(_overflow_without_eviction))


def test_a_column_wise_tables_overflow_raises_on_every_rank_counted_once(world) -> None:
    """Its first column block (on rank 1) holds the overflow against the next step;
    the other block's equal map adds nothing."""
    results = world(2).run(_overflow_without_eviction, bag_module, column_wise([1, 0]))
    check_overflow_raised_at_the_next_step(results)
    assert "rank 1: dynamic table 'd': 8 ids found their bucket full" in results[0][1]
    assert "rank 0" not in results[0][1], results[0][1]


BAD_PLANS = {
    "rows": (13, {"d": table_wise(0)}, {"d": IdMapSpec(4, 3)}, "num_embeddings 13 is not"),
    "cut": (12, {"d": row_wise([4, 8])}, {"d": IdMapSpec(4, 3)}, "cuts its rows at 4"),
    "unknown": (12, {"d": table_wise(0)}, {"x": IdMapSpec(4, 3)}, "'x': not a table"),
    "data_parallel": (
        12,
        {"d": data_parallel()},
        {"d": IdMapSpec(4, 3)},
        "data-parallel is refused: each rank's copy of the id map would need every rank's ids",
    ),
    "hot_rows": (
        12,
        {"d": row_wise(hot_rows=3)},
        {"d": IdMapSpec(4, 3)},
        "hot rows copy fixed row numbers to every rank, and a dynamic table's rows change ids",
    ),
    "grid_cut": (
        12,
        {"d": grid(2, [[0, 1], [1, 0]], [[6, 6], [4, 8]])},
        {"d": IdMapSpec(4, 3)},
        "cuts its rows at 4",
    ),
    "spec": (12, {"d": table_wise(0)}, {"d": 3}, "expected an IdMapSpec"),
}


def _bad_plan(rows: int, plan: dict, dynamic: dict) -> str:
    plan = {"s": table_wise(0), **plan}
    return _raises(
        lambda: embshard.shard(
            EmbeddingBagCollection(tables=configs(rows), device=torch.device("meta")),
            ShardingPlan(plan),
            dynamic=dynamic,
        )
    )


@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_bad_dynamic_plans_are_one_line_plan_errors_on_every_rank(world, name: str) -> None:
    rows, plan, dynamic, expected = BAD_PLANS[name]
    messages = world(2).run(_bad_plan, rows, plan, dynamic)
    assert messages[0] == messages[1]
    assert messages[0].startswith("PlanError: dynamic table"), messages[0]
    assert expected in messages[0] and "\n" not in messages[0]


def _shared_feature() -> str:
    """A feature feeding the dynamic table and a static one."""
    shared = [
        *configs(12),
        EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=5, feature_names=["f_d2"]),
    ]
    plan = ShardingPlan({"d": table_wise(0), "s": table_wise(0), "t": table_wise(1)})
    return _raises(
        lambda: embshard.shard(
            EmbeddingBagCollection(tables=shared, device=torch.device("meta")),
            plan,
            dynamic={"d": IdMapSpec(4, 3)},
        )
    )


def test_shared_features_are_refused(world) -> None:
    for shared in world(2).run(_shared_feature):
        assert shared.startswith("PlanError: dynamic table 'd': its feature 'f_d2' feeds another")


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=configs(12), device=torch.device("meta"))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(features).values()


def _through_shard_model() -> tuple[object, str]:
    """shard_model passes each collection its dynamic tables; names none of them refused."""
    plan = ShardingPlan({"d": row_wise(), "s": table_wise(0)})
    model = embshard.shard_model(
        _Model(), plan, dynamic={"d": IdMapSpec(4, 3)}, data_parallel_wrapper=lambda m: m
    )
    rank = torch.distributed.get_rank()
    model(kjt([[[rank, 7]], [[2**63 - 1]]], [[[1]]]))
    unknown = _raises(
        lambda: embshard.shard_model(
            _Model(), plan, dynamic={"x": IdMapSpec(4, 3)}, data_parallel_wrapper=lambda m: m
        )
    )
    return model.ebc.dynamic_stats()["d"], unknown


def test_shard_model_takes_dynamic_tables(world) -> None:
    for stats, unknown in world(2).run(_through_shard_model):
        assert (stats.admitted, stats.live, stats.overflow) == (4, 4, 0)  # ids 0, 1, 7, 2**63-1
        assert (
            unknown == "PlanError: dynamic tables ['x'] are not tables of the model's collections"
        )
