"""The machines a plan is priced for: ranks, their memory, the links between them, and
how fast a rank looks rows up and remaps a dynamic table's ids. ``Topology.cpu`` and
``Topology.gpu`` give defaults that a config or the CLI overrides field by field."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from embshard.errors import PlanningError

GiB = 2**30
# Ids a second one rank's id maps remap (a dynamic table's keys to rows, admitted rows
# initialized, ids without rows dropped). CPU: below what tools/bench_dynamic.py
# measures with the CPU kernels (a rank's 59,392 keys a step for about 12 ms of CPU on
# the 2-core machine of the other CPU figures, 5e6 a second), so it prices remaps high.
# GPU: assumed, not measured (the map's tests pass on one; its rate there is not timed).
CPU_REMAP_RATE = 3.5e6
GPU_REMAP_RATE = 1.0e9
_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
}


def parse_bytes(text: str | int | float) -> int:
    """``80GiB``, ``512 MiB``, ``1.5TB`` or a number of bytes."""
    if isinstance(text, int | float):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (like 80GiB, 512MiB, 1.5TB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def byte_unit(size: float) -> tuple[str, int]:
    """The largest binary unit (B to TiB) that ``size`` reaches, and its size in bytes."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return unit, scale
    return "B", 1


def format_bytes(size: float) -> str:
    unit, scale = byte_unit(size)
    return f"{size:.0f} B" if scale == 1 else f"{size / scale:.1f} {unit}"


SIZE_FIELDS = ("memory_per_rank", "reserved_memory")
_TOPOLOGY_RULES = {
    "world_size": ("a whole number of at least 1", lambda v, t: isinstance(v, int) and v >= 1),
    "ranks_per_host": ("a whole number of at least 1", lambda v, t: isinstance(v, int) and v >= 1),
    "memory_per_rank": ("more than 0", lambda v, t: v > 0),
    "intra_bandwidth": ("more than 0", lambda v, t: v > 0),
    "intra_latency": ("at least 0", lambda v, t: v >= 0),
    "inter_bandwidth": ("more than 0", lambda v, t: v > 0),
    "inter_latency": ("at least 0", lambda v, t: v >= 0),
    "lookup_bandwidth": ("more than 0", lambda v, t: v > 0),
    "remap_rate": ("more than 0", lambda v, t: v > 0),
    "reserved_memory": (
        "at least 0 and less than memory_per_rank",
        lambda v, t: 0 <= v < t.memory_per_rank,
    ),
}


@dataclass(frozen=True)
class Topology:
    """The machines: ranks, their memory, and the links between them (bytes/s, s).

    ``reserved_memory`` of each rank's memory is left to all-to-all buffers,
    activations and the CUDA context; tables get the rest.
    """

    world_size: int
    ranks_per_host: int
    memory_per_rank: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    lookup_bandwidth: float
    remap_rate: float  # ids a second a rank's id maps remap (dynamic tables)
    reserved_memory: int = 0

    def __post_init__(self) -> None:
        """Every value checked on construction, so no cost comes out negative."""
        for name, (rule, ok) in _TOPOLOGY_RULES.items():
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and ok(value, self)):
                shown = format_bytes(value) if number and name in SIZE_FIELDS else repr(value)
                raise PlanningError(f"topology {name}: must be {rule}, got {shown}")

    @classmethod
    def cpu(cls, world_size: int, **overrides: Any) -> Topology:
        """Processes on CPU hosts, one thread each: gloo over loopback inside a host,
        10 GbE between; an eighth of each rank's memory reserved. Inside a host, the
        project's 2-core machine's figures (``tools/gloo_alltoall.py``: 0.2 ms for a
        small all-to-all, 1.1 GB/s for 4 MiB a peer; FBGEMM's forward, backward and
        update at about 4 GB/s counted as three passes over the rows;
        ``tools/calibrate.py`` sets the model against the bench)."""
        values = {
            "ranks_per_host": world_size,
            "memory_per_rank": 8 * GiB,
            "intra_bandwidth": 1.2e9,
            "intra_latency": 200e-6,
            "inter_bandwidth": 1.25e9,
            "inter_latency": 250e-6,
            "lookup_bandwidth": 4e9,
            "remap_rate": CPU_REMAP_RATE,
        } | overrides
        values.setdefault("reserved_memory", values["memory_per_rank"] // 8)
        return cls(world_size, **values)

    @classmethod
    def gpu(cls, world_size: int, **overrides: Any) -> Topology:
        """8 x 80 GiB GPUs per host (H100-like): NVLink inside (about 370 GB/s of
        all-to-all a GPU), a 400 Gb/s InfiniBand NIC a GPU between (about 45 GB/s);
        4 GiB of each reserved (a quarter where a GPU has less than 16 GiB)."""
        values = {
            "ranks_per_host": 8,
            "memory_per_rank": 80 * GiB,
            "intra_bandwidth": 370e9,
            "intra_latency": 5e-6,
            "inter_bandwidth": 45e9,
            "inter_latency": 10e-6,
            "lookup_bandwidth": 1e12,
            "remap_rate": GPU_REMAP_RATE,
        } | overrides
        values.setdefault("reserved_memory", min(4 * GiB, values["memory_per_rank"] // 4))
        return cls(world_size, **values)

    @property
    def usable_memory(self) -> int:
        """What the tables and their optimizer state may use of a rank."""
        return self.memory_per_rank - self.reserved_memory

    def host_ranks(self, host: int) -> range:
        """The ranks of ``host``: ranks ``host * ranks_per_host`` onwards, as torchrun
        numbers them."""
        start = host * self.ranks_per_host
        return range(start, min(start + self.ranks_per_host, self.world_size))

    def seconds(self, inside: float, across: float) -> float:
        """Moving ``inside`` bytes between ranks of a host (a rank's bytes to itself
        among them) and ``across`` bytes between hosts; each rank has its own link
        across hosts (a NIC a GPU), not shared with the others of its host."""
        return inside / self.intra_bandwidth + across / self.inter_bandwidth

    def seconds_per_byte(self) -> float:
        """A shard's all-to-all bytes: every rank's batch asks for it alike, so they go
        to every rank evenly, those of its own host (itself included) inside it."""
        if self.world_size <= 1:
            return 0.0
        inside = min(self.ranks_per_host, self.world_size) / self.world_size
        return self.seconds(inside, 1 - inside)

    def collective_latency(self) -> float:
        """An all-to-all's latency: one message to each other rank, of its host or not."""
        if self.world_size <= 1:
            return 0.0
        local = min(self.ranks_per_host, self.world_size)
        return (local - 1) * self.intra_latency + (self.world_size - local) * self.inter_latency
