"""The data path is device-generic: what a CUDA step would pay in host syncs, checked on CPU.

On a GPU every read of a tensor's value on the host (``tolist``, ``item``, ``bool``,
``int``) waits for the device, and some ops read sizes back themselves (``nonzero``,
``repeat_interleave`` without ``output_size``, FBGEMM's permutes without
``permuted_lengths_sum``). The forward may pay one such wait, reading back the counts
exchange; the backward none. The same code runs on CPU, where these modes count them.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist
from oracle import Case, Table, global_batch, local_batches
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagCollection

import embshard
from embshard import ShardingPlan, column_wise, data_parallel, row_wise, table_wise

aten = torch.ops.aten

TABLES = (
    Table("tw", 40, 8, ("f_a", "f_b")),
    Table("rw", 30, 12, ("f_a",)),  # f_a is whole for one table, bucketized for the other
    Table("uneven", 25, 16, ("f_c",), mean=True),  # 10 hot rows, looked up locally
    Table("cw", 20, 16, ("f_d",)),
    Table("dp", 12, 8, ("f_b", "f_d")),  # looked up locally
)
PLAN = ShardingPlan(
    {
        "tw": table_wise(1),
        "rw": row_wise(),
        "uneven": row_wise([15, 0], hot_rows=10),
        "cw": column_wise([1, 0, 1, 0]),
        "dp": data_parallel(),
    }
)

_HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__float__,
    torch.Tensor.numpy,
}
_SIZE_READING_OPS = {aten.nonzero.default, aten.masked_select.default, aten.unique_dim.default}
_NEEDS_OUTPUT_SIZE = {
    aten.repeat_interleave.Tensor: "output_size",
    aten.repeat_interleave.self_Tensor: "output_size",
}


class HostReads(TorchFunctionMode):
    """Every read of a tensor's value from Python."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class SizeReads(TorchDispatchMode):
    """Every op that, on CUDA, reads a size back to the host before it can return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if func in _SIZE_READING_OPS:
            self.ops.append(str(func))
        elif func in _NEEDS_OUTPUT_SIZE and kwargs.get("output_size") is None:
            self.ops.append(f"{func} without output_size")
        elif schema.name.startswith("fbgemm::permute_") and "sparse_data" in schema.name:
            given = args[4] if len(args) > 4 else kwargs.get("permuted_lengths_sum")
            if given is None:
                self.ops.append(f"{func} without permuted_lengths_sum")
        return func(*args, **kwargs)


def count_syncs(case: Case) -> dict:
    rank = dist.get_rank()
    configs = [t.config() for t in case.tables]
    sharded = embshard.shard(EmbeddingBagCollection(tables=configs, device="meta"), case.plan)
    batches = local_batches(case, 0)
    sharded(batches[rank]).values().sum().backward()  # warm: first-use work is not a step's
    weights = {k: embshard.gather_table(v) for k, v in sharded.state_dict().items()}
    reads, sizes = HostReads(), SizeReads()
    with reads, sizes:
        out = sharded(batches[rank])
    forward_reads, forward_ops = list(reads.reads), list(sizes.ops)
    with reads, sizes:
        out.values().sum().backward()
    oracle = EmbeddingBagCollection(tables=configs)
    oracle.load_state_dict(weights)
    return {
        "forward_reads": forward_reads,
        "forward_ops": forward_ops,
        "backward_reads": reads.reads[len(forward_reads) :],
        "backward_ops": sizes.ops[len(forward_ops) :],
        "out": out.values().detach(),
        "expected": oracle(global_batch(batches))
        .values()
        .detach()
        .split([len(b.lengths()) // len(b.keys()) for b in batches])[rank],
    }


def test_a_step_reads_back_from_the_device_once(world):
    check_one_read_a_step(world)


def check_one_read_a_step(world) -> None:
    """On ``world(2)``: one host read in the forward, none in the backward, and no op
    that reads a size back; the step the unsharded module's."""
    case = Case(TABLES, PLAN, (5, 3))
    for report in world(2).run(count_syncs, case):
        assert report["forward_reads"] == ["tolist"], report["forward_reads"]
        assert report["forward_ops"] == [], report["forward_ops"]
        assert report["backward_reads"] == [] and report["backward_ops"] == [], report
        # The counted step is a real one: the pooled rows are the unsharded module's.
        torch.testing.assert_close(report["out"], report["expected"])


def test_first_forward_prints_no_notice(tmp_path):
    script = (
        "import torch.distributed as dist, embshard\n"
        "from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
        "world_size=1)\n"
        "ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name='t', "
        "embedding_dim=4, num_embeddings=10, feature_names=['f'])], device='meta')\n"
        "sharded = embshard.shard(ebc, embshard.ShardingPlan({'t': embshard.table_wise(0)}))\n"
        "out = sharded(KeyedJaggedTensor.from_lengths_sync(['f'], "
        "torch.tensor([1, 2]), torch.tensor([1, 1])))\n"
        "print(out['f'].shape)\n"
        "dist.destroy_process_group()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import torch\n" + script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "torch.Size([2, 4])" in done.stdout
    assert "is_fx_tracing" not in done.stderr, done.stderr
