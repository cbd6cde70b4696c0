"""The tests' oracle: embshard.oracle (``embshard simulate --check`` runs it too)."""

from embshard.oracle import (
    Case,
    Table,
    column_blocks,
    feature_rows,
    features_of,
    global_batch,
    local_batches,
    oracle_step,
    run_case,
    unsharded,
    upstream,
    weight_gap,
)

__all__ = [
    "Case",
    "Table",
    "column_blocks",
    "feature_rows",
    "features_of",
    "global_batch",
    "local_batches",
    "oracle_step",
    "run_case",
    "unsharded",
    "upstream",
    "weight_gap",
]
