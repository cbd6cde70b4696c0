"""2-D sharding groups: 4 ranks as 2 sharding groups of 2 (and 4 of 1), each group
holding a copy of the plan, the copies averaged once a step (``sync_replicas``).

The oracle follows the same definition with TorchRec's unsharded module and the
plain optimizers of tests/oracle.py: each replica's copy steps on its sharding
group's batches (its ranks' batches concatenated, the loss averaged over the group's
ranks), then the copies' weights and optimizer state are averaged."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import test_teardown as teardown
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from click.testing import CliRunner
from oracle import (
    Case,
    Table,
    global_batch,
    local_batches,
    max_diff,
    oracle_step,
    run_sequence_case,
    tables_of,
    unsharded,
    upstream,
)
from torch import nn
from torchrec import EmbeddingBagCollection

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, row_wise, table_wise
from embshard import checkpoint as ckpt
from embshard.app.cli import main as cli
from embshard.app.config import check_launch, load_config
from embshard.app.train import train
from embshard.errors import ConfigError
from embshard.modules.mesh import sharding_mesh, world_mesh

ROOT = Path(__file__).resolve().parents[1]

WORLD = 4
TOL = 1e-5
TABLES = (
    Table("tw", 30, 8, ("f_tw",)),
    Table("rw", 40, 8, ("f_rw",), mean=True),
    Table("cw", 24, 12, ("f_cw",)),
    Table("dp", 16, 4, ("f_dp", "f_tw")),
    Table("hot", 36, 8, ("f_hot",)),
)
# A plan for each sharding group size: every layout, data-parallel and hot rows included.
PLANS = {
    4: {
        "tw": table_wise(3),
        "rw": row_wise([0, 10, 20, 10]),
        "cw": column_wise([2, 0, 3]),
        "dp": data_parallel(),
        "hot": row_wise(hot_rows=4),
    },
    2: {
        "tw": table_wise(1),
        "rw": row_wise(),
        "cw": column_wise([1, 0, 1]),
        "dp": data_parallel(),
        "hot": row_wise(hot_rows=6),
    },
    1: {
        "tw": table_wise(0),
        "rw": row_wise(),
        "cw": column_wise([0, 0, 0]),
        "dp": data_parallel(),
        "hot": row_wise(hot_rows=6),
    },
}
OPTIMIZERS = [
    embshard.SGD(lr=0.1),
    embshard.RowWiseAdagrad(lr=0.1, eps=1e-4),
    embshard.Adagrad(lr=0.1, eps=1e-4),
]


COPIES = ("dp", "hot")  # the tables with copies, which Adam and LAMB refuse


def case_for(group_size: int, optimizer, device: str | None = None) -> Case:
    """The tables on ``device`` (the default group's), those with copies left out for
    an optimizer that refuses them."""
    keep = [
        t
        for t in TABLES
        if optimizer is None or optimizer.ZERO_GRADIENT_KEEPS or t.name not in COPIES
    ]
    plan = ShardingPlan({t.name: PLANS[group_size][t.name] for t in keep})
    return Case(tuple(keep), plan, (5, 3, 1, 6), optimizer=optimizer, device=device)


def mesh_of(group_size: int, device: str | None = None):
    """The 2-D mesh of sharding groups of ``group_size`` ranks; the 1-D world mesh for
    one group of every rank."""
    return world_mesh(device) if group_size == WORLD else sharding_mesh(group_size, device)


def blocks(case: Case, group_size: int) -> dict[str, list[tuple[int, int]]]:
    """Each table's column blocks under the plan, for row-wise Adagrad's accumulators."""
    tables = case.plan.resolve([t.config() for t in case.tables], group_size)
    return {n: sorted({(s.col_offset, s.cols) for s in t.shards}) for n, t in tables.items()}


def replicas_oracle(case: Case, group_size: int) -> tuple[list[list[torch.Tensor]], dict]:
    """Every step's expected output of every rank, and the final tables: one unsharded
    copy per sharding group stepping on its group's batches, then the copies' weights
    and optimizer state averaged, each step."""
    module = unsharded(case)
    replicas = WORLD // group_size
    copies = [copy.deepcopy(module) for _ in range(replicas)]
    states: list[dict] = [{} for _ in range(replicas)]
    table_blocks = blocks(case, group_size)
    expected: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
    for step in range(case.steps):
        batches = local_batches(case, step)
        for g, (ebc, state) in enumerate(zip(copies, states)):
            ranks = range(g * group_size, (g + 1) * group_size)
            out = ebc(global_batch([batches[r] for r in ranks])).values()
            parts = out.split([case.batch_sizes[r] for r in ranks])
            loss = sum(
                (part * upstream(case, step, len(part), part.shape[1], r)).sum()
                for r, part in zip(ranks, parts)
            )
            (loss / group_size).backward()
            oracle_step(ebc, case, table_blocks, state)
            for r, part in zip(ranks, parts):
                expected[r].append(part.detach())
        _average(copies, states)
    return expected, {n: t.weight.detach() for n, t in tables_of(copies[0]).items()}


def _average(copies: list, states: list[dict]) -> None:
    """Every copy's weights and optimizer state set to their mean over the copies."""
    with torch.no_grad():
        for name in tables_of(copies[0]):
            mean = torch.stack([tables_of(c)[name].weight for c in copies]).mean(0)
            for c in copies:
                tables_of(c)[name].weight.copy_(mean)
        for key, state in states[0].items():
            if isinstance(state, tuple):  # Adam's and LAMB's: both moments, the steps
                moments = [torch.stack([s[key][i] for s in states]).mean(0) for i in (0, 1)]
                for s in states:
                    s[key] = (*[m.clone() for m in moments], state[2])
                continue
            mean = torch.stack([s[key] for s in states]).mean(0)
            for s in states:
                s[key] = mean.clone()


def run_twod(optimizer, group_size: int, device: str | None = None) -> dict[str, float]:
    """The sharded model on sharding groups of ``group_size`` against the replicas'
    oracle: the largest output and final weight differences; and the largest
    difference of that oracle from one group of all 4 ranks (the 1-D run)."""
    rank = dist.get_rank()
    case = case_for(group_size, optimizer, device)
    expected, final = replicas_oracle(case, group_size)
    mesh = mesh_of(group_size, device)
    sharded = embshard.shard(
        copy.deepcopy(unsharded(case)), case.plan, mesh=mesh, optimizer=optimizer
    )
    worst = {"forward": 0.0}
    for step in range(case.steps):
        out = sharded(local_batches(case, step)[rank].to(mesh.device_type)).values()
        worst["forward"] = max(worst["forward"], max_diff(out, expected[rank][step]))
        grad = upstream(case, step, len(out), out.shape[1], rank).to(out.device)
        (out * grad).sum().backward()
        sharded.sync_replicas()
    worst["weights"] = max(
        max_diff(embshard.gather_table(w), final[n]) for n, w in sharded.weights.items()
    )
    one_d = replicas_oracle(case_for(WORLD, optimizer, device), WORLD)[1]
    worst["from_1d"] = max(max_diff(final[n], one_d[n]) for n in final)
    worst["update"] = max(max_diff(final[n], tables_of(unsharded(case))[n].weight) for n in final)
    return worst


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.KIND)
@pytest.mark.parametrize("group_size", [2, 1])
def test_sharding_groups_match_the_averaged_replicas(world, optimizer, group_size):
    check_against_replicas(world(WORLD).run(run_twod, optimizer, group_size), optimizer)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "optimizer",
    [embshard.Adam(lr=0.01, eps=1e-4), embshard.Lamb(lr=0.1, eps=1e-4)],
    ids=lambda o: o.KIND,
)
def test_cuda_only_optimizers_on_sharding_groups(cuda_world, optimizer):
    """Adam and LAMB (FBGEMM's CUDA kernels only): 4 ranks sharing the GPU as 2 groups
    of 2, their moments averaged with the weights."""
    check_against_replicas(cuda_world(WORLD).run(run_twod, optimizer, 2, "cuda"), optimizer)


def check_against_replicas(results: list[dict[str, float]], optimizer) -> None:
    for worst in results:
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst
        assert worst["update"] > 100 * TOL, worst  # the steps moved the tables
        if isinstance(optimizer, embshard.SGD):  # one step on the global batch, averaged
            assert worst["from_1d"] < TOL, worst
        else:  # Adagrad's accumulators see each group's gradient, not the global one
            assert worst["from_1d"] > 100 * TOL, worst


COLLECTIVES = (
    "all_to_all_single",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "barrier",
)


def count_collectives(group_size: int) -> dict:
    """The collectives of one training step (forward and backward, then the sync) by
    name and the ranks of their group; with this rank's sharding and replica groups."""
    rank = dist.get_rank()
    case = case_for(group_size, embshard.SGD(lr=0.1))
    ebc = unsharded(case)
    sharded = embshard.shard(ebc, case.plan, mesh=mesh_of(group_size), optimizer=case.optimizer)
    mesh = sharded.sharding_mesh
    batch = local_batches(case, 0)[rank]
    sharded(batch).values().sum().backward()  # a first step: anything done once is done
    calls: list[tuple[str, tuple[int, ...]]] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def recording(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            calls.append((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
            return originals[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, recording(name))
    try:
        sharded(batch).values().sum().backward()
        step = list(calls)
        sharded.sync_replicas()
        sync = calls[len(step) :]
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)

    def ranks(group):
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    return {
        "step": step,
        "sync": sync,
        "sharding": ranks(mesh.sharding_group),
        "replica": ranks(mesh.replica_group) if mesh.replica_group else None,
    }


def test_collectives_stay_in_the_sharding_group_and_one_all_reduce_syncs(world):
    one_d = world(WORLD).run(count_collectives, WORLD)
    for rank, counted in enumerate(world(WORLD).run(count_collectives, 2)):
        group = (0, 1) if rank < 2 else (2, 3)
        assert counted["sharding"] == group and counted["replica"] == (rank % 2, rank % 2 + 2)
        # The step's collectives are the 1-D step's, each inside the sharding group:
        # the counts exchange, the ids, the pooled rows and their gradients, and the
        # data-parallel tables' gradient all-reduce.
        assert [name for name, _ in counted["step"]] == [name for name, _ in one_d[rank]["step"]]
        assert sorted(name for name, _ in counted["step"]) == [
            "all_reduce",
            *["all_to_all_single"] * 4,
        ]
        assert all(ranks == group for _, ranks in counted["step"]), counted["step"]
        assert counted["sync"] == [("all_reduce", counted["replica"])]
        assert one_d[rank]["sync"] == []  # one group: no copies to sync


def build(group_size: int, optimizer, seed: int):
    """The tables sharded over groups of ``group_size`` with the seeded initialization."""
    ebc = EmbeddingBagCollection(tables=[t.config() for t in TABLES], device="meta")
    plan = ShardingPlan(PLANS[group_size])
    return embshard.shard(ebc, plan, mesh=mesh_of(group_size), optimizer=optimizer, seed=seed)


def whole(sharded) -> dict[str, torch.Tensor]:
    """Every table and optimizer state tensor, gathered whole."""
    tables = {f"weight.{n}": embshard.gather_table(w) for n, w in sharded.weights.items()}
    return tables | {k: embshard.gather_table(v) for k, v in sharded.optimizer_state().items()}


def save_trained(root: str, group_size: int, optimizer) -> dict[str, torch.Tensor]:
    sharded = build(group_size, optimizer, seed=0)
    case = case_for(group_size, optimizer)
    for step in range(2):
        batch = local_batches(case, step)[dist.get_rank()]
        sharded(batch).values().pow(2).sum().backward()
        sharded.sync_replicas()
    ckpt.save(root, sharded, step=2)
    return whole(sharded)


def load_into(root: str, group_size: int, optimizer) -> dict[str, torch.Tensor]:
    sharded = build(group_size, optimizer, seed=9)
    assert ckpt.load(ckpt.latest(root), sharded) == 2
    return whole(sharded)


@pytest.mark.parametrize(
    ("saved", "loaded"), [(2, WORLD), (WORLD, 2), (2, 1), (1, 2)], ids=lambda g: f"g{g}"
)
def test_checkpoints_reshard_between_group_sizes_bit_exact(world, tmp_path, saved, loaded):
    optimizer = embshard.RowWiseAdagrad(lr=0.1, eps=1e-4)
    expected = world(WORLD).run(save_trained, str(tmp_path), saved, optimizer)[0]
    for got in world(WORLD).run(load_into, str(tmp_path), loaded, optimizer):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
    # One copy saved: every table's and state's chunks cover it exactly once.
    metadata = dcp.FileSystemReader(str(ckpt.latest(tmp_path))).read_metadata()
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(("model.", "sparse_optimizer.")):
            assert sum(c.sizes.numel() for c in entry.chunks) == entry.size.numel(), key
    replicas = {2: 2, 1: 4, WORLD: 1}[saved]
    described = ckpt.describe(ckpt.latest(tmp_path))
    assert (described["world_size"], described["sharding_group_size"]) == (WORLD, saved), described
    assert described["replicas"] == replicas
    inspected = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path)])
    groups = f"saved by {WORLD} ranks as {replicas} sharding groups of {saved}"
    assert (groups in inspected.output) == (replicas > 1), inspected.output


def train_small(tmp: str, name: str, group_size: int, dynamic: bool = False) -> dict:
    """``configs/small.yaml`` trained a few steps with SGD on sharding groups of
    ``group_size``, checkpointed at the end; with ``dynamic``, its user table dynamic
    and small (its buckets fill and evict)."""
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(steps=4, batch_size=32, sharding_group_size=group_size)
    if dynamic:
        data["tables"][0].update(num_embeddings=64, dynamic={"buckets": 8})
    data["sparse_optimizer"] = {"type": "sgd", "lr": 5.0}
    data["dense_optimizer"] = {"type": "sgd", "lr": 0.1}
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": f"{tmp}/{name}", "every": 2}
    path = Path(tmp) / f"{name}.yaml"
    if dist.get_rank() == 0:
        path.write_text(yaml.safe_dump(data))
    dist.barrier()
    return train(load_config(path))


@pytest.mark.parametrize("dynamic", [False, True])
def test_training_on_sharding_groups_with_sgd_takes_the_1d_steps(world, tmp_path, dynamic):
    """With SGD the groups' averaged step is the step on the global batch: the 2-D job
    ends where the 1-D one does, dense layers and tables alike, and a dynamic table's
    id map with them (every copy remaps its replica group's keys)."""
    one_d = world(WORLD).run(train_small, str(tmp_path), "one_d", WORLD, dynamic)[0]
    two_d = world(WORLD).run(train_small, str(tmp_path), "two_d", 2, dynamic)[0]
    assert two_d["steps"] == one_d["steps"] == 4
    assert two_d.get("dynamic") == one_d.get("dynamic")
    if dynamic:
        assert one_d["dynamic"]["user"]["evicted"] > 0
    assert abs(two_d["loss"] - one_d["loss"]) < 1e-5
    for step in ("step_00000002", "step_00000004"):
        expected = ckpt.read_tensors(tmp_path / "one_d" / step)
        got = ckpt.read_tensors(tmp_path / "two_d" / step)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            if value.is_floating_point():
                assert max_diff(got[key], value) < 1e-5, (step, key)
            else:
                assert torch.equal(got[key], value), (step, key)
        assert any(k.startswith("dynamic.") for k in got) == dynamic
    before = ckpt.read_tensors(tmp_path / "two_d" / "step_00000002")
    tables = [k for k in got if k.startswith("model.") and ".embedding_bags." in k]
    assert len(tables) == 5
    assert max(max_diff(got[k], before[k]) for k in tables) > 1e-3  # the steps moved them
    described = ckpt.describe(ckpt.latest(tmp_path / "two_d"))
    assert (described["sharding_group_size"], described["replicas"]) == (2, 2)


def run_sequence_on_groups() -> dict[str, float]:
    tables = tuple(Table(t.name, t.rows, 12, t.features) for t in TABLES[:3])
    plan = ShardingPlan({n: PLANS[2][n] for n in ("tw", "rw", "cw")})
    case = Case(tables, plan, (4, 0, 3, 5), sequence=True, group_size=2)
    return run_sequence_case(case)


def test_embedding_collections_shard_on_sharding_groups(world):
    """An EmbeddingCollection on 2 groups of 2, with SGD against the global batch's
    oracle (which the groups' averaged SGD step equals)."""
    for worst in world(WORLD).run(run_sequence_on_groups):
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst
        assert worst["update"] > 100 * TOL, worst


def shards_of_a_module_built_per_rank() -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """This rank's shards, by offset, of a module whose weights are the case's plus the
    rank's number, sharded on 2 groups of 2."""
    case = case_for(2, embshard.SGD(lr=0.1))
    module = unsharded(case)
    with torch.no_grad():
        for table in tables_of(module).values():
            table.weight += dist.get_rank()
    sharded = embshard.shard(module, case.plan, mesh=mesh_of(2))
    held = {}
    for name, weight in sharded.weights.items():
        local = weight.to_local()  # a plain empty tensor off the table's ranks
        shards = zip(local.local_shards(), local.local_offsets()) if local.numel() else []
        held[name] = [(tuple(o), s.clone()) for s, o in shards]
    return held


def test_copies_of_a_module_built_per_rank_start_as_the_first_groups(world):
    """Each rank copies its own module's rows; then every group's copy is the first
    group's, and the copies inside a group (data-parallel, hot rows) its first rank's."""
    base = {n: t.weight.detach() for n, t in tables_of(unsharded(case_for(2, None))).items()}
    for rank, shards in enumerate(world(WORLD).run(shards_of_a_module_built_per_rank)):
        for name, held in shards.items():
            for (row, col), shard in held:
                copied = name == "dp" or (name == "hot" and row == 0)
                added = 0 if copied else rank % 2  # rank 0's, or the first group's rank
                rows, cols = shard.shape
                expected = base[name][row : row + rows, col : col + cols] + added
                assert torch.equal(shard, expected), (rank, name, row, col)


@pytest.mark.parametrize(
    ("size", "problem"),
    [(3, "3 does not divide the job's 4 ranks"), (0, "must be at least 1")],
)
def test_a_group_size_the_world_cannot_take_is_refused_before_the_job(tmp_path, size, problem):
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data | {"sharding_group_size": size}))
    with pytest.raises(ConfigError, match=re.escape(f"{path}.sharding_group_size: {problem}")):
        check_launch(load_config(path), str(path), WORLD, resume=False)


class StepLoss(nn.Module):
    """The test's loss on a sharded collection's output, for ``TrainPipeline``: a batch
    is (step, local KeyedJaggedTensor)."""

    def __init__(self, sharded, case: Case) -> None:
        super().__init__()
        self.sharded, self.case = sharded, case
        self.unused = nn.Parameter(torch.zeros(1))  # the dense optimizer needs one

    def forward(self, batch):
        step, features = batch
        out = self.sharded(features).values()
        grad = upstream(self.case, step, len(out), out.shape[1], dist.get_rank())
        return (out * grad).sum() + 0 * self.unused.sum(), out


def pipelined_on_groups(optimizer) -> dict[str, float]:
    """``TrainPipeline`` over 2 groups of 2: its outputs and final tables against the
    replicas' oracle."""
    rank, case = dist.get_rank(), case_for(2, optimizer)
    expected, final = replicas_oracle(case, 2)
    sharded = embshard.shard(
        copy.deepcopy(unsharded(case)), case.plan, mesh=mesh_of(2), optimizer=optimizer
    )
    model = StepLoss(sharded, case)
    batches = [(step, local_batches(case, step)[rank]) for step in range(case.steps)]
    dense = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = list(embshard.TrainPipeline(model, dense, batches))
    return {
        "forward": max(max_diff(out, want) for out, want in zip(outputs, expected[rank])),
        "weights": max(
            max_diff(embshard.gather_table(w), final[n]) for n, w in sharded.weights.items()
        ),
        "steps": len(outputs),
    }


def test_the_training_pipeline_syncs_the_groups_each_step(world):
    for worst in world(WORLD).run(pipelined_on_groups, OPTIMIZERS[2]):
        assert worst["steps"] == 3
        assert worst["forward"] < TOL and worst["weights"] < TOL, worst


def test_a_script_on_sharding_groups_ending_with_shutdown_exits_cleanly(tmp_path):
    """test_teardown's user script on 2 sharding groups of 1 rank (their process groups
    made by embshard), synced each step: it ends cleanly on slow gloo threads."""
    script = tmp_path / "user_script.py"
    on_groups = teardown.SCRIPT.replace(
        "plan, optimizer=", "plan, mesh=embshard.sharding_mesh(1), optimizer="
    ).replace(
        "    dense_optimizer.zero_grad()\n",
        "    dense_optimizer.zero_grad()\n    embshard.sync_replicas(model)\n",
    )
    assert on_groups.count("sharding_mesh") == 1 and on_groups.count("sync_replicas") == 1
    script.write_text(on_groups + "embshard.shutdown()\n")
    for i in range(2):
        ended, output = teardown.launch(script, tmp_path / f"checkpoints_{i}")
        assert ended == "exited 0", output[-3000:]
        assert teardown.ranks_done(output) == ["0", "1"], output[-3000:]
