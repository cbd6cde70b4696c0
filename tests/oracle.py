"""The tests' oracle: embshard.oracle (``embshard simulate --check`` runs it too)."""

from embshard.oracle import (
    Case,
    Table,
    column_blocks,
    feature_rows,
    features_of,
    float32_twin,
    global_batch,
    local_batches,
    max_abs,
    max_diff,
    oracle_step,
    round_to_storage,
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
    "float32_twin",
    "global_batch",
    "local_batches",
    "max_abs",
    "max_diff",
    "oracle_step",
    "round_to_storage",
    "run_case",
    "unsharded",
    "upstream",
    "weight_gap",
]
