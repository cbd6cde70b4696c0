"""``embshard export`` and ``embshard predict``: a training job's checkpoint made a
serving artifact (quantized tables, the exported program), and that artifact scoring
the job's data formats, with throughput and AUC.

The artifact is ``embshard.serving.export``'s folder plus the training config
(``config.yaml``, the one the checkpoint carries unless one is given), which says how
to read data for it. Scoring runs the exported program itself, as a predictor would,
not embshard's modules. A sharded artifact (``--world-size``) is
``embshard.serving.artifact``'s folder; its predictor is a gloo world of that many
processes running embshard's sharded collections.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml
from torchmetrics.functional.classification import binary_auroc
from tqdm import tqdm

from embshard import checkpoint
from embshard.app.config import TrainConfig, load_config
from embshard.app.data import Batch, CriteoData, SyntheticData, empty_batch
from embshard.app.planning import plan_config
from embshard.app.train import build_model
from embshard.checkpoint.store import saved_config
from embshard.errors import CheckpointError, EmbshardError
from embshard.plan.specs import ShardingPlan
from embshard.serving.artifact import SHARDS, load_sharded, write_sharded
from embshard.serving.export import MANIFEST, PROGRAM, Manifest, export_model
from embshard.serving.id_maps import saved_maps, table_of
from embshard.serving.model import checkpoint_weights, from_checkpoint

CONFIG = "config.yaml"
SYNTHETIC = "synthetic"  # DATA that names the config's synthetic held-out batches


def serving_model(path: str | Path, config: TrainConfig, precision: str) -> torch.nn.Module:
    """The config's model with the checkpoint's weights, its tables quantized."""
    return from_checkpoint(path, build_model(config), precision, config.id_maps())


def job_config(path: Path, config_path: str | Path | None) -> tuple[TrainConfig, str]:
    """The training config and its YAML text: ``config_path``'s, else the one the
    checkpoint carries (its bytes checked against their checksums first)."""
    if config_path is not None:
        return load_config(config_path, check_files=False), Path(config_path).read_text()
    saved = saved_config(path)
    if saved is None:
        raise CheckpointError(
            f"{path} does not carry its training config (saved before embshard kept it, "
            "or not by `embshard train`): pass --config"
        )
    text = yaml.safe_dump(saved, sort_keys=False)
    with tempfile.TemporaryDirectory(prefix="embshard-export-") as folder:
        (Path(folder) / CONFIG).write_text(text)
        return load_config(Path(folder) / CONFIG, check_files=False), text


def export_checkpoint(
    path: str | Path,
    out: str | Path,
    precision: str,
    config_path: str | Path | None = None,
    world_size: int | None = None,
    plan_path: str | Path | None = None,
) -> Manifest:
    """Write the serving artifact of checkpoint ``path`` (a step or a root, for its
    latest) into the folder ``out``: for one host (the exported program), or sharded
    over ``world_size`` ranks by the plan at ``plan_path`` (default: the planner's, or
    the config's own). The checkpoint's bytes are checked against its checksums first."""
    path = checkpoint.resolve(path)
    found = checkpoint.verify(path)
    if found.bad:
        bad = ", ".join(str(c) for c in found.bad)
        raise CheckpointError(f"{path}: corrupt checkpoint, not matching its checksums: {bad}")
    config, text = job_config(path, config_path)
    model = build_model(config)
    extra = {"checkpoint": str(path), "step": checkpoint.describe(path)["step"]}
    dense_in = config.dense_in_features
    if world_size is None:
        served = from_checkpoint(path, model, precision, config.id_maps())
        manifest = export_model(served, out, dense_in, extra)
    else:
        tables = config.embedding_bag_configs()
        if plan_path is not None:
            plan = ShardingPlan.load(plan_path, tables, world_size)
        else:
            plan, _ = plan_config(config, world_size)
        weights, dense = checkpoint_weights(path, model)
        maps = saved_maps(path, config.id_maps())
        dynamic = {table_of(key): m for key, m in maps.items()}
        manifest = write_sharded(
            model, weights, dense, plan, world_size, precision, out, dense_in, extra, dynamic
        )
    (Path(out) / CONFIG).write_text(text)
    return manifest


@dataclass(frozen=True)
class Scores:
    """What scoring gives: the samples, the time in the program, each batch's latency,
    and AUC and loss from the labels."""

    samples: int
    seconds: float  # the program's calls only (reading data excluded)
    batch_latency_ms: list[float]
    auc: float | None  # None where there are no labels of both classes
    loss: float | None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else float("nan")

    def summary(self) -> dict:
        """The figures, latency as its median and 99th percentile."""
        latency = torch.tensor(self.batch_latency_ms or [float("nan")], dtype=torch.float64)
        return {
            "samples": self.samples,
            "seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "batch_latency_ms_p50": float(latency.quantile(0.5)),
            "batch_latency_ms_p99": float(latency.quantile(0.99)),
            "auc": self.auc,
            "loss": self.loss,
        }


def load_program(artifact: str | Path) -> torch.nn.Module:
    """The artifact's exported program, callable as ``(dense, ids, lengths)``."""
    import fbgemm_gpu  # noqa: F401 - registers the lookup ops the program calls

    return torch.export.load(Path(artifact) / PROGRAM).module()


def artifact_batches(
    artifact: str | Path, data: str, batch_size: int | None, batches: int | None
) -> Iterator[Batch]:
    """Batches of ``data`` for the artifact: a Criteo TSV file, read whole, or
    ``synthetic``: the training job's synthetic held-out batches (``batches`` of them,
    default the config's ``eval.batches``; with drifting ids, as the stream is at the
    checkpoint's step, as the job's evaluation draws them)."""
    config = load_config(Path(artifact) / CONFIG, check_files=False)
    size = batch_size or config.batch_size
    if (data == SYNTHETIC) != (config.data.type == SYNTHETIC):
        wanted = "`synthetic`" if config.data.type == SYNTHETIC else "a Criteo TSV file"
        raise ValueError(
            f"{artifact}'s model was trained on {config.data.type} data: DATA must be {wanted}"
        )
    if data == SYNTHETIC:
        source = SyntheticData(
            config.tables, config.dense_in_features, size, config.seed, 0, config.data.drift
        )
        # Drifting ids: the held-out batches of the stream at the checkpoint's step.
        step = Manifest.read(artifact).extra.get("step") if source.drifts else None
        return (source.batch(i, "eval", step) for i in range(batches or config.eval.batches))
    criteo = CriteoData(data, None, config.tables, size, 0, 1, epochs=1)
    batches_read = criteo.epoch_batches()
    return batches_read if batches is None else (b for _, b in zip(range(batches), batches_read))


def score(
    program: torch.nn.Module, manifest: Manifest, batches: Iterable[Batch], progress: bool = True
) -> tuple[Scores, torch.Tensor]:
    """Every batch through the exported program; the scores and the logits."""
    logits, labels, latency = [], [], []
    bar = tqdm(batches, desc="scoring", unit="batch", file=sys.stderr, disable=not progress)
    samples = 0
    for batch in bar:
        check_features(batch, manifest)
        began = time.perf_counter()
        out = program(batch.dense, batch.sparse.values(), batch.sparse.lengths())
        latency.append((time.perf_counter() - began) * 1e3)
        logits.append(out.reshape(-1))
        labels.append(batch.labels)
        samples += batch.size
        bar.set_postfix(samples_s=f"{samples / (sum(latency) / 1e3):,.0f}")
    every = torch.cat(logits)
    return scores_of(every, torch.cat(labels), latency), every


def check_features(batch: Batch, manifest: Manifest) -> None:
    if batch.sparse.keys() != manifest.features:
        raise ValueError(
            f"the data's features {batch.sparse.keys()} are not the model's {manifest.features}"
        )


def scores_of(logits: torch.Tensor, labels: torch.Tensor, latency: list[float]) -> Scores:
    """The figures of every sample's logit and label, ``latency`` each batch's (ms)."""
    both = bool(len(labels)) and 0 < float(labels.sum()) < len(labels)
    return Scores(
        samples=len(labels),
        seconds=sum(latency) / 1e3,
        batch_latency_ms=latency,
        auc=float(binary_auroc(torch.sigmoid(logits), labels.long())) if both else None,
        loss=float(F.binary_cross_entropy_with_logits(logits, labels)) if len(labels) else None,
    )


def predict(
    artifact: str | Path,
    data: str,
    batch_size: int | None = None,
    batches: int | None = None,
    progress: bool = True,
) -> tuple[Scores, torch.Tensor]:
    """Score ``data`` with the artifact's program: the scores and every sample's logit."""
    manifest = Manifest.read(artifact)
    program = load_program(artifact)
    return score(program, manifest, artifact_batches(artifact, data, batch_size, batches), progress)


def is_artifact(path: str | Path) -> bool:
    """Whether ``path`` holds what ``embshard export`` writes, one-host or sharded."""
    path = Path(path)
    served = (path / PROGRAM).is_file() or (path / SHARDS).is_dir()
    return served and all((path / name).is_file() for name in (MANIFEST, CONFIG))


def predict_sharded(
    artifact: str | Path,
    data: str,
    batch_size: int | None = None,
    batches: int | None = None,
    nproc: int | None = None,
) -> tuple[Scores, torch.Tensor]:
    """Score ``data`` with a sharded artifact in a gloo world of its ranks on this host
    (``nproc``, if given, must be its world size): rank ``r`` scores batches ``r, r +
    nproc, ...``, each step every rank one batch (or none) at once. A batch's latency
    is its step's, the slowest rank's. The scores and every sample's logit."""
    manifest = Manifest.read(artifact)
    world = manifest.sharded["world_size"]
    if nproc is not None and nproc != world:
        raise ValueError(f"{artifact} is sharded over {world} ranks: --nproc must be {world}")
    with tempfile.TemporaryDirectory(prefix="embshard-predict-") as folder:
        args = (world, folder, str(artifact), data, batch_size, batches)
        try:
            mp.start_processes(_score_rank, args, nprocs=world, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            said = sorted(Path(folder).glob("error_*"))
            if not said:
                raise
            raise ValueError(said[0].read_text()) from None
        result = torch.load(Path(folder) / "scores.pt", weights_only=True)
    return scores_of(result["logits"], result["labels"], result["latency"]), result["logits"]


def _score_rank(
    rank: int,
    world: int,
    folder: str,
    artifact: str,
    data: str,
    batch_size: int | None,
    batches: int | None,
) -> None:
    """One rank of ``predict_sharded``: its batches through the sharded model; rank 0
    gathers every logit and latency into ``folder/scores.pt``. A bad artifact or data
    is written to ``folder/error_<rank>`` (the same on every rank)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        manifest = Manifest.read(artifact)
        config = load_config(Path(artifact) / CONFIG, check_files=False)
        model = load_sharded(artifact, build_model(config))
        every = list(artifact_batches(artifact, data, batch_size, batches))
        mine, steps = every[rank::world], -(-len(every) // world)
        empty = empty_batch(manifest.features, manifest.dense_in)
        logits, latency = [], []
        for step in range(steps):
            batch = mine[step] if step < len(mine) else empty
            check_features(batch, manifest)
            dist.barrier()  # a step starts on every rank at once
            began = time.perf_counter()
            logits.append(model(batch.dense, batch.sparse).reshape(-1))
            latency.append((time.perf_counter() - began) * 1e3)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (logits, latency))
        if rank == 0:
            in_order = [gathered[i % world][0][i // world] for i in range(len(every))]
            slowest = [max(gathered[r][1][s] for r in range(world)) for s in range(steps)]
            result = {
                "logits": torch.cat(in_order) if in_order else torch.zeros(0),
                "labels": torch.cat([b.labels for b in every]) if every else torch.zeros(0),
                "latency": slowest,
            }
            torch.save(result, Path(folder) / "scores.pt")
    except (EmbshardError, ValueError) as e:
        (Path(folder) / f"error_{rank}").write_text(str(e))
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()
