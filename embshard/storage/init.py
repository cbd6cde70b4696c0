"""Plan-independent initialization: a row's values depend only on (seed, table, row).

Rows come in fixed blocks of ``ROW_BLOCK`` global rows, each drawn from a generator
seeded by a hash of (seed, table, block), so a shard generates only the blocks it
overlaps and every plan and world size sees the same full table.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

ROW_BLOCK = 4096


def _block_seed(seed: int, table: str, block: int) -> int:
    key = f"{seed}/{table}/{block}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def init_bounds(config: EmbeddingBagConfig) -> tuple[float, float]:
    """TorchRec's default uniform bounds: the config's, else +-sqrt(1 / num_embeddings)."""
    bound = math.sqrt(1 / config.num_embeddings)
    low = config.weight_init_min if config.weight_init_min is not None else -bound
    high = config.weight_init_max if config.weight_init_max is not None else bound
    return low, high


def init_shard(
    out: torch.Tensor, config: EmbeddingBagConfig, row_offset: int, col_offset: int, seed: int
) -> None:
    """Fill ``out`` with rows ``[row_offset, +len(out))`` and its columns of the table.

    Values are drawn in float32 whatever ``out``'s dtype, so a float16 table holds the
    float32 init rounded to nearest."""
    rows, cols = out.shape
    low, high = init_bounds(config)
    end = row_offset + rows
    for block in range(row_offset // ROW_BLOCK, math.ceil(end / ROW_BLOCK)):
        start = block * ROW_BLOCK
        block_rows = min(ROW_BLOCK, config.num_embeddings - start)
        generator = torch.Generator().manual_seed(_block_seed(seed, config.name, block))
        values = torch.empty(block_rows, config.embedding_dim, dtype=torch.float32)
        values.uniform_(low, high, generator=generator)
        lo, hi = max(start, row_offset), min(start + block_rows, end)
        out[lo - row_offset : hi - row_offset].copy_(
            values[lo - start : hi - start, col_offset : col_offset + cols]
        )
