"""A user's script under torchrun ends cleanly with ``embshard.shutdown()``, launch
after launch, on ranks whose gloo threads are slow (tests/slow_gloo_threads.py: the
busy machine on which torch 2.13 aborts a process at exit). The same script ending
with ``dist.destroy_process_group()`` aborts there, which shows that the harness
opens the window the first test must survive (docs/faults.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "slow_gloo_threads.py"
# On slow gloo threads the script ending with destroy_process_group aborted 10 launches
# in 10 (19 of 20 ranks, docs/faults.md): 3 launches of an ending that aborts that often
# all pass less than once in a million (as is, 4 launches in 30 aborted).
LAUNCHES = 3
# The ending that aborts, launched until it does: it aborts most launches, so this
# usually costs one, and a busy machine that closes the window in some still finds it.
CONTROL_LAUNCHES = 6

SCRIPT = '''\
"""A user's script: a DLRM sharded by shard_model, two training steps, a table gathered,
a checkpoint saved and loaded, the ranks' losses gathered."""

import sys

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

import embshard
from embshard import checkpoint

dist.init_process_group("gloo")
rank = dist.get_rank()
tables = [
    EmbeddingBagConfig(name="user", num_embeddings=100, embedding_dim=8, feature_names=["uid"]),
    EmbeddingBagConfig(name="item", num_embeddings=500, embedding_dim=8, feature_names=["iid"]),
]
plan = embshard.ShardingPlan({"user": embshard.table_wise(rank=0), "item": embshard.row_wise()})
dlrm = DLRM(
    EmbeddingBagCollection(tables=tables, device="meta"),
    dense_in_features=4,
    dense_arch_layer_sizes=[8, 8],
    over_arch_layer_sizes=[8, 1],
)
model = embshard.shard_model(dlrm, plan, optimizer=embshard.SGD(lr=0.1))
dense_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batch = KeyedJaggedTensor(
    keys=["uid", "iid"],
    values=torch.tensor([rank, 7, 400 + rank, 12, 13]),
    lengths=torch.tensor([1, 1, 1, 2]),
)
for _ in range(2):
    loss = model(torch.ones(2, 4), batch).pow(2).sum()
    loss.backward()
    dense_optimizer.step()
    dense_optimizer.zero_grad()
item = embshard.gather_table(model.module.sparse_arch.embedding_bag_collection.weights["item"])
checkpoint.save(sys.argv[1], model, step=2)
checkpoint.load(sys.argv[1], model)
losses = [None] * dist.get_world_size()
dist.all_gather_object(losses, round(loss.item(), 6))
print(f"rank {rank} done: item table {tuple(item.shape)}, losses {losses}")
'''


def launch(script: Path, checkpoints: Path) -> tuple[str, str]:
    """How one torchrun launch of ``script`` on 2 slow-threaded ranks ended ("exited 0",
    "aborted", "hung", "exited N"), and its output."""
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HARNESS), str(script), str(checkpoints)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)  # the agent and both ranks
        return "hung", run.communicate()[0]
    if "terminate called" in output:
        return "aborted", output
    return f"exited {run.returncode}", output


def launches(tmp_path: Path, ending: str) -> list[tuple[str, str]]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT + ending + "\n")
    return [launch(script, tmp_path / f"checkpoints_{i}") for i in range(LAUNCHES)]


def ranks_done(output: str) -> list[str]:
    """The ranks that printed their last line (torchrun's ranks write unbuffered, so
    their lines can interleave)."""
    return sorted(re.findall(r"rank (\d) done: ", output))


def test_a_script_ending_with_shutdown_exits_cleanly_every_time(tmp_path):
    for ended, output in launches(tmp_path, "embshard.shutdown()"):
        assert ended == "exited 0", output[-3000:]
        assert ranks_done(output) == ["0", "1"], output[-3000:]  # printed before leaving


def test_the_same_script_ending_with_destroy_process_group_aborts_on_slow_threads(tmp_path):
    """Launched until one launch aborts (or hangs), at most ``CONTROL_LAUNCHES`` times: a
    busy machine makes the harness's window rarer, not absent."""
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT + "dist.destroy_process_group()\n")
    ends = []
    for i in range(CONTROL_LAUNCHES):
        ended, output = launch(script, tmp_path / f"checkpoints_{i}")
        assert ended in ("exited 0", "aborted", "hung"), output[-3000:]  # fails only at exit
        ends.append(ended)
        if ended != "exited 0":
            break
    assert ends[-1] in ("aborted", "hung"), ends
