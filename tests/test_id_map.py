"""The id map against a plain reference written here: Python lists of slots per bucket,
the same policies and tie rules, and the hashes on Python ints (with the key hash's
inverse, to show it is one-to-one). Every test runs twice on CPU: on the fused kernel
(runtime/native_dynamic.cpp) and on the torch operations that CUDA runs."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embshard.errors import CheckpointError, InputError, PlanError
from embshard.runtime import native
from embshard.runtime.keys import bucket_of, hash_ids, initial_rows, write_initial_rows
from embshard.storage.id_map import IdMap, IdMapSpec

M64, M63 = (1 << 64) - 1, (1 << 63) - 1

LIBRARY = native.library()


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernel where it built (CI builds it: a missing build fails here), else the
    torch operations."""
    if request.param == "kernel":
        assert LIBRARY is not None, "the CPU kernels did not build"
    monkeypatch.setattr(native, "library", lambda: LIBRARY if request.param == "kernel" else None)
    return request.param


EXTREMES = [0, 1, 2, 3, 2**63 - 1, 2**63 - 2, 2**62, 2**62 - 1, 2**32, 2**32 - 1]
GAMMA, MUL1, MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x: int) -> int:
    z = (x + GAMMA) & M64
    z = ((z ^ (z >> 30)) * MUL1) & M64
    z = ((z ^ (z >> 27)) * MUL2) & M64
    return z ^ (z >> 31)


def ref_key(raw: int) -> int:
    """splitmix64's steps modulo 2**63."""
    z = (raw + GAMMA) & M63
    z = ((z ^ (z >> 30)) * (MUL1 & M63)) & M63
    z = ((z ^ (z >> 27)) * (MUL2 & M63)) & M63
    return z ^ (z >> 31)


def unshift(z: int, bits: int) -> int:
    """The x with x ^ (x >> bits) == z, for 63-bit values."""
    x = z
    for _ in range(63 // bits + 1):
        x = z ^ (x >> bits)
    return x


def ref_raw(key: int) -> int:
    """ref_key's inverse: odd multipliers invert modulo 2**63."""
    z = unshift(key, 31)
    z = unshift((z * pow(MUL2 & M63, -1, 1 << 63)) & M63, 27)
    z = unshift((z * pow(MUL1 & M63, -1, 1 << 63)) & M63, 30)
    return (z - GAMMA) & M63


def ref_bucket(key: int, buckets: int) -> int:
    return key // -(-(2**63) // buckets)


def keys_of(raws: list[int]) -> list[int]:
    return [ref_key(raw) for raw in raws]


def ref_initial(key: int, dim: int, seed: int, table: str, low: float, high: float) -> list[float]:
    digest = hashlib.blake2b(f"{seed}/{table}".encode(), digest_size=8).digest()
    key = splitmix64(key ^ int.from_bytes(digest, "little"))
    units = [(splitmix64((key + c) & M64) >> 40) / 2**24 for c in range(dim)]
    return [float(torch.tensor(u * (high - low) + low, dtype=torch.float32)) for u in units]


@dataclass
class Entry:
    key: int
    last: int
    hits: int


class Reference:
    """One Python list of slots per bucket (None: empty), and the same for probation."""

    def __init__(self, spec: IdMapSpec, first: int, last: int) -> None:
        self.spec, self.first = spec, first
        rows = spec.rows_per_bucket
        self.slots = {b: [None] * rows for b in range(first, last)}
        self.probation = {b: [None] * rows for b in range(first, last)}

    def remap(self, ids: list[int], step: int):
        spec, counts = self.spec, Counter(ids)
        by_bucket: dict[int, list[int]] = {}
        for key in sorted(counts):
            by_bucket.setdefault(ref_bucket(key, spec.buckets), []).append(key)
        rows, admitted, evicted, overflow = {}, [], 0, 0
        for b in sorted(by_bucket):
            slots, probation, base = self.slots[b], self.probation[b], (b - self.first)
            base *= spec.rows_per_bucket
            where = {e.key: i for i, e in enumerate(slots) if e is not None}
            seen = set()
            for key in by_bucket[b]:
                if key in where:
                    e = slots[where[key]]
                    e.last, e.hits = step, e.hits + counts[key]
                    rows[key] = base + where[key]
                    seen.add(where[key])
            new = [key for key in by_bucket[b] if key not in where]
            waiting = {e.key: i for i, e in enumerate(probation) if e is not None}
            total = {
                key: counts[key] + (probation[waiting[key]].hits if key in waiting else 0)
                for key in new
            }
            due = [key for key in new if total[key] >= spec.admit_after]

            def evictable(i: int, e: Entry, seen=seen) -> bool:
                if spec.policy == "none":
                    return False
                if spec.policy == "ttl":
                    return step - e.last >= spec.ttl_steps
                return i not in seen

            def order(i: int, slots=slots) -> tuple:
                e = slots[i]
                if e is None:
                    return (0, i)
                return (1, e.hits, e.last, i) if spec.policy == "lfu" else (1, e.last, i)

            victims = sorted(
                (i for i, e in enumerate(slots) if e is None or evictable(i, e)), key=order
            )
            got = set()
            for key, i in zip(due, victims):
                evicted += slots[i] is not None
                slots[i] = Entry(key, step, total[key])
                rows[key] = base + i
                admitted.append((base + i, key))
                got.add(key)
            overflow += len(due) - len(got)
            if spec.admit_after == 1:
                continue
            for key in got & set(waiting):
                probation[waiting[key]] = None
            kept = set()
            for key in new:
                if key not in got and key in waiting:
                    e = probation[waiting[key]]
                    e.last, e.hits = step, total[key]
                    kept.add(waiting[key])

            def porder(i: int, probation=probation) -> tuple:
                e = probation[i]
                return (0, i) if e is None else (1, e.last, i)

            free = sorted((i for i in range(len(probation)) if i not in kept), key=porder)
            entering = [key for key in new if key not in got and key not in waiting]
            for key, i in zip(entering, free):
                probation[i] = Entry(key, step, total[key])
        return [rows.get(key, -1) for key in ids], admitted, evicted, overflow


def slot_states(idmap: IdMap, prefix: str = "") -> list[tuple[int, int, int] | None]:
    """Every slot as (key, last step seen, sightings), None where empty."""
    state = {k: v.flatten().tolist() for k, v in idmap.state_dict().items()}
    return [
        (key, last, hits) if live else None
        for key, live, last, hits in zip(
            *(state[prefix + name] for name in ("keys", "occupied", "last_seen", "hits"))
        )
    ]


def ref_states(tables: dict[int, list[Entry | None]]) -> list[tuple[int, int, int] | None]:
    return [
        None if e is None else (e.key, e.last, e.hits) for b in sorted(tables) for e in tables[b]
    ]


def remap_as_the_reference(idmap: IdMap, ref: Reference, ids: list[int], step: int) -> int:
    """One call of both at ``step``: the same rows, admissions (slot and key, in order),
    evictions, overflow and slots. Returns the evictions."""
    rows, admitted, evicted, overflow = ref.remap(ids, step)
    got = idmap.remap(torch.tensor(ids, dtype=torch.int64), step)
    assert got.rows.tolist() == rows
    assert list(zip(got.admitted.tolist(), got.admitted_keys.tolist())) == admitted
    assert (got.evicted.item(), got.overflow.item()) == (evicted, overflow)
    assert slot_states(idmap) == ref_states(ref.slots)
    return evicted


def in_range(pool: list[int], buckets: int, first: int, last: int) -> list[int]:
    return [raw for raw in pool if first <= ref_bucket(raw, buckets) < last]


def test_keys_are_one_to_one_and_buckets_are_ranges_of_keys() -> None:
    generator = torch.Generator().manual_seed(0)
    raws = torch.cat(
        [
            torch.tensor(EXTREMES, dtype=torch.int64),
            torch.randint(0, 2**63 - 1, (3000,), generator=generator, dtype=torch.int64),
            torch.arange(1000),
        ]
    )
    keys = hash_ids(raws)
    assert keys.tolist() == keys_of(raws.tolist())
    assert [ref_raw(key) for key in keys.tolist()] == raws.tolist()
    assert keys.min() >= 0
    for buckets in (1, 7, 1024, 1000003):
        got = bucket_of(keys, buckets)
        assert got.tolist() == [ref_bucket(key, buckets) for key in keys.tolist()]
        assert got.max() < buckets
    spread = Counter(bucket_of(hash_ids(torch.arange(8192)), 8).tolist())
    assert min(spread.values()) > 900


def test_initial_rows_per_id_whatever_the_batch() -> None:
    ids = torch.tensor([*EXTREMES, 12345, 98765], dtype=torch.int64)
    bounds = (-0.25, 0.25)
    rows = initial_rows(ids, 5, 7, "t0", bounds)
    assert rows.dtype == torch.float32 and rows.shape == (len(ids), 5)
    for raw, row in zip(ids.tolist(), rows.tolist()):
        assert row == ref_initial(raw, 5, 7, "t0", *bounds)
    assert rows.min() >= -0.25 and rows.max() < 0.25
    shuffled = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    batch = torch.cat([ids[shuffled], torch.tensor([3, 4, 5])])
    again = initial_rows(batch, 5, 7, "t0", bounds)
    assert torch.equal(again[: len(ids)], rows[shuffled])
    assert not torch.equal(initial_rows(ids, 5, 8, "t0", bounds), rows)
    assert not torch.equal(initial_rows(ids, 5, 7, "t1", bounds), rows)
    assert len(set(rows[:, 0].tolist())) == len(ids)


SPECS = st.builds(
    lambda rows, policy, ttl, admit: IdMapSpec(
        buckets=5,
        rows_per_bucket=rows,
        policy=policy,
        ttl_steps=ttl if policy == "ttl" else None,
        admit_after=admit,
        seed=3,
    ),
    st.integers(1, 3),
    st.sampled_from(["lru", "lfu", "ttl", "none"]),
    st.integers(1, 3),
    st.sampled_from([1, 3]),
)


def id_stream(pool: list[int], seed: int, steps: int = 25) -> list[tuple[int, list[int]]]:
    """(step, ids) pairs: steps 0 to 3 apart, 0 to 12 ids each, drawn with skewed
    frequencies so that recency and frequency disagree."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in rng.sample(range(len(pool)), len(pool))]
    stream, step = [], 0
    for _ in range(steps):
        step += rng.choice([0, 1, 1, 1, 2, 3])
        stream.append((step, rng.choices(pool, weights, k=rng.randint(0, 12))))
    return stream


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=SPECS,
    first=st.integers(0, 2),
    pool=st.lists(st.integers(0, 2**63 - 1), max_size=8, unique=True),
    seed=st.integers(0, 2**32),
)
def test_remap_matches_reference(spec: IdMapSpec, first: int, pool: list[int], seed: int) -> None:
    """After every step of a stream fed in shuffled order: the same rows, admitted rows,
    evictions, overflow and slots (probation included) as the reference."""
    last = first + 3
    pool = in_range(keys_of(sorted(set(pool) | set(range(24)))), spec.buckets, first, last)
    idmap, ref = IdMap(spec, first, last), Reference(spec, first, last)
    shuffle = random.Random(seed + 1)
    for step, ids in id_stream(pool, seed):
        rows, admitted, evicted, overflow = ref.remap(ids, step)
        order = shuffle.sample(range(len(ids)), len(ids))
        got = idmap.remap(torch.tensor([ids[i] for i in order], dtype=torch.int64), step)
        assert got.rows.tolist() == [rows[i] for i in order]
        assert list(zip(got.admitted.tolist(), got.admitted_keys.tolist())) == admitted
        assert (got.evicted.item(), got.overflow.item()) == (evicted, overflow)
        # Counted where no host read is needed: by the kernel, or a call with no keys.
        assert got.missing == (rows.count(-1) if native.library() or not ids else None)
        assert slot_states(idmap) == ref_states(ref.slots)
        if spec.admit_after > 1:
            assert slot_states(idmap, "probation_") == ref_states(ref.probation)


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl", "none"])
@pytest.mark.parametrize("admit_after", [1, 3])
def test_any_split_of_buckets_gives_the_same_map(policy: str, admit_after: int) -> None:
    spec = IdMapSpec(
        buckets=6,
        rows_per_bucket=3,
        policy=policy,
        ttl_steps=2 if policy == "ttl" else None,
        admit_after=admit_after,
    )
    whole = IdMap(spec)
    parts = [IdMap(spec, 0, 1), IdMap(spec, 1, 4), IdMap(spec, 4, 6)]
    generator = torch.Generator().manual_seed(5)
    for step in range(30):
        ids = hash_ids(torch.randint(0, 80, (25,), generator=generator))
        want = whole.remap(ids, step)
        buckets = bucket_of(ids, spec.buckets)
        for part in parts:
            mine = (buckets >= part.first) & (buckets < part.last)
            got = part.remap(ids[mine], step)
            offset = part.first * spec.rows_per_bucket
            assert torch.equal(torch.where(got.rows >= 0, got.rows + offset, -1), want.rows[mine])
    for name, tensor in whole.state_dict().items():
        assert torch.equal(torch.cat([p.state_dict()[name] for p in parts]), tensor)


def test_state_dict_round_trip() -> None:
    spec = IdMapSpec(buckets=4, rows_per_bucket=2, policy="lfu", admit_after=2)
    a, b = IdMap(spec), IdMap(spec)
    ids = torch.tensor([1, 2, 3, 1, 2, 9, 9, 10, 11, 12])
    a.remap(ids, 0)
    a.remap(ids, 1)
    b.load_state_dict({k: v.clone() for k, v in a.state_dict().items()})
    more = torch.tensor([4, 5, 6, 7, 1, 2, 8, 8])
    assert torch.equal(a.remap(more, 2).rows, b.remap(more, 2).rows)
    with pytest.raises(CheckpointError, match="probation_keys"):
        IdMap(IdMapSpec(buckets=4, rows_per_bucket=2)).load_state_dict(a.state_dict())
    with pytest.raises(CheckpointError, match=r"keys is torch.int64 \(4, 2\), this map needs"):
        IdMap(spec, 0, 2).load_state_dict(a.state_dict())


def test_overflow_is_counted_and_left_without_a_row() -> None:
    spec = IdMapSpec(buckets=1, rows_per_bucket=2, policy="none")
    idmap = IdMap(spec)
    got = idmap.remap(torch.tensor([5, 3, 4, 3]), 0)
    assert got.rows.tolist() == [-1, 0, 1, 0]
    assert (got.overflow.item(), got.evicted.item()) == (1, 0)
    got = idmap.remap(torch.tensor([7, 4]), 1)
    assert got.rows.tolist() == [-1, 1] and got.overflow.item() == 1
    lru = IdMap(IdMapSpec(buckets=1, rows_per_bucket=2, policy="lru"))
    lru.remap(torch.tensor([1, 2]), 0)
    got = lru.remap(torch.tensor([2, 8, 9]), 1)  # 2 was seen in this call: only 1 goes
    assert got.rows.tolist() == [1, 0, -1] and (got.evicted.item(), got.overflow.item()) == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buckets": 0}, "buckets must be an int >= 1, got 0"),
        ({"rows_per_bucket": 2.0}, "rows_per_bucket must be an int >= 1, got 2.0"),
        ({"policy": "fifo"}, "policy must be one of lru, lfu, ttl, none, got 'fifo'"),
        ({"policy": "ttl"}, "policy 'ttl' needs ttl_steps, an int >= 1, got None"),
        ({"ttl_steps": 3}, "ttl_steps is only for policy 'ttl', got policy 'lru'"),
        ({"admit_after": 0}, "admit_after must be an int >= 1, got 0"),
    ],
)
def test_bad_spec(kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError, match=f"^IdMapSpec: {message}$"):
        IdMapSpec(**{"buckets": 4, "rows_per_bucket": 2, **kwargs})


def test_bad_input() -> None:
    spec = IdMapSpec(buckets=4, rows_per_bucket=2)
    with pytest.raises(PlanError, match=r"bucket range \[2, 5\) is not inside \[0, 4\)"):
        IdMap(spec, 2, 5)
    idmap = IdMap(spec, 1, 3)
    pool = keys_of(list(range(40)))
    other = next(key for key in pool if ref_bucket(key, 4) == 3)
    mine = in_range(pool, 4, 1, 3)[:3]
    with pytest.raises(
        InputError,
        match=rf"\[1, 3\): 1 keys are outside its buckets, e.g. key {other} \(bucket 3\)$",
    ):
        idmap.remap(torch.tensor([*mine, other]), 0)
    with pytest.raises(
        InputError, match=r"1 keys are outside its buckets, e.g. key -5 \(bucket -1\)$"
    ):
        idmap.remap(torch.tensor([*mine, -5]), 0)
    with pytest.raises(
        InputError, match=r"keys must be a 1-D int64 tensor, got torch\.int32 of 1 dims$"
    ):
        idmap.remap(torch.tensor(mine).int(), 0)
    with pytest.raises(
        InputError, match=r"keys must be a 1-D int64 tensor, got torch\.int64 of 2 dims$"
    ):
        idmap.remap(torch.tensor([mine]), 0)
    idmap.remap(torch.tensor(mine), 4)
    with pytest.raises(InputError, match=r"step must be an int in \[4, 2\*\*61\), got 3"):
        idmap.remap(torch.tensor(mine), 3)
    assert idmap.remap(torch.tensor([], dtype=torch.int64), 4).rows.numel() == 0


@pytest.mark.cuda
def test_cuda_gives_the_cpu_map() -> None:
    """Hash, initial rows and every remap result are the same bits on CUDA as on CPU."""
    generator = torch.Generator().manual_seed(2)
    ids = hash_ids(torch.randint(0, 2**63 - 1, (5000,), generator=generator, dtype=torch.int64))
    assert torch.equal(hash_ids(ids.cuda()).cpu(), hash_ids(ids))
    assert torch.equal(bucket_of(ids.cuda(), 1024).cpu(), bucket_of(ids, 1024))
    rows = initial_rows(ids, 16, 3, "t", (-0.01, 0.01))
    assert torch.equal(initial_rows(ids.cuda(), 16, 3, "t", (-0.01, 0.01)).cpu(), rows)
    for policy in ("lru", "lfu", "ttl", "none"):
        spec = IdMapSpec(
            buckets=8,
            rows_per_bucket=4,
            policy=policy,
            ttl_steps=2 if policy == "ttl" else None,
            admit_after=2,
        )
        cpu, cuda = IdMap(spec), IdMap(spec, device="cuda")
        for step in range(40):
            batch = hash_ids(torch.randint(0, 200, (60,), generator=generator))
            want, got = cpu.remap(batch, step), cuda.remap(batch.cuda(), step)
            for name in ("rows", "admitted", "admitted_keys", "evicted", "overflow"):
                assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
        for name, tensor in cpu.state_dict().items():
            assert torch.equal(cuda.state_dict()[name].cpu(), tensor), name


def test_lookup_reads_rows_and_changes_nothing():
    spec = IdMapSpec(buckets=4, rows_per_bucket=2, policy="lru")
    idmap = IdMap(spec, 0, 4)
    keys = torch.tensor(keys_of([3, 5, 7, 11]))
    assert idmap.lookup(keys).tolist() == [-1] * 4  # a fresh map: no step yet
    rows = idmap.remap(keys, 0).rows
    before = {k: v.clone() for k, v in idmap.state_dict().items()}
    new = torch.tensor(keys_of([13]))
    assert idmap.lookup(torch.cat([keys, new])).tolist() == [*rows.tolist(), -1]
    after = idmap.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def index_of(state: dict[str, torch.Tensor], prefix: str = "") -> tuple[list[int], list[int]]:
    """The live keys of a map's state, sorted, and each one's flat slot: what the map's
    index must hold, rebuilt here from the slots."""
    keys = state[prefix + "keys"].flatten().tolist()
    live = state[prefix + "occupied"].flatten().tolist()
    pairs = sorted((key, slot) for slot, (key, on) in enumerate(zip(keys, live)) if on)
    return [key for key, _ in pairs], [slot for _, slot in pairs]


def assert_index_agrees(idmap: IdMap) -> None:
    state = idmap.state_dict()
    tables = [("", idmap.slots)]
    if idmap.probation is not None:
        tables.append(("probation_", idmap.probation))
    for prefix, slots in tables:
        keys, flat = index_of(state, prefix)
        assert slots.index_keys.tolist() == keys, prefix
        assert slots.index_slots.tolist() == flat, prefix


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
def test_the_index_of_live_keys_follows_evictions_probation_and_loads(policy: str) -> None:
    spec = IdMapSpec(
        buckets=6,
        rows_per_bucket=4,
        policy=policy,
        ttl_steps=2 if policy == "ttl" else None,
        admit_after=2,
    )
    idmap = IdMap(spec, 1, 5)
    generator = torch.Generator().manual_seed(7)
    evicted = left = 0
    for step in range(40):
        ids = hash_ids(torch.randint(0, 120, (40,), generator=generator))
        ids = ids[(bucket_of(ids, 6) >= 1) & (bucket_of(ids, 6) < 5)]
        got = idmap.remap(ids, step)
        evicted += got.evicted.item()
        left += len(got.admitted)  # admitted ids left probation
        assert_index_agrees(idmap)
        if step % 10 == 9:  # a fresh map loading the state rebuilds its index
            loaded = IdMap(spec, 1, 5)
            loaded.load_state_dict({k: v.clone() for k, v in idmap.state_dict().items()})
            assert_index_agrees(loaded)
            assert torch.equal(loaded.lookup(ids), idmap.lookup(ids))
            idmap = loaded
    assert evicted > 0 and left > 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
@pytest.mark.parametrize("rows_per_bucket", [3, 16])
def test_steps_too_large_to_pack_with_a_slot_give_the_reference(
    policy: str, rows_per_bucket: int
) -> None:
    """Victims pack ((sightings,) last step, slot) in one integer while they fit; past
    that they are ranked by sorts: both give the reference, across the switch (the
    torch operations' at 2**59 with 3 rows, the kernel's at 2**59 with 32 slots; lfu's
    sightings take bits too: torch sorts throughout)."""
    spec = IdMapSpec(
        buckets=2,
        rows_per_bucket=rows_per_bucket,
        policy=policy,
        ttl_steps=2 if policy == "ttl" else None,
    )
    idmap, ref = IdMap(spec), Reference(spec, 0, 2)
    pool = keys_of(list(range(10 * rows_per_bucket)))
    evictions = 0
    for step, ids in id_stream(pool, seed=11, steps=60):
        step += 2**59 - 15
        evictions += remap_as_the_reference(idmap, ref, ids, step)
    assert step >= 2**59 and evictions > 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
@pytest.mark.parametrize("new", [30, 64, 65, 90])
def test_a_full_bucket_giving_up_many_slots_at_once_gives_the_reference(
    policy: str, new: int
) -> None:
    """A full bucket of 100 slots, half of them seen a step later, takes ``new`` keys
    in one call: the kernel takes up to 64 victims one smallest key at a time and more
    through a heap, across ties of the sightings and the last step seen (broken by
    slot)."""
    spec = IdMapSpec(
        buckets=1, rows_per_bucket=100, policy=policy, ttl_steps=1 if policy == "ttl" else None
    )
    idmap, ref = IdMap(spec), Reference(spec, 0, 1)
    pool = keys_of(list(range(100 + new)))
    calls = [(pool[:100], 0), (pool[:50:2] + pool[51:100:2], 1), (pool[100:] + pool[:2], 2)]
    for ids, step in calls:
        evicted = remap_as_the_reference(idmap, ref, ids, step)
    assert evicted == new


def test_keys_that_fall_close_together_give_the_reference() -> None:
    """Thousands of keys in a sliver of the key space, first seen in descending order,
    fall in one range of the kernel's counting sort, where its insertion pass gives way
    to a full sort; hashed keys, spread evenly, take the insertion pass. Admission is in
    key order either way."""
    spec = IdMapSpec(buckets=4, rows_per_bucket=500, policy="lru")
    idmap, ref = IdMap(spec), Reference(spec, 0, 4)
    close = list(range(5_000, 2_000, -1))
    spread = keys_of(list(range(3_000)))
    for step, ids in enumerate([close, spread, close[::2] + spread[::3]]):
        remap_as_the_reference(idmap, ref, ids, step)


def test_initial_rows_of_a_large_batch_are_the_reference() -> None:
    """Rows are made a few thousand at a time: the rows at either side of a cut are
    still each key's own."""
    generator = torch.Generator().manual_seed(4)
    keys = torch.randint(0, 2**63 - 1, (9000,), generator=generator, dtype=torch.int64)
    rows = initial_rows(keys, 64, 2, "big", (-0.5, 0.5))
    for i in (0, 4095, 4096, 4097, 8191, 8192, 8999):
        assert rows[i].tolist() == ref_initial(keys[i].item(), 64, 2, "big", -0.5, 0.5)


def _admission(rows: int, width: int, stride: int) -> tuple[torch.Tensor, ...]:
    """Weights of ``rows`` x ``width`` in rows of ``stride`` floats, a per-row state and
    a per-value one, none of them zero; admitted keys and their distinct rows."""
    generator = torch.Generator().manual_seed(5)
    weights = torch.rand(rows, stride, generator=generator)[:, :width]
    states = torch.rand(rows, 1, generator=generator), torch.rand(rows, width, generator=generator)
    keys = torch.randint(0, 2**63 - 1, (rows // 2,), generator=generator, dtype=torch.int64)
    return weights, *states, keys, torch.randperm(rows, generator=generator)[: rows // 2]


@pytest.mark.parametrize("stride", [7, 16])
def test_initial_rows_written_in_place_are_the_reference(cpu_path: str, stride: int) -> None:
    """A column block's admitted rows (columns 5 to 12 of 16): the kernel writes the
    reference's values into them in place, in rows of any stride, as the copy of
    ``initial_rows`` does, and zeroes their optimizer state; the rest is untouched.
    Without the kernel nothing is written."""
    weights, per_row, per_value, keys, rows = _admission(300, 7, stride)
    before = [t.clone() for t in (weights, per_row, per_value)]
    states = (per_row, per_value)
    versions = [t._version for t in (weights, *states)]
    wrote = write_initial_rows(weights, rows, keys, slice(5, 12), 3, "t", (-0.2, 0.3), states)
    assert wrote == (cpu_path == "kernel")
    if not wrote:
        assert all(torch.equal(t, b) for t, b in zip((weights, *states), before))
        return
    # Autograd sees the writes, as it sees index_copy_'s.
    assert all(t._version > v for t, v in zip((weights, *states), versions))
    expected = [t.clone() for t in before]
    for key, row in zip(keys.tolist(), rows.tolist()):
        expected[0][row] = torch.tensor(ref_initial(key, 16, 3, "t", -0.2, 0.3)[5:12])
        expected[1][row], expected[2][row] = 0, 0
    assert all(torch.equal(t, e) for t, e in zip((weights, *states), expected))
    copied = before[0].index_copy_(0, rows, initial_rows(keys, 16, 3, "t", (-0.2, 0.3))[:, 5:12])
    assert torch.equal(weights, copied)


@pytest.mark.parametrize(
    "layout", ["float16 weights", "columns apart", "a state's columns apart", "on meta"]
)
def test_initial_rows_in_place_leave_other_layouts_to_the_copy(layout: str) -> None:
    """Weights not float32, or a tensor whose rows' values are not side by side on CPU:
    the kernel writes nothing and says so, and the caller copies ``initial_rows``."""
    weights, per_row, per_value, keys, rows = _admission(40, 6, 6)
    if layout == "float16 weights":
        weights = weights.half()
    elif layout == "columns apart":
        weights = weights.t().contiguous().t()
    elif layout == "a state's columns apart":
        per_value = per_value.t().contiguous().t()
    else:
        weights = weights.to("meta")
    before = [t.clone() for t in (weights, per_row, per_value)]
    args = (weights, rows, keys, slice(0, 6), 1, "t", (-1.0, 1.0), (per_row, per_value))
    assert not write_initial_rows(*args)
    for t, b in zip((weights, per_row, per_value), before):
        assert t.is_meta or torch.equal(t, b)


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl", "none"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_the_kernel_and_the_torch_operations_agree_on_busy_maps(
    policy: str, admit_after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Larger maps than the reference's, full and evicting, on skewed ids with repeats
    and steps repeated: the kernel's results, slots, probation and index are the torch
    operations'."""
    assert LIBRARY is not None
    spec = IdMapSpec(
        buckets=40,
        rows_per_bucket=24,
        policy=policy,
        ttl_steps=3 if policy == "ttl" else None,
        admit_after=admit_after,
    )
    maps = {"kernel": IdMap(spec, 5, 33), "torch": IdMap(spec, 5, 33)}
    generator = torch.Generator().manual_seed(13)
    width = -(-(2**63) // 40)
    for step in range(60):
        raws = (torch.rand(1500, generator=generator) ** 3 * 4000).long() + step * 20
        keys = hash_ids(raws)
        keys = keys[(keys >= 5 * width) & (keys < 33 * width)]
        results = {}
        for path, idmap in maps.items():
            monkeypatch.setattr(
                native, "library", lambda p=path: LIBRARY if p == "kernel" else None
            )
            results[path] = idmap.remap(keys, step // 2)
        for field in ("rows", "admitted", "admitted_keys", "evicted", "overflow"):
            assert torch.equal(getattr(results["kernel"], field), getattr(results["torch"], field))
        assert results["kernel"].missing == (results["torch"].rows < 0).sum().item()
    kernel, torch_ops = maps["kernel"], maps["torch"]
    assert kernel.state_dict().keys() == torch_ops.state_dict().keys()
    for name, tensor in kernel.state_dict().items():
        assert torch.equal(tensor, torch_ops.state_dict()[name]), name
    for table in ("slots", "probation"):
        a, b = getattr(kernel, table), getattr(torch_ops, table)
        if a is not None:
            assert torch.equal(a.index_keys, b.index_keys) and torch.equal(
                a.index_slots, b.index_slots
            )
    stats = kernel.state_dict()
    assert stats["occupied"].all() or policy == "ttl"


def test_without_a_compiler_the_torch_operations_run_after_a_warning(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.undo()  # the real loader, not the fixture's stand-in
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("EMBSHARD_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build or load with"):
            assert native.library() is None
        spec = IdMapSpec(buckets=2, rows_per_bucket=2)
        got = IdMap(spec).remap(hash_ids(torch.tensor([1, 2, 1])), 0)
        assert got.rows[0] == got.rows[2] >= 0
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_a_cached_library_that_does_not_load_falls_back_after_a_warning(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file in the cache that is no library (a home shared with another machine, a
    disk that filled up) is reported, not raised."""
    monkeypatch.undo()
    monkeypatch.setattr(native, "_built", lambda compiler: tmp_path / "native-x.so")
    (tmp_path / "native-x.so").write_bytes(b"not a shared library")
    native.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build or load with"):
            assert native.library() is None
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
