"""Training configs: YAML files read strictly into dataclasses.

Unknown keys, missing keys and wrong types fail at load time with a message that
names the file and the key's path, before any process group exists. Planning,
drawing and simulating read the same files but need only ``tables``. Relative paths
in a config are read from the config's folder.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)

from embshard.errors import ConfigError, PlanError
from embshard.plan.specs import Kind, ShardingPlan, plural, yaml_problem
from embshard.planner.search import DYNAMIC_KINDS
from embshard.storage.id_map import IdMapSpec
from embshard.storage.optimizers import FUSED_OPTIMIZERS, device_problem

_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")

SPARSE_OPTIMIZERS = list(FUSED_OPTIMIZERS)
DENSE_OPTIMIZERS = ["sgd", "adagrad", "adam"]  # torch.optim's, for the dense layers
CRITEO_DENSE = 13
CRITEO_CATEGORICAL = 26
# What training needs beyond the tables; planning, drawing and simulating take defaults.
TRAINING_KEYS = ("model", "sparse_optimizer", "dense_optimizer", "batch_size", "steps")
GroupSize = int | Literal["auto"]  # a sharding group's ranks, or the planner's choice
PLANNING_BATCH_SIZE = 512  # per rank, where a config gives none: TorchRec's planner's
# What a config is read for: "train" needs every training key and DLRM's rules (one
# embedding_dim, pooled tables); "simulate" and "plan" need only tables, of any dims,
# "plan" (plan, show) sequence tables too.
Use = Literal["train", "simulate", "plan"]
# What a table's ``shardings`` may allow the planner: every kind but the grid, which it
# never plans.
PLANNED_KINDS = tuple(k.value for k in Kind if k is not Kind.GRID)
# Where training runs: auto picks CUDA when this host has a CUDA device for each of its
# ranks, else the CPU.
Device = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class ModelConfig:
    kind: Literal["dlrm", "dlrm_dcn"]
    dense_in_features: int
    dense_arch_layer_sizes: list[int]
    over_arch_layer_sizes: list[int]
    dcn_num_layers: int = 2
    dcn_low_rank_dim: int = 16


@dataclass(frozen=True)
class DynamicConfig:
    """A dynamic table's id map (docs/dynamic.md): its features' raw ids are remapped
    to the table's rows, ``num_embeddings / buckets`` rows a bucket, each live id
    owning its row alone."""

    buckets: int = 1024
    policy: Literal["lru", "lfu", "ttl", "none"] = "lru"
    ttl_steps: int | None = None  # for policy ttl: steps unseen before an id may go
    admit_after: int = 1  # sightings before an id gets a row


@dataclass(frozen=True)
class TableConfig:
    name: str
    num_embeddings: int
    embedding_dim: int
    features: list[str]
    pooling: Literal["sum", "mean", "none"] = "sum"  # none: a sequence table, one row per id
    data_type: Literal["fp32", "fp16"] = "fp32"  # fp16: half the memory
    mean_pooling: float = 1.0  # mean ids per bag, for synthetic data and the planner
    # Planner constraints: allowed sharding types, ranks its shards may use, column blocks.
    shardings: list[Literal[PLANNED_KINDS]] | None = None
    ranks: list[int] | None = None
    column_blocks: int | None = None
    dynamic: DynamicConfig | None = None  # raw ids remapped to rows; None: ids are rows

    @property
    def sequence(self) -> bool:
        """An EmbeddingCollection's table (``pooling: none``): one row per id, no bags."""
        return self.pooling == "none"

    def torchrec_config(self) -> EmbeddingBagConfig | EmbeddingConfig:
        """TorchRec's config of the table: an ``EmbeddingConfig`` for a sequence table."""
        if self.sequence:
            return EmbeddingConfig(
                name=self.name,
                num_embeddings=self.num_embeddings,
                embedding_dim=self.embedding_dim,
                feature_names=list(self.features),
                data_type=self._data_type,
            )
        return self.embedding_bag_config()

    def embedding_bag_config(self) -> EmbeddingBagConfig:
        """TorchRec's config of a pooled table (``pooling`` sum or mean)."""
        if self.sequence:
            raise ValueError(f"table {self.name!r} has pooling none: it is no EmbeddingBag's")
        return EmbeddingBagConfig(
            name=self.name,
            num_embeddings=self.num_embeddings,
            embedding_dim=self.embedding_dim,
            feature_names=list(self.features),
            pooling=PoolingType.MEAN if self.pooling == "mean" else PoolingType.SUM,
            data_type=self._data_type,
        )

    def id_map(self, seed: int) -> IdMapSpec | None:
        """The id map of a dynamic table (None for a static one)."""
        if self.dynamic is None:
            return None
        d = self.dynamic
        rows_per_bucket = self.num_embeddings // d.buckets
        return IdMapSpec(d.buckets, rows_per_bucket, d.policy, d.ttl_steps, d.admit_after, seed)

    @property
    def _data_type(self) -> DataType:
        return DataType.FP16 if self.data_type == "fp16" else DataType.FP32


@dataclass(frozen=True)
class OptimizerConfig:
    type: Literal["sgd", "adagrad", "rowwise_adagrad", "adam", "lamb"]
    lr: float
    eps: float = 1e-8


@dataclass(frozen=True)
class DriftConfig:
    """Synthetic ids that come and go, as production ids do: each feature's ids are
    born at a steady rate, hot when new and fading as they age."""

    live_per_row: float = 1.0  # ids live at a time, per row of the feature's table
    turnover_steps: int = 1000  # steps in which as many ids are born as are live
    live: dict[str, int] | None = None  # ids live at a time by table, in place of per row


@dataclass(frozen=True)
class DataConfig:
    type: Literal["synthetic", "criteo"] = "synthetic"
    path: str | None = None  # Criteo TSV for training
    eval_path: str | None = None  # Criteo TSV held out for evaluation
    skip_bad_lines: bool = False  # skip malformed Criteo lines instead of failing
    epochs: int | None = None  # passes over the Criteo training file; None: until steps
    drift: DriftConfig | None = None  # synthetic ids that drift; None: a fixed vocabulary


@dataclass(frozen=True)
class EvalConfig:
    every: int = 100  # steps between evaluations; 0 turns them off
    batches: int = 8  # per rank


@dataclass(frozen=True)
class LoggingConfig:
    metrics: str | None = None  # JSONL file that rank 0 appends to
    every: int = 10  # steps between metrics lines
    progress: bool = True


@dataclass(frozen=True)
class TopologyConfig:
    """The planner's picture of the machines; unset values take the kind's defaults."""

    kind: Literal["cpu", "gpu"] = "cpu"
    ranks_per_host: int | None = None
    memory_per_rank: str | None = None  # like 80GiB
    reserved_memory: str | None = None  # per rank, for buffers; default GPU 4 GiB, CPU 1/8
    intra_bandwidth: float | None = None  # bytes/s
    inter_bandwidth: float | None = None
    intra_latency: float | None = None  # s
    inter_latency: float | None = None
    lookup_bandwidth: float | None = None
    remap_rate: float | None = None  # ids/s a rank's id maps remap


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # root of step_* checkpoints; None: no checkpoints
    every: int = 0  # steps between saves (0: only at the end and on SIGTERM)
    keep: int = 3  # how many to keep


@dataclass(frozen=True)
class TrainConfig:
    """A config as read for its use (``load_config``): training has every key of
    TRAINING_KEYS; a tables-only config, for planning, gets None for the model, the
    dense optimizer and the steps, a batch of PLANNING_BATCH_SIZE and the planner's
    rowwise_adagrad (whose state's memory it prices)."""

    tables: list[TableConfig]
    model: ModelConfig | None = None
    sparse_optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig("rowwise_adagrad", lr=0.01)
    )
    dense_optimizer: OptimizerConfig | None = None
    batch_size: int = PLANNING_BATCH_SIZE  # per rank
    steps: int | None = None
    plan: dict[str, Any] | None = None  # a plan's "tables" mapping; None: the planner
    seed: int = 0
    timeout_s: int = 120  # process group timeout
    comm_precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # of the pooled all-to-alls
    device: Device = "auto"  # cuda: NCCL, one GPU per rank; cpu: gloo
    # Ranks of one sharding group (2-D: the plan is made for them, every group holds a
    # copy and the copies are averaged each step); auto: the planner's choice; None: one
    # group of every rank.
    sharding_group_size: GroupSize | None = None
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)

    @property
    def dense_in_features(self) -> int:
        """Dense features in a batch: the model's, or Criteo's for a tables-only
        config (whose uses read only the ids)."""
        return self.model.dense_in_features if self.model is not None else CRITEO_DENSE

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return [t.embedding_bag_config() for t in self.tables]

    def torchrec_configs(self) -> list[EmbeddingBagConfig | EmbeddingConfig]:
        """Every table's TorchRec config, sequence tables' included."""
        return [t.torchrec_config() for t in self.tables]

    def id_maps(self) -> dict[str, IdMapSpec]:
        """The dynamic tables' id maps, by table (``shard_model``'s ``dynamic``)."""
        return {t.name: spec for t in self.tables if (spec := t.id_map(self.seed)) is not None}

    def sharding_plan(self, world_size: int | None = None) -> ShardingPlan | None:
        """The config's own plan, checked against its tables (and ``world_size``, where
        given) in one round."""
        if self.plan is None:
            return None
        return ShardingPlan.from_dict({"tables": self.plan}, self.torchrec_configs(), world_size)


def _parse(kind: Any, value: Any, where: str) -> Any:
    """``value`` checked against the type annotation ``kind``."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(kind) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(kind)):
            return None
        if len(options) == 1:
            return _parse(options[0], value, where)
        for option in options:
            try:
                return _parse(option, value, where)
            except ConfigError:
                pass
        names = " or ".join(
            " or ".join(map(repr, typing.get_args(o)))
            if typing.get_origin(o) is Literal
            else o.__name__
            for o in options
        )
        raise ConfigError(f"{where}: expected {names}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(kind):
            raise ConfigError(
                f"{where}: expected one of {list(typing.get_args(kind))}, got {value!r}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(kind)
        return [_parse(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if dataclasses.is_dataclass(kind):
        return _dataclass(kind, value, where)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str) and _EXPONENT.fullmatch(value):
        return float(value)  # YAML 1.1 (PyYAML) reads 1e9 and 1.2e6 as strings
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


def _dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (known: {sorted(fields)})")
    missing = [
        n
        for n, f in fields.items()
        if n not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing keys {missing}")
    return cls(**{k: _parse(hints[k], v, f"{where}.{k}") for k, v in data.items()})


def read_yaml(path: str | Path, what: str = "config") -> Any:
    """A YAML file's data. Problems are one-line ConfigErrors naming the file, and for
    a syntax error the line and column, since PyYAML's own name only "<unicode string>"."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {what} {path}: it is not UTF-8 text") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(yaml_problem(e, str(path))) from None


def load_config(path: str | Path, *, use: Use = "train", check_files: bool = True) -> TrainConfig:
    """Read and check a config for ``use`` (see ``Use``); every problem found is a
    ConfigError. ``check_files=False`` leaves the data files alone: planning needs
    none. Relative paths in it (data files, the metrics file, the checkpoint
    directory) are taken from the config's folder."""
    data = read_yaml(path)
    where = str(path)
    if use == "train" and isinstance(data, dict):
        missing = [k for k in TRAINING_KEYS if data.get(k) is None]
        if missing:
            raise ConfigError(
                f"{where}: missing keys {missing} (training needs them; `embshard plan`, "
                "`show` and `simulate` need only tables)"
            )
    config = _with_paths_from(Path(path).parent, _dataclass(TrainConfig, data, where))
    _check(config, where, use, check_files)
    return config


def _with_paths_from(folder: Path, config: TrainConfig) -> TrainConfig:
    """``config`` with its relative paths taken from ``folder``, normalized
    (``configs/../data/x.tsv`` reads ``data/x.tsv``)."""

    def under(path: str | None) -> str | None:
        if path is None:
            return None
        return os.path.normpath(os.path.join(folder, os.path.expanduser(path)))

    data, logging, saves = config.data, config.logging, config.checkpoint
    return dataclasses.replace(
        config,
        data=dataclasses.replace(data, path=under(data.path), eval_path=under(data.eval_path)),
        logging=dataclasses.replace(logging, metrics=under(logging.metrics)),
        checkpoint=dataclasses.replace(saves, dir=under(saves.dir)),
    )


def check_launch(config: TrainConfig, where: str, world_size: int | None, resume: bool) -> None:
    """What a training job of ``world_size`` ranks needs of its config, found before
    any process starts: its own plan fits that world (any world, for an elastic job:
    None), and ``resume`` has a checkpoint directory to look in. Problems are
    ConfigErrors naming the file."""
    _check_plan(config, where, group_size(config, world_size, where))
    if resume and config.checkpoint.dir is None:
        raise ConfigError(
            f"{where}: --resume continues from the latest checkpoint under checkpoint.dir, "
            "and the config has no checkpoint: section"
        )


def group_size(config: TrainConfig, world_size: int | None, where: str = "config") -> int | None:
    """The ranks of a sharding group in a ``world_size`` job (None: unknown, an elastic
    job's, or ``auto``, the planner's to choose): the config's ``sharding_group_size``,
    else the whole world. A size that does not divide the world is a ConfigError."""
    size = config.sharding_group_size
    if size == "auto":
        return None
    if size is None or world_size is None:
        return size or world_size
    if world_size % size:
        raise ConfigError(
            f"{where}.sharding_group_size: {size} does not divide the job's {world_size} ranks"
        )
    return size


def launch_device(
    config: TrainConfig, where: str, local_ranks: int, override: Device | None = None
) -> Literal["cpu", "cuda"]:
    """The device a job's ``local_ranks`` ranks on this host train on, by ``override``
    (``--device``) or else the config's ``device``: for ``auto``, CUDA when torch sees
    a CUDA device for each rank, else the CPU. ``cuda`` without them, or a fused
    optimizer the device cannot run, is a ConfigError naming the option or the file's
    key (NCCL refuses two ranks on one device), found before any process group exists."""
    device = _chosen_device(config, where, local_ranks, override)
    check_sparse_optimizer(config, where, device)
    return device


def _chosen_device(
    config: TrainConfig, where: str, local_ranks: int, override: Device | None
) -> Literal["cpu", "cuda"]:
    choice, where = (override, "--device") if override else (config.device, f"{where}.device")
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "auto":
        return "cuda" if devices >= local_ranks else "cpu"
    if choice == "cuda" and devices < local_ranks:
        seen = plural(devices, "CUDA device") if devices else "no CUDA device"
        raise ConfigError(
            f"{where}: cuda needs {plural(local_ranks, 'CUDA device')} for this host's "
            f"{plural(local_ranks, 'rank')} (one each: NCCL refuses two ranks on one "
            f"device); torch sees {seen}"
        )
    return choice


def check_sparse_optimizer(config: TrainConfig, where: str, device_type: str) -> None:
    """The config's fused optimizer runs on ``device_type`` (Adam and LAMB need CUDA): a
    ConfigError naming the key, found before any process starts."""
    problem = device_problem(FUSED_OPTIMIZERS[config.sparse_optimizer.type], device_type)
    if problem:
        raise ConfigError(f"{where}.sparse_optimizer.type: {problem}")


def _check_plan(config: TrainConfig, where: str, world_size: int | None = None) -> None:
    """The config's own plan fits its tables (and ``world_size``, where given)."""
    try:
        config.sharding_plan(world_size)
    except PlanError as e:
        raise ConfigError(f"{where}.plan: {e}") from None


def first_tables(tables: Sequence[TableConfig]) -> dict[str, str]:
    """Each feature's first table, by name: the one whose ids synthetic data draws."""
    return {f: t.name for t in reversed(tables) for f in t.features}


def _check_live(config: TrainConfig, where: str) -> None:
    """``drift.live``: positive counts of ids, by the name of a table that a feature
    draws from (its first)."""
    live = config.data.drift.live or {}
    drawn = set(first_tables(config.tables).values())
    for table, count in live.items():
        if table not in drawn:
            raise ConfigError(
                f"{where}: {table!r} is no table a feature draws from {sorted(drawn)}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{where}.{table}: expected a count of ids above 0, got {count!r}")


def _check_dynamic(config: TrainConfig, where: str, use: Use) -> None:
    """Each dynamic table's map fits its rows, its features feed it alone (their ids
    are raw, no other table's rows), and it is sharded a way it can be."""
    for i, t in enumerate(config.tables):
        if t.dynamic is None:
            continue
        at = f"{where}.tables[{i}].dynamic"
        others = sorted(set(t.shardings or ()) - set(DYNAMIC_KINDS))
        if others:
            raise ConfigError(
                f"{where}.tables[{i}].shardings: a dynamic table is table_wise, "
                f"row_wise or column_wise, got {others}"
            )
        if t.dynamic.buckets < 1 or t.num_embeddings % t.dynamic.buckets:
            raise ConfigError(
                f"{at}.buckets: must divide num_embeddings ({t.num_embeddings}), "
                f"got {t.dynamic.buckets}"
            )
        try:
            t.id_map(config.seed)
        except PlanError as e:
            raise ConfigError(f"{at}: {str(e).removeprefix('IdMapSpec: ')}") from None
        shared = sorted(
            {f for other in config.tables if other is not t for f in other.features}
            & set(t.features)
        )
        if shared:
            raise ConfigError(
                f"{where}.tables[{i}]: the dynamic table {t.name!r} takes raw ids, so its "
                f"features feed no other table; {shared} do"
            )


def _check(config: TrainConfig, where: str, use: Use, check_files: bool) -> None:
    trains = use == "train"
    if not config.tables:
        raise ConfigError(f"{where}.tables: a model needs at least one table")
    names = [t.name for t in config.tables]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.tables: table names repeat: {names}")
    for i, t in enumerate(config.tables):
        if t.sequence and use != "plan":
            why = (
                "the DLRM model cannot take (it pools every feature)"
                if trains
                else "`embshard simulate` cannot take (it simulates pooled lookups only)"
            )
            raise ConfigError(
                f"{where}.tables[{i}].pooling: none makes {t.name!r} a sequence table, which "
                f"{why}; `embshard plan` and `embshard show` take it"
            )
    for key in ("batch_size", "steps", "timeout_s", "sharding_group_size"):
        value = getattr(config, key)
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"{where}.{key}: must be at least 1")
    dims = {t.embedding_dim for t in config.tables}
    if trains and len(dims) != 1:
        raise ConfigError(
            f"{where}.tables: DLRM needs one embedding_dim for all, got {sorted(dims)} "
            "(`embshard plan`, `show` and `simulate` take any)"
        )
    if trains and config.model.dense_arch_layer_sizes[-1] != dims.pop():
        raise ConfigError(
            f"{where}.model.dense_arch_layer_sizes: the last size must equal embedding_dim"
        )
    _check_dynamic(config, where, use)
    _check_plan(config, where)
    if len({t.data_type for t in config.tables}) > 1:
        raise ConfigError(
            f"{where}.tables: all tables need one data_type (the model has one "
            f"EmbeddingBagCollection), got {sorted({t.data_type for t in config.tables})}"
        )
    if config.data.epochs is not None and config.data.epochs < 1:
        raise ConfigError(f"{where}.data.epochs: must be at least 1")
    if config.sparse_optimizer.type not in SPARSE_OPTIMIZERS:
        raise ConfigError(f"{where}.sparse_optimizer.type: FBGEMM fuses {SPARSE_OPTIMIZERS}")
    dense = config.dense_optimizer
    if dense is not None and dense.type not in DENSE_OPTIMIZERS:
        raise ConfigError(f"{where}.dense_optimizer.type: the dense layers take {DENSE_OPTIMIZERS}")
    data = config.data
    if data.drift is not None:
        if data.type != "synthetic":
            raise ConfigError(f"{where}.data.drift: only synthetic data drifts")
        if not data.drift.live_per_row > 0:
            raise ConfigError(f"{where}.data.drift.live_per_row: must be above 0")
        if data.drift.turnover_steps < 1:
            raise ConfigError(f"{where}.data.drift.turnover_steps: must be at least 1")
        _check_live(config, f"{where}.data.drift.live")
    if data.type == "criteo":
        if config.dense_in_features != CRITEO_DENSE:
            raise ConfigError(f"{where}.model.dense_in_features: Criteo has {CRITEO_DENSE}")
        columns = {f"cat_{i}" for i in range(CRITEO_CATEGORICAL)}
        unknown = sorted({f for t in config.tables for f in t.features} - columns)
        if unknown:
            raise ConfigError(f"{where}.tables: Criteo features are cat_0..cat_25, got {unknown}")
        for key in ("path", "eval_path") if check_files else ():
            file = getattr(data, key)
            if file is not None and not Path(file).is_file():
                raise ConfigError(
                    f"{where}.data.{key}: cannot read {file} (a relative path in a config "
                    "is read from the config's folder)"
                )
        if data.path is None:
            raise ConfigError(f"{where}.data.path: Criteo data needs a path")
