"""ShardedEmbeddingBagCollection: a TorchRec EmbeddingBagCollection sharded over a mesh.

Each rank allocates only its own shards, in one FBGEMM TBE, and exposes every table
as a DTensor over views of the TBE's weights. ``state_dict()`` has the unsharded
module's keys (``embedding_bags.<table>.weight``), so TorchRec state dicts load into it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embshard.init import init_shard
from embshard.lookup import SGD, FusedOptimizer
from embshard.plan import ShardingPlan
from embshard.shards import allocate_storage, gather_table, table_dtensor


def _key(table: str) -> str:
    return f"embedding_bags.{table}.weight"


@functools.cache
def _submesh(mesh: DeviceMesh, ranks: tuple[int, ...]) -> DeviceMesh:
    """The mesh of plan ranks ``ranks`` (positions in ``mesh``); built once per process."""
    return DeviceMesh(mesh.device_type, mesh.mesh[list(ranks)])


def _check_mesh(mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"embshard shards over a 1-D mesh, got a {mesh.ndim}-D mesh")
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}; "
            "embshard needs a mesh over the whole world"
        )


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class ShardedEmbeddingBagCollection(nn.Module):
    """The sharded form of a TorchRec ``EmbeddingBagCollection``; build it with ``shard()``."""

    def __init__(
        self,
        configs: Sequence[EmbeddingBagConfig],
        plan: ShardingPlan,
        mesh: DeviceMesh,
        optimizer: FusedOptimizer,
        seed: int = 0,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        _check_mesh(mesh)
        self._configs = list(configs)
        self._tables = plan.resolve(self._configs, mesh.size())
        self._plan = plan
        self._mesh = mesh
        self._storage = allocate_storage(
            self._tables, mesh.get_local_rank(), optimizer, _mesh_device(mesh)
        )
        self._fill(seed, weights)
        self._weights = {
            name: table_dtensor(
                table, self._storage.wrappers[name], mesh, functools.partial(_submesh, mesh)
            )
            for name, table in self._tables.items()
        }

    def _fill(self, seed: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Write each local shard: from ``weights`` (full tables) or the seeded init."""
        if self._storage.tbe is None:
            return
        configs = {c.name: c for c in self._configs}
        views = self._storage.tbe.split_embedding_weights()
        for (name, s), view in zip(self._storage.shards, views):
            if weights is None:
                init_shard(view, configs[name], s.row_offset, s.col_offset, seed)
            else:
                source = weights[name][s.row_offset : s.row_offset + s.rows]
                view.copy_(source[:, s.col_offset : s.col_offset + s.cols])

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def weights(self) -> dict[str, DTensor]:
        """Every table as a DTensor over this rank's shards (views of the TBE's weights)."""
        return dict(self._weights)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        for name, weight in self._weights.items():
            destination[prefix + _key(name)] = weight

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        """Take full tensors (a TorchRec state dict) or DTensors of any embshard layout.

        Every entry is checked before any is written, so a failing load (under
        ``strict``, a missing or unexpected key too) changes no table. DTensor entries
        are gathered one table at a time: a collective, as loading a sharded module is
        on every rank.
        """
        ours = {prefix + _key(name): name for name in self._tables}
        missing = [k for k in ours if k not in state_dict]
        unexpected = [k for k in state_dict if k.startswith(prefix) and k not in ours]
        missing_keys.extend(missing)
        if strict:
            unexpected_keys.extend(unexpected)
        present = {key: name for key, name in ours.items() if key in state_dict}
        errors = []
        for key, name in present.items():
            value, shape = state_dict[key], self._weights[name].shape
            if not isinstance(value, torch.Tensor):
                errors.append(f"{key}: expected a tensor, got {type(value).__name__}")
            elif value.shape != shape:
                errors.append(
                    f"size mismatch for {key}: the checkpoint has {tuple(value.shape)}, "
                    f"table {name!r} is {tuple(shape)}"
                )
        error_msgs.extend(errors)
        if errors or (strict and (missing or unexpected)):
            return
        for key, name in present.items():
            self._load_table(name, state_dict[key])

    def _load_table(self, name: str, value: torch.Tensor) -> None:
        full = gather_table(value) if isinstance(value, DTensor) else value
        wrapper = self._storage.wrappers[name]
        with torch.no_grad():
            for shard, (row, col) in zip(wrapper.local_shards(), wrapper.local_offsets()):
                rows, cols = shard.shape
                shard.copy_(full[row : row + rows, col : col + cols])


def shard(
    module: EmbeddingBagCollection,
    plan: ShardingPlan,
    *,
    mesh: DeviceMesh | None = None,
    optimizer: FusedOptimizer = SGD(lr=0.01),
    seed: int = 0,
) -> ShardedEmbeddingBagCollection:
    """Shard ``module`` by ``plan`` over ``mesh`` (default: the whole default process group).

    A module on ``meta`` gets the plan-independent seeded initialization; a module with
    real weights keeps them, each rank copying only its own rows and columns.
    """
    if not isinstance(module, EmbeddingBagCollection):
        raise TypeError(f"shard() takes a TorchRec EmbeddingBagCollection, got {type(module)}")
    if not dist.is_initialized():
        raise RuntimeError("shard() needs torch.distributed initialized (init_process_group)")
    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    weights = {name: bag.weight for name, bag in module.embedding_bags.items()}
    on_meta = any(w.is_meta for w in weights.values())
    return ShardedEmbeddingBagCollection(
        module.embedding_bag_configs(),
        plan,
        mesh,
        optimizer,
        seed,
        weights=None if on_meta else {n: w.detach() for n, w in weights.items()},
    )
