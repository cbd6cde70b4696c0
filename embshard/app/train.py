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
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass, replace
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
from embshard.app.config import (
    Device,
    OptimizerConfig,
    TrainConfig,
    check_launch,
    launch_device,
    load_config,
)
from embshard.app.data import Batch, CriteoData, Feed, SyntheticData, build_data
from embshard.app.planning import plan_job, topology_for
from embshard.checkpoint.store import first_line, rank_failures
from embshard.errors import CheckpointError, ConfigError, EmbshardError, InputError
from embshard.modules.mesh import default_device, sharding_mesh
from embshard.modules.pipeline import drain, prefetch
from embshard.modules.shard_model import shard_model, sharded_collections, sync_replicas
from embshard.plan.specs import ShardingPlan, plural
from embshard.planner.search import plan_loads
from embshard.planner.topology import format_bytes
from embshard.runtime.teardown import shutdown
from embshard.storage.optimizers import FUSED_OPTIMIZERS, SGD, FusedOptimizer

_stop_requested = False


def _request_stop(signum: int, frame: object) -> None:
    global _stop_requested
    _stop_requested = True


def build_model(config: TrainConfig) -> nn.Module:
    """The unsharded model: tables on ``meta`` (each rank allocates only its shards),
    dense layers on the CPU, so that they start alike on every device (``shard_model``
    moves them to the rank's)."""
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
    topology, dynamic = topology_for(config, world), config.id_maps()
    loads = plan_loads(plan, config.tables, topology, config.batch_size, optimizer, dynamic=dynamic)
    state = f"table weights + {optimizer} state" + (" + id maps" if dynamic else "")
    lines = [plan.to_yaml().rstrip(), f"per rank ({state}):"]
    for load in loads:
        held = ", ".join(load.shards) or "-"
        lines.append(f"  rank {load.rank}: {format_bytes(load.memory)}  {held}")
    return "\n".join(lines)


def evaluate(model: nn.Module, batches: list[Batch], empty: Batch) -> tuple[float, float]:
    """AUC and mean loss over every rank's held-out batches (collective). Ranks may
    hold different numbers: those done step with ``empty`` until every rank is."""
    count = all_reduced([len(batches)], dist.ReduceOp.MAX)  # forward is collective: same count
    preds, labels = [], []
    model.eval()  # dynamic tables look ids up without admitting them
    with torch.no_grad():
        for i in range(int(count)):
            batch = batches[i] if i < len(batches) else empty
            preds.append(model(batch.dense, batch.sparse).squeeze(1))
            labels.append(batch.labels)
    model.train()
    mine = (torch.cat(preds).cpu(), torch.cat(labels).cpu()) if preds else (torch.zeros(0),) * 2
    everyone: list = [None] * dist.get_world_size()  # CPU tensors: unpickled on any rank
    dist.all_gather_object(everyone, mine)
    logits = torch.cat([p for p, _ in everyone])
    targets = torch.cat([t for _, t in everyone])
    if not len(targets):
        return float("nan"), float("nan")
    loss = F.binary_cross_entropy_with_logits(logits, targets)
    return float(binary_auroc(torch.sigmoid(logits), targets.long())), float(loss)


def all_reduced(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """``values`` reduced over the ranks by ``op`` (collective), returned on the CPU;
    they travel on the rank's device, the only one NCCL takes."""
    reduced = torch.tensor(values, device=default_device())
    dist.all_reduce(reduced, op=op)
    return reduced.cpu()


def local_loss(logits: torch.Tensor, labels: torch.Tensor, global_samples: int) -> torch.Tensor:
    """This rank's BCE summed over its samples, times world / ``global_samples``.

    DDP averages the dense gradients over the ranks, and embshard divides the tables'
    gradients by the world size, so both come out as the gradients of the mean BCE
    over the global batch's real samples, whatever each rank holds: a rank with no
    samples adds zero (a mean over its own samples would be NaN), one with a partial
    batch its share. The all-reduced sum of these over the ranks, divided by the world
    size, is that mean.

    With sharding groups embshard divides the tables' gradients by the group's size:
    each group's copy steps on its own batches scaled as the global batch (their mean,
    where the groups hold equal samples), and with SGD the average of the groups'
    steps (``sync_replicas``) is the global batch's.
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
        longest = all_reduced([per_epoch], dist.ReduceOp.MAX)
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
    """The feed's next batch, on the rank's device, its input distribution started
    (collective). A batch that cannot be read (a malformed line) is replaced by an
    empty one and its problem returned: the rank must still join the collectives, and
    the loop's all-reduce tells every rank to stop at the same step."""
    try:
        batch, problem = feed.take(), None
    except Exception as e:
        batch, problem = feed.source.empty_batch(), f"rank {dist.get_rank()}: {e}"
    batch = batch.to(default_device())  # the very object the forward gets: prefetch's
    prefetch(model, batch)
    return batch, problem


def _next_epoch(feed: Feed) -> int:
    """Start the next pass on every rank (collective); its first step's global batch
    size, 0 when no pass is left."""
    if not feed.next_epoch():
        return 0
    samples = all_reduced([feed.pending])
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

    With ``resume``, when torchrun restarted the job, or when the latest checkpoint
    was saved by this very job (a host replaced or added), it continues from the
    latest checkpoint under ``config.checkpoint.dir``, on any world size: rank 0
    decides, and every rank loads the same one. SIGTERM (on any rank) saves a
    checkpoint, if configured, and stops every rank after the step in flight.
    """
    global _stop_requested
    _stop_requested = False
    previous = signal.signal(signal.SIGTERM, _request_stop)
    try:
        _check_shared_checkpoint_dir(config)
        return _train(config, _checkpoint_to_resume(config, resume))
    finally:
        signal.signal(signal.SIGTERM, previous)


def job_id() -> str | None:
    """The job's identity, the same on every host and kept across restarts and
    membership changes: torchrun's rendezvous id (None outside torchrun)."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def _checkpoint_to_resume(config: TrainConfig, resume: bool) -> Path | None:
    """The checkpoint every rank starts from, decided once, on rank 0 (collective).

    The run continues on ``--resume``, after a restart on any host (each torchrun agent
    counts its own restarts: a host started afresh counts 0), or when the latest
    checkpoint is this job's own (a host added or replaced: torchrun counts no
    restart). Finding none, rank 0 warns, naming where it looked, and the run starts
    from step 0."""
    restarts = all_reduced(
        [int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))], dist.ReduceOp.MAX
    )
    decided: list[str | None] = [None]
    if dist.get_rank() == 0:
        root = config.checkpoint.dir
        found = checkpoint.latest(root) if root else None
        reason = "--resume" if resume else f"restart {int(restarts)}" if restarts else None
        if reason is None and found is not None and job_id() is not None:
            reason = "this job's checkpoint" if _saved_by_this_job(found) else None
        if reason is not None and found is None:
            looked = f"no checkpoint in {root}" if root else "the config has no checkpoint: section"
            print(f"embshard: warning: {reason}: {looked}: starting from step 0", file=sys.stderr)
        decided = [str(found) if reason is not None and found is not None else None]
    dist.broadcast_object_list(decided, src=0)
    return None if decided[0] is None else Path(decided[0])


def _saved_by_this_job(path: Path) -> bool:
    """Whether the checkpoint at ``path`` names this job as its saver."""
    try:
        return checkpoint.read_description(path).get("job") == job_id()
    except CheckpointError:
        return False  # not readable as a description: loading it will say why


def _check_shared_checkpoint_dir(config: TrainConfig) -> None:
    """Every rank must see the checkpoint directory rank 0 writes to: a save writes
    each rank's files there and reads them all back (collective). Rank 0 leaves a
    marker; a rank that does not see it stops every rank, before the first step."""
    root = config.checkpoint.dir
    if root is None:
        return
    marker = Path(root) / ".embshard_shared_storage_check"
    token: list[str | None] = [None]
    problem = None
    if dist.get_rank() == 0:
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
            token = [f"{job_id()}:{os.getpid()}:{time.time_ns()}"]
            marker.write_text(token[0])
        except OSError as e:
            problem = f"rank 0: cannot write to checkpoint.dir {root}: {e}"
    dist.broadcast_object_list(token, src=0)
    if problem is None and token[0] is not None:
        try:
            seen = marker.read_text()
        except OSError:
            seen = None
        if seen != token[0]:
            problem = (
                f"rank {dist.get_rank()} does not see the file rank 0 wrote in checkpoint.dir "
                f"{root}: checkpoints need a directory on storage shared by every host"
            )
    try:
        agree(problem, "checking the checkpoint directory")
    finally:
        if dist.get_rank() == 0:
            marker.unlink(missing_ok=True)


def _sharded_model(
    config: TrainConfig, found: Path | None
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The config's model sharded by its plan (its own, or the planner's) on the rank's
    device, its dense optimizer, and the step to start from (checkpoint ``found``'s, if
    any)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = job_ranks_per_host()  # collective: first, on every rank
    hosts = config.topology.ranks_per_host or hosts  # the config's own wins
    plan, report = plan_job(config, world, ranks_per_host=hosts)  # the same on every rank
    group = report.topology.world_size  # the plan's ranks: a sharding group's
    torch.manual_seed(config.seed)  # the dense layers' init: runs are reproducible
    model = shard_model(
        build_model(config),
        plan,
        mesh=sharding_mesh(group) if group < world else None,
        optimizer=fused_optimizer(config.sparse_optimizer),
        seed=config.seed,
        comm_precision=config.comm_precision,
        dynamic=config.id_maps(),
    )
    if rank == 0:
        layout = describe_plan(plan, config, group)
        ranks = f"{plural(world, 'rank')}, {default_device().type} ({dist.get_backend()})"
        if group < world:
            ranks += f", as {world // group} sharding groups of {group}"
        if config.sharding_group_size == "auto":
            ranks += " (the planner's choice of group size)"
        print(f"embshard: {config.model.kind} on {ranks}, plan:\n{layout}", flush=True)
    optimizer = dense_optimizer(config.dense_optimizer, model.parameters())
    start = 0
    if found is not None:
        start = checkpoint.load(found, model, optimizer)
        if rank == 0:
            print(f"embshard: resumed from {found} at step {start}", flush=True)
    return model, optimizer, start


def job_ranks_per_host() -> int | None:
    """The ranks on each host, as torchrun's ``LOCAL_WORLD_SIZE`` gives them, for the
    planner's topology; None where it is not set. Collective: every rank raises the
    same TrainingError where hosts differ, since the planner prices traffic by the host
    each rank is on."""
    given = os.environ.get("LOCAL_WORLD_SIZE")
    mine = int(given) if given and given.isdigit() else None
    found: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    if len(set(found)) > 1:
        ranks: dict[int | None, list[int]] = {}
        for rank, value in enumerate(found):
            ranks.setdefault(value, []).append(rank)
        got = "; ".join(f"{value} on ranks {held}" for value, held in ranks.items())
        raise TrainingError(
            "LOCAL_WORLD_SIZE must be the same on every host (the planner's ranks per "
            f"host), got {got}"
        )
    return found[0]


def _read_data(config: TrainConfig) -> tuple[SyntheticData | CriteoData, list[Batch]]:
    """This rank's data and held-out batches (on the rank's device); a rank that cannot
    read its data stops every rank, naming it (collective), rather than leave the
    others waiting."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem, data, eval_batches = None, None, []
    try:
        data = build_data(config, rank, world)
        held_out = data.eval_batches(config.eval.batches) if config.eval.every else []
        eval_batches = [batch.to(default_device()) for batch in held_out]
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
        checkpoint.save(
            saves.dir,
            model,
            optimizer,
            step=step,
            keep=saves.keep,
            job=job_id(),
            config=dataclasses.asdict(config),
        )
    except CheckpointException as e:  # DCP raises it on every rank
        raise TrainingError(f"{phase} failed: {rank_failures(e)}") from None


def _train(config: TrainConfig, found: Path | None) -> dict:
    """The job's outline: an evaluation before the first step, then training steps
    until the configured steps, the data or a SIGTERM end them, each step logged,
    evaluated and saved on schedule. Failures name the phase they happened in."""
    job, start = _start_job(config, found)
    summary = {"steps": start, "samples": 0}
    loop = _LoopState(step=start, phase=f"step {start}: evaluation", summary=summary)
    with _failures_named(job, loop):
        if config.eval.every and start == 0:
            _evaluate(job, 0)
        _open_data(job, loop)
        while loop.batch is not None:
            _take_next_batch(job, loop)
            loss = _forward_backward(job, loop)
            stats = _all_reduce_step(job, loop, loss)
            ended = _next_pass_if_due(job, loop, stats.stop)
            done = loop.step == config.steps or ended
            loop.batch = None if stats.stop or done else loop.following
            _log_step(job, loop, stats, done)
            _evaluate_if_due(job, loop, done)
            _save_if_due(job, loop, stats.stop or done)
            if stats.stop:
                job.say(f"stopping at step {loop.step}: a rank received SIGTERM")
                loop.summary["stopped"] = True
                break
            if ended:
                job.say(f"the training data ran out at step {loop.step}: every pass is done")
                loop.summary["data_ended"] = True
    return loop.summary


@dataclass(frozen=True)
class _Job:
    """What every step of a run uses on this rank: the config, the sharded model and
    its dense optimizer, the rank's data (with the empty batch that stands in for a
    missing one) and where rank 0 reports."""

    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: SyntheticData | CriteoData
    eval_batches: list[Batch]
    empty: Batch
    metrics: Metrics
    progress: tqdm

    def say(self, line: str) -> None:
        """A line on rank 0's console (tqdm.write prints even where the bar is disabled)."""
        if dist.get_rank() == 0:
            self.progress.write(line)


@dataclass
class _LoopState:
    """Where the training loop is on this rank, from one step to the next."""

    step: int  # steps done
    phase: str  # what the loop is doing: a failure names it
    summary: dict  # what the run returns
    feed: Feed | None = None
    batch: Batch | None = None  # the next step's, its ids sent
    problem: str | None = None  # why that batch could not be read, if it could not
    upcoming: int = 0  # the next step's global batch size
    following: Batch | None = None  # the batch taken ahead of the next step's
    began: float = 0.0  # the logged throughput's clock
    last: float = 0.0
    samples_since: int = 0


@dataclass(frozen=True)
class _StepStats:
    """A step's figures summed over the ranks by the per-step all-reduce."""

    loss: float  # the mean BCE over the global batch
    samples: int
    stop: bool  # a rank received SIGTERM
    skipped: int  # malformed lines skipped so far, every rank's


def _start_job(config: TrainConfig, found: Path | None) -> tuple[_Job, int]:
    """The sharded model, this rank's data, rank 0's metrics log and progress bar; and
    the step to start from."""
    rank = dist.get_rank()
    model, optimizer, start = _sharded_model(config, found)
    data, eval_batches = _read_data(config)
    empty = data.empty_batch().to(default_device())
    metrics = Metrics(config.logging.metrics, rank)
    quiet = rank != 0 or not config.logging.progress
    progress = tqdm(total=config.steps, initial=start, disable=quiet, file=sys.stdout)
    return _Job(config, model, optimizer, data, eval_batches, empty, metrics, progress), start


@contextlib.contextmanager
def _failures_named(job: _Job, loop: _LoopState) -> Iterator[None]:
    """Failures in the loop raised as TrainingErrors naming its phase; then the batch
    taken ahead of the last step (never used) is drained, unless a collective failed,
    and the reports are closed."""
    collectives_failed = False
    try:
        yield
    except InputError as e:  # raised by every rank in the same forward
        raise TrainingError(f"{loop.phase}: {e}") from None
    except TrainingError:
        raise
    except RuntimeError as e:  # a collective failed: a rank is stuck or gone
        collectives_failed = True
        raise TrainingError(
            f"rank {dist.get_rank()}, {loop.phase}: {first_line(e)} (a collective failed: "
            f"another rank may be stuck or gone; timeout_s is {job.config.timeout_s})",
            agreed=False,
        ) from e
    finally:
        if not collectives_failed:
            drain(job.model)
        job.progress.close()
        job.metrics.close()


def _evaluate(job: _Job, step: int) -> tuple[float, float]:
    """AUC and loss on the held-out batches (collective), logged and printed; on
    drifting data, the held-out batches of the stream as it is at ``step``."""
    held_out = job.eval_batches
    if job.data.drifts:
        drawn = job.data.eval_batches(job.config.eval.batches, step)
        held_out = [batch.to(default_device()) for batch in drawn]
    auc, eval_loss = evaluate(job.model, held_out, job.empty)
    job.metrics.write({"step": step, "eval_auc": auc, "eval_loss": eval_loss})
    job.say(f"step {step}: eval AUC {auc:.4f}, eval loss {eval_loss:.4f}")
    return auc, eval_loss


def _open_data(job: _Job, loop: _LoopState) -> None:
    """The training data opened at the loop's step, and its first batch taken."""
    loop.phase = f"step {loop.step}: opening the training data"
    loop.feed, loop.upcoming = _open_feed(job.data, loop.step)
    loop.began = loop.last = time.perf_counter()
    if loop.step < job.config.steps and loop.upcoming:
        loop.batch, loop.problem = _take_ahead(job.model, loop.feed)


def _take_next_batch(job: _Job, loop: _LoopState) -> None:
    """Pipelined: the batch after this step's is taken and its ids sent first."""
    loop.phase = f"step {loop.step + 1}: taking the next batch and distributing its ids"
    loop.following, found = (None, None)
    if loop.step + 1 < job.config.steps:
        loop.following, found = _take_ahead(job.model, loop.feed)
    loop.problem = loop.problem or found


def _forward_backward(job: _Job, loop: _LoopState) -> torch.Tensor:
    """The step's forward, loss, backward and dense optimizer step (the fused optimizer
    updates the tables in the backward), then, with sharding groups, the tables'
    copies averaged (one all-reduce across the groups); its local loss."""
    batch = loop.batch
    loop.phase = f"step {loop.step + 1}: forward (ids and pooled all-to-alls)"
    logits = job.model(batch.dense, batch.sparse).squeeze(1)
    loss = local_loss(logits, batch.labels, loop.upcoming)
    loop.phase = f"step {loop.step + 1}: backward (gradient all-to-all, DDP all-reduce)"
    loss.backward()
    job.optimizer.step()
    job.optimizer.zero_grad()
    loop.phase = f"step {loop.step + 1}: averaging the tables over the sharding groups"
    sync_replicas(job.model)
    return loss


def _all_reduce_step(job: _Job, loop: _LoopState, loss: torch.Tensor) -> _StepStats:
    """The per-step all-reduce (collective) of the loss, the samples and the flags: a
    SIGTERM, the next batch's samples, an unreadable batch (every rank then stops,
    naming it) and the lines skipped. The step is done: it is counted in the summary."""
    loop.phase = f"step {loop.step + 1}: the per-step all-reduce"
    ahead = loop.following.size if loop.following is not None else 0
    flags = [float(_stop_requested), ahead, float(loop.problem is not None), job.data.skipped]
    stats = all_reduced([loss.item(), loop.batch.size, *flags])
    step = _StepStats(
        loss=float(stats[0]) / dist.get_world_size(),
        samples=int(stats[1]),
        stop=bool(stats[2]),
        skipped=int(stats[5]),
    )
    loop.step, loop.upcoming = loop.step + 1, int(stats[3])
    if stats[4]:
        agree(loop.problem, f"stopped after step {loop.step}")
    summary = loop.summary
    summary.update(steps=loop.step, samples=summary["samples"] + step.samples, loss=step.loss)
    if step.skipped:
        summary["skipped_lines"] = step.skipped
    return step


def _next_pass_if_due(job: _Job, loop: _LoopState, stop: bool) -> bool:
    """When every rank's part of this pass is done (the batch taken ahead is empty
    everywhere), the next pass starts and its first batch replaces it; True when no
    pass is left."""
    if loop.upcoming or stop or loop.step == job.config.steps:
        return False
    loop.phase = f"step {loop.step}: starting the next pass"
    loop.upcoming = _next_epoch(loop.feed)
    if loop.upcoming:
        loop.following, loop.problem = _take_ahead(job.model, loop.feed)
    return not loop.upcoming


def _log_step(job: _Job, loop: _LoopState, stats: _StepStats, done: bool) -> None:
    """Every ``logging.every`` steps and at the last: the loss, the samples a second
    since the last log and the dynamic tables' id counts, to the metrics log and the
    progress bar (the counts, at the last, to the summary too)."""
    loop.samples_since += stats.samples
    now = time.perf_counter()
    if loop.step % job.config.logging.every == 0 or done:
        rate = loop.samples_since / (now - loop.last)
        elapsed = now - loop.began
        line = {"step": loop.step, "loss": stats.loss, "samples_per_s": rate, "elapsed_s": elapsed}
        dynamic = _dynamic_stats(job.model)
        job.metrics.write(line | dynamic)
        if done:
            loop.summary.update(dynamic)
        job.progress.set_postfix(loss=f"{stats.loss:.4f}", samples_s=f"{rate:,.0f}")
        loop.last, loop.samples_since = now, 0
    job.progress.update(1)


def _dynamic_stats(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Each dynamic table's ids admitted, evicted and overflowing so far and live now,
    over every rank (collective); empty without dynamic tables."""
    found = {}
    for collection in sharded_collections(model).values():
        found |= {n: dataclasses.asdict(s) for n, s in collection.dynamic_stats().items()}
    return {"dynamic": found} if found else {}


def _evaluate_if_due(job: _Job, loop: _LoopState, done: bool) -> None:
    """Every ``eval.every`` steps and at the last: an evaluation, kept in the summary."""
    every = job.config.eval.every
    if every and (loop.step % every == 0 or done):
        loop.phase = f"step {loop.step}: evaluation"
        auc, eval_loss = _evaluate(job, loop.step)
        loop.summary.update(eval_auc=auc, eval_loss=eval_loss)


def _save_if_due(job: _Job, loop: _LoopState, last: bool) -> None:
    """Every ``checkpoint.every`` steps and at the last step the run makes: a checkpoint."""
    saves = job.config.checkpoint
    if saves.dir and (last or (saves.every and loop.step % saves.every == 0)):
        loop.phase = f"step {loop.step}: saving a checkpoint"
        _save(job.config, job.model, job.optimizer, loop.step, loop.phase)


def init_process_group(timeout: timedelta, device: str = "cpu") -> None:
    """gloo on ``cpu``, NCCL on ``cuda`` (on the GPU LOCAL_RANK names, made current
    first: NCCL's collectives, object ones included, run on the current device), over
    the store torchrun names (MASTER_ADDR, MASTER_PORT).

    When torchrun's agent shares its rendezvous store with the workers (its default),
    that store outlives a restart, and gloo would find the dead attempt's peer
    addresses there: each attempt takes keys under its own prefix. That count is each
    agent's own, so across hosts it can differ: ``embshard train`` sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and rank 0 then hosts a new store every
    rendezvous round, which needs no prefix of its own."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_store else "0"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    prefixed = dist.PrefixStore(f"embshard/attempt_{attempt}", store)
    backend, bound = "gloo", {}
    if device == "cuda":
        gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(gpu)
        backend, bound = "nccl", {"device_id": gpu}
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world, timeout=timeout, **bound
    )


def _group_size(value: str) -> int | str:
    """``--sharding-group-size``: a number, or ``auto``."""
    return value if value == "auto" else int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embshard.app.train", description=__doc__)
    parser.add_argument("--config", required=True, help="training config (YAML)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--device", choices=typing.get_args(Device), help="in place of the config's device"
    )
    parser.add_argument(
        "--sharding-group-size",
        type=_group_size,
        help="in place of the config's sharding_group_size (a number, or auto)",
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if args.sharding_group_size is not None:
            config = replace(config, sharding_group_size=args.sharding_group_size)
        check_launch(config, args.config, int(os.environ["WORLD_SIZE"]), args.resume)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        device = launch_device(config, args.config, local_ranks, args.device)
    except ConfigError as e:
        print(f"embshard: {e}", file=sys.stderr)
        return 2
    try:
        init_process_group(timedelta(seconds=config.timeout_s), device)
    except (RuntimeError, ValueError) as e:  # DistStoreError, DistNetworkError among them
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        failed = f"starting the process group at {where} failed: {first_line(e)}"
        print(f"embshard: rank {os.environ['RANK']}: {failed}", file=sys.stderr, flush=True)
        return 1
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
