"""A collision-free map from raw ids to the rows of a bounded table.

A raw id in ``[0, 2**63)`` hashes one-to-one to a key (``hash_ids``, with ``bucket_of``
and ``initial_rows`` from ``runtime.keys``); a bucket is a contiguous range of keys and
owns ``rows_per_bucket`` consecutive rows.
An ``IdMap`` holds a contiguous range of buckets on one rank: a live key owns one row
of its bucket alone until it is evicted. Every decision (which slot, which victim,
which candidate waits) depends only on the keys a bucket receives at each step, never
on their order within a call, on the other buckets or on which rank holds the bucket:
any split of the buckets over ranks gives the same map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embshard.errors import CheckpointError, InputError, PlanError
from embshard.runtime.keys import KEY_LIMIT, bucket_of, bucket_width

POLICIES = ("lru", "lfu", "ttl", "none")

_STEP_LIMIT = 1 << 61  # victims sort on a step or a count with two bits above it


@dataclass(frozen=True)
class IdMapSpec:
    """The shape and rules of a dynamic table's id map.

    ``buckets`` hash buckets of ``rows_per_bucket`` rows each; ``policy`` picks the
    victim when a bucket is full: ``"lru"`` (least recently seen), ``"lfu"`` (fewest
    sightings, then least recent), ``"ttl"`` (only ids not seen for ``ttl_steps`` steps,
    least recent first) or ``"none"`` (no eviction). ``admit_after`` = k gives an id a
    row at its k-th sighting (1: at first sight); ``seed`` seeds the rows' initial values.
    """

    buckets: int
    rows_per_bucket: int
    policy: str = "lru"
    ttl_steps: int | None = None
    admit_after: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        problem = _spec_problem(self)
        if problem:
            raise PlanError(f"IdMapSpec: {problem}")

    def bytes_per_row(self) -> int:
        """The map's bytes for each row of the table on the rank holding it (a slot a
        row, and a probation slot too with ``admit_after`` > 1): what a planner adds to
        a row's weights and optimizer state."""
        return _Slots.slot_bytes() * (2 if self.admit_after > 1 else 1)

    def evictable(self, seen_now: torch.Tensor, last_seen: torch.Tensor, step: int) -> torch.Tensor:
        """Which live slots may give their row to a new id at ``step``, by the policy;
        ``seen_now``: the slots whose id is in this call (never evicted)."""
        if self.policy == "ttl":
            return step - last_seen >= self.ttl_steps
        if self.policy == "none":
            return torch.zeros_like(seen_now)
        return ~seen_now


def _spec_problem(spec: IdMapSpec) -> str | None:
    def positive_int(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if not positive_int(spec.buckets):
        return f"buckets must be an int >= 1, got {spec.buckets!r}"
    if not positive_int(spec.rows_per_bucket):
        return f"rows_per_bucket must be an int >= 1, got {spec.rows_per_bucket!r}"
    if spec.policy not in POLICIES:
        return f"policy must be one of {', '.join(POLICIES)}, got {spec.policy!r}"
    if spec.policy == "ttl" and not positive_int(spec.ttl_steps):
        return f"policy 'ttl' needs ttl_steps, an int >= 1, got {spec.ttl_steps!r}"
    if spec.policy != "ttl" and spec.ttl_steps is not None:
        return f"ttl_steps is only for policy 'ttl', got policy {spec.policy!r}"
    if not positive_int(spec.admit_after):
        return f"admit_after must be an int >= 1, got {spec.admit_after!r}"
    if not isinstance(spec.seed, int) or isinstance(spec.seed, bool):
        return f"seed must be an int, got {spec.seed!r}"
    return None


@dataclass(frozen=True)
class RemapResult:
    """What one ``IdMap.remap`` call did.

    ``rows``: each input key's local row, -1 where it has none (not admitted yet, or its
    bucket had no free slot). ``admitted`` / ``admitted_keys``: the rows that got a new
    key this call and those keys, in key order (initialize those rows from
    ``initial_rows(admitted_keys, ...)``). ``evicted``: live keys that lost their row;
    ``overflow``: keys due a row that found none in their bucket. The counts are 0-d
    int64 tensors, so reading them is the caller's choice of host sync."""

    rows: torch.Tensor
    admitted: torch.Tensor
    admitted_keys: torch.Tensor
    evicted: torch.Tensor
    overflow: torch.Tensor


class _Slots:
    """A table of ``(buckets, rows_per_bucket)`` slots: key, occupied, last step seen and
    sightings. Used for the map and for the probation of keys not admitted yet."""

    dtypes = (
        ("keys", torch.int64),
        ("occupied", torch.bool),
        ("last_seen", torch.int64),
        ("hits", torch.int64),
    )
    names = tuple(name for name, _ in dtypes)
    keys: torch.Tensor
    occupied: torch.Tensor
    last_seen: torch.Tensor
    hits: torch.Tensor

    def __init__(self, buckets: int, rows: int, device: torch.device) -> None:
        for name, dtype in self.dtypes:
            setattr(self, name, torch.zeros((buckets, rows), dtype=dtype, device=device))

    @classmethod
    def slot_bytes(cls) -> int:
        return sum(dtype.itemsize for _, dtype in cls.dtypes)

    def find(self, touched: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The flat slot (``bucket * rows + slot``) of each unique key ``ids``, -1 where
        absent; ``touched``: their buckets. A sort-join over the touched buckets' slots only."""
        rows = self.keys.shape[1]
        # Empty slots hold -1, which no key equals: live keys are distinct, so one
        # unstable sort orders them.
        keys = torch.where(_of(self.occupied, touched), _of(self.keys, touched), -1).flatten()
        sorted_keys, order = torch.sort(keys)
        pos = torch.searchsorted(sorted_keys, ids).clamp_(max=len(sorted_keys) - 1)
        slot = order[pos]
        flat = touched[torch.div(slot, rows, rounding_mode="floor")] * rows + slot % rows
        return torch.where(sorted_keys[pos] == ids, flat, -1)

    def victims(
        self, touched: torch.Tensor, evictable: torch.Tensor, by_hits: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each touched bucket's slots in the order new keys take them, and how many may
        be taken: empty slots, then the evictable live ones by (sightings if ``by_hits``,)
        last step seen, ties by slot; ``evictable`` is ``(len(touched), rows)``. Slots
        are the same wherever a bucket is held, so the order is too."""
        occupied = _of(self.occupied, touched)
        live = occupied.long()
        kind = torch.where(occupied, 1 + (~evictable).long(), 0)  # empty, evictable, kept
        # Stable sorts, least significant key first; the last carries the kind in its
        # top bits (steps stay below _STEP_LIMIT, and so do sightings in any real stream).
        keys = [_of(self.last_seen, touched) * live]
        if by_hits:
            keys.append(_of(self.hits, touched) * live)
        keys[-1] = keys[-1] | (kind << 61)
        order = torch.sort(keys[0], dim=1, stable=True)[1]
        for key in keys[1:]:
            order = order.gather(1, torch.sort(key.gather(1, order), dim=1, stable=True)[1])
        return order, (kind < 2).sum(1)

    def take(
        self,
        touched: torch.Tensor,
        evictable: torch.Tensor,
        by_hits: bool,
        group: torch.Tensor,
        wants: torch.Tensor,
    ) -> torch.Tensor:
        """The flat slot each wanting id takes (-1: none left, or not wanting).

        Keys come in order, ``group``: their index into ``touched``; the
        r-th wanting id of a bucket takes that bucket's r-th victim."""
        order, free = self.victims(touched, evictable, by_hits)
        taken = torch.cumsum(wants.long(), 0)
        starts = torch.searchsorted(group, torch.arange(len(touched), device=group.device))
        before = (taken - wants.long())[starts]
        rank = taken - 1 - before[group]
        ok = wants & (rank < free[group])
        slot = order[group, rank.clamp(0, order.shape[1] - 1)]
        return torch.where(ok, touched[group] * order.shape[1] + slot, -1)

    def write(self, flat: torch.Tensor, keys: torch.Tensor, step: int, hits: torch.Tensor) -> None:
        self.keys.view(-1)[flat] = keys
        self.occupied.view(-1)[flat] = True
        self.last_seen.view(-1)[flat] = step
        self.hits.view(-1)[flat] = hits

    def seen(self, flat: torch.Tensor, step: int, hits: torch.Tensor) -> None:
        self.last_seen.view(-1)[flat] = step
        self.hits.view(-1)[flat] = hits

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}


class IdMap:
    """The id map of buckets ``[first, last)`` of ``spec``, on ``device``.

    State: per bucket ``rows_per_bucket`` slots holding a key (``keys``), whether it is
    live (``occupied``), the last step it was seen and its sightings (``hits``: every
    occurrence counts, from its first sighting). With ``admit_after`` k > 1 a probation
    table of the same shape holds the keys seen but not admitted yet and their sightings;
    when a bucket's probation is full, a newcomer takes the slot of the candidate seen
    least recently (then the lower slot); candidates seen this call are kept.
    """

    def __init__(
        self, spec: IdMapSpec, first: int = 0, last: int | None = None, device: str = "cpu"
    ) -> None:
        last = spec.buckets if last is None else last
        if not 0 <= first < last <= spec.buckets:
            raise PlanError(
                f"IdMap: bucket range [{first}, {last}) is not inside [0, {spec.buckets})"
            )
        self.spec, self.first, self.last = spec, first, last
        self.device = torch.device(device)
        self.step: int | None = None
        self.slots = _Slots(last - first, spec.rows_per_bucket, self.device)
        self.probation = (
            _Slots(last - first, spec.rows_per_bucket, self.device)
            if spec.admit_after > 1
            else None
        )

    def _check(self, keys: torch.Tensor, step: int) -> None:
        """Raises on bad input (one host sync: ``.item()``)."""
        where = f"IdMap of buckets [{self.first}, {self.last})"
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
            got = (
                f"{keys.dtype} of {keys.dim()} dims"
                if isinstance(keys, torch.Tensor)
                else type(keys).__name__
            )
            raise InputError(f"{where}: keys must be a 1-D int64 tensor, got {got}")
        if keys.device != self.device:
            raise InputError(f"{where}: keys are on {keys.device}, the map on {self.device}")
        lowest = self.step or 0
        if not isinstance(step, int) or not lowest <= step < _STEP_LIMIT:
            raise InputError(f"{where}: step must be an int in [{lowest}, 2**61), got {step!r}")
        width = bucket_width(self.spec.buckets)
        highest = min(self.last * width, KEY_LIMIT) - 1
        outside = (keys < self.first * width) | (keys > highest)
        if outside.any().item():
            bad = keys[outside]
            raise InputError(
                f"{where}: {len(bad)} keys are outside its buckets, e.g. key {bad[0].item()} "
                f"(bucket {bucket_of(bad[:1], self.spec.buckets).item()})"
            )

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Each key's local row, -1 for a key without one, changing nothing (no
        sighting, admission or eviction): what a forward that must not learn reads
        (evaluation, as TorchRec's managed-collision modules outside training)."""
        self._check(keys, self.step or 0)
        if len(keys) == 0:
            return keys.new_empty(0)
        uniq, inverse = torch.unique(keys, return_inverse=True)
        touched = torch.unique_consecutive(bucket_of(uniq, self.spec.buckets) - self.first)
        return self.slots.find(touched, uniq)[inverse]

    def remap(self, keys: torch.Tensor, step: int) -> RemapResult:
        """Each key's local row (-1: none) at ``step`` (non-decreasing over calls), admitting
        and evicting by the spec. Depends on the set of keys and their counts, not their
        order.

        Within a call: live keys are seen first (last step, sightings); then keys due a row
        (k sightings, probation included) take their bucket's victims in key order; live
        keys seen in this call are never victims. Keys due a row that find no victim get -1
        and count as ``overflow``; they wait in probation if there is one."""
        self._check(keys, step)
        self.step = step
        empty = keys.new_empty(0)
        if len(keys) == 0:
            zero = torch.zeros((), dtype=torch.int64, device=self.device)
            return RemapResult(empty, empty, empty, zero, zero)
        # Sorted keys are in bucket order: a bucket is a range of keys.
        uniq, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        touched, group = torch.unique_consecutive(
            bucket_of(uniq, self.spec.buckets) - self.first, return_inverse=True
        )
        slots, rows = self.slots, self.spec.rows_per_bucket

        found = slots.find(touched, uniq)
        live = found >= 0
        seen = live.nonzero()[:, 0]
        slots.seen(found[seen], step, slots.hits.view(-1)[found[seen]] + counts[seen])

        new, total, waiting = ~live, counts, None
        if self.probation is not None:
            waiting = self.probation.find(touched, uniq)
            total = counts + torch.where(
                waiting >= 0, self.probation.hits.view(-1)[waiting.clamp(min=0)], 0
            )
        due = new & (total >= self.spec.admit_after)

        seen_now = _marked(touched, rows, group[seen], found[seen])
        evictable = self.spec.evictable(seen_now, _of(slots.last_seen, touched), step)
        taken = slots.take(touched, evictable, self.spec.policy == "lfu", group, due)
        admit = taken >= 0
        got = admit.nonzero()[:, 0]
        evicted = slots.occupied.view(-1)[taken[got]].sum()
        slots.write(taken[got], uniq[got], step, total[got])

        if self.probation is not None and waiting is not None:
            self._wait(touched, group, uniq, total, waiting, admit, new & ~admit, step)

        return RemapResult(
            rows=torch.where(live, found, taken)[inverse],
            admitted=taken[got],
            admitted_keys=uniq[got],
            evicted=evicted,
            overflow=(due & ~admit).sum(),
        )

    def _wait(
        self,
        touched: torch.Tensor,
        group: torch.Tensor,
        uniq: torch.Tensor,
        total: torch.Tensor,
        waiting: torch.Tensor,
        admit: torch.Tensor,
        wait: torch.Tensor,
        step: int,
    ) -> None:
        """Probation after admission: admitted ids leave it, ids still waiting are seen
        (kept this call) or enter it, taking free slots, then the least recently seen."""
        probation, known = self.probation, waiting >= 0
        assert probation is not None
        probation.occupied.view(-1)[waiting[(known & admit).nonzero()[:, 0]]] = False
        stay = (known & wait).nonzero()[:, 0]
        probation.seen(waiting[stay], step, total[stay])
        kept = ~_marked(touched, self.spec.rows_per_bucket, group[stay], waiting[stay])
        taken = probation.take(touched, kept, False, group, wait & ~known)
        enter = (taken >= 0).nonzero()[:, 0]
        probation.write(taken[enter], uniq[enter], step, total[enter])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The map's plain tensors, each ``(buckets of this range, rows_per_bucket)``:
        the bucket axis splits and joins across ranges."""
        state = self.slots.tensors()
        if self.probation is not None:
            state |= {f"probation_{k}": v for k, v in self.probation.tensors().items()}
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``state_dict()``'s tensors (copied onto this map's device)."""
        mine = self.state_dict()
        if set(state) != set(mine):
            raise CheckpointError(
                f"IdMap: state has keys {sorted(state)}, this map needs {sorted(mine)}"
            )
        for name, tensor in mine.items():
            given = state[name]
            if given.shape != tensor.shape or given.dtype != tensor.dtype:
                raise CheckpointError(
                    f"IdMap: state {name} is {given.dtype} {tuple(given.shape)}, "
                    f"this map needs {tensor.dtype} {tuple(tensor.shape)}"
                )
        for name, tensor in mine.items():
            tensor.copy_(state[name])


def _of(table: torch.Tensor, touched: torch.Tensor) -> torch.Tensor:
    """The rows of ``table`` (a row a bucket) of the buckets ``touched`` (distinct, in
    order): the table itself, uncopied, where they are all of its buckets."""
    return table if len(touched) == len(table) else table[touched]


def _marked(
    touched: torch.Tensor, rows: int, group: torch.Tensor, flat: torch.Tensor
) -> torch.Tensor:
    """A ``(len(touched), rows)`` mask, true at the given flat slots of ``group``'s buckets."""
    mask = torch.zeros(len(touched), rows, dtype=torch.bool, device=touched.device)
    mask[group, flat % rows] = True
    return mask
