"""A training pipeline: batch i+1's input distribution runs before batch i's step.

As TorchRec's ``TrainPipelineSparseDist``: the checks, routing, counts exchange and
the ids all-to-all of the next batch are started before the current batch's forward
and backward, so the all-to-all travels while the step computes. The results are
those of the plain loop, bit for bit: the input distribution reads ids, not weights.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.modules.collection import ShardedCollection


def prefetch(model: nn.Module, batch: Any) -> list[tuple[str, KeyedJaggedTensor]]:
    """Start the input distribution of ``batch`` for every sharded collection of
    ``model`` (a collective: every rank calls it with its own batch).

    Each collection takes the KeyedJaggedTensor of ``batch`` (found in dataclass
    fields, tuples, lists and dict values) with the fewest keys that hold all its
    features (TorchRec models hand every collection the whole batch); the model's
    forward must then hand it that very object. Returns what was started: (module
    path, features).
    """
    return _start(model, batch)[0]


def signal_end(model: nn.Module) -> tuple[int, ...]:
    """Join the other ranks' ``prefetch`` with no batch, telling them this rank's
    batches ran out (collective). Returns every rank whose batches ran out."""
    ended: tuple[int, ...] = ()
    for _, module in _sharded(model):
        ended = module.signal_end()
    return ended


def _sharded(model: nn.Module) -> list[tuple[str, ShardedCollection]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, ShardedCollection)]


def _start(
    model: nn.Module, batch: Any, every: bool = False
) -> tuple[list[tuple[str, KeyedJaggedTensor]], tuple[int, ...]]:
    """``prefetch``'s work; also the ranks that called ``signal_end`` instead.
    ``every``: refuse, before any collective, a batch that does not feed every sharded
    collection (a rank whose batches ran out tells the others in each one's)."""
    found = _jagged_tensors(batch)
    chosen = []
    for path, module in _sharded(model):
        holding = [f for f in found if module.feature_names <= set(f.keys())]
        features = min(holding, key=lambda f: len(f.keys()), default=None)
        if features is not None:
            chosen.append((path, module, features))
        elif every:
            raise ValueError(
                f"TrainPipeline: the batch holds no KeyedJaggedTensor with every feature "
                f"of {path or 'the model'} ({sorted(module.feature_names)}); hand the "
                "pipeline batches that carry each sharded collection's features"
            )
    ended: tuple[int, ...] = ()
    for _, module, features in chosen:
        ended = module.prefetch(features)
    return [(path, features) for path, _, features in chosen], ended


def drain(model: nn.Module) -> None:
    """Wait for every batch's input distribution started ahead, and drop them: before
    the process group is destroyed, or when the batches taken ahead will not be used."""
    for module in model.modules():
        if isinstance(module, ShardedCollection):
            module.drop_prefetched()


def _jagged_tensors(batch: Any) -> list[KeyedJaggedTensor]:
    if isinstance(batch, KeyedJaggedTensor):
        return [batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        parts = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, (tuple, list)):
        parts = list(batch)
    elif isinstance(batch, dict):
        parts = list(batch.values())
    else:
        return []
    return [kjt for part in parts for kjt in _jagged_tensors(part)]


class TrainPipeline:
    """Trains ``model`` on ``batches`` with ``optimizer``, one batch ahead.

    ``model(batch)`` returns ``(loss, output)``, as TorchRec's pipelines expect;
    ``progress()`` runs one step (forward, backward, ``optimizer.step()``) and returns
    its output, raising StopIteration when the batches are done. Each step is
    collective: when one rank's batches run out, every rank stops after the same step
    (the ranks learn it in the next batch's counts exchange: no collective of its own)
    and warns, naming the ranks that ran out; the batches left on the others are not
    trained. An InputError of the next batch is raised by the step that uses it, on
    every rank. Every sharded collection of the model must find its features in each
    batch, so that all ranks start the same input distributions.

    On a 2-D mesh each step ends with ``sync_replicas``, and "every rank" is every
    rank of the sharding group: give every rank the same number of batches, or a group
    that stops first leaves the others waiting in that all-reduce.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable):
        self._model = model
        self._optimizer = optimizer
        self._batches = iter(batches)
        self._next: tuple[Any, list] | None = None
        self._started = False
        self._steps = 0

    def progress(self) -> Any:
        if not self._started:
            self._started = True
            self._next = self._fetch()
        if self._next is None:
            raise StopIteration
        (batch, prefetched), self._next = self._next, self._fetch()
        self._optimizer.zero_grad()
        loss, output = self._model(batch)
        _check_consumed(self._model, prefetched)
        loss.backward()
        self._optimizer.step()
        for _, module in _sharded(self._model):
            module.sync_replicas()  # on a 2-D mesh; nothing on a 1-D one
        self._steps += 1
        return output

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.progress()
            except StopIteration:
                return

    def _fetch(self) -> tuple[Any, list] | None:
        """The next batch with its input distribution started, or None at the end:
        this rank's or another's (collective either way)."""
        batch = next(self._batches, None)
        if batch is None:
            ended = signal_end(self._model)
        else:
            started, ended = _start(self._model, batch, every=True)
        if not ended:
            return batch, started
        drain(self._model)
        if len(ended) < _sharded(self._model)[0][1].sharding_mesh.size:
            steps = self._steps + (self._next is not None)
            warnings.warn(
                f"TrainPipeline: every rank stops after {steps} steps: ranks {list(ended)} "
                "ran out of batches; the other ranks' remaining batches are not trained",
                stacklevel=4,
            )
        return None


def _check_consumed(model: nn.Module, prefetched: list[tuple[str, KeyedJaggedTensor]]) -> None:
    """The forward must have used what was prefetched for it: a model that hands its
    collections other objects (a transformed KeyedJaggedTensor) cannot be pipelined."""
    for path, features in prefetched:
        module = model.get_submodule(path)
        if module.is_prefetched(features):
            raise ValueError(
                f"TrainPipeline: {path or 'the model'} was not given the batch's "
                f"KeyedJaggedTensor (keys {features.keys()}) in its forward, so its input "
                "distribution could not be done ahead; hand the collection the batch's "
                "own KeyedJaggedTensor, or train without the pipeline"
            )
