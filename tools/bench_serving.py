"""Serving benchmark: the demo model (configs/small.yaml) trained briefly by 2 ranks,
then exported at fp16, int8 and int4 and scored on the same synthetic held-out batches
as the float32 model: AUC against float32, table memory against float32, and the
lookup's throughput and latency (p50, p99) for a batch of 512 against TorchRec's
quantized EmbeddingBagCollection on the same tables and inputs; the same lookup sharded
over 2 gloo ranks on this host (the planner's plan), each rank a batch of 512 a step,
beside the float32 sharded module's forward without autograd, timed in the same rounds;
and the tables' bytes against float32 at wider rows.

    PYTHONPATH=. .venv/bin/python tools/bench_serving.py --json docs/bench_serving.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.ao import quantization as quant
from torchmetrics.functional.classification import binary_auroc
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchRecQuantEBC

from embshard import ShardingPlan, checkpoint, shard
from embshard.app.config import TrainConfig, load_config
from embshard.app.data import Batch, SyntheticData
from embshard.app.planning import plan_config
from embshard.app.serve import export_checkpoint, load_program, score
from embshard.app.train import build_model
from embshard.serving.collection import QuantizedEmbeddingBagCollection
from embshard.serving.export import Manifest
from embshard.serving.precision import Precision
from embshard.serving.sharded import shard_quantized

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp16", "int8", "int4")
TORCH_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.half}


def train_demo(config: Path, steps: int, nproc: int, work: Path) -> tuple[Path, Path]:
    """The config trained ``steps`` steps by ``nproc`` ranks; its copy and checkpoint root."""
    data = yaml.safe_load(config.read_text())
    data.update(steps=steps)
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": str(work / "ckpt")}
    copy = work / "config.yaml"
    copy.write_text(yaml.safe_dump(data))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    job = ["--nproc-per-node", str(nproc), "-m", "embshard.app.train", "--config", str(copy)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run([*launch, *job], check=True, env=env, stdout=subprocess.DEVNULL)
    return copy, work / "ckpt"


def float_model(path: Path, config: TrainConfig) -> torch.nn.Module:
    """The trained model in float32, every table whole: the AUC baseline."""
    model = build_model(config)
    ebc = model.sparse_arch.embedding_bag_collection
    model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(
        tables=ebc.embedding_bag_configs()
    )
    model.load_state_dict(checkpoint.read_tensors(checkpoint.resolve(path), "model."))
    return model.eval()


def held_out(config: TrainConfig, batches: int, size: int) -> list[Batch]:
    data = SyntheticData(config.tables, config.dense_in_features, size, config.seed, 0)
    return [data.batch(i, "eval") for i in range(batches)]


def auc(logits: Callable[[Batch], torch.Tensor], batches: list[Batch]) -> float:
    with torch.no_grad():
        scores = torch.cat([logits(b).reshape(-1) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    return float(binary_auroc(torch.sigmoid(scores), labels.long()))


def torchrec_quantized(ebc: EmbeddingBagCollection, precision: str) -> TorchRecQuantEBC:
    ebc.qconfig = quant.QConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
        weight=quant.PlaceholderObserver.with_args(dtype=TORCH_DTYPES[precision]),
    )
    return TorchRecQuantEBC.from_float(ebc)


def latencies(calls: dict[str, Callable[[], object]], iters: int, warmup: int) -> dict:
    """Each call's latency in ms over ``iters`` rounds, the calls interleaved in every
    round so that both see the same load on a shared machine."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(iters):
            for name, call in calls.items():
                began = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - began) * 1e3)
    return {name: summary(values) for name, values in times.items()}


def summary(ms: list[float]) -> dict:
    t = torch.tensor(ms, dtype=torch.float64)
    return {
        "p50_ms": float(t.quantile(0.5)),
        "p99_ms": float(t.quantile(0.99)),
        "mean_ms": float(t.mean()),
    }


def lookup_bench(float_ebc: EmbeddingBagCollection, batch: Batch, iters: int, warmup: int) -> dict:
    """The quantized collections' forward on one batch: embshard's against TorchRec's."""
    found = {}
    for precision in PRECISIONS:
        ours = QuantizedEmbeddingBagCollection.from_float(float_ebc, precision)
        theirs = torchrec_quantized(float_ebc, precision)
        same = all(
            torch.equal(ours(batch.sparse).to_dict()[k], v)
            for k, v in theirs(batch.sparse).to_dict().items()
        )
        calls = {
            "embshard": lambda ours=ours: ours(batch.sparse),
            "torchrec": lambda theirs=theirs: theirs(batch.sparse),
        }
        times = latencies(calls, iters, warmup)
        # by the median: a shared machine's stalls land in the mean
        rate = {k: batch.size / (v["p50_ms"] / 1e3) for k, v in times.items()}
        found[precision] = {
            "equal_outputs": same,
            **{f"{k}_{m}": v[m] for k, v in times.items() for m in ("p50_ms", "p99_ms")},
            "embshard_samples_per_s": rate["embshard"],
            "torchrec_samples_per_s": rate["torchrec"],
            "speedup": rate["embshard"] / rate["torchrec"],
        }
    return found


def memory_by_dim(config: TrainConfig, dims: tuple[int, ...] = (16, 64, 128)) -> dict:
    """The quantized tables' bytes (FBGEMM's layout: scale, bias, alignment) against
    float32 for the config's tables at each row width."""
    found = {}
    for dim in dims:
        tables = [dataclasses.replace(t, embedding_dim=dim) for t in config.embedding_bag_configs()]
        ebc = EmbeddingBagCollection(tables=tables)
        float32 = sum(t.num_embeddings * dim * 4 for t in tables)
        found[dim] = {
            p: QuantizedEmbeddingBagCollection.from_float(ebc, p).table_bytes() / float32
            for p in PRECISIONS
        }
    return found


def sharded_bench(
    work: Path, config_path: Path, float_ebc: EmbeddingBagCollection, args: argparse.Namespace
) -> dict:
    """The lookup sharded over ``args.world`` gloo ranks (the planner's plan for them),
    rank ``r`` a batch of ``args.batch`` a step, its output checked against the one-host
    collection's; on rank 0, the one-host embshard and TorchRec lookups timed in the
    same rounds (the other ranks wait in the round's barrier)."""
    config = load_config(config_path, check_files=False)
    plan, _ = plan_config(config, args.world)
    torch.save(float_ebc.state_dict(), work / "tables.pt")
    (work / "plan.yaml").write_text(plan.to_yaml())
    job = (args.world, str(work), str(config_path), args.batch, args.iters, args.warmup)
    mp.start_processes(_sharded_rank, job, nprocs=args.world, start_method="spawn")
    found = json.loads((work / "sharded.json").read_text())
    return {"plan": plan.to_yaml(), **found}


def _sharded_rank(
    rank: int, world: int, work: str, config_path: str, size: int, iters: int, warmup: int
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{work}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    config = load_config(config_path, check_files=False)
    plan = ShardingPlan.load(Path(work) / "plan.yaml")
    ebc = EmbeddingBagCollection(tables=config.embedding_bag_configs())
    ebc.load_state_dict(torch.load(Path(work) / "tables.pt", weights_only=True))
    batch = held_out(config, world, size)[rank]
    float32 = shard(ebc, plan)  # the training module's forward, without autograd
    found = {}
    for precision in PRECISIONS:
        served = shard_quantized(ebc, plan, precision)
        one_host = QuantizedEmbeddingBagCollection.from_float(ebc, precision)
        got, want = served(batch.sparse).values(), one_host(batch.sparse).values()
        calls = {
            "sharded": lambda served=served: served(batch.sparse),
            "sharded_float32": lambda: _no_grad(float32, batch),
        }
        if rank == 0:
            theirs = torchrec_quantized(ebc, precision)
            calls |= {
                "embshard": lambda one_host=one_host: one_host(batch.sparse),
                "torchrec": lambda theirs=theirs: theirs(batch.sparse),
            }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for step in range(warmup + iters):
            for name, call in calls.items():
                if name.startswith("sharded"):
                    dist.barrier()  # the ranks start the step together
                began = time.perf_counter()
                call()
                if step >= warmup:
                    times[name].append((time.perf_counter() - began) * 1e3)
        per_rank: list = [None] * world
        dist.all_gather_object(
            per_rank,
            {
                "max_abs_diff_vs_one_host": float((got - want).abs().max()),
                "table_bytes": served.table_bytes(),
                **{name: summary(ms) for name, ms in times.items()},
            },
        )
        if rank == 0:
            step = max(r["sharded"]["p50_ms"] for r in per_rank)
            step_float32 = max(r["sharded_float32"]["p50_ms"] for r in per_rank)
            found[precision] = {
                "ranks": per_rank,
                "sharded_samples_per_s": world * size / (step / 1e3),
                "sharded_float32_samples_per_s": world * size / (step_float32 / 1e3),
                "embshard_one_host_samples_per_s": size / (per_rank[0]["embshard"]["p50_ms"] / 1e3),
                "torchrec_samples_per_s": size / (per_rank[0]["torchrec"]["p50_ms"] / 1e3),
            }
    if rank == 0:
        (Path(work) / "sharded.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _no_grad(module: torch.nn.Module, batch: Batch) -> object:
    with torch.no_grad():
        return module(batch.sparse)


def model_bench(
    reference: torch.nn.Module, artifact: Path, batch: Batch, iters: int, warmup: int
) -> dict:
    """The whole int8 model on one batch: the exported program, against TorchRec's DLRM
    with TorchRec's quantized collection (dense layers alike)."""
    program = load_program(artifact)
    theirs = copy.deepcopy(reference)
    float_ebc = theirs.sparse_arch.embedding_bag_collection
    theirs.sparse_arch.embedding_bag_collection = torchrec_quantized(float_ebc, "int8")
    inputs = (batch.dense, batch.sparse.values(), batch.sparse.lengths())
    with torch.no_grad():
        same = torch.equal(program(*inputs), theirs(batch.dense, batch.sparse))
    calls = {
        "exported": lambda: program(*inputs),
        "torchrec": lambda: theirs(batch.dense, batch.sparse),
    }
    times = latencies(calls, iters, warmup)
    rate = {k: batch.size / (v["p50_ms"] / 1e3) for k, v in times.items()}
    return {
        "equal_outputs": same,
        **{f"{k}_{m}": v[m] for k, v in times.items() for m in ("p50_ms", "p99_ms")},
        "speedup": rate["exported"] / rate["torchrec"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "small.yaml")
    parser.add_argument("--steps", type=int, default=2000, help="training steps (the demo's)")
    parser.add_argument("--nproc", type=int, default=2, help="training ranks")
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out batches")
    parser.add_argument("--batch", type=int, default=512, help="the timed batch size")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads when timing")
    parser.add_argument("--world", type=int, default=2, help="ranks of the sharded lookup")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        began = time.perf_counter()
        config_path, ckpt = train_demo(args.config, args.steps, args.nproc, work)
        trained_s = time.perf_counter() - began
        config = load_config(config_path, check_files=False)
        batches = held_out(config, args.eval_batches, config.batch_size)
        reference = float_model(ckpt, config)
        results = {
            "config": str(args.config.relative_to(ROOT)),
            "steps": args.steps,
            "training_s": trained_s,
            "held_out_samples": sum(b.size for b in batches),
            "float32_auc": auc(lambda b: reference(b.dense, b.sparse), batches),
            "precisions": {},
        }
        torch.set_num_threads(args.threads)
        for precision in PRECISIONS:
            out = work / precision
            manifest: Manifest = export_checkpoint(ckpt, out, precision, config_path)
            program = load_program(out)
            scores, _ = score(program, manifest, batches, progress=False)
            results["precisions"][precision] = {
                "auc": scores.auc,
                "auc_minus_float32": scores.auc - results["float32_auc"],
                "table_bytes": manifest.table_bytes,
                "float32_table_bytes": manifest.float32_bytes,
                "memory_vs_float32": manifest.table_bytes / manifest.float32_bytes,
                "row_bytes_by_dim": {
                    d: Precision.parse(precision).row_bytes(d) / (4 * d) for d in (16, 64, 128)
                },
                f"exported_model_p50_ms_batch_{config.batch_size}": scores.summary()[
                    "batch_latency_ms_p50"
                ],
            }
        timed = held_out(config, 1, args.batch)[0]
        float_ebc = reference.sparse_arch.embedding_bag_collection
        results["lookup"] = lookup_bench(float_ebc, timed, args.iters, args.warmup)
        results["int8_model"] = model_bench(
            reference, work / "int8", timed, args.iters, args.warmup
        )
        results["sharded_lookup"] = sharded_bench(work, config_path, float_ebc, args)
        results["memory_vs_float32_by_dim"] = memory_by_dim(config)
    results["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": args.threads,
        "torch": torch.__version__,
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
