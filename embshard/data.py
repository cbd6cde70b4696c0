"""Training batches: a deterministic synthetic generator and a Criteo TSV reader.

Each rank makes or reads only its own part. Both give ``Batch``es of dense features,
a KeyedJaggedTensor of sparse ids in the model's feature order, and labels.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.config import CRITEO_CATEGORICAL, CRITEO_DENSE, TableConfig


@dataclass(frozen=True)
class Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.labels)


class CriteoFormatError(ValueError):
    """A malformed Criteo line; the message names the file and line number."""


def feature_rows(tables: Sequence[TableConfig]) -> dict[str, int]:
    """Every feature in model order, with the rows of the smallest table it feeds."""
    rows: dict[str, int] = {}
    for t in tables:
        for f in t.features:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    return rows


def _stable_seed(*parts: object) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SyntheticData:
    """Batches that depend only on (seed, split, rank, step).

    Ids follow a power law (``floor(rows ** u)``, u uniform: low ids are hot), bag
    sizes are Poisson around each table's ``mean_pooling`` (at least 1), and labels
    are drawn from a fixed hidden logistic model of the dense features and the ids,
    so a model can learn them.
    """

    def __init__(
        self, tables: Sequence[TableConfig], dense_in: int, batch_size: int, seed: int, rank: int
    ) -> None:
        self.rows = feature_rows(tables)
        self.pooling = {f: t.mean_pooling for t in tables for f in t.features}
        self.dense_in, self.batch_size, self.seed, self.rank = dense_in, batch_size, seed, rank
        hidden = torch.Generator().manual_seed(_stable_seed(seed, "hidden"))
        self.dense_weight = torch.randn(dense_in, generator=hidden) / math.sqrt(dense_in)
        self.feature_salt = {f: _stable_seed(seed, f) % (1 << 16) for f in self.rows}

    def _score(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        """A fixed pseudo-random score in [-1, 1) per (feature, id)."""
        mixed = (ids * 2654435761 + self.feature_salt[feature]) % (1 << 16)
        return mixed.float() / (1 << 15) - 1

    def batch(self, step: int, split: str = "train") -> Batch:
        g = torch.Generator().manual_seed(_stable_seed(self.seed, split, self.rank, step))
        size = self.batch_size
        dense = torch.randn(size, self.dense_in, generator=g)
        logit = 0.5 * (dense @ self.dense_weight)
        lengths, values = [], []
        for feature, rows in self.rows.items():
            mean = torch.full((size,), float(self.pooling[feature]))
            bags = torch.poisson(mean, generator=g).clamp(min=1).long()
            u = torch.rand(int(bags.sum()), generator=g, dtype=torch.float64)
            ids = (torch.pow(float(rows), u).floor().long() - 1).clamp(0, rows - 1)
            sample = torch.repeat_interleave(torch.arange(size), bags)
            scores = torch.zeros(size).index_add(0, sample, self._score(feature, ids))
            logit += 3 * scores / bags / math.sqrt(len(self.rows))
            lengths.append(bags)
            values.append(ids)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        sparse = KeyedJaggedTensor(
            keys=list(self.rows), values=torch.cat(values), lengths=torch.cat(lengths)
        )
        return Batch(dense, sparse, labels)

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """The batches of steps ``start``, ``start + 1``, ..."""
        step = start
        while True:
            yield self.batch(step)
            step += 1

    def eval_batches(self, count: int) -> list[Batch]:
        return [self.batch(i, "eval") for i in range(count)]


def _count_newlines(f, end: int, chunk: int = 1 << 20) -> int:
    count = 0
    while f.tell() < end:
        count += f.read(min(chunk, end - f.tell())).count(b"\n")
    return count


class CriteoData:
    """The Criteo Kaggle TSV format: label, 13 integer and 26 hex categorical columns.

    Rank ``r`` of ``w`` reads the lines that start in bytes [size*r/w, size*(r+1)/w)
    of each file. Dense values become log(1 + max(x, 0)), empty ones 0; a categorical
    value is its hex number modulo the rows of the feature's table, an empty one an
    empty bag. A malformed line raises CriteoFormatError naming file and line, or is
    skipped with ``skip_bad_lines``.
    """

    def __init__(
        self,
        path: str,
        eval_path: str | None,
        tables: Sequence[TableConfig],
        batch_size: int,
        rank: int,
        world: int,
        skip_bad_lines: bool = False,
    ) -> None:
        self.path, self.eval_path = path, eval_path
        self.rows = feature_rows(tables)
        self.columns = [1 + CRITEO_DENSE + int(f.removeprefix("cat_")) for f in self.rows]
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
        rows = self.rows.values()
        return float(fields[0]), dense, [None if i is None else i % r for i, r in zip(ids, rows)]

    def _batches(self, path: str, repeat: bool) -> Iterator[Batch]:
        records: list[tuple] = []
        while True:
            found = False
            for line_no, text in self._lines(path):
                found = True
                record = self._parse(path, line_no, text)
                if record is not None:
                    records.append(record)
                if len(records) == self.batch_size:
                    yield self._collate(records)
                    records = []
            if not found:
                raise CriteoFormatError(f"{path}: rank {self.rank} of {self.world} has no lines")
            if not repeat:
                return

    def _collate(self, records: list[tuple]) -> Batch:
        labels = torch.tensor([r[0] for r in records])
        dense = torch.tensor([r[1] for r in records], dtype=torch.float32)
        lengths, values = [], []
        for column in range(len(self.rows)):
            ids = [r[2][column] for r in records]
            lengths += [0 if i is None else 1 for i in ids]
            values += [i for i in ids if i is not None]
        sparse = KeyedJaggedTensor(
            keys=list(self.rows),
            values=torch.tensor(values, dtype=torch.long),
            lengths=torch.tensor(lengths, dtype=torch.long),
        )
        return Batch(dense, sparse, labels)

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """The batches of steps ``start``, ``start + 1``, ...: the file's, cycled."""
        batches = self._batches(self.path, repeat=True)
        for _ in range(start):
            next(batches)
        return batches

    def eval_batches(self, count: int) -> list[Batch]:
        if self.eval_path is None:
            return []
        batches = []
        for batch in self._batches(self.eval_path, repeat=False):
            batches.append(batch)
            if len(batches) == count:
                break
        return batches
