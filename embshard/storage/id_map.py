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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from embshard.errors import CheckpointError, InputError, PlanError
from embshard.runtime import native
from embshard.runtime.keys import KEY_LIMIT, bucket_of, bucket_width

POLICIES = ("lru", "lfu", "ttl", "none")

_INDEX_BYTES = 16  # a live key's entry in a map's index: the key and its slot, int64
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
        """The map's most bytes for each row of the table on the rank holding it (a
        slot a row and its live key's index entry, and as much again for probation with
        ``admit_after`` > 1): what a planner adds to a row's weights and optimizer state."""
        return (_Slots.slot_bytes() + _INDEX_BYTES) * (2 if self.admit_after > 1 else 1)

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
    int64 tensors, so reading them is the caller's choice of host sync. ``missing``:
    how many of ``rows`` are -1 where that is known without a host read (the CPU
    kernel's count), else None."""

    rows: torch.Tensor
    admitted: torch.Tensor
    admitted_keys: torch.Tensor
    evicted: torch.Tensor
    overflow: torch.Tensor
    missing: int | None = None


@dataclass(frozen=True)
class _Due:
    """Keys due a slot (sorted) by bucket: the buckets they touch (local, distinct, in
    order), each key's bucket among them (``group``) and rank in it, each bucket's
    count of keys, and its live slots (``live``; None where the slots are not
    ``packed``, when its next empty slot is not known from it)."""

    touched: torch.Tensor
    group: torch.Tensor
    rank: torch.Tensor
    counts: torch.Tensor
    live: torch.Tensor | None

    def read(self, rows: int) -> list[torch.Tensor]:
        """What ``IdMap`` reads on the host before taking slots: the most keys a bucket
        has, and whether every bucket has room for its keys (rows of ``rows`` slots)."""
        roomy = (
            self.counts.new_zeros((), dtype=torch.bool)
            if self.live is None
            else (self.live + self.counts <= rows).all()
        )
        return [self.counts.max(), roomy]


def sorted_find(
    keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``ids``' value (``values[i]`` where ``keys[i]`` equals it; ``keys``
    sorted and distinct), -1 where it is absent, by a binary search; and its place in
    ``keys`` (where it is, or would go)."""
    place = torch.searchsorted(keys, ids)
    if not len(keys):
        return torch.full_like(ids, -1), place
    pos = place.clamp(max=len(keys) - 1)
    hit = keys.gather(0, pos) == ids
    return torch.where(hit, values.gather(0, pos), -1), place


class _Slots:
    """A table of ``(buckets, rows_per_bucket)`` slots: key, occupied, last step seen and
    sightings. Used for the map and for the probation of keys not admitted yet.

    Beside them, derived from them: an index of the live keys, sorted (``index_keys``),
    with each one's flat slot (``index_slots``), so a key is found by a binary search
    instead of a sort of the slots at every call. ``write`` and ``clear`` keep it up to
    date by a merge, without a sort; whatever changes the slots otherwise calls
    ``reindex`` (a load).

    ``packed``: every bucket's live slots are its first ones. New keys take empty slots
    in slot order, so only ``clear`` undoes it (and a load of such slots); while it
    holds, a bucket with room for its new keys gives them its next slots, unranked."""

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
    index_keys: torch.Tensor
    index_slots: torch.Tensor
    newest: int  # no step seen is later: victims may pack it with a slot
    packed: bool
    # The CPU kernel's index buffers: those behind the index, and a spare pair.
    _held: tuple[torch.Tensor, torch.Tensor] | None = None
    _spare: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, buckets: int, rows: int, device: torch.device) -> None:
        for name, dtype in self.dtypes:
            setattr(self, name, torch.zeros((buckets, rows), dtype=dtype, device=device))
        self.reindex()

    @classmethod
    def slot_bytes(cls) -> int:
        return sum(dtype.itemsize for _, dtype in cls.dtypes)

    def reindex(self) -> None:
        """Rebuild the index of live keys from the slots (one host sync)."""
        occupied = self.occupied
        packed = (occupied[:, 1:] <= occupied[:, :-1]).all()
        self.newest, packed = _host(self.last_seen.max(), packed)
        self.packed = bool(packed)
        flat = self.occupied.view(-1).nonzero()[:, 0]
        self.index_keys, order = torch.sort(self.keys.view(-1)[flat])
        self.index_slots = flat[order]

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The flat slot (``bucket * rows + slot``) of each key ``ids``, -1 where absent:
        a binary search of the index."""
        return self.search(ids)[0]

    def search(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``find``'s slots, and each key's place in the index (where it is, or would
        go): what ``write`` would search again."""
        return sorted_find(self.index_keys, self.index_slots, ids)

    def victims(
        self,
        touched: torch.Tensor,
        evictable: Callable[[torch.Tensor], torch.Tensor],
        by_hits: bool,
        most: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``most`` slots of each touched bucket in the order new keys take
        them, and how many may be taken: empty slots, then the evictable live ones by
        (sightings if ``by_hits``,) last step seen, ties by slot; ``evictable(last_seen)``
        gives the ``(len(touched), rows)`` mask of the live slots the policy gives up.
        Slots are the same wherever a bucket is held, so the order is too."""
        occupied = _of(self.occupied, touched)
        last_seen = _of(self.last_seen, touched)
        kept = occupied & ~evictable(last_seen)
        rows = occupied.shape[1]
        free = rows - kept.sum(1)
        bits = (rows - 1).bit_length()
        # The kind of slot in the top bits: 0 empty, 1 evictable, 2 kept. Masks multiply
        # and add in place: fresh tensors and a where over these slots cost several
        # times more.
        key, steps = last_seen * occupied, self.newest.bit_length()
        hits = _of(self.hits, touched) * occupied if by_hits else None
        width = steps + bits + (0 if hits is None else int(hits.max().item()).bit_length())
        if width <= 61:
            # (kind, sightings if by_hits, last step seen, slot) in one int64, distinct
            # in a bucket: the first few by a partial sort.
            if hits is not None:
                key.bitwise_or_(hits.bitwise_left_shift_(steps))
            key.bitwise_left_shift_(bits).bitwise_or_(torch.arange(rows, device=key.device))
            key.add_(occupied, alpha=1 << 61).add_(kept, alpha=1 << 61)
            return torch.topk(key, most, dim=1, largest=False).indices, free
        # Stable sorts, least significant key first; the last carries the kind in its
        # top bits (steps stay below _STEP_LIMIT, and so do sightings in any real stream).
        keys = [key] if hits is None else [key, hits]
        keys[-1].add_(occupied, alpha=1 << 61).add_(kept, alpha=1 << 61)
        order = torch.sort(keys[0], dim=1, stable=True)[1]
        for key in keys[1:]:
            order = order.gather(1, torch.sort(key.gather(1, order), dim=1, stable=True)[1])
        return order[:, :most], free

    def take(
        self,
        due: _Due,
        evictable: Callable[[torch.Tensor], torch.Tensor],
        by_hits: bool,
        most: int,
        roomy: bool,
    ) -> torch.Tensor:
        """The flat slot each new key of ``due`` takes (-1: none left): the r-th new key
        of a bucket takes that bucket's r-th victim; no bucket has over ``most`` new
        keys. ``roomy``: the slots are ``packed`` and every bucket has room for its
        new keys, so its victims are its next empty slots, as ``victims`` would rank."""
        touched, group, rank, rows = due.touched, due.group, due.rank, self.keys.shape[1]
        if roomy:
            assert due.live is not None
            return (touched * rows + due.live)[group].add_(rank)
        order, free = self.victims(touched, evictable, by_hits, most)
        slot = order.reshape(-1).gather(0, group * most + rank.clamp(max=most - 1))
        return torch.where(rank < free[group], touched[group] * rows + slot, -1)

    def write(
        self,
        flat: torch.Tensor,
        keys: torch.Tensor,
        step: int,
        hits: torch.Tensor,
        places: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Give the distinct slots ``flat`` to ``keys`` (sorted, none live); returns how
        many live keys they held (0-d). ``places``: the keys' places in the index as it
        is (``search``'s), when known."""
        held = self.occupied.view(-1).gather(0, flat)
        gone = self.keys.view(-1).gather(0, flat)[held]
        self.keys.view(-1).scatter_(0, flat, keys)
        self.occupied.view(-1).scatter_(0, flat, True)
        self.seen(flat, step, hits)
        self._merge(gone, keys, flat, places)
        return held.sum()

    def clear(self, flat: torch.Tensor) -> None:
        """Empty the live slots ``flat``."""
        gone = self.keys.view(-1).gather(0, flat)
        self.occupied.view(-1).scatter_(0, flat, False)
        self.packed = self.packed and not len(flat)
        self._merge(gone, gone[:0], flat[:0])

    def _merge(
        self,
        gone: torch.Tensor,
        keys: torch.Tensor,
        flat: torch.Tensor,
        places: torch.Tensor | None = None,
    ) -> None:
        """The index without the keys ``gone`` and with ``keys`` (sorted) at ``flat``:
        every entry's new place from one cumulative count, then scatters (linear in
        the live keys, where a sort is not)."""
        if not len(gone) and not len(keys):
            return
        old, device = self.index_keys, self.index_keys.device
        size = len(old) - len(gone) + len(keys)
        removed = torch.searchsorted(old, gone).sort()[0]
        inserted = torch.searchsorted(old, keys) if places is None else places
        # Entry j moves up by the keys inserted at or before it and down by the entries
        # removed before it; a new key lands after the kept entries below it and the
        # new keys before it. Removed entries go to a spare last place, then cut.
        place = torch.ones(len(old) + 1, dtype=torch.int64, device=device)
        place[0] = 0
        place.index_add_(0, inserted, torch.ones_like(inserted))
        place.index_add_(0, removed + 1, torch.full_like(removed, -1))
        place = place.cumsum_(0)[:-1].scatter_(0, removed, size)
        new = torch.arange(len(keys), device=device).add_(inserted)
        new.sub_(torch.searchsorted(removed, inserted))
        index_keys = old.new_empty(size + 1).scatter_(0, place, old).scatter_(0, new, keys)
        index_slots = old.new_empty(size + 1).scatter_(0, place, self.index_slots)
        index_slots.scatter_(0, new, flat)
        self.index_keys, self.index_slots = index_keys[:size], index_slots[:size]

    def seen(self, flat: torch.Tensor, step: int, hits: torch.Tensor) -> None:
        self.last_seen.view(-1).scatter_(0, flat, step)
        self.hits.view(-1).scatter_(0, flat, hits)
        self.newest = max(self.newest, step)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}

    def native(self, room: int) -> tuple[native.Slots, tuple[torch.Tensor, torch.Tensor]]:
        """The slots and index as the CPU kernel takes them, and the buffers it writes
        the new index into (``room``: the most keys it may add): the spare pair, kept
        between calls, as fresh memory costs a page fault a page."""
        size = len(self.index_keys) + room
        if self._spare is None or len(self._spare[0]) < size:
            size += size // 4
            self._spare = (self.index_keys.new_empty(size), self.index_slots.new_empty(size))
        self.index_keys = self.index_keys.contiguous()
        self.index_slots = self.index_slots.contiguous()
        struct = native.Slots(
            *(getattr(self, name).data_ptr() for name in self.names),
            self.index_keys.data_ptr(),
            self.index_slots.data_ptr(),
            len(self.index_keys),
            self._spare[0].data_ptr(),
            self._spare[1].data_ptr(),
            0,
        )
        return struct, self._spare

    def adopt(
        self, struct: native.Slots, out: tuple[torch.Tensor, torch.Tensor], step: int
    ) -> None:
        """Take the index the CPU kernel wrote into ``out`` (unless it left it as it
        was); the buffers of the index it replaces are the next spare pair."""
        if struct.out_index_size >= 0:
            self.index_keys = out[0][: struct.out_index_size]
            self.index_slots = out[1][: struct.out_index_size]
            self._spare, self._held = self._held, out
        self.newest = max(self.newest, step)


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
        self,
        spec: IdMapSpec,
        first: int = 0,
        last: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        last = spec.buckets if last is None else last
        if not 0 <= first < last <= spec.buckets:
            raise PlanError(
                f"IdMap: bucket range [{first}, {last}) is not inside [0, {spec.buckets})"
            )
        self.spec, self.first, self.last = spec, first, last
        self.device = torch.empty(0, device=device).device  # "cuda" as the current GPU's
        self.step: int | None = None
        self.slots = _Slots(last - first, spec.rows_per_bucket, self.device)
        self.probation = (
            _Slots(last - first, spec.rows_per_bucket, self.device)
            if spec.admit_after > 1
            else None
        )

    def _check(self, keys: torch.Tensor, step: int) -> None:
        """Raises on a bad type, device or step."""
        where = self._where()
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

    def _key_range(self) -> tuple[int, int]:
        """The lowest and highest key of the map's buckets."""
        width = bucket_width(self.spec.buckets)
        return self.first * width, min(self.last * width, KEY_LIMIT) - 1

    def _outside(self, keys: torch.Tensor) -> torch.Tensor:
        """The mask of the keys outside the map's buckets, which ``_refuse`` raises on
        once read (no host sync)."""
        lowest, highest = self._key_range()
        return (keys < lowest) | (keys > highest)

    def _where(self) -> str:
        return f"IdMap of buckets [{self.first}, {self.last})"

    def _refuse(self, keys: torch.Tensor, outside: torch.Tensor) -> None:
        """Raise on the keys ``outside`` the map's buckets (``_outside``'s mask, some
        true)."""
        bad = keys[outside]
        raise InputError(
            f"{self._where()}: {len(bad)} keys are outside its buckets, e.g. key "
            f"{bad[0].item()} (bucket {bucket_of(bad[:1], self.spec.buckets).item()})"
        )

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Each key's local row, -1 for a key without one, changing nothing (no
        sighting, admission or eviction): what a forward that must not learn reads
        (evaluation, as TorchRec's managed-collision modules outside training)."""
        self._check(keys, self.step or 0)
        outside = self._outside(keys)
        if outside.any().item():
            self._refuse(keys, outside)
        return self.slots.find(keys)

    def remap(self, keys: torch.Tensor, step: int) -> RemapResult:
        """Each key's local row (-1: none) at ``step`` (non-decreasing over calls), admitting
        and evicting by the spec. Depends on the set of keys and their counts, not their
        order.

        Within a call: live keys are seen first (last step, sightings); then keys due a row
        (k sightings, probation included) take their bucket's victims in key order; live
        keys seen in this call are never victims. Keys due a row that find no victim get -1
        and count as ``overflow``; they wait in probation if there is one."""
        self._check(keys, step)
        empty = keys.new_empty(0)
        if len(keys) == 0:
            self.step = step
            zero = torch.zeros((), dtype=torch.int64, device=self.device)
            return RemapResult(empty, empty, empty, zero, zero, missing=0)
        if native.available(keys):
            return self._remap_native(keys, step)
        outside = self._outside(keys)
        uniq, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        slots = self.slots

        found, places = slots.search(uniq)
        live = found >= 0
        new, total, waiting = ~live, counts, None
        if self.probation is not None:
            waiting = self.probation.find(uniq)
            total = counts + torch.where(
                waiting >= 0, self.probation.hits.view(-1)[waiting.clamp(min=0)], 0
            )
        due = (new & (total >= self.spec.admit_after)).nonzero()[:, 0]
        by_bucket = self._due(slots, uniq[due])
        # The call's one host read (before anything changes): a key outside the map,
        # and what taking slots needs.
        rows = self.spec.rows_per_bucket
        refused, *took = _host(outside.any(), *(by_bucket.read(rows) if len(due) else []))
        if refused:
            self._refuse(keys, outside)
        self.step = step
        seen = found[live]
        slots.seen(seen, step, slots.hits.view(-1)[seen] + counts[live])

        def evictable(seen_now: torch.Tensor, last_seen: torch.Tensor) -> torch.Tensor:
            return self.spec.evictable(seen_now, last_seen, step)

        taken = torch.full_like(uniq, -1)
        if len(due):
            by_hits = self.spec.policy == "lfu"
            taken.scatter_(0, due, self._take(slots, by_bucket, seen, evictable, by_hits, *took))
        got = due[taken[due] >= 0]
        evicted = slots.write(taken[got], uniq[got], step, total[got], places[got])

        if self.probation is not None and waiting is not None:
            self._wait(uniq, total, waiting, taken >= 0, new, step)

        return RemapResult(
            rows=torch.where(live, found, taken)[inverse],
            admitted=taken[got],
            admitted_keys=uniq[got],
            evicted=evicted,
            overflow=(taken[due] < 0).sum(),
        )

    def _remap_native(self, keys: torch.Tensor, step: int) -> RemapResult:
        """``remap`` on CPU in one call of the fused kernel (``runtime/native_dynamic.cpp``),
        which follows the same rules; no host sync beyond its counts."""
        keys, spec = keys.contiguous(), self.spec
        lowest, highest = self._key_range()
        rules = native.Spec(
            buckets=self.last - self.first,
            rows=spec.rows_per_bucket,
            first=self.first,
            width=bucket_width(spec.buckets),
            lowest_key=lowest,
            highest_key=highest,
            policy=POLICIES.index(spec.policy),
            ttl_steps=spec.ttl_steps or 0,
            admit_after=spec.admit_after,
            step=step,
        )
        slots, out = self.slots.native(len(keys))
        probation = self.probation.native(len(keys)) if self.probation is not None else None
        result, rows, admitted, admitted_keys = native.remap(
            keys, rules, slots, None if probation is None else probation[0]
        )
        if result.outside:
            self._refuse(keys, self._outside(keys))
        self.step = step
        self.slots.adopt(slots, out, step)
        if self.probation is not None and probation is not None:
            self.probation.adopt(*probation, step)
            self.probation.packed = self.probation.packed and not result.cleared
        count = result.admitted_count
        return RemapResult(
            rows=rows,
            admitted=admitted[:count],
            admitted_keys=admitted_keys[:count],
            evicted=torch.tensor(result.evicted),
            overflow=torch.tensor(result.overflow),
            missing=result.missing,
        )

    def _due(self, slots: _Slots, keys: torch.Tensor) -> _Due:
        """``keys`` (sorted, none in ``slots``) by bucket (no host sync)."""
        touched, group, counts = torch.unique_consecutive(
            bucket_of(keys, self.spec.buckets) - self.first,
            return_inverse=True,
            return_counts=True,
        )
        rank = torch.arange(len(keys), device=keys.device) - (counts.cumsum(0) - counts)[group]
        live = None
        if slots.packed:  # clamped: keys outside the map are refused before use
            live = _of(slots.occupied, touched.clamp(0, len(slots.occupied) - 1)).sum(1)
        return _Due(touched, group, rank, counts, live)

    def _take(
        self,
        slots: _Slots,
        due: _Due,
        seen: torch.Tensor,
        evictable: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        by_hits: bool,
        most: int,
        roomy: int,
    ) -> torch.Tensor:
        """The flat slot of ``slots`` each key of ``due`` (at least one) takes, -1 where
        none is left: a bucket's r-th key takes its r-th victim. Only the buckets of
        ``due`` are ranked (none where it is ``roomy``); ``most``, ``roomy``: its
        ``read``, on the host; ``seen``: the slots seen in this call, which
        ``evictable(seen_now, last_seen)`` reads as masks of those buckets' slots."""
        rows = self.spec.rows_per_bucket
        seen_now = None if roomy else _marked(due.touched, rows, seen)
        return slots.take(
            due,
            lambda last_seen: evictable(seen_now, last_seen),
            by_hits,
            min(rows, most),
            bool(roomy),
        )

    def _wait(
        self,
        uniq: torch.Tensor,
        total: torch.Tensor,
        waiting: torch.Tensor,
        admit: torch.Tensor,
        new: torch.Tensor,
        step: int,
    ) -> None:
        """Probation after admission: admitted ids leave it, ids still waiting are seen
        (kept this call) or enter it, taking free slots, then the least recently seen."""
        probation, known, wait = self.probation, waiting >= 0, new & ~admit
        assert probation is not None
        probation.clear(waiting[known & admit])
        stay = known & wait
        seen = waiting[stay]
        probation.seen(seen, step, total[stay])
        enter = (wait & ~known).nonzero()[:, 0]
        if not len(enter):
            return
        due = self._due(probation, uniq[enter])
        took = _host(*due.read(self.spec.rows_per_bucket))
        taken = self._take(probation, due, seen, lambda seen_now, _: ~seen_now, False, *took)
        ok = taken >= 0
        probation.write(taken[ok], uniq[enter][ok], step, total[enter][ok])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The map's plain tensors, each ``(buckets of this range, rows_per_bucket)``:
        the bucket axis splits and joins across ranges. They are the map's own: change
        them through ``load_state_dict`` only, which rebuilds the index of live keys
        derived from them."""
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
        self.slots.reindex()
        if self.probation is not None:
            self.probation.reindex()


def _host(*values: torch.Tensor) -> list[int]:
    """The 0-d ``values`` on the host, read at once: one host sync."""
    return torch.stack([v.to(torch.int64) for v in values]).tolist()


def _of(table: torch.Tensor, touched: torch.Tensor) -> torch.Tensor:
    """The rows of ``table`` (a row a bucket) of the buckets ``touched`` (distinct, in
    order): the table itself, uncopied, where they are all of its buckets."""
    return table if len(touched) == len(table) else table.index_select(0, touched)


def _marked(touched: torch.Tensor, rows: int, flat: torch.Tensor) -> torch.Tensor:
    """A ``(len(touched), rows)`` mask of the buckets ``touched`` (distinct, in order),
    true at the flat slots ``flat`` that are theirs."""
    mask = torch.zeros(len(touched), rows, dtype=torch.bool, device=touched.device)
    bucket = torch.div(flat, rows, rounding_mode="floor")
    at = torch.searchsorted(touched, bucket).clamp_(max=len(touched) - 1)
    mine = (touched.gather(0, at) == bucket).nonzero()[:, 0]
    mask.view(-1).scatter_(0, (at * rows + flat % rows)[mine], True)
    return mask
