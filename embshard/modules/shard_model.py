"""Sharding whole TorchRec models: every EmbeddingBagCollection and EmbeddingCollection
sharded, the rest DDP."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollection,
    ManagedCollisionEmbeddingCollection,
)

from embshard.errors import PlanError
from embshard.modules.collection import ShardedCollection
from embshard.modules.mesh import ShardingMesh, world_mesh
from embshard.modules.shard import shard
from embshard.plan.specs import ShardingPlan
from embshard.storage.id_map import IdMapSpec
from embshard.storage.lookup import LookupBackend, TrainingTBE
from embshard.storage.optimizers import SGD, FusedOptimizer

# TorchRec's DistributedModelParallel wraps the dense part in DDP with these settings
# (DefaultDataParallelWrapper, torchrec 1.8). static_graph lets a model hold
# parameters that never get a gradient (TorchRec's TestSparseNN has one): DDP finds
# them on the first step, where plain DDP fails on the second. forward_sync_buffers
# is torch 2.13's name for TorchRec's broadcast_buffers=False: no buffer broadcast
# before each forward (buffers are still synced once, at construction). A DDP without
# it (torch 2.11, 2.12) gets broadcast_buffers instead: see _ddp_settings.
DDP_DEFAULTS: Mapping[str, Any] = {
    "static_graph": True,
    "find_unused_parameters": False,
    "forward_sync_buffers": False,
    "gradient_as_bucket_view": True,
}


Collection = EmbeddingBagCollection | EmbeddingCollection | BaseManagedCollisionEmbeddingCollection


def embedding_bag_collections(model: nn.Module) -> dict[str, Collection]:
    """Every EmbeddingBagCollection and EmbeddingCollection in ``model``, by path; a
    managed-collision collection whole (not the collection inside it)."""
    found: dict[str, Collection] = {}
    for path, m in model.named_modules():
        inside = any(not p or path.startswith(f"{p}.") for p in found)
        if isinstance(m, Collection) and not inside:
            found[path] = m
    return found


def _configs(collection: Collection) -> list:
    if isinstance(collection, BaseManagedCollisionEmbeddingCollection):
        return _configs(collection._embedding_module)
    if isinstance(collection, EmbeddingCollection):
        return collection.embedding_configs()
    return collection.embedding_bag_configs()


def shard_model(
    model: nn.Module,
    plan: ShardingPlan,
    *,
    mesh: DeviceMesh | None = None,
    optimizer: FusedOptimizer = SGD(lr=0.01),
    seed: int = 0,
    device: torch.device | str | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
    data_parallel_wrapper: Callable[[nn.Module], nn.Module] | None = None,
    comm_precision: str | None = None,
    lookup: LookupBackend = TrainingTBE(),
    dynamic: Mapping[str, IdMapSpec] | None = None,
) -> nn.Module:
    """Shard every EmbeddingBagCollection and EmbeddingCollection of ``model`` by
    ``plan`` (one plan naming the tables of all of them) and wrap the model in DDP,
    which then holds only the dense parameters: the sharded tables are trained by
    their fused optimizer.

    ``device`` is where everything goes: the tables (FBGEMM's TBE in device memory on
    CUDA), the routing and collectives, and the dense parameters, which are moved
    there, or materialized and reset when they are on ``meta``; DDP then broadcasts
    rank 0's, so every rank starts from the same model. By default it is ``mesh``'s
    device type, else CUDA when the default group runs NCCL, else CPU. On CUDA it
    must be the current device (``torch.cuda.set_device``), as NCCL needs.

    The DDP is TorchRec's DistributedModelParallel's: ``DDP_DEFAULTS``
    (``static_graph=True``, ``find_unused_parameters=False``, rank 0's buffers
    broadcast once at construction, none before each forward,
    ``gradient_as_bucket_view=True``) updated by ``ddp_kwargs``.
    A model whose set of used parameters changes from step to step needs
    ``ddp_kwargs={"static_graph": False, "find_unused_parameters": True}``.

    ``data_parallel_wrapper`` replaces that DDP, as DMP's argument of that name does:
    a callable taking the sharded model (its sharded collections hold no parameters,
    so it sees only the dense ones) and returning the module to train, which
    ``shard_model`` returns. ``lambda m: m`` trains without a wrapper; without DDP's
    broadcast, seed the dense initialization alike on every rank.

    ``comm_precision`` (``"fp16"``, ``"bf16"``; default float32) is every sharded
    EmbeddingBagCollection's all-to-all precision for pooled rows and their
    gradients: see ``shard``.

    ``lookup`` builds every sharded collection's per-rank lookup: see ``shard``.

    ``dynamic`` names the dynamic tables, of any collection, with their ``IdMapSpec``s:
    see ``shard``. A ManagedCollisionEmbeddingBagCollection or
    ManagedCollisionEmbeddingCollection is sharded whole, its managed-collision
    modules with its tables (see ``shard``).

    A 2-D ``mesh`` (``sharding_mesh(group_size)``) shards the tables by ``plan``, made
    for ``group_size`` ranks, inside every sharding group; DDP still averages the dense
    gradients over the whole world. Call ``sync_replicas(model)`` after every step.

    End the script with ``embshard.shutdown()``: DDP keeps a gloo process group and its
    threads alive after ``destroy_process_group``, and with torch 2.13 they can abort
    the process at exit (docs/faults.md).
    """
    if data_parallel_wrapper is not None and not callable(data_parallel_wrapper):
        raise TypeError(
            "data_parallel_wrapper must be a callable taking the model and returning the "
            f"module to train, got {type(data_parallel_wrapper).__name__}"
        )
    if data_parallel_wrapper is not None and ddp_kwargs:
        raise ValueError(
            "ddp_kwargs configure the default DDP wrapper; with data_parallel_wrapper, "
            "configure your own wrapper instead"
        )
    collections = embedding_bag_collections(model)
    if not collections:
        raise ValueError(
            f"{type(model).__name__} holds no EmbeddingBagCollection or EmbeddingCollection "
            "to shard"
        )
    configs = [c for collection in collections.values() for c in _configs(collection)]
    names = [c.name for c in configs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"table names {repeated} appear in more than one embedding collection")
    device = _device(device, mesh)
    mesh = world_mesh(device.type) if mesh is None else mesh
    if mesh.device_type != device.type:
        raise ValueError(f"device {device} does not match the mesh's {mesh.device_type!r}")
    plan.resolve(configs, ShardingMesh.of(mesh).size)  # one error naming every problem
    dynamic = dict(dynamic or {})
    unknown = sorted(set(dynamic) - set(names))
    if unknown:
        raise PlanError(f"dynamic tables {unknown} are not tables of the model's collections")
    for path, collection in collections.items():
        own = {c.name for c in _configs(collection)}
        sub_plan = ShardingPlan({n: s for n, s in plan.tables.items() if n in own})
        pooled = not isinstance(
            collection, EmbeddingCollection | ManagedCollisionEmbeddingCollection
        )
        sharded = shard(
            collection,
            sub_plan,
            mesh=mesh,
            optimizer=optimizer,
            seed=seed,
            comm_precision=comm_precision if pooled else None,
            lookup=lookup,
            dynamic={n: spec for n, spec in dynamic.items() if n in own},
        )
        _replace(model, path, sharded)
    _place_dense(model, device)
    if data_parallel_wrapper is not None:
        return data_parallel_wrapper(model)
    device_ids = {"device_ids": [device]} if device.type == "cuda" else {}
    settings, sync_buffers_once = _ddp_settings(ddp_kwargs or {}, DistributedDataParallel)
    wrapped = DistributedDataParallel(model, **device_ids, **settings)
    if sync_buffers_once:
        _broadcast_buffers(wrapped)
    return wrapped


def _device(device: torch.device | str | None, mesh: DeviceMesh | None) -> torch.device:
    """The device a sharded model lives on; on CUDA, the current one (NCCL's)."""
    if device is None:
        device = mesh.device_type if mesh is not None else world_mesh().device_type
    device = torch.device(device)
    if device.type != "cuda":
        return device
    current = torch.device("cuda", torch.cuda.current_device())
    if device.index is not None and device != current:
        raise ValueError(
            f"device {device} is not the current CUDA device ({current}): call "
            "torch.cuda.set_device(local_rank) before sharding, as NCCL needs"
        )
    return current


def sharded_collections(model: nn.Module) -> dict[str, ShardedCollection]:
    return {path: m for path, m in model.named_modules() if isinstance(m, ShardedCollection)}


def sync_replicas(model: nn.Module) -> None:
    """Average every sharded collection of ``model`` with its copies in the other
    sharding groups (``ShardedCollection.sync_replicas``: one all-reduce over the
    replica group each): on a 2-D mesh, once a step, after the backward, on every
    rank, as TorchRec's ``DMPCollection.sync()``. On a 1-D mesh nothing runs."""
    for collection in sharded_collections(model).values():
        collection.sync_replicas()


def _ddp_settings(ddp_kwargs: Mapping[str, Any], ddp: type) -> tuple[dict[str, Any], bool]:
    """``DDP_DEFAULTS`` updated by ``ddp_kwargs``, in the arguments ``ddp`` takes, and
    whether the buffers must then be broadcast once. Chosen by ``ddp``'s signature: a
    DDP without ``forward_sync_buffers`` (torch before 2.13) gets ``broadcast_buffers``,
    which when False also skips the broadcast at construction that
    ``forward_sync_buffers=False`` keeps; the caller does that one broadcast."""
    settings = {**DDP_DEFAULTS, **ddp_kwargs}
    if "broadcast_buffers" in ddp_kwargs and "forward_sync_buffers" not in ddp_kwargs:
        # DDP ignores the older broadcast_buffers when forward_sync_buffers is given.
        del settings["forward_sync_buffers"]
    if "forward_sync_buffers" not in settings or (
        "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
    ):
        return settings, False
    forward_sync = settings.pop("forward_sync_buffers")
    settings["broadcast_buffers"] = forward_sync
    return settings, not forward_sync


def _broadcast_buffers(ddp: DistributedDataParallel) -> None:
    """Rank 0's buffers on every rank of ``ddp``'s group, as DDP's own broadcast at
    construction does (buffers DDP is told to ignore stay each rank's own)."""
    ignored = set(getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ()))
    for name, buffer in ddp.module.named_buffers():
        if name not in ignored:
            dist.broadcast(buffer, group=ddp.process_group, group_src=0)


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    if not path:
        raise ValueError(
            "shard_model takes a model that holds EmbeddingBagCollections; use shard()"
        )
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, module)


def _place_dense(model: nn.Module, device: torch.device) -> None:
    """Dense parameters and buffers onto ``device``: moved, or, from ``meta``,
    materialized and reset. The sharded collections hold none of their own."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to(device)
        return
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif any(True for _ in module.parameters(recurse=False)):
                # Modules without reset_parameters (TorchRec's LowRankCrossNet): its init.
                for param in module.parameters(recurse=False):
                    if param.dim() > 1:
                        nn.init.xavier_normal_(param)
                    else:
                        param.zero_()
