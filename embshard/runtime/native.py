"""embshard's fused CPU kernels (``native_batch.cpp``: every step's stage 1;
``native_dynamic.cpp``: dynamic tables), built on first use and loaded with ctypes.

The id map's remap, the initial rows of admitted keys, and the sender's raw ids to
keys, routing stand-ins and keys put back are dozens of torch operations over small
tensors; on CPU one C++ pass each does the same work several times faster, bit for
bit. The batch check (``bounds_check``, an op of its own: ``torch.ops.embshard``)
finds what FBGEMM's bounds check finds, in about a sixth of its CPU time, and the
row-wise routing (``block_bucketize``, an op too) gives FBGEMM's bucketizer's results
in about a third of its; ``pack`` and ``unpack`` (ops too) do in one pass each what
FBGEMM's permutes, ``cat``s and cumsum do around the ids all-to-all. The sources
need no torch headers: the system's C++ compiler (``$CXX``, else ``c++``) builds them
in a few seconds into ``$EMBSHARD_CACHE`` (default ``~/.cache/embshard``), once per
sources and compiler. Where they cannot be built, or with ``EMBSHARD_NATIVE=0``, the
torch operations and FBGEMM's check, bucketizer and permutes run instead (the same
results, slower) after one warning. CUDA tensors always take those.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.autograd.graph import increment_version

_SOURCES = tuple(Path(__file__).with_name(f) for f in ("native_batch.cpp", "native_dynamic.cpp"))
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_BITS = {torch.int32: 32, torch.int64: 64}
_BOUND_WIDTHS = (3, 5, 9, 17)  # native_batch.cpp's block_bucketize, compiled for each


class Slots(ctypes.Structure):
    """An id map's slot table and index (``native_dynamic.cpp``'s ``Slots``)."""

    _fields_ = [
        ("keys", _P),
        ("occupied", _P),
        ("last_seen", _P),
        ("hits", _P),
        ("index_keys", _P),
        ("index_slots", _P),
        ("index_size", _I),
        ("out_index_keys", _P),
        ("out_index_slots", _P),
        ("out_index_size", _I),
    ]


class Spec(ctypes.Structure):
    """A remap call's map and rules (``native_dynamic.cpp``'s ``Spec``)."""

    _fields_ = [
        ("buckets", _I),
        ("rows", _I),
        ("first", _I),
        ("width", ctypes.c_uint64),
        ("lowest_key", _I),
        ("highest_key", _I),
        ("policy", _I),
        ("ttl_steps", _I),
        ("admit_after", _I),
        ("step", _I),
    ]


class Result(ctypes.Structure):
    """What a remap call did (``native_dynamic.cpp``'s ``Result``)."""

    _fields_ = [
        ("rows", _P),
        ("admitted", _P),
        ("admitted_keys", _P),
        ("admitted_count", _I),
        ("evicted", _I),
        ("overflow", _I),
        ("cleared", _I),
        ("outside", _I),
        ("missing", _I),
    ]


class Routing(ctypes.Structure):
    """A DynamicIds' settings per feature (``native_dynamic.cpp``'s ``Routing``)."""

    _fields_ = [(name, _P) for name in ("width", "last", "rows", "ranged", "base", "firsts")]


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels run on ``tensor``'s device: built, on and on CPU."""
    return tensor.device.type == "cpu" and library() is not None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, None where they are off or cannot be built or loaded (warned
    once)."""
    if os.environ.get("EMBSHARD_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CXX", "c++")
    try:
        lib = ctypes.CDLL(str(_built(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        said = (getattr(error, "stderr", None) or str(error)).strip().splitlines()
        warnings.warn(
            f"embshard: the CPU kernels (the batch check, routing and packing ids, dynamic "
            f"tables) did not build or load with {compiler!r} "
            f"({said[-1] if said else type(error).__name__}); torch operations and FBGEMM's "
            "check, bucketizer and permutes run instead, slower",
            stacklevel=2,
        )
        return None
    slots = ctypes.POINTER(Slots)
    lib.embshard_remap.argtypes = [
        _P,
        _I,
        ctypes.POINTER(Spec),
        slots,
        slots,
        ctypes.POINTER(Result),
    ]
    lib.embshard_remap.restype = None
    lib.embshard_initial_rows.argtypes = [_P, _I, _I, _I, ctypes.c_double, ctypes.c_double, _P]
    lib.embshard_initial_rows.restype = None
    lib.embshard_admit_rows.argtypes = [
        *(_P, _P, _I, _I, _I, _I, ctypes.c_double, ctypes.c_double),
        *(_P, _I, _I, _P, _P, _P),
    ]
    lib.embshard_admit_rows.restype = None
    lib.embshard_keyed.argtypes = [_P, _I, _P, _I, _P, _P]
    lib.embshard_stand_ins.argtypes = [_P, _I, _P, _I, ctypes.POINTER(Routing), _P, _P]
    lib.embshard_put_back.argtypes = [_P, _P, _P, _P, _I, _P]
    for kernel in (lib.embshard_keyed, lib.embshard_stand_ins, lib.embshard_put_back):
        kernel.restype = None
    for lengths, ids in itertools.product(_BITS.values(), repeat=2):
        kernel = getattr(lib, f"embshard_bounds_check_{lengths}_{ids}")
        kernel.argtypes = [_P, _I, _I, _P, _I, _P, _P, _P]
        kernel.restype = None
        kernel = getattr(lib, f"embshard_block_bucketize_{lengths}_{ids}")
        kernel.argtypes = [_P, _I, _I, _P, _I, _P, _I, _I, _P, _P, _P, _P, _P]
        kernel.restype = None
        for payload in _BITS.values():
            kernel = getattr(lib, f"embshard_pack_{lengths}_{ids}_{payload}")
            kernel.argtypes = [_P, _I, _I, _P, _I, _P, _P, _P, _I, _P, _I]
            kernel.restype = None
    for bits in _BITS.values():
        kernel = getattr(lib, f"embshard_unpack_{bits}")
        kernel.argtypes = [_P, _P, _P, _I, _I, ctypes.c_bool, _P, _P, _P]
        kernel.restype = None
    return lib


def _library() -> ctypes.CDLL:
    """The built kernels, for a caller that ``available`` sent here."""
    lib = library()
    assert lib is not None, "the CPU kernels are not built"
    return lib


def _kernel(name: str, *typed: torch.Tensor) -> Callable[..., None]:
    """Kernel ``name``'s copy for the dtypes of ``typed`` (its C name ends in their
    bits, ``embshard_{name}_32_64``)."""
    return getattr(
        _library(), "_".join([f"embshard_{name}", *(str(_BITS[t.dtype]) for t in typed)])
    )


def _int64s(values: Sequence[int]) -> ctypes.Array:
    """``values`` as a C array of int64 (one element at least, for an empty list)."""
    return (ctypes.c_int64 * max(len(values), 1))(*values)


def _built(compiler: str) -> Path:
    """The shared library of the sources, built into the cache unless it is there."""
    sources = [s.read_bytes() for s in _SOURCES]
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256(b"\0".join([*sources, " ".join(_FLAGS).encode(), version.encode()]))
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "embshard"
    cache = Path(os.environ.get("EMBSHARD_CACHE", default))
    path = cache / f"native-{digest.hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: ranks building at once never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / path.name
        subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), *map(str, _SOURCES)],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(built, path)
    return path


def remap(
    keys: torch.Tensor, spec: Spec, slots: Slots, probation: Slots | None
) -> tuple[Result, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One id map's remap of the CPU int64 ``keys`` (contiguous, at least one): the
    kernel's counts, each key's row, and the admitted rows and keys (room for every
    key; the counts say how many)."""
    rows, admitted, admitted_keys = torch.empty(3, len(keys), dtype=torch.int64)
    result = Result(rows.data_ptr(), admitted.data_ptr(), admitted_keys.data_ptr())
    _library().embshard_remap(
        keys.data_ptr(),
        len(keys),
        ctypes.byref(spec),
        ctypes.byref(slots),
        None if probation is None else ctypes.byref(probation),
        ctypes.byref(result),
    )
    return result, rows, admitted, admitted_keys


def initial_rows(
    keys: torch.Tensor, dim: int, table_key: int, low: float, scale: float
) -> torch.Tensor:
    """``keys.initial_rows``' float32 rows of the CPU int64 ``keys``, in one pass."""
    keys = keys.contiguous()
    rows = torch.empty(len(keys), dim, dtype=torch.float32)
    _library().embshard_initial_rows(
        keys.data_ptr(), len(keys), dim, table_key, low, scale, rows.data_ptr()
    )
    return rows


def _rows_in_place(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is 2-D on CPU with each row's elements side by side."""
    return (
        tensor.device.type == "cpu"
        and tensor.dim() == 2
        and (tensor.shape[1] <= 1 or tensor.stride(1) == 1)
    )


def admit_rows(
    keys: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    states: Sequence[torch.Tensor],
    first: int,
    table_key: int,
    low: float,
    scale: float,
) -> bool:
    """Write the initial values of the CPU int64 ``keys`` (``initial_rows``' columns
    ``first`` on, as many as ``weights`` has) into rows ``rows`` of ``weights`` and zero
    those rows of the 2-D ``states``, in one pass; False, writing nothing, where the
    kernels are off or the weights are not float32 or a tensor's rows are not laid out
    side by side on CPU (the caller then copies ``initial_rows``)."""
    if (
        not available(keys)
        or weights.dtype != torch.float32
        or not all(_rows_in_place(t) for t in (weights, *states))
    ):
        return False
    keys, rows = keys.to(torch.int64).contiguous(), rows.to(torch.int64).contiguous()
    pointers = (_P * max(len(states), 1))(*(s.data_ptr() for s in states))
    strides, widths = (
        _int64s(values)
        for values in (
            [s.stride(0) * s.element_size() for s in states],
            [s.shape[1] * s.element_size() for s in states],
        )
    )
    _library().embshard_admit_rows(
        keys.data_ptr(),
        rows.data_ptr(),
        len(keys),
        first,
        weights.shape[1],
        table_key,
        low,
        scale,
        weights.data_ptr(),
        weights.stride(0),
        len(states),
        pointers,
        strides,
        widths,
    )
    # Written through their pointers: counted as the torch writes would, for autograd.
    for tensor in (weights, *states):
        increment_version(tensor)
    return True


def keyed(values: torch.Tensor, counts: torch.Tensor, hashed: torch.Tensor) -> torch.Tensor:
    """``DynamicIds.keyed``'s ids in one pass: the CPU int64 feature-major ``values``
    (``counts``: ids a feature), the features flagged in the bool ``hashed`` as keys."""
    values, counts = values.contiguous(), counts.to(torch.int64).contiguous()
    out = torch.empty_like(values)
    _library().embshard_keyed(
        values.data_ptr(),
        values.numel(),
        counts.data_ptr(),
        len(counts),
        hashed.data_ptr(),
        out.data_ptr(),
    )
    return out


def stand_ins(
    keys: torch.Tensor, counts: torch.Tensor, settings: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DynamicIds.stand_ins`` in one pass over the CPU int64 feature-major ``keys``
    (``counts``: ids a feature); ``settings``: ``Routing``'s tensors, in its order
    (contiguous, int64 but the bool ``ranged``)."""
    keys, counts = keys.contiguous(), counts.to(torch.int64).contiguous()
    routing = Routing(*(s.data_ptr() for s in settings))
    out, is_key = torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)
    _library().embshard_stand_ins(
        keys.data_ptr(),
        keys.numel(),
        counts.data_ptr(),
        len(counts),
        ctypes.byref(routing),
        out.data_ptr(),
        is_key.data_ptr(),
    )
    return out, is_key


def put_back(
    bucketized: torch.Tensor, where: torch.Tensor, keys: torch.Tensor, is_key: torch.Tensor
) -> torch.Tensor:
    """``DynamicIds.put_back`` in one pass: the CPU int64 ``bucketized`` ids with each
    key back at its place ``where`` (int64)."""
    bucketized, where = bucketized.contiguous(), where.contiguous()
    keys, is_key = keys.contiguous(), is_key.contiguous()
    out = torch.empty_like(bucketized)
    _library().embshard_put_back(
        bucketized.data_ptr(),
        where.data_ptr(),
        keys.data_ptr(),
        is_key.data_ptr(),
        bucketized.numel(),
        out.data_ptr(),
    )
    return out


_OPS = torch.library.Library("embshard", "DEF")
_OPS.define(
    "bounds_check(Tensor lengths, Tensor values, Tensor rows_less_one, Tensor(a!) problems, "
    "Tensor(b!) routable) -> ()"
)


def bounds_check(
    lengths: torch.Tensor,
    values: torch.Tensor,
    rows_less_one: torch.Tensor,
    problems: torch.Tensor,
    routable: torch.Tensor,
) -> None:
    """The batch check's problem count into ``problems`` (int64 [1]): 1 where the lengths
    table [features, batch] has a negative length or does not add up to the ids, else
    the ids outside [0, rows) of their feature (``rows_less_one``, int64); and into
    ``routable`` (shaped and typed as ``lengths``) the lengths, or where they are bad
    one bag holding every id. Ids and lengths int32 or int64, on CPU. What FBGEMM's
    ``bounds_check_indices`` finds, as ``runtime/batch.py`` calls it, in one op the
    dispatcher sees (so op counts and profiles show it as one kernel)."""
    torch.ops.embshard.bounds_check(lengths, values, rows_less_one, problems, routable)


def _bounds_check_cpu(
    lengths: torch.Tensor,
    values: torch.Tensor,
    rows_less_one: torch.Tensor,
    problems: torch.Tensor,
    routable: torch.Tensor,
) -> None:
    assert routable.is_contiguous() and routable.shape == lengths.shape
    assert routable.dtype == lengths.dtype
    # Held by name: a pointer into a temporary's memory would outlive it.
    lengths, values, rows_less_one = (t.contiguous() for t in (lengths, values, rows_less_one))
    features, batch = lengths.shape
    _kernel("bounds_check", lengths, values)(
        lengths.data_ptr(),
        features,
        batch,
        values.data_ptr(),
        values.numel(),
        rows_less_one.data_ptr(),
        problems.data_ptr(),
        routable.data_ptr(),
    )


_OPS.impl("bounds_check", _bounds_check_cpu, "CPU")


_OPS.define(
    "block_bucketize(Tensor lengths, Tensor values, Tensor? weights, Tensor boundaries, "
    "Tensor(a!) new_lengths, Tensor(b!) new_values, Tensor(c!)? new_weights, "
    "Tensor(d!)? order) -> ()"
)


def bucket_bounds(bounds: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each feature's row boundaries (``buckets + 1`` of them, non-decreasing from 0) as
    ``block_bucketize`` takes them: int64 [features, width], padded with -1 (all ones,
    above every id read unsigned) to the widths the kernel is built for (3, 5, 9, 17)."""
    need = len(bounds[0]) if bounds else 1
    width = next((w for w in _BOUND_WIDTHS if w >= need), need)
    return torch.tensor([[*b, *[-1] * (width - len(b))] for b in bounds], dtype=torch.int64)


def block_bucketize(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    boundaries: torch.Tensor,
    buckets: int,
    with_positions: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """FBGEMM's ``block_bucketize_sparse_features`` given each feature's row
    boundaries (``boundaries``: ``bucket_bounds``' table), bit for bit, in one op the
    dispatcher sees: the bags of ``lengths`` (1-D, feature-major, int32 or int64; ids
    int32 or int64, weights float32) cut into ``buckets``: lengths [buckets * bags], ids
    and weights in bucket order, and with ``with_positions`` where each id went. Several
    times faster than FBGEMM's CPU operation, which searches the boundaries twice an
    id."""
    new_lengths = lengths.new_empty(buckets * lengths.numel())
    new_values = torch.empty_like(values)
    new_weights = None if weights is None else torch.empty_like(weights)
    order = torch.empty_like(values) if with_positions else None
    torch.ops.embshard.block_bucketize(
        lengths, values, weights, boundaries, new_lengths, new_values, new_weights, order
    )
    return new_lengths, new_values, new_weights, order


def _block_bucketize_cpu(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    boundaries: torch.Tensor,
    new_lengths: torch.Tensor,
    new_values: torch.Tensor,
    new_weights: torch.Tensor | None,
    order: torch.Tensor | None,
) -> None:
    features, width = boundaries.shape
    assert lengths.numel() % features == 0, "lengths: a batch of bags for every feature"
    buckets = new_lengths.numel() // lengths.numel()
    assert weights is None or weights.dtype == torch.float32
    lengths, values, boundaries = lengths.contiguous(), values.contiguous(), boundaries.contiguous()
    weights = None if weights is None else weights.contiguous()
    _kernel("block_bucketize", lengths, values)(
        lengths.data_ptr(),
        features,
        lengths.numel() // features,
        values.data_ptr(),
        values.numel(),
        boundaries.data_ptr(),
        width,
        buckets,
        None if weights is None else weights.data_ptr(),
        new_lengths.data_ptr(),
        new_values.data_ptr(),
        None if new_weights is None else new_weights.data_ptr(),
        None if order is None else order.data_ptr(),
    )


_OPS.impl("block_bucketize", _block_bucketize_cpu, "CPU")


_OPS.define(
    "pack(Tensor lengths, Tensor values, Tensor? weights, Tensor send_rows, "
    "int[] rows_per_dest, Tensor(a!) payload) -> ()"
)


def pack(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    send_rows: torch.Tensor,
    rows_per_dest: Sequence[int],
    payload: torch.Tensor,
) -> None:
    """The ids all-to-all's payload into ``payload`` (int32 or int64), in one op the
    dispatcher sees: for each destination in turn, the rows ``send_rows`` (int32, in
    order, ``rows_per_dest`` of them each) of the lengths table ``lengths`` ([rows,
    batch], int32 or int64), then those rows' ids (``values``, int32 or int64), then
    their weights' float32 bits, all as the payload's type. What FBGEMM's
    ``permute_2D_sparse_data`` and a ``cat`` give, in one pass."""
    torch.ops.embshard.pack(lengths, values, weights, send_rows, list(rows_per_dest), payload)


def _pack_cpu(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    send_rows: torch.Tensor,
    rows_per_dest: list[int],
    payload: torch.Tensor,
) -> None:
    assert payload.is_contiguous() and send_rows.dtype == torch.int32
    assert weights is None or weights.dtype == torch.float32
    lengths, values, send_rows = lengths.contiguous(), values.contiguous(), send_rows.contiguous()
    weights = None if weights is None else weights.contiguous()
    rows, batch = lengths.shape
    _kernel("pack", lengths, values, payload)(
        lengths.data_ptr(),
        rows,
        batch,
        values.data_ptr(),
        values.numel(),
        None if weights is None else weights.data_ptr(),
        send_rows.data_ptr(),
        _int64s(rows_per_dest),
        len(rows_per_dest),
        payload.data_ptr(),
        payload.numel(),
    )


_OPS.impl("pack", _pack_cpu, "CPU")


_OPS.define(
    "unpack(Tensor received, int[] sizes, int[] batch_sizes, int slots, Tensor(a!) values, "
    "Tensor(b!) offsets, Tensor(c!)? weights) -> ()"
)


def unpack(
    received: torch.Tensor,
    sizes: Sequence[int],
    batch_sizes: Sequence[int],
    slots: int,
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
) -> None:
    """The TBE's input from the ids all-to-all's ``received`` buffer (int32 or int64;
    ``sizes``: each source's chunk, its bags' lengths slot by slot, ``batch_sizes`` a
    slot, then their ids, then with ``weights`` their float32 bits), in one op the
    dispatcher sees: into ``values`` the ids slot by slot, each slot's sources in rank
    order, into ``offsets`` (of the buffer's type) its bags' offsets from 0, and into
    ``weights`` (float32) the weights. What cutting the chunks, FBGEMM's
    ``permute_1D_sparse_data`` and its complete cumsum give, in one pass."""
    torch.ops.embshard.unpack(
        received, list(sizes), list(batch_sizes), slots, values, offsets, weights
    )


def _unpack_cpu(
    received: torch.Tensor,
    sizes: list[int],
    batch_sizes: list[int],
    slots: int,
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
) -> None:
    assert received.is_contiguous() and values.dtype == offsets.dtype == received.dtype
    assert len(offsets) == slots * sum(batch_sizes) + 1
    assert weights is None or weights.dtype == torch.float32
    _kernel("unpack", received)(
        received.data_ptr(),
        _int64s(sizes),
        _int64s(batch_sizes),
        len(sizes),
        slots,
        weights is not None,
        values.data_ptr(),
        offsets.data_ptr(),
        None if weights is None else weights.data_ptr(),
    )


_OPS.impl("unpack", _unpack_cpu, "CPU")
