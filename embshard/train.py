"""The main job: train a sharded TorchRec DLRM under torchrun.

    torchrun --nproc-per-node 2 -m embshard.train --config configs/small.yaml

Each step: every rank takes its own batch, the sharded model pools and predicts,
BCE loss on the local batch, backward (the fused optimizer updates the tables, DDP
averages the dense gradients), dense optimizer step, then one small all-reduce of
(loss, samples, stop) that feeds the progress bar and lets a SIGTERM on any rank
stop every rank at the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from tqdm import tqdm

from embshard import checkpoint
from embshard.config import ConfigError, OptimizerConfig, TrainConfig, load_config
from embshard.data import Batch, CriteoData, SyntheticData
from embshard.lookup import SGD, Adagrad, FusedOptimizer, RowWiseAdagrad
from embshard.model import shard_model
from embshard.plan import ShardingPlan, local_shards
from embshard.planner import plan_config, shard_name

_stop_requested = False


def _request_stop(signum: int, frame: object) -> None:
    global _stop_requested
    _stop_requested = True


def build_model(config: TrainConfig) -> nn.Module:
    """The unsharded model: tables on ``meta`` (each rank allocates only its shards)."""
    ebc = EmbeddingBagCollection(tables=config.embedding_bag_configs(), device="meta")
    m = config.model
    dense = (m.dense_in_features, m.dense_arch_layer_sizes, m.over_arch_layer_sizes)
    if m.kind == "dlrm_dcn":
        return DLRM_DCN(ebc, *dense, m.dcn_num_layers, m.dcn_low_rank_dim, dense_device="cpu")
    return DLRM(ebc, *dense, dense_device="cpu")


def fused_optimizer(config: OptimizerConfig) -> FusedOptimizer:
    if config.type == "sgd":
        return SGD(lr=config.lr)
    kind = RowWiseAdagrad if config.type == "rowwise_adagrad" else Adagrad
    return kind(lr=config.lr, eps=config.eps)


def dense_optimizer(config: OptimizerConfig, params) -> torch.optim.Optimizer:
    if config.type == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    if config.type == "adam":
        return torch.optim.Adam(params, lr=config.lr, eps=config.eps)
    return torch.optim.Adagrad(params, lr=config.lr, eps=config.eps)


def build_data(config: TrainConfig, rank: int, world: int) -> SyntheticData | CriteoData:
    if config.data.type == "criteo":
        return CriteoData(
            config.data.path,
            config.data.eval_path,
            config.tables,
            config.batch_size,
            rank,
            world,
            config.data.skip_bad_lines,
        )
    dense_in = config.model.dense_in_features
    return SyntheticData(config.tables, dense_in, config.batch_size, config.seed, rank)


def describe_plan(plan: ShardingPlan, config: TrainConfig, world: int) -> str:
    """The plan, and what each rank holds."""
    tables = plan.resolve(config.embedding_bag_configs(), world)
    lines = [plan.to_yaml().rstrip(), "per rank:"]
    for rank in range(world):
        shards = local_shards(tables, rank)
        mib = sum(s.rows * s.cols for _, s in shards) * 4 / 2**20
        held = ", ".join(shard_name(n, s) for n, s in shards)
        lines.append(f"  rank {rank}: {mib:.1f} MiB  {held or '-'}")
    return "\n".join(lines)


def evaluate(model: nn.Module, batches: list[Batch]) -> tuple[float, float]:
    """AUC and mean loss over every rank's held-out batches (collective)."""
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # forward is collective: same count
    preds, labels = [], []
    with torch.no_grad():
        for batch in batches[: int(count)]:
            preds.append(model(batch.dense, batch.sparse).squeeze(1))
            labels.append(batch.labels)
    mine = (torch.cat(preds), torch.cat(labels)) if preds else (torch.zeros(0), torch.zeros(0))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    logits = torch.cat([p for p, _ in everyone])
    targets = torch.cat([t for _, t in everyone])
    if not len(targets):
        return float("nan"), float("nan")
    loss = F.binary_cross_entropy_with_logits(logits, targets)
    return float(binary_auroc(torch.sigmoid(logits), targets.long())), float(loss)


class Metrics:
    """Rank 0's JSONL log (appended) and console lines."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.file = None
        if path and rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")  # noqa: SIM115 - closed by close()

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def train(config: TrainConfig, resume: bool = False) -> dict:
    """Run the training loop on an initialized process group; rank 0 reports.

    With ``resume`` (or when torchrun restarted the job), it continues from the latest
    checkpoint under ``config.checkpoint.dir``, on any world size. SIGTERM (on any
    rank) saves a checkpoint, if configured, and stops every rank after the step in
    flight.
    """
    global _stop_requested
    _stop_requested = False
    previous = signal.signal(signal.SIGTERM, _request_stop)
    try:
        return _train(config, resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train(config: TrainConfig, resume: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = config.sharding_plan() or plan_config(config, world)[0]
    torch.manual_seed(config.seed)  # the dense layers' init: runs are reproducible
    model = shard_model(
        build_model(config),
        plan,
        optimizer=fused_optimizer(config.sparse_optimizer),
        seed=config.seed,
    )
    if rank == 0:
        layout = describe_plan(plan, config, world)
        print(f"embshard: {config.model.kind} on {world} ranks, plan:\n{layout}", flush=True)
    optimizer = dense_optimizer(config.dense_optimizer, model.parameters())
    saves = config.checkpoint
    start = 0
    found = checkpoint.latest(saves.dir) if resume and saves.dir else None
    if found is not None:
        start = checkpoint.load(found, model, optimizer)
        if rank == 0:
            print(f"embshard: resumed from {found} at step {start}", flush=True)
    data = build_data(config, rank, world)
    eval_batches = data.eval_batches(config.eval.batches) if config.eval.every else []
    metrics = Metrics(config.logging.metrics, rank)
    quiet = rank != 0 or not config.logging.progress
    progress = tqdm(total=config.steps, initial=start, disable=quiet, file=sys.stdout)
    summary: dict = {"steps": start}
    if config.eval.every and start == 0:
        auc, eval_loss = evaluate(model, eval_batches)
        metrics.write({"step": 0, "eval_auc": auc, "eval_loss": eval_loss})
        progress.write(f"step 0: eval AUC {auc:.4f}, eval loss {eval_loss:.4f}")
    began = last = time.perf_counter()
    samples_since = 0
    for step, batch in zip(range(start, config.steps), data.train_batches(start)):
        logits = model(batch.dense, batch.sparse).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        stats = torch.tensor([loss.item() * batch.size, batch.size, float(_stop_requested)])
        dist.all_reduce(stats)
        global_loss, samples, stop = float(stats[0] / stats[1]), int(stats[1]), bool(stats[2])
        samples_since += samples
        summary.update(steps=step + 1, loss=global_loss)
        now = time.perf_counter()
        if (step + 1) % config.logging.every == 0 or step + 1 == config.steps:
            rate = samples_since / (now - last)
            metrics.write(
                {
                    "step": step + 1,
                    "loss": global_loss,
                    "samples_per_s": rate,
                    "elapsed_s": now - began,
                }
            )
            progress.set_postfix(loss=f"{global_loss:.4f}", samples_s=f"{rate:,.0f}")
            last, samples_since = now, 0
        progress.update(1)
        if config.eval.every and ((step + 1) % config.eval.every == 0 or step + 1 == config.steps):
            auc, eval_loss = evaluate(model, eval_batches)
            metrics.write({"step": step + 1, "eval_auc": auc, "eval_loss": eval_loss})
            progress.write(f"step {step + 1}: eval AUC {auc:.4f}, eval loss {eval_loss:.4f}")
            summary.update(eval_auc=auc, eval_loss=eval_loss)
        done = step + 1 == config.steps
        if saves.dir and (stop or done or (saves.every and (step + 1) % saves.every == 0)):
            checkpoint.save(saves.dir, model, optimizer, step=step + 1, keep=saves.keep)
        if stop:
            progress.write(f"stopping at step {step + 1}: a rank received SIGTERM")
            summary["stopped"] = True
            break
    progress.close()
    metrics.close()
    return summary


def init_process_group(timeout: timedelta) -> None:
    """gloo over torchrun's store, under a prefix per restart attempt: torchrun keeps
    its store across restarts, and gloo would otherwise find the dead attempt's peer
    addresses there and fail to connect."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    prefixed = dist.PrefixStore(f"embshard/attempt_{attempt}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embshard.train", description=__doc__)
    parser.add_argument("--config", required=True, help="training config (YAML)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"embshard: {e}", file=sys.stderr)
        return 2
    init_process_group(timedelta(seconds=config.timeout_s))
    try:
        summary = train(config, resume=args.resume)
        if dist.get_rank() == 0:
            print(f"embshard: done {json.dumps(summary)}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
