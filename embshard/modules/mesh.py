"""The ranks a sharded collection spans: its sharding group, and the meshes its
tables' DTensors live on."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@functools.cache
def _submesh(mesh: DeviceMesh, ranks: tuple[int, ...]) -> DeviceMesh:
    """The mesh of plan ranks ``ranks`` (positions in ``mesh``), built once per process.

    Metadata only: no process group behind it. embshard's collectives and DCP's run
    on the default group; groups held by meshes cost a collective each to create and,
    with torch 2.13's gloo, can abort the process at exit ("terminate called without
    an active exception") after destroy_process_group.
    """
    return DeviceMesh(mesh.device_type, mesh.mesh[list(ranks)], _init_backend=False)


def forget_meshes() -> None:
    """Drop the sub-meshes built so far: ``embshard simulate`` runs worlds of many
    sizes in one process."""
    _submesh.cache_clear()


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


@dataclass(frozen=True)
class ShardingMesh:
    """Where a collection's shards live. The sharding group holds one copy of the
    plan: its ranks are those the plan's rank numbers name, and the ids and pooled
    rows travel among them. A replica group would hold the ranks with the same shards
    (the other copies of the plan), which average their gradients. Only the
    one-dimensional case is built: the sharding group is the whole world, on the
    default process group, and there are no other copies."""

    mesh: DeviceMesh

    @staticmethod
    def of(mesh: DeviceMesh) -> ShardingMesh:
        """``mesh`` checked: one dimension, over the whole world."""
        if mesh.ndim != 1:
            raise ValueError(f"embshard shards over a 1-D mesh, got a {mesh.ndim}-D mesh")
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}; "
                "embshard needs a mesh over the whole world"
            )
        return ShardingMesh(mesh)

    @property
    def sharding_group(self) -> dist.ProcessGroup | None:
        """The process group of the sharding group's collectives: None, the default
        group, which the sharding group spans."""
        return None

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The process group of the copies of this rank's shards: None, there are none."""
        return None

    @property
    def rank(self) -> int:
        """This rank's position in the sharding group: the rank numbers plans use."""
        return self.mesh.get_coordinate()[0]

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def device(self) -> torch.device:
        """The device this rank's shards live on (on CUDA, the current one)."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    def submesh(self, ranks: tuple[int, ...]) -> DeviceMesh:
        """The mesh of the sharding group's ranks ``ranks``, where a table's shards lie."""
        return _submesh(self.mesh, ranks)
