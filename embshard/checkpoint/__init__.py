"""DCP checkpoints of sharded models: atomic saves, loads that reshard to any plan and
world size, checksums checked before anything changes, files from elsewhere read
without running their code, and ``embshard ckpt``'s inspect, verify and export.
``from embshard import checkpoint`` gives the calls below."""

from embshard.checkpoint.contents import describe, export, module_prefixes, read_tensors
from embshard.checkpoint.store import (
    CHECKSUMS,
    META,
    Chunk,
    Verification,
    checkpoints,
    latest,
    load,
    read_description,
    read_metadata,
    resolve,
    save,
    verify,
)
from embshard.errors import CheckpointError

__all__ = [
    "CHECKSUMS",
    "META",
    "CheckpointError",
    "Chunk",
    "Verification",
    "checkpoints",
    "describe",
    "export",
    "latest",
    "load",
    "module_prefixes",
    "read_description",
    "read_metadata",
    "read_tensors",
    "resolve",
    "save",
    "verify",
]
