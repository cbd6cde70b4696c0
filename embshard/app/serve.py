"""``embshard export`` and ``embshard predict``: a training job's checkpoint made a
serving artifact (quantized tables, the exported program), and that artifact scoring
the job's data formats, with throughput and AUC.

The artifact is ``embshard.serving.export``'s folder plus the training config
(``config.yaml``), which says how to read data for it. Scoring runs the exported
program itself, as a predictor would, not embshard's modules.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc
from tqdm import tqdm

from embshard import checkpoint
from embshard.app.config import TrainConfig, load_config
from embshard.app.data import Batch, CriteoData, SyntheticData
from embshard.app.train import build_model
from embshard.serving.export import MANIFEST, PROGRAM, Manifest, export_model
from embshard.serving.model import from_checkpoint

CONFIG = "config.yaml"
SYNTHETIC = "synthetic"  # DATA that names the config's synthetic held-out batches


def serving_model(path: str | Path, config: TrainConfig, precision: str) -> torch.nn.Module:
    """The config's model with the checkpoint's weights, its tables quantized."""
    return from_checkpoint(path, build_model(config), precision)


def export_checkpoint(
    path: str | Path, config_path: str | Path, out: str | Path, precision: str
) -> Manifest:
    """Write the serving artifact of checkpoint ``path`` (a step or a root, for its
    latest) of the job ``config_path`` describes into the folder ``out``."""
    config = load_config(config_path, check_files=False)
    path = checkpoint.resolve(path)
    model = serving_model(path, config, precision)
    step = checkpoint.describe(path)["step"]
    manifest = export_model(
        model, out, config.dense_in_features, {"checkpoint": str(path), "step": step}
    )
    shutil.copyfile(config_path, Path(out) / CONFIG)
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
    default the config's ``eval.batches``)."""
    config = load_config(Path(artifact) / CONFIG, check_files=False)
    size = batch_size or config.batch_size
    if (data == SYNTHETIC) != (config.data.type == SYNTHETIC):
        wanted = "`synthetic`" if config.data.type == SYNTHETIC else "a Criteo TSV file"
        raise ValueError(
            f"{artifact}'s model was trained on {config.data.type} data: DATA must be {wanted}"
        )
    if data == SYNTHETIC:
        source = SyntheticData(config.tables, config.dense_in_features, size, config.seed, 0)
        return (source.batch(i, "eval") for i in range(batches or config.eval.batches))
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
        if batch.sparse.keys() != manifest.features:
            raise ValueError(
                f"the data's features {batch.sparse.keys()} are not the model's {manifest.features}"
            )
        began = time.perf_counter()
        out = program(batch.dense, batch.sparse.values(), batch.sparse.lengths())
        latency.append((time.perf_counter() - began) * 1e3)
        logits.append(out.reshape(-1))
        labels.append(batch.labels)
        samples += batch.size
        bar.set_postfix(samples_s=f"{samples / (sum(latency) / 1e3):,.0f}")
    every, targets = torch.cat(logits), torch.cat(labels)
    both = bool(len(targets)) and 0 < float(targets.sum()) < len(targets)
    scores = Scores(
        samples=samples,
        seconds=sum(latency) / 1e3,
        batch_latency_ms=latency,
        auc=float(binary_auroc(torch.sigmoid(every), targets.long())) if both else None,
        loss=float(F.binary_cross_entropy_with_logits(every, targets)) if len(targets) else None,
    )
    return scores, every


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
    return all((Path(path) / name).is_file() for name in (PROGRAM, MANIFEST, CONFIG))
