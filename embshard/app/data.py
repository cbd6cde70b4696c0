"""Training batches: a deterministic synthetic generator and a Criteo TSV reader.

Each rank makes or reads only its own part. Both give ``Batch``es of dense features,
a KeyedJaggedTensor of sparse ids in the model's feature order, and labels, in
passes (epochs) over the data; a ``Feed`` keeps the passes of all ranks in step when
their parts hold different numbers of samples.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.app.config import (
    CRITEO_CATEGORICAL,
    CRITEO_DENSE,
    DriftConfig,
    TableConfig,
    TrainConfig,
    first_tables,
)
from embshard.errors import EmbshardError


@dataclass(frozen=True)
class Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``, where the model is: itself when it is there."""
        if self.labels.device == device:
            return self
        return Batch(self.dense.to(device), self.sparse.to(device), self.labels.to(device))


def empty_batch(features: Sequence[str], dense_in: int) -> Batch:
    """A batch of no samples, every feature present: what a rank whose data is used
    up feeds the sharded forward, which is collective and needs every rank."""
    no_ids = torch.zeros(0, dtype=torch.long)
    sparse = KeyedJaggedTensor(keys=list(features), values=no_ids, lengths=no_ids)
    return Batch(torch.zeros(0, dense_in), sparse, torch.zeros(0))


class CriteoFormatError(EmbshardError, ValueError):
    """A malformed Criteo line; the message names the file and line number."""


def feature_rows(tables: Sequence[TableConfig]) -> dict[str, int]:
    """Every feature in model order, with the rows of the smallest table it feeds."""
    rows: dict[str, int] = {}
    for t in tables:
        for f in t.features:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    return rows


def id_moduli(tables: Sequence[TableConfig]) -> dict[str, int | None]:
    """Every feature in model order, with the rows its raw ids are taken modulo: its
    smallest table's, or None for a dynamic table's feature, which keeps its raw ids
    (the table remaps them)."""
    dynamic = {f for t in tables if t.dynamic is not None for f in t.features}
    return {f: None if f in dynamic else rows for f, rows in feature_rows(tables).items()}


def _stable_seed(*parts: object) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def power_law_ids(rows: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids of a table of ``rows``, ``floor(rows ** u) - 1`` with u uniform in
    [0, 1): low ids are hot, as in recommendation data (the bench uses it too)."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return (torch.pow(float(rows), u).floor().long() - 1).clamp(0, rows - 1)


_SCRAMBLE = 0x5851F42D4C957F2D  # odd: multiplying by it permutes [0, 2**63)
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class Drift:
    """One feature's drifting ids: the id born ``a``-th most recently before a step is
    drawn as ``power_law_ids``' ``a``-th row, so about ``live`` ids are live at a time
    (the newest hottest) and ``born_per_step`` new ones arrive each step. Raw ids are
    the ids' birth numbers scrambled over ``[0, 2**63)`` (a permutation), as hashed
    production ids look."""

    live: int
    born_per_step: float
    salt: int

    def ids(self, step: int, count: int, generator: torch.Generator) -> torch.Tensor:
        newest = self.live - 1 + math.floor(step * self.born_per_step)
        born = newest - power_law_ids(self.live, count, generator)
        return (born * _SCRAMBLE + self.salt) & _MASK63


class SyntheticData:
    """Batches that depend only on (seed, split, rank, step).

    Ids follow a power law (``floor(rows ** u)``, u uniform: low ids are hot), bag
    sizes are Poisson around each table's ``mean_pooling`` (at least 1), and labels
    are drawn from a fixed hidden logistic model of the dense features and the ids,
    so a model can learn them.

    With ``drift``, each feature's ids come and go (``Drift``): the labels are drawn
    from the raw ids, and a static table's ids are the raw ids hashed onto its rows
    (``raw % rows``), where ids that are live together can collide; a dynamic table
    takes them raw.
    """

    epochs = 1  # one pass that never ends
    skipped = 0  # lines skipped: none, the data is generated

    def __init__(
        self,
        tables: Sequence[TableConfig],
        dense_in: int,
        batch_size: int,
        seed: int,
        rank: int,
        drift: DriftConfig | None = None,
    ) -> None:
        self.rows = feature_rows(tables)
        self.moduli = id_moduli(tables)
        self.pooling = {f: t.mean_pooling for t in tables for f in t.features}
        self.dense_in, self.batch_size, self.seed, self.rank = dense_in, batch_size, seed, rank
        hidden = torch.Generator().manual_seed(_stable_seed(seed, "hidden"))
        self.dense_weight = torch.randn(dense_in, generator=hidden) / math.sqrt(dense_in)
        self.feature_salt = {f: _stable_seed(seed, f) % (1 << 16) for f in self.rows}
        # The features of one table draw from one id space (item_id and last_item: the
        # same items), salted by the table (a feature's first).
        table_of = first_tables(tables)
        self.drift = (
            {}
            if drift is None
            else {
                f: Drift(
                    live := (drift.live or {}).get(table_of[f])
                    or max(1, round(drift.live_per_row * rows)),
                    live / drift.turnover_steps,
                    _stable_seed(seed, "drift", table_of[f]) & _MASK63,
                )
                for f, rows in self.rows.items()
            }
        )

    @property
    def drifts(self) -> bool:
        """Whether held-out batches change with the step (drawn at it)."""
        return bool(self.drift)

    def _score(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        """A fixed pseudo-random score in [-1, 1) per (feature, id)."""
        mixed = (ids * 2654435761 + self.feature_salt[feature]) % (1 << 16)
        return mixed.float() / (1 << 15) - 1

    def _draw(
        self, step: int, split: str, at: int | None = None
    ) -> tuple[torch.Generator, torch.Tensor, list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """The step's generator, dense features and each feature's (name, bags, raw
        ids), in the order of their draws; drifting ids as they are at step ``at``
        (default ``step``)."""
        g = torch.Generator().manual_seed(_stable_seed(self.seed, split, self.rank, step))
        size = self.batch_size
        dense = torch.randn(size, self.dense_in, generator=g)
        drawn = []
        for feature, rows in self.rows.items():
            mean = torch.full((size,), float(self.pooling[feature]))
            bags = torch.poisson(mean, generator=g).clamp(min=1).long()
            count = int(bags.sum())
            drift = self.drift.get(feature)
            ids = (
                power_law_ids(rows, count, g)
                if drift is None
                else drift.ids(step if at is None else at, count, g)
            )
            drawn.append((feature, bags, ids))
        return g, dense, drawn

    def _to_rows(
        self, drawn: list[tuple[str, torch.Tensor, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Drifting raw ids hashed onto their static tables' rows."""
        if not self.drift:
            return drawn
        return [
            (f, bags, ids if (m := self.moduli[f]) is None else ids % m) for f, bags, ids in drawn
        ]

    def batch(self, step: int, split: str = "train", at: int | None = None) -> Batch:
        g, dense, drawn = self._draw(step, split, at)
        logit = 0.5 * (dense @ self.dense_weight)
        for feature, bags, ids in drawn:
            sample = torch.repeat_interleave(torch.arange(self.batch_size), bags)
            scores = torch.zeros(self.batch_size).index_add(0, sample, self._score(feature, ids))
            logit += 3 * scores / bags / math.sqrt(len(self.rows))
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return Batch(dense, _features(self._to_rows(drawn)), labels)

    def epoch_batches(self, skip: int = 0) -> Iterator[Batch]:
        """The batches of steps ``skip``, ``skip + 1``, ..."""
        return map(self.batch, itertools.count(skip))

    def epoch_features(self) -> Iterator[KeyedJaggedTensor]:
        """The sparse features of ``epoch_batches()``, without the labels' work: what
        ``embshard simulate`` routes."""
        return (
            _features(self._to_rows(self._draw(step, "train")[2])) for step in itertools.count()
        )

    def batches_per_epoch(self) -> int | None:
        return None

    def empty_batch(self) -> Batch:
        return empty_batch(list(self.rows), self.dense_in)

    def eval_batches(self, count: int, step: int = 0) -> list[Batch]:
        """The held-out batches; drifting, those of the stream as it is at ``step``
        (a fixed set otherwise)."""
        return [self.batch(i, "eval", step if self.drift else None) for i in range(count)]


def _count_newlines(f, end: int, chunk: int = 1 << 20) -> int:
    count = 0
    while f.tell() < end:
        count += f.read(min(chunk, end - f.tell())).count(b"\n")
    return count


def _features(drawn: list[tuple[str, torch.Tensor, torch.Tensor]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=[feature for feature, _, _ in drawn],
        values=torch.cat([ids for _, _, ids in drawn]),
        lengths=torch.cat([bags for _, bags, _ in drawn]),
    )


class CriteoData:
    """The Criteo Kaggle TSV format: label, 13 integer and 26 hex categorical columns.

    Rank ``r`` of ``w`` reads the lines that start in bytes [size*r/w, size*(r+1)/w)
    of each file, so ranks may get different numbers of lines (or none); a pass ends
    with a partial batch where the rank's part does not divide into whole ones. Dense
    values become log(1 + max(x, 0)), empty ones 0; a categorical value is its hex
    number modulo the rows of the feature's table (a dynamic table takes the number
    itself), an empty one an empty bag. A
    malformed line raises CriteoFormatError naming file and line, or is skipped with
    ``skip_bad_lines``. ``epochs`` passes over the training file, None: no end.
    """

    drifts = False  # the held-out file is the same at every step

    def __init__(
        self,
        path: str,
        eval_path: str | None,
        tables: Sequence[TableConfig],
        batch_size: int,
        rank: int,
        world: int,
        skip_bad_lines: bool = False,
        epochs: int | None = None,
    ) -> None:
        for file in (path, eval_path):
            if file is not None and Path(file).stat().st_size == 0:
                raise CriteoFormatError(f"{file}: the file is empty")
        self.path, self.eval_path, self.epochs = path, eval_path, epochs
        self.moduli = id_moduli(tables)
        self.columns = [1 + CRITEO_DENSE + int(f.removeprefix("cat_")) for f in self.moduli]
        self.batch_size, self.rank, self.world = batch_size, rank, world
        self.skip_bad_lines = skip_bad_lines
        self.skipped = 0

    def _lines(self, path: str) -> Iterator[tuple[int, str]]:
        """(line number, text) of this rank's lines of ``path``."""
        size = Path(path).stat().st_size
        start, end = size * self.rank // self.world, size * (self.rank + 1) // self.world
        with open(path, "rb") as f:
            line_no = 1 + _count_newlines(f, start)
            if start:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line that started before ``start`` is the last rank's
                    line_no += 1
            while f.tell() < end:
                raw = f.readline()
                if not raw:
                    break
                yield line_no, raw.decode("utf-8", errors="replace").rstrip("\r\n")
                line_no += 1

    def _parse(self, path: str, line_no: int, text: str) -> tuple | None:
        fields = text.split("\t")
        try:
            if len(fields) != 1 + CRITEO_DENSE + CRITEO_CATEGORICAL:
                raise ValueError(f"{len(fields)} tab-separated fields, expected 40")
            if fields[0] not in ("0", "1"):
                raise ValueError(f"label {fields[0]!r} is not 0 or 1")
            dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + CRITEO_DENSE]]
            ids = [int(fields[c], 16) if fields[c] else None for c in self.columns]
        except ValueError as e:
            if self.skip_bad_lines:
                self.skipped += 1
                return None
            raise CriteoFormatError(f"{path}:{line_no}: malformed Criteo line: {e}") from None
        moduli = self.moduli.values()
        found = [i if i is None or m is None else i % m for i, m in zip(ids, moduli)]
        return float(fields[0]), dense, found

    def _records(self, path: str) -> Iterator[tuple]:
        for line_no, text in self._lines(path):
            record = self._parse(path, line_no, text)
            if record is not None:
                yield record

    def _batches(self, path: str, skip: int = 0) -> Iterator[Batch]:
        """One pass over this rank's part of ``path`` from its ``skip``-th batch; the
        last batch holds what is left, so no sample is dropped."""
        records = itertools.islice(self._records(path), skip * self.batch_size, None)
        while chunk := list(itertools.islice(records, self.batch_size)):
            yield self._collate(chunk)

    def _collate(self, records: list[tuple]) -> Batch:
        labels = torch.tensor([r[0] for r in records])
        dense = torch.tensor([r[1] for r in records], dtype=torch.float32)
        lengths, values = [], []
        for column in range(len(self.moduli)):
            ids = [r[2][column] for r in records]
            lengths += [0 if i is None else 1 for i in ids]
            values += [i for i in ids if i is not None]
        sparse = KeyedJaggedTensor(
            keys=list(self.moduli),
            values=torch.tensor(values, dtype=torch.long),
            lengths=torch.tensor(lengths, dtype=torch.long),
        )
        return Batch(dense, sparse, labels)

    def epoch_batches(self, skip: int = 0) -> Iterator[Batch]:
        """One pass over this rank's part of the training file, from batch ``skip``."""
        return self._batches(self.path, skip)

    def epoch_features(self) -> Iterator[KeyedJaggedTensor]:
        """The sparse features of ``epoch_batches()``: what ``embshard simulate`` routes."""
        return (batch.sparse for batch in self.epoch_batches())

    def batches_per_epoch(self) -> int:
        """This rank's batches in one pass (reads its part once)."""
        return math.ceil(sum(1 for _ in self._records(self.path)) / self.batch_size)

    def empty_batch(self) -> Batch:
        return empty_batch(list(self.moduli), CRITEO_DENSE)

    def eval_batches(self, count: int) -> list[Batch]:
        """Up to ``count`` batches of this rank's part of the held-out file."""
        if self.eval_path is None:
            return []
        return list(itertools.islice(self._batches(self.eval_path), count))


class Feed:
    """One rank's training batches, pass by pass, in step with the other ranks.

    In a pass each rank takes its own batches, then empty ones once its part is used
    up, until every rank's is: the training loop learns that from the sizes of the
    batches every rank holds next (``pending``, summed in its per-step all-reduce) and
    only then starts the next pass everywhere. So every sample is trained once a pass
    however unevenly the data splits over the ranks, and no rank leaves the
    collectives early.
    """

    def __init__(self, source: SyntheticData | CriteoData, epoch: int = 0, skip: int = 0) -> None:
        self.source = source
        self.epoch = epoch - 1  # the pass under way; next_epoch() starts ``epoch``
        self._skip = skip  # batches of that pass already trained (when resuming)
        self._batches: Iterator[Batch] = iter(())
        self._next: Batch | None = None
        self._error: Exception | None = None  # reading the next batch failed

    @property
    def pending(self) -> int:
        """Samples in the batch this rank takes next: 0 once its part of the pass is done.
        A batch that could not be read counts as pending: taking it raises the error."""
        if self._error is not None:
            return 1
        return 0 if self._next is None else self._next.size

    def next_epoch(self) -> bool:
        """Start the next pass; False when the source has no passes left."""
        self.epoch += 1
        if self.source.epochs is not None and self.epoch >= self.source.epochs:
            self._next = None
            return False
        self._batches = self.source.epoch_batches(self._skip)
        self._skip = 0
        self._read_ahead()
        return True

    def take(self) -> Batch:
        """This rank's next batch, or an empty one once its part of the pass is done.
        Raises what reading it raised (a malformed line), when it is its turn."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        batch = self._next if self._next is not None else self.source.empty_batch()
        self._read_ahead()
        return batch

    def _read_ahead(self) -> None:
        """Read the next batch now; an error waits for the take() that would return it,
        where the training loop can agree on it with the other ranks."""
        try:
            self._next = next(self._batches, None)
        except Exception as e:
            self._next, self._error = None, e


def build_data(config: TrainConfig, rank: int, world: int) -> SyntheticData | CriteoData:
    if config.data.type == "criteo":
        return CriteoData(
            config.data.path,
            config.data.eval_path,
            config.tables,
            config.batch_size,
            rank,
            world,
            config.data.skip_bad_lines,
            epochs=config.data.epochs,
        )
    dense_in = config.dense_in_features
    return SyntheticData(
        config.tables, dense_in, config.batch_size, config.seed, rank, config.data.drift
    )
