"""A sharded serving artifact: the model's tables quantized shard by shard for a world
of ranks, as a sharded predictor loads them. A folder:

    serving.json          the manifest, its ``sharded`` entry the world size and plan
                          (and the dynamic tables' specs)
    shards/rank_<r>.pt    rank r's quantized shards and copies, by collection
    shards/maps_<r>.pt    rank r's id maps of its dynamic shards' bucket ranges, by
                          table (``IdMap.state_dict()``; none without dynamic tables)
    dense.pt              the dense part's float32 state dict

Written in one process from whole tensors (a checkpoint's, of any world size and
plan); loaded by every rank of a world of that size, each reading its own file only.
Loading needs embshard, whose sharded collections route the ids and rows. The files are
plain tensors, read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn

from embshard.errors import ConfigError
from embshard.modules.collection import ShardedCollection
from embshard.modules.shard_model import shard_model
from embshard.plan.specs import ShardingPlan, TableShard
from embshard.serving.export import Manifest, float32_bytes
from embshard.serving.model import collections_of, table_key
from embshard.serving.precision import Precision
from embshard.serving.sharded import (
    NO_OPTIMIZER,
    ServedShards,
    check_servable,
    quantize_sharded,
    served_shards,
)
from embshard.serving.tables import PackedRows, QuantizedRows
from embshard.storage.dynamic import check_dynamic, map_ranges
from embshard.storage.id_map import IdMapSpec

SHARDS = "shards"
DENSE = "dense.pt"


def rank_file(artifact: str | Path, rank: int) -> Path:
    return Path(artifact) / SHARDS / f"rank_{rank}.pt"


def maps_file(artifact: str | Path, rank: int) -> Path:
    return Path(artifact) / SHARDS / f"maps_{rank}.pt"


def write_sharded(
    model: nn.Module,
    tables: Mapping[str, torch.Tensor],
    dense: Mapping[str, torch.Tensor],
    plan: ShardingPlan,
    world_size: int,
    precision: Precision | str,
    out: str | Path,
    dense_in: int,
    extra: Mapping | None = None,
    dynamic: Mapping[str, tuple[IdMapSpec, Mapping[str, torch.Tensor]]] | None = None,
) -> Manifest:
    """Write the artifact of ``model`` (holding one EmbeddingBagCollection) sharded by
    ``plan`` over ``world_size`` ranks into the folder ``out``: ``tables`` (whole, by
    state dict key) quantized shard by shard to ``precision``, ``dense`` as it is.
    ``dynamic``: each dynamic table's spec and whole id map state (by name), split by
    the bucket ranges of its shards (a plan a dynamic table cannot have is refused)."""
    precision = Precision.parse(precision)
    found = collections_of(model)
    if len(found) != 1:
        raise ValueError(f"a served model needs one EmbeddingBagCollection, it has {len(found)}")
    ((path, ebc),) = found.items()
    configs = ebc.embedding_bag_configs()
    resolved = plan.resolve(configs, world_size)
    check_servable(resolved, precision, torch.device("cpu"))
    dynamic = dict(dynamic or {})
    specs = {name: spec for name, (spec, _) in dynamic.items()}
    check_dynamic(specs, configs, resolved)
    (Path(out) / SHARDS).mkdir(parents=True, exist_ok=True)
    rank_bytes = []
    for rank in range(world_size):
        packed = [
            PackedRows.of(
                name,
                tables[table_key(path, name)][
                    s.row_offset : s.row_offset + s.rows, s.col_offset : s.col_offset + s.cols
                ],
                precision,
            )
            for name, s in served_shards(resolved, rank)
        ]
        torch.save({path: [vars(p) for p in packed]}, rank_file(out, rank))
        if dynamic:
            torch.save(_rank_maps(dynamic, served_shards(resolved, rank)), maps_file(out, rank))
        rank_bytes.append(_layout_bytes(packed, precision))
    torch.save(dict(dense), Path(out) / DENSE)
    manifest = Manifest(
        features=[f for t in configs for f in t.feature_names],
        dense_in=dense_in,
        precision=precision.value,
        table_bytes=sum(rank_bytes),
        float32_bytes=float32_bytes(configs),
        extra={**(extra or {}), "rank_table_bytes": rank_bytes},
        sharded={
            "world_size": world_size,
            "plan": yaml.safe_load(plan.to_yaml()),
            **({"dynamic": {n: dataclasses.asdict(s) for n, s in specs.items()}} if specs else {}),
        },
    )
    manifest.write(out)
    return manifest


def load_sharded(artifact: str | Path, model: nn.Module) -> nn.Module:
    """``model`` (built as the exporter's, its tables may be on ``meta``) sharded as the
    artifact says, this rank's quantized shards and the dense part loaded from it.
    Collective: every rank of a world of the artifact's size calls it."""
    manifest = Manifest.read(artifact)
    if manifest.sharded is None:
        raise ConfigError(f"{artifact} is a one-host artifact: its program is model.pt2")
    world, here = manifest.sharded["world_size"], dist.get_world_size()
    if world != here:
        raise ConfigError(f"{artifact} is sharded over {world} ranks, this world has {here}")
    plan = ShardingPlan.from_dict(manifest.sharded["plan"])
    specs = {n: IdMapSpec(**s) for n, s in manifest.sharded.get("dynamic", {}).items()}
    served = shard_model(
        model, plan, optimizer=NO_OPTIMIZER, data_parallel_wrapper=lambda m: m, dynamic=specs
    )
    if specs:
        maps = torch.load(maps_file(artifact, dist.get_rank()), weights_only=True)
        for sharded in served.modules():
            if isinstance(sharded, ShardedCollection) and sharded.dynamic_tables is not None:
                sharded.dynamic_tables.restore(maps, 0, {})
    saved = torch.load(rank_file(artifact, dist.get_rank()), weights_only=True)
    packed = {path: [PackedRows(**p) for p in rows] for path, rows in saved.items()}
    served = quantize_sharded(served, manifest.precision, packed)
    dense = torch.load(Path(artifact) / DENSE, weights_only=True)
    shards = tuple(f"{p}." for p, m in served.named_modules() if isinstance(m, ServedShards))
    wanted = {k for k in served.state_dict() if not k.startswith(shards)}
    if set(dense) != wanted:
        odd = sorted(set(dense) ^ wanted)
        raise ConfigError(f"{artifact}: {DENSE} does not hold the model's dense part ({odd[0]!r})")
    served.load_state_dict(dense, strict=False)
    return served


def _rank_maps(
    dynamic: Mapping[str, tuple[IdMapSpec, Mapping[str, torch.Tensor]]],
    shards: list[tuple[str, TableShard]],
) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
    """The id map state of the dynamic shards in ``shards``, by table: the first bucket
    of the range covering all of the table's blocks here and that range's rows, what
    ``DynamicTables.restore`` gives each block its part of."""
    ranges = map_ranges(shards, {name: spec for name, (spec, _) in dynamic.items()})
    return {
        name: (first, {k: v[first:last].clone() for k, v in dynamic[name][1].items()})
        for name, (first, last) in ranges.items()
    }


def _layout_bytes(packed: list[PackedRows], precision: Precision) -> int:
    """The bytes a rank's quantized lookup of ``packed`` takes in FBGEMM's layout (each
    table aligned), as the rank will hold them."""
    if not packed:
        return 0
    cpu = torch.device("cpu")
    return QuantizedRows(packed, range(len(packed)), precision, cpu, PoolingMode.SUM).table_bytes()
