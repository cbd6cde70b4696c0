"""Raw ids to keys, keys to buckets, and a key's initial row: the hashes of dynamic
tables, the same on every device, run and world size.

A raw id in ``[0, 2**63)`` hashes one-to-one to a key (``hash_ids``); a bucket is a
contiguous range of keys (``bucket_of``). The sender hashes and routes keys by bucket
(``runtime.dynamic_ids``); the owner's id map (``storage.id_map``) holds them and
starts an admitted key's row at ``initial_rows``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from embshard.runtime import native

_MASK64 = (1 << 64) - 1
KEY_LIMIT = 1 << 63  # keys, and the raw ids they come from, are in [0, KEY_LIMIT)
_MASK63 = KEY_LIMIT - 1


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


# Values initial_rows works on at a time (a thousand rows of 64): the dozen passes over
# its two int64 temporaries stay in a core's cache.
_CHUNK = 1 << 16


def _shr(x: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic), into ``out``."""
    return torch.bitwise_right_shift(x, bits, out=out).bitwise_and_((1 << (64 - bits)) - 1)


def _scramble(z: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer but its last xor-shift, in place on ``z``; ``spare``: a
    buffer of its shape."""
    z ^= _shr(z, 30, spare)
    z *= _MUL1
    z ^= _shr(z, 27, spare)
    z *= _MUL2
    return z


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each int64 (its bits read as unsigned, the result's bits returned as
    int64): one golden-ratio step then the finalizer. Torch's int64 add and multiply wrap
    the same way on every device, so the bits are the same everywhere."""
    z = x + _GAMMA
    spare = torch.empty_like(z)
    z = _scramble(z, spare)
    z ^= _shr(z, 31, spare)
    return z


def hash_ids(raw_ids: torch.Tensor) -> torch.Tensor:
    """The key of each raw id in ``[0, 2**63)``: splitmix64's steps on 63 bits (add, then
    xor-shifts and odd multiplies, all modulo 2**63), so a bijection of ``[0, 2**63)``.

    Keys, not raw ids, are what travels and what maps hold: one is as good as the other
    (no two ids share a key), and contiguous ranges of keys are the buckets, so ranks
    owning ranges of buckets route keys as they route rows. Negative raw ids have no
    key; the caller refuses them."""
    # In place after the first add: no fresh buffer a pass (z stays non-negative, so
    # torch's arithmetic shifts are logical ones).
    z = raw_ids.add(_GAMMA & _MASK63).bitwise_and_(_MASK63)
    z.bitwise_xor_(z >> 30).mul_(_MUL1 & _MASK63).bitwise_and_(_MASK63)
    z.bitwise_xor_(z >> 27).mul_(_MUL2 & _MASK63).bitwise_and_(_MASK63)
    return z.bitwise_xor_(z >> 31)


def bucket_width(buckets: int) -> int:
    """How many keys a bucket spans: bucket ``b`` holds keys ``[b * width, (b + 1) * width)``
    (the last one fewer when ``buckets`` does not divide 2**63)."""
    return -(-KEY_LIMIT // buckets)


def bucket_of(keys: torch.Tensor, buckets: int) -> torch.Tensor:
    """The bucket in ``[0, buckets)`` of each key (``hash_ids``): its range of keys, so
    the same on every device, run and world size; negative for a negative key."""
    if buckets == 1:  # a width of 2**63 is no int64
        return torch.where(keys < 0, -1, 0)
    return torch.div(keys, bucket_width(buckets), rounding_mode="floor")


def _table_key(seed: int, table: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{table}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def _scaled(bounds: tuple[float, float]) -> tuple[float, float]:
    """The low bound and the factor of the hash's 24 bits: exact in [0, 1), scaling them
    by 2**-24 rounds nothing, so folding it into (high - low) gives the same float64
    values."""
    low, high = bounds
    return low, 2.0**-24 * (high - low)


def initial_rows(
    keys: torch.Tensor, dim: int, seed: int, table: str, bounds: tuple[float, float]
) -> torch.Tensor:
    """The initial float32 rows ``(len(keys), dim)`` of admitted keys, uniform in
    ``bounds`` (``init.init_bounds`` gives TorchRec's default for a config).

    Value ``[i, c]`` is a counter-based hash of (seed, table, key, column): it does not
    depend on the row the key got, the batch, the device or the world size."""
    low, factor = _scaled(bounds)
    if native.available(keys):
        return native.initial_rows(keys.to(torch.int64), dim, _table_key(seed, table), low, factor)
    # mix64(key + column) is the finalizer of (key + _GAMMA) + column; its last
    # xor-shift (by 31) leaves the top 33 bits as they are, and only the top 24 are kept.
    start = mix64(keys.to(torch.int64) ^ _table_key(seed, table)).add_(_GAMMA)
    columns = torch.arange(dim, dtype=torch.int64, device=keys.device)
    rows = torch.empty(len(keys), dim, dtype=torch.float32, device=keys.device)
    # A float64 0-d tensor makes the multiply convert the int64 bits and compute in
    # float64 in one pass; the add computes in float64 and rounds once to the float32 rows.
    scale = torch.tensor(factor, dtype=torch.float64, device=keys.device)
    step = max(1, _CHUNK // max(dim, 1))
    for first in range(0, len(keys), step):
        bits = start[first : first + step, None] + columns
        spare = torch.empty_like(bits)
        _scramble(bits, spare)
        torch.add(_shr(bits, 40, spare).mul(scale), low, out=rows[first : first + step])
    return rows


def write_initial_rows(
    weights: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    columns: slice,
    seed: int,
    table: str,
    bounds: tuple[float, float],
    states: Sequence[torch.Tensor] = (),
) -> bool:
    """Write ``initial_rows``' ``columns`` of ``keys`` into rows ``rows`` of ``weights``
    (as many columns as it has) and zero those rows of ``states`` (2-D), in one pass of
    the CPU kernel, without the rows' temporary; False, writing nothing, where the kernel
    cannot (``native.admit_rows``): the caller copies ``initial_rows``."""
    low, factor = _scaled(bounds)
    key = _table_key(seed, table)
    return native.admit_rows(keys, rows, weights, states, columns.start, key, low, factor)
