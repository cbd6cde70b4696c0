"""The main job: train a sharded TorchRec DLRM under torchrun.

    torchrun --nproc-per-node 2 -m embshard.app.train --config configs/small.yaml

Each step, pipelined as TorchRec's TrainPipelineSparseDist: the next batch is taken
and its input distribution started (``embshard.modules.pipeline.prefetch``), then the
current one's: every rank takes its own batch, the sharded model pools and predicts,
BCE loss on the local batch, backward (the fused optimizer updates the tables, DDP
averages the dense gradients), dense optimizer step, then one small all-reduce of
(loss, samples, stop, next batch's samples) that feeds the progress bar, lets a
SIGTERM on any rank stop every rank at the same step, and tells every rank when the
ranks' parts of the data are all used up. A rank whose part runs out first keeps
stepping with empty batches until then: the sharded forward is collective.
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
from torch.distributed.checkpoint.api import CheckpointException
from torchmetrics.functional.classification import binary_auroc
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from tqdm import tqdm

from embshard import checkpoint
from embshard.app.config import OptimizerConfig, TrainConfig, check_launch, load_config
from embshard.app.data import Batch, CriteoData, Feed, SyntheticData, build_data
from embshard.app.planning import plan_config, topology_for
from embshard.checkpoint.store import first_line, rank_failures
from embshard.errors import ConfigError, EmbshardError, InputError
from embshard.modules.model import shard_model
from embshard.modules.pipeline import drain, prefetch
from embshard.plan.specs import ShardingPlan
from embshard.planner.search import format_bytes, plan_loads
from embshard.runtime.teardown import shutdown
from embshard.storage.optimizers import FUSED_OPTIMIZERS, SGD, FusedOptimizer

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
    kind = FUSED_OPTIMIZERS[config.type]
    return kind(lr=config.lr) if kind is SGD else kind(lr=config.lr, eps=config.eps)


def dense_optimizer(config: OptimizerConfig, params) -> torch.optim.Optimizer:
    if config.type == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    if config.type == "adam":
        return torch.optim.Adam(params, lr=config.lr, eps=config.eps)
    return torch.optim.Adagrad(params, lr=config.lr, eps=config.eps)


def describe_plan(plan: ShardingPlan, config: TrainConfig, world: int) -> str:
    """The plan, and what each rank holds, in the memory ``embshard plan`` reports."""
    optimizer = config.sparse_optimizer.type
    loads = plan_loads(
        plan, config.tables, topology_for(config, world), config.batch_size, optimizer
    )
    lines = [plan.to_yaml().rstrip(), f"per rank (table weights + {optimizer} state):"]
    for load in loads:
        held = ", ".join(load.shards) or "-"
        lines.append(f"  rank {load.rank}: {format_bytes(load.memory)}  {held}")
    return "\n".join(lines)


def evaluate(model: nn.Module, batches: list[Batch], empty: Batch) -> tuple[float, float]:
    """AUC and mean loss over every rank's held-out batches (collective). Ranks may
    hold different numbers: those done step with ``empty`` until every rank is."""
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # forward is collective: same count
    preds, labels = [], []
    with torch.no_grad():
        for i in range(int(count)):
            batch = batches[i] if i < len(batches) else empty
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


def local_loss(logits: torch.Tensor, labels: torch.Tensor, global_samples: int) -> torch.Tensor:
    """This rank's BCE summed over its samples, times world / ``global_samples``.

    DDP averages the dense gradients over the ranks, and embshard divides the tables'
    gradients by the world size, so both come out as the gradients of the mean BCE
    over the global batch's real samples, whatever each rank holds: a rank with no
    samples adds zero (a mean over its own samples would be NaN), one with a partial
    batch its share. The all-reduced sum of these over the ranks, divided by the world
    size, is that mean.
    """
    summed = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return summed * (dist.get_world_size() / global_samples)


def _open_feed(data: SyntheticData | CriteoData, start: int) -> tuple[Feed, int]:
    """The feed at step ``start``, and the global batch size of its first step.

    Resuming places ``start`` in its pass by the longest rank's batches per pass (one
    all-reduce, at start-up only).
    """
    epoch, skip = 0, start
    per_epoch = data.batches_per_epoch() if start else None
    if per_epoch is not None:
        longest = torch.tensor([per_epoch])
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        epoch, skip = divmod(start, max(int(longest), 1))
    feed = Feed(data, epoch, skip)
    return feed, _next_epoch(feed)


class TrainingError(EmbshardError, RuntimeError):
    """Training stopped on a failure. ``agreed``: every rank raises it, with the same
    message (a bad batch or data line on any rank); else it is this rank's own (a
    collective that failed because another rank is stuck or gone)."""

    def __init__(self, message: str, agreed: bool = True) -> None:
        super().__init__(message)
        self.agreed = agreed


def agree(problem: str | None, where: str) -> None:
    """Raise the same TrainingError on every rank if any rank has a problem, naming
    each (collective: one all_gather_object, only when the ranks know to call it)."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p is not None]
    if found:
        raise TrainingError(f"{where}: " + "; ".join(found))


def _take_ahead(model: nn.Module, feed: Feed) -> tuple[Batch, str | None]:
    """The feed's next batch, its input distribution started (collective). A batch
    that cannot be read (a malformed line) is replaced by an empty one and its problem
    returned: the rank must still join the collectives, and the loop's all-reduce
    tells every rank to stop at the same step."""
    try:
        batch, problem = feed.take(), None
    except Exception as e:
        batch, problem = feed.source.empty_batch(), f"rank {dist.get_rank()}: {e}"
    prefetch(model, batch)
    return batch, problem


def _next_epoch(feed: Feed) -> int:
    """Start the next pass on every rank (collective); its first step's global batch
    size, 0 when no pass is left."""
    if not feed.next_epoch():
        return 0
    samples = torch.tensor([feed.pending])
    dist.all_reduce(samples)
    if not int(samples):
        raise ValueError(
            "no rank has a training sample: every line was skipped or the data is empty"
        )
    return int(samples)


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
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    resuming = "--resume" if resume else f"restart {restart}" if restart else None
    try:
        return _train(config, resuming)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _resume_from(config: TrainConfig, resuming: str | None) -> Path | None:
    """The latest checkpoint, when the run resumes (``resuming`` says why: --resume or
    a restart). Finding none, rank 0 warns, naming where it looked, and the run
    starts from step 0."""
    root = config.checkpoint.dir
    if resuming is None:
        return None
    found = checkpoint.latest(root) if root else None
    if found is None and dist.get_rank() == 0:
        looked = f"no checkpoint in {root}" if root else "the config has no checkpoint: section"
        print(f"embshard: warning: {resuming}: {looked}: starting from step 0", file=sys.stderr)
    return found


def _sharded_model(
    config: TrainConfig, resuming: str | None
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The config's model sharded by its plan (its own, or the planner's), its dense
    optimizer, and the step to start from (a checkpoint's, when resuming)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = plan_config(config, world)[0]
    torch.manual_seed(config.seed)  # the dense layers' init: runs are reproducible
    model = shard_model(
        build_model(config),
        plan,
        optimizer=fused_optimizer(config.sparse_optimizer),
        seed=config.seed,
        comm_precision=config.comm_precision,
    )
    if rank == 0:
        layout = describe_plan(plan, config, world)
        print(f"embshard: {config.model.kind} on {world} ranks, plan:\n{layout}", flush=True)
    optimizer = dense_optimizer(config.dense_optimizer, model.parameters())
    start = 0
    found = _resume_from(config, resuming)
    if found is not None:
        start = checkpoint.load(found, model, optimizer)
        if rank == 0:
            print(f"embshard: resumed from {found} at step {start}", flush=True)
    return model, optimizer, start


def _read_data(config: TrainConfig) -> tuple[SyntheticData | CriteoData, list[Batch]]:
    """This rank's data and held-out batches; a rank that cannot read its data stops
    every rank, naming it (collective), rather than leave the others waiting."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem, data, eval_batches = None, None, []
    try:
        data = build_data(config, rank, world)
        eval_batches = data.eval_batches(config.eval.batches) if config.eval.every else []
    except Exception as e:
        problem = f"rank {rank}: {e}"
    agree(problem, "reading the data")
    return data, eval_batches


def _save(
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    phase: str,
) -> None:
    """A checkpoint of ``step`` (collective); a failed save on any rank stops every
    rank with what failed where."""
    saves = config.checkpoint
    try:
        checkpoint.save(saves.dir, model, optimizer, step=step, keep=saves.keep)
    except CheckpointException as e:  # DCP raises it on every rank
        raise TrainingError(f"{phase} failed: {rank_failures(e)}") from None


def _train(config: TrainConfig, resuming: str | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, start = _sharded_model(config, resuming)
    data, eval_batches = _read_data(config)
    empty = data.empty_batch()
    saves = config.checkpoint
    metrics = Metrics(config.logging.metrics, rank)
    quiet = rank != 0 or not config.logging.progress
    progress = tqdm(total=config.steps, initial=start, disable=quiet, file=sys.stdout)

    def say(line: str) -> None:  # tqdm.write prints even where the bar is disabled
        if rank == 0:
            progress.write(line)

    def evaluation(step: int) -> tuple[float, float]:
        auc, eval_loss = evaluate(model, eval_batches, empty)
        metrics.write({"step": step, "eval_auc": auc, "eval_loss": eval_loss})
        say(f"step {step}: eval AUC {auc:.4f}, eval loss {eval_loss:.4f}")
        return auc, eval_loss

    summary: dict = {"steps": start, "samples": 0}
    phase, collectives_failed = f"step {start}: evaluation", False
    try:
        if config.eval.every and start == 0:
            evaluation(0)
        phase = f"step {start}: opening the training data"
        feed, upcoming = _open_feed(data, start)
        began = last = time.perf_counter()
        samples_since, step = 0, start
        batch, problem = (None, None)
        if step < config.steps and upcoming:
            batch, problem = _take_ahead(model, feed)
        while batch is not None:
            phase = f"step {step + 1}: taking the next batch and distributing its ids"
            following, found = (None, None)
            if step + 1 < config.steps:  # pipelined: the next batch's ids travel first
                following, found = _take_ahead(model, feed)
            problem = problem or found
            phase = f"step {step + 1}: forward (ids and pooled all-to-alls)"
            logits = model(batch.dense, batch.sparse).squeeze(1)
            loss = local_loss(logits, batch.labels, upcoming)
            phase = f"step {step + 1}: backward (gradient all-to-all, DDP all-reduce)"
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

            phase = f"step {step + 1}: the per-step all-reduce"
            ahead = following.size if following is not None else 0
            flags = [float(_stop_requested), ahead, float(problem is not None), data.skipped]
            stats = torch.tensor([loss.item(), batch.size, *flags])
            dist.all_reduce(stats)
            global_loss, samples = float(stats[0]) / world, int(stats[1])
            stop, upcoming = bool(stats[2]), int(stats[3])
            step += 1
            if stats[4]:
                agree(problem, f"stopped after step {step}")
            ended = False
            if not (upcoming or stop or step == config.steps):
                # Every rank's part of this pass is done: the batch taken ahead is empty
                # everywhere; the next pass's first batch replaces it.
                phase = f"step {step}: starting the next pass"
                upcoming = _next_epoch(feed)
                ended = not upcoming
                if upcoming:
                    following, problem = _take_ahead(model, feed)
            done = step == config.steps or ended
            batch = None if stop or done else following
            samples_since += samples
            summary.update(steps=step, samples=summary["samples"] + samples, loss=global_loss)
            if stats[5]:
                summary["skipped_lines"] = int(stats[5])
            now = time.perf_counter()
            if step % config.logging.every == 0 or done:
                rate = samples_since / (now - last)
                elapsed = now - began
                metrics.write(
                    {"step": step, "loss": global_loss, "samples_per_s": rate, "elapsed_s": elapsed}
                )
                progress.set_postfix(loss=f"{global_loss:.4f}", samples_s=f"{rate:,.0f}")
                last, samples_since = now, 0
            progress.update(1)
            if config.eval.every and (step % config.eval.every == 0 or done):
                phase = f"step {step}: evaluation"
                auc, eval_loss = evaluation(step)
                summary.update(eval_auc=auc, eval_loss=eval_loss)
            if saves.dir and (stop or done or (saves.every and step % saves.every == 0)):
                phase = f"step {step}: saving a checkpoint"
                _save(config, model, optimizer, step, phase)
            if stop:
                say(f"stopping at step {step}: a rank received SIGTERM")
                summary["stopped"] = True
                break
            if ended:
                say(f"the training data ran out at step {step}: every pass is done")
                summary["data_ended"] = True
    except InputError as e:  # raised by every rank in the same forward
        raise TrainingError(f"{phase}: {e}") from None
    except TrainingError:
        raise
    except RuntimeError as e:  # a collective failed: a rank is stuck or gone
        collectives_failed = True
        raise TrainingError(
            f"rank {rank}, {phase}: {first_line(e)} (a collective failed: another "
            f"rank may be stuck or gone; timeout_s is {config.timeout_s})",
            agreed=False,
        ) from e
    finally:
        if not collectives_failed:
            drain(model)  # the batch taken ahead of the last step is never used
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
    parser = argparse.ArgumentParser(prog="python -m embshard.app.train", description=__doc__)
    parser.add_argument("--config", required=True, help="training config (YAML)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        check_launch(config, args.config, int(os.environ["WORLD_SIZE"]), args.resume)
    except ConfigError as e:
        print(f"embshard: {e}", file=sys.stderr)
        return 2
    init_process_group(timedelta(seconds=config.timeout_s))
    try:
        summary = train(config, resume=args.resume)
        if dist.get_rank() == 0:
            print(f"embshard: done {json.dumps(summary)}", flush=True)
    except TrainingError as e:
        if dist.get_rank() == 0 or not e.agreed:  # an agreed message, printed once
            print(f"embshard: {e}", file=sys.stderr, flush=True)
        if e.agreed:
            dist.barrier()  # leave together: torchrun stops the others at the first exit
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    shutdown(main())  # main destroyed the process group: this ends the process cleanly
