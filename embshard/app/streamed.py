"""``embshard simulate``'s streamed mode: one sending rank at a time (a few at once,
one a core).

Every rank's batch is made, checked and routed by the real input distribution, then
dropped: what the ids all-to-all would deliver is counted from the sending side, since
the ids a rank receives from a peer are exactly those the peer routed to it. So the
memory is a few ranks' batches and a few counters per rank and step, whatever the
number of ranks, and the report is the full mode's, field by field (the tests compare
them).

A batch is routed with its bags merged into one per feature: how many ids go to each
rank's slots does not depend on where the bags split, and routing the whole batch
would fill a lengths table of (ranks x features x batch) entries per bucketizing
pass, which at 1,024 ranks costs about half a second a batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.app.config import TrainConfig
from embshard.app.data import build_data
from embshard.app.rank_report import (
    RankReport,
    Traffic,
    copies_looked_up,
    host_of,
    pooled_widths,
    step_report,
)
from embshard.app.sim_maps import StreamedKeys
from embshard.errors import InputError
from embshard.plan.specs import ShardedTable
from embshard.runtime.batch import check_batch, describe_problem
from embshard.runtime.input_dist import InputDistribution
from embshard.runtime.routes import Routes
from embshard.runtime.scratch import Scratch
from embshard.storage.id_map import IdMapSpec

# Sending ranks under way at once, a thread each: FBGEMM's and torch's ops release
# Python's lock, so the cores share the work; each holds one batch.
WORKERS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class _Sent:
    """What one rank's batch sends: its size, the payload elements (lengths and ids)
    for each rank, the ids for each slot of each rank (``Routes.send_rows`` order), and
    its own ids looked up in copies."""

    batch_size: int
    payload: torch.Tensor
    slot_ids: torch.Tensor
    copies: list[int]
    keys: tuple[torch.Tensor, ...]  # to the dynamic slots, and how many each (StreamedKeys)


def _send(
    sender: int, features: KeyedJaggedTensor, input_dist: InputDistribution, keys: StreamedKeys
) -> _Sent:
    """Check and route ``sender``'s batch by the real input stage, and count what it
    sends whom (and which keys, to the dynamic tables' slots)."""
    routes = input_dist.routes
    batch = check_batch(features, routes, input_dist.check_inputs)
    if isinstance(batch, str) or bool(batch.problems):
        problem = batch if isinstance(batch, str) else describe_problem(features, routes)
        raise InputError(f"bad input batch:\n  rank {sender}: {problem}")
    whole = dataclasses.replace(
        batch, lengths=batch.ids_per_feature[:, None], offsets=None, stand_in=None
    )
    routed = input_dist.route(whole)
    tally = routed.tally
    if tally is None:  # one rank, whose TBE takes the batch's own bags
        tally = input_dist.tally(whole.lengths, whole.row_ids)
    slot_ids = input_dist.ids_per_slot(tally)
    payload = torch.zeros(input_dist.world, dtype=torch.long)
    if input_dist.world > 1:  # on one rank nothing travels
        payload.index_add_(0, input_dist.slot_rank, slot_ids * input_dist.ids_per_element)
        payload += torch.tensor(input_dist.slots_per_rank) * batch.batch_size
    sent_keys = keys.routed(routed.lengths, routed.values) if keys else ()
    return _Sent(batch.batch_size, payload, slot_ids, copies_looked_up(routes, batch), sent_keys)


class _StepCounts:
    """One step's counters, filled one sending rank at a time: every rank's batch size,
    the payload elements it sends (to all, and to other hosts) and receives (from all,
    and from its own host), the ids each slot of each rank receives
    (``Routes.send_rows`` order) and its own ids looked up in copies."""

    def __init__(self, routes: Routes) -> None:
        world = routes.world_size
        self.batch_sizes = [0] * world
        self.sent = [0] * world
        self.sent_across = [0] * world
        self.received = torch.zeros(world, dtype=torch.long)
        self.received_inside = torch.zeros(world, dtype=torch.long)
        self.slot_ids = torch.zeros(sum(map(len, routes.slots)), dtype=torch.long)
        self.copies: list[list[int]] = [[] for _ in range(world)]

    def add(self, sender: int, sent: _Sent, ranks_per_host: int) -> None:
        host = host_of(sender, ranks_per_host)
        total, inside = int(sent.payload.sum()), sent.payload[host]
        self.batch_sizes[sender] = sent.batch_size
        self.sent[sender], self.sent_across[sender] = total, total - int(inside.sum())
        self.received += sent.payload
        self.received_inside[host] += inside
        self.slot_ids += sent.slot_ids
        self.copies[sender] = sent.copies

    def reports(self, routes: Routes, ranks_per_host: int) -> list[RankReport]:
        """Every rank's step."""
        widths = pooled_widths(routes)
        received, inside = self.received.tolist(), self.received_inside.tolist()
        slot_ids = self.slot_ids.tolist()
        starts = list(accumulate(map(len, routes.slots), initial=0))
        return [
            step_report(
                routes,
                rank,
                self.batch_sizes,
                widths,
                slot_ids[starts[rank] : starts[rank + 1]],
                Traffic(self.sent[rank], received[rank]),
                Traffic(self.sent_across[rank], received[rank] - inside[rank]),
                self.copies[rank],
                ranks_per_host,
            )
            for rank in range(routes.world_size)
        ]


def _features(config: TrainConfig, rank: int, world: int) -> Iterator[KeyedJaggedTensor]:
    """A rank's batches' sparse features as training's ``Feed`` hands them out in its
    first pass: its own, then empty ones once its part is used up. Without the
    ``Feed``'s read-ahead, which would make one batch more than the steps need, and
    without the labels, which nothing here reads."""
    source = build_data(config, rank, world)
    empty = source.empty_batch().sparse
    return itertools.chain(source.epoch_features(), itertools.repeat(empty))


def stream_ranks(
    config: TrainConfig,
    routes: Routes,
    batches: int,
    ranks_per_host: int,
    progress: Callable[[int], None],
    tables: Mapping[str, ShardedTable],
    dynamic: Mapping[str, IdMapSpec],
    workers: int = WORKERS,
) -> list[RankReport]:
    """Every rank's report over ``batches`` steps of its own data, sending ranks taken
    ``workers`` at a time, one a thread (``progress`` told of each rank's step); the
    ``dynamic`` tables' maps then run on the keys the senders routed to them."""
    world, cpu = routes.world_size, torch.device("cpu")
    steps = [_StepCounts(routes) for _ in range(batches)]
    keys = StreamedKeys(routes, dynamic, InputDistribution(routes, 0, Scratch(), cpu).send_rows)
    counting = threading.Lock()

    def send_all(sender: int) -> None:
        input_dist = InputDistribution(routes, sender, Scratch(), cpu)
        for index, (step, features) in enumerate(zip(steps, _features(config, sender, world))):
            sent = _send(sender, features, input_dist, keys)
            with counting:
                step.add(sender, sent, ranks_per_host)
                if sent.keys:
                    keys.add(index, *sent.keys)
                progress(1)

    with ThreadPoolExecutor(workers) as pool:
        done = [pool.submit(send_all, sender) for sender in range(world)]
        try:
            for future in done:
                future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the ranks not started never will
            raise
    reports = [RankReport(rank) for rank in range(world)]
    for step in steps:
        for report, counted in zip(reports, step.reports(routes, ranks_per_host)):
            report.add_step(counted)
    keys.run(config, tables, reports, workers)
    return reports
