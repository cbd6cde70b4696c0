"""The ranks a sharded collection spans: its sharding group, the other copies of its
shards (its replica group), and the meshes its tables' DTensors live on."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# The dimension names of a 2-D mesh, as TorchRec's DMPCollection names them.
MESH_DIMS = ("replicate", "shard")


@functools.cache
def _submesh(mesh: DeviceMesh, ranks: tuple[int, ...]) -> DeviceMesh:
    """The mesh of plan ranks ``ranks`` (positions along ``mesh``'s last dimension, the
    sharding group's), every replica's row of it on a 2-D mesh; built once per process.

    Metadata only: no process group behind it. embshard's collectives run on the
    groups ``_groups`` makes, and DCP's on the default group; groups held by meshes
    cost a collective each to create and, with torch 2.13's gloo, can abort the
    process at exit ("terminate called without an active exception") after
    destroy_process_group.
    """
    return DeviceMesh(
        mesh.device_type,
        mesh.mesh[..., list(ranks)],
        mesh_dim_names=mesh.mesh_dim_names,
        _init_backend=False,
    )


@functools.cache
def _groups(
    rows: tuple[tuple[int, ...], ...],
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's sharding group (its row of ``rows``) and replica group (its column),
    made once per process. Collective: every rank makes every group, rows first, in
    the same order (``dist.new_group`` needs that); the default group's
    ``destroy_process_group()`` (or ``embshard.shutdown()``) ends them all."""
    sharding = [dist.new_group(list(ranks)) for ranks in rows]
    replica = [dist.new_group(list(ranks)) for ranks in zip(*rows)]
    me = dist.get_rank()
    row = next(i for i, ranks in enumerate(rows) if me in ranks)
    return sharding[row], replica[rows[row].index(me)]


def forget_meshes() -> None:
    """Drop the sub-meshes and groups built so far: ``embshard simulate`` runs worlds of
    many sizes in one process."""
    _submesh.cache_clear()
    _groups.cache_clear()


def default_device() -> torch.device:
    """This rank's device under the default process group: the current CUDA device
    (``torch.cuda.set_device``) when the group runs NCCL, which takes only CUDA
    tensors, else the CPU."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_mesh(device_type: str | None = None) -> DeviceMesh:
    """A 1-D mesh over the whole world, without process groups of its own (see
    _submesh). ``device_type`` defaults to ``default_device``'s."""
    if device_type is None:
        device_type = default_device().type
    return DeviceMesh(device_type, torch.arange(dist.get_world_size()), _init_backend=False)


def sharding_mesh(group_size: int, device_type: str | None = None) -> DeviceMesh:
    """A 2-D mesh (``"replicate"``, ``"shard"``) over the whole world: sharding groups
    of ``group_size`` consecutive ranks (a host's, when ``group_size`` is the ranks per
    host), each holding a copy of the plan. Its all-to-alls stay inside the group; the
    ranks with the same position in every group are a replica group, which
    ``sync_replicas`` averages. ``device_type`` defaults to ``default_device``'s.
    As TorchRec's DMPCollection with ``use_inter_host_allreduce=True``."""
    world = dist.get_world_size()
    if group_size < 1 or world % group_size:
        raise ValueError(
            f"sharding group size {group_size} does not divide the world's {world} ranks"
        )
    if device_type is None:
        device_type = default_device().type
    return DeviceMesh(
        device_type,
        torch.arange(world).view(world // group_size, group_size),
        mesh_dim_names=MESH_DIMS,
        _init_backend=False,
    )


@dataclass(frozen=True)
class ShardingMesh:
    """Where a collection's shards live. The sharding group holds one copy of the
    plan: its ranks are those the plan's rank numbers name, and the ids and pooled
    rows travel among them. On a 2-D mesh (replicas x sharding group) every row is a
    sharding group with its own copy of every shard, and a column, the ranks holding
    the same shards, is a replica group, whose copies ``sync_replicas`` averages. On a
    1-D mesh the sharding group is the whole world, on the default process group,
    and there are no other copies."""

    mesh: DeviceMesh

    @staticmethod
    def of(mesh: DeviceMesh) -> ShardingMesh:
        """``mesh`` checked: one dimension, or two (replicas x sharding group), over the
        whole world."""
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"embshard shards over a 1-D mesh or a 2-D (replicate, shard) mesh, "
                f"got a {mesh.ndim}-D mesh"
            )
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}; "
                "embshard needs a mesh over the whole world"
            )
        sharding = ShardingMesh(mesh)
        if sharding.replicas > 1:
            _groups(sharding._rows)  # collective: made now, on every rank alike
        return sharding

    @property
    def _rows(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(row) for row in self.mesh.mesh.view(-1, self.size).tolist())

    @property
    def replicas(self) -> int:
        """How many copies of the plan the mesh holds: its sharding groups."""
        return self.mesh.size(0) if self.mesh.ndim == 2 else 1

    @property
    def sharding_group(self) -> dist.ProcessGroup | None:
        """The process group of the sharding group's collectives: None, the default
        group, when the sharding group is the whole world."""
        return _groups(self._rows)[0] if self.replicas > 1 else None

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The process group of the copies of this rank's shards: None where there are
        none (one sharding group)."""
        return _groups(self._rows)[1] if self.replicas > 1 else None

    @property
    def rank(self) -> int:
        """This rank's position in the sharding group: the rank numbers plans use."""
        return self.mesh.get_coordinate()[-1]

    @property
    def size(self) -> int:
        """The sharding group's ranks: the world size plans are made for."""
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def device(self) -> torch.device:
        """The device this rank's shards live on (on CUDA, the current one)."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    def submesh(self, ranks: tuple[int, ...]) -> DeviceMesh:
        """The mesh of the sharding group's ranks ``ranks``, where a table's shards lie
        (on a 2-D mesh, with their copies in every replica)."""
        return _submesh(self.mesh, ranks)
