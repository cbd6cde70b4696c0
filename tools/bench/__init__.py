"""Benchmark embshard against TorchRec's DistributedModelParallel, side by side.

    .venv/bin/python tools/bench.py --world-sizes 2 4 --workloads a b c d --json bench.json
    (or embshard bench from this source checkout, with the same options)

For each world size it starts W gloo processes (one thread each). For every workload
and plan, both libraries get the same tables, the same weights (TorchRec's local shards
are copied from embshard's) and the same pre-generated inputs, the same plan (converted
with ``embshard.to_torchrec_plan``, FUSED kernel) and the same fused optimizer
(EXACT_SGD), and, with ``--comm-precision fp16``, fp16 pooled all-to-alls (TorchRec's
qcomms; TorchRec falls back from bf16 to fp16 on gloo, embshard sends bf16). Outputs
are compared before anything is timed; then training steps
(forward, backward with the fused update) alternate between the two libraries. A
step's time is the slowest rank's. It also times the same per-rank lookups, backward
and update in a bare TBE (the data the rank's TBE received, one rank at a time so that
no two timings share the cores), and the step's collectives replayed alone with the
same sizes: their sum, the slowest rank's, is the step's floor on this machine. Also
the machine's gather bandwidth against the local lookup's, and the fraction of the
ids each rank's TBE received that repeat within their table (what deduplicating would
save).
Workload (e) is an EmbeddingCollection (a row per id; TorchRec's
EmbeddingCollectionSharder); a cell embshard refuses to shard (there: compressed
all-to-alls) is skipped, its reason recorded.

The modules, in the order a run uses them: command.py (the options), launch.py (the
worlds and their workers), case.py (one cell), workloads.py, libraries.py (both
libraries built alike), timing.py, collectives.py and floor.py (embshard's floor),
report.py. They import torch inside their functions, so that ``--help`` is quick.
Below are the names the other tools and the tests build on.
"""

from .case import bench_case
from .collectives import CollectiveBytes
from .floor import duplicate_fraction, repeated_ids
from .launch import Options, run
from .libraries import LIBRARIES, build, copy_weights, difference, loss
from .report import summary_line
from .timing import slowest
from .workloads import (
    COMM_PRECISIONS,
    CRITEO_KAGGLE_ROWS,
    ID_LAWS,
    MLPERF_MULTI_HOT_SIZES,
    PLANS,
    SEQUENCE_MEANS,
    SEQUENCE_ROWS,
    WORKLOADS,
    make_inputs,
    make_plan,
    table_configs,
)

__all__ = [
    "COMM_PRECISIONS",
    "CRITEO_KAGGLE_ROWS",
    "ID_LAWS",
    "LIBRARIES",
    "MLPERF_MULTI_HOT_SIZES",
    "PLANS",
    "SEQUENCE_MEANS",
    "SEQUENCE_ROWS",
    "WORKLOADS",
    "CollectiveBytes",
    "Options",
    "bench_case",
    "build",
    "copy_weights",
    "difference",
    "duplicate_fraction",
    "loss",
    "make_inputs",
    "make_plan",
    "repeated_ids",
    "run",
    "slowest",
    "summary_line",
    "table_configs",
]
