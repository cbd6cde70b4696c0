// embshard's fused CPU kernels for dynamic tables: on the owner, an id map's remap in
// one pass over its keys and the initial rows of admitted keys; on the sender, raw ids
// to keys, their routing stand-ins and the keys put back after bucketizing. Each does
// what the torch operations of storage/id_map.py, runtime/keys.py and
// runtime/dynamic_ids.py do, bit for bit, without their dozens of passes over small
// tensors. Plain C entry points over raw buffers (runtime/native.py loads them with
// ctypes): no torch headers, so building takes seconds, not minutes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// splitmix64's constants (runtime/keys.py).
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull, kMul1 = 0xBF58476D1CE4E5B9ull,
                   kMul2 = 0x94D049BB133111EBull;

constexpr int64_t kAhead = 16;  // how far ahead a loop of random reads prefetches
constexpr size_t kFewVictims = 64;  // a bucket's victims taken one smallest key at a time
constexpr int64_t kChunk = 64;      // keys whose smallest is kept while victims are taken
constexpr int64_t kDenseChanges = 32;  // an index merged entry by entry: changes this close

// The bits that hold `value`: 0 for 0.
int bit_length(uint64_t value) { return value ? 64 - __builtin_clzll(value) : 0; }

// The bits that tell `count` things apart: those of the largest index, count - 1.
int index_bits(uint64_t count) { return count > 1 ? bit_length(count - 1) : 0; }

// A loop that vectorizes, built several times on x86-64 Linux where the compiler can:
// the loader picks the AVX-512 copy (GCC) or the AVX2 copy on a CPU that has it.
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones) && !defined(__clang__)
#define EMBSHARD_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif __has_attribute(target_clones)
#define EMBSHARD_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef EMBSHARD_CLONES
#define EMBSHARD_CLONES
#endif

// One slot table (buckets x rows, flat) of an id map, and its index of live keys
// (sorted keys, each one's flat slot). The kernel writes the slots in place and the
// updated index into out_index_*; out_index_size is -1 where the index is unchanged.
struct Slots {
  int64_t* keys;
  uint8_t* occupied;
  int64_t* last_seen;
  int64_t* hits;
  const int64_t* index_keys;
  const int64_t* index_slots;
  int64_t index_size;
  int64_t* out_index_keys;  // room for index_size + the call's keys
  int64_t* out_index_slots;
  int64_t out_index_size;
};

enum Policy : int64_t { kLru = 0, kLfu = 1, kTtl = 2, kNone = 3 };

struct Spec {
  int64_t buckets;      // the map's buckets
  int64_t rows;         // rows (slots) a bucket
  int64_t first;        // the map's first bucket
  uint64_t width;       // keys a bucket spans
  int64_t lowest_key;   // the map's keys are [lowest_key, highest_key]
  int64_t highest_key;
  int64_t policy;
  int64_t ttl_steps;
  int64_t admit_after;
  int64_t step;
};

struct Result {
  int64_t* rows;           // each key's row, -1: none
  int64_t* admitted;       // rows given a new key, in key order (room for the keys)
  int64_t* admitted_keys;  // and those keys
  int64_t admitted_count;
  int64_t evicted;   // live keys that lost their row
  int64_t overflow;  // keys due a row that found none
  int64_t cleared;   // probation slots emptied (their keys were admitted)
  int64_t outside;   // keys outside the map's buckets: then nothing else is done
  int64_t missing;   // keys (repeats counted) left without a row
};

// Division of keys (below 2**63) by a bucket's width as a multiply and a shift, where
// a 64-bit division costs dozens of cycles: m = ceil(2**(63 + l) / width), l the bits
// of width - 1, gives floor(key / width) = floor(key * m / 2**(63 + l)) for every key
// below 2**63 (Granlund and Montgomery, 1994), and m fits in 64 bits.
struct BucketOf {
  uint64_t magic;
  int shift;
  explicit BucketOf(uint64_t width) {
    const int bits = index_bits(width);
    const unsigned __int128 power = static_cast<unsigned __int128>(1) << (63 + bits);
    magic = static_cast<uint64_t>((power + width - 1) / width);
    shift = 63 + bits;
  }
  int64_t operator()(uint64_t key) const {
    return static_cast<int64_t>((static_cast<unsigned __int128>(key) * magic) >> shift);
  }
};

// The distinct keys of a call in key order, each one's count, and each key's place
// among them.
struct Distinct {
  std::vector<int64_t> keys;
  std::vector<int64_t> counts;
  std::vector<int64_t> inverse;
};

// A call's temporaries (megabytes on a large map), kept per thread between calls:
// fresh memory costs a page fault a page.
struct Scratch {
  std::vector<uint32_t> table;
  std::vector<std::pair<uint64_t, int64_t>> order, sorted;
  std::vector<int64_t> counts, first_seen, place, start, next;
  Distinct distinct;
  std::vector<int64_t> found, waiting, places, waiting_places, total, due, seen, taken, gone;
  std::vector<std::pair<int64_t, int64_t>> added;
  std::vector<uint8_t> marked;
  std::vector<uint64_t> keyed, least;  // a bucket's keys, as victims, and chunks' smallest
};

// Not inlined: its caller keeps the address, where an inlined thread-local's address
// is recomputed (a call into the loader) inside loops.
__attribute__((noinline)) Scratch& scratch() {
  static thread_local Scratch kept;
  return kept;
}

// Sorts [first, last) by insertion, cheap where the items are few or each lies a few
// places from its own, as std::sort's set-up costs more there; past 8 moves an item it
// gives way to std::sort, so it stays O(n log n) however they come.
template <typename It>
void sort_nearly_sorted(It first, It last) {
  const size_t most_moves = 8 * static_cast<size_t>(last - first);
  size_t moves = 0;
  for (It at = first; at != last && moves <= most_moves; ++at) {
    const auto item = *at;
    It to = at;
    for (; to != first && item < *(to - 1); --to) *to = *(to - 1);
    *to = item;
    moves += static_cast<size_t>(at - to);
  }
  if (moves > most_moves) std::sort(first, last);
}

// `items` (key, payload; keys distinct, in the map's) sorted by key: counted into as
// many ranges of keys as there are items, in order, then each range's few put in order
// by insertion (a key moves within its range only). Keys are hashes, spread evenly:
// most ranges hold one or two; where many fall together, a full sort finishes.
void sort_by_key(std::vector<std::pair<uint64_t, int64_t>>& items, const Spec& spec) {
  const int range_bits = index_bits(items.size());
  const uint64_t lowest = static_cast<uint64_t>(spec.lowest_key);
  const int span_bits = bit_length(static_cast<uint64_t>(spec.highest_key) - lowest);
  // Keys above the lowest are below 2**span_bits: shifted up by range_bits then down by
  // span_bits, they fall in [0, 2**range_bits), in order.
  const auto range_of = [=](uint64_t key) {
    return static_cast<size_t>((static_cast<unsigned __int128>(key - lowest) << range_bits) >>
                               span_bits);
  };
  const size_t ranges = size_t{1} << range_bits;
  std::vector<int64_t>& start = scratch().start;
  start.assign(ranges + 1, 0);
  for (const auto& item : items) start[range_of(item.first) + 1]++;
  for (size_t r = 0; r < ranges; ++r) start[r + 1] += start[r];
  std::vector<std::pair<uint64_t, int64_t>>& sorted = scratch().sorted;
  sorted.resize(items.size());
  std::vector<int64_t>& next = scratch().next;
  next.assign(start.begin(), start.end() - 1);
  for (const auto& item : items) sorted[next[range_of(item.first)]++] = item;
  sort_nearly_sorted(sorted.begin(), sorted.end());
  items.swap(sorted);
}

// The distinct keys by a hash table of (key, place among them) (keys are below 2**63:
// all ones marks an empty entry), then sorted.
const Distinct& distinct(const int64_t* keys, int64_t n, const Spec& spec) {
  const int bits = std::max(4, index_bits(n + n / 2));
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  Scratch& kept = scratch();
  std::vector<uint32_t>& table = kept.table;
  table.assign(mask + 1, 0);
  std::vector<std::pair<uint64_t, int64_t>>& order = kept.order;
  order.clear();
  std::vector<int64_t>&counts = kept.counts, &first_seen = kept.first_seen;
  counts.clear();
  first_seen.resize(n);
  const auto slot_of = [bits](int64_t key) {
    return (static_cast<uint64_t>(key) * kGamma) >> (64 - bits);
  };
  for (int64_t i = 0; i < n; ++i) {
    // The probes miss the cache: ask for a later key's entry early.
    if (i + kAhead < n) __builtin_prefetch(&table[slot_of(keys[i + kAhead])]);
    const uint64_t key = static_cast<uint64_t>(keys[i]);
    uint64_t at = slot_of(keys[i]);
    uint32_t entry;
    while ((entry = table[at]) != 0 && order[entry - 1].first != key) at = (at + 1) & mask;
    if (entry == 0) {
      entry = static_cast<uint32_t>(order.size() + 1);
      table[at] = entry;
      order.emplace_back(key, static_cast<int64_t>(entry - 1));
      counts.push_back(0);
    }
    first_seen[i] = entry - 1;
    counts[entry - 1]++;
  }
  sort_by_key(order, spec);
  Distinct& out = kept.distinct;
  out.keys.resize(order.size());
  out.counts.resize(order.size());
  std::vector<int64_t>& place = kept.place;
  place.resize(order.size());
  for (size_t u = 0; u < order.size(); ++u) {
    out.keys[u] = static_cast<int64_t>(order[u].first);
    out.counts[u] = counts[order[u].second];
    place[order[u].second] = static_cast<int64_t>(u);
  }
  out.inverse.resize(n);
  for (int64_t i = 0; i < n; ++i) out.inverse[i] = place[first_seen[i]];
  return out;
}

// The first place at or after `from` in the sorted `keys` whose key is not below `key`:
// a galloping search, as the keys searched for come in order. Most searches end a few
// places on: the next kNear keys below `key` are counted first, without a branch to
// mispredict.
int64_t gallop(const int64_t* keys, int64_t size, int64_t from, int64_t key) {
  constexpr int64_t kNear = 16;
  if (from + kNear <= size) {
    int64_t below = 0;
    for (int64_t i = 0; i < kNear; ++i) below += keys[from + i] < key;
    if (below < kNear) return from + below;
    from += kNear;
  }
  int64_t low = from, high = from, stride = 1;
  while (high < size && keys[high] < key) {
    low = high + 1;
    high += stride;
    stride <<= 1;
  }
  return std::lower_bound(keys + low, keys + std::min(high, size), key) - keys;
}

// Each of the sorted distinct `keys`' flat slot in `slots`, -1 where it is not live,
// and its place in the index (where it is, or would go).
void find(const Slots& slots, const std::vector<int64_t>& keys, std::vector<int64_t>& found,
          std::vector<int64_t>& places) {
  found.assign(keys.size(), -1);
  places.resize(keys.size());
  int64_t at = 0;
  for (size_t u = 0; u < keys.size(); ++u) {
    at = gallop(slots.index_keys, slots.index_size, at, keys[u]);
    places[u] = at;
    if (at < slots.index_size && slots.index_keys[at] == keys[u]) found[u] = slots.index_slots[at];
  }
}

// The orders of a bucket's live victims: fewer sightings first (LFU only), then seen
// less recently, then the lower slot. `Packed` is `ByStep` in one integer, where the
// steps leave the slot's bits free: a cheaper sort.
struct Victim {
  int64_t hits;
  int64_t last_seen;
  int64_t slot;
  bool operator<(const Victim& other) const {
    if (hits != other.hits) return hits < other.hits;
    return last_seen != other.last_seen ? last_seen < other.last_seen : slot < other.slot;
  }
};

struct ByHits {
  Victim key(const Slots& slots, int64_t slot) const {
    return {slots.hits[slot], slots.last_seen[slot], slot};
  }
  static int64_t slot(const Victim& victim) { return victim.slot; }
};

struct ByStep {
  Victim key(const Slots& slots, int64_t slot) const { return {0, slots.last_seen[slot], slot}; }
  static int64_t slot(const Victim& victim) { return victim.slot; }
};

struct Packed {
  int bits;  // of a flat slot
  uint64_t key(const Slots& slots, int64_t slot) const {
    return (static_cast<uint64_t>(slots.last_seen[slot]) << bits) | static_cast<uint64_t>(slot);
  }
  int64_t slot(uint64_t key) const { return static_cast<int64_t>(key & ((uint64_t{1} << bits) - 1)); }
};

// The smallest of `n` keys.
EMBSHARD_CLONES
uint64_t smallest(const uint64_t* __restrict keys, int64_t n) {
  uint64_t least = ~uint64_t{0};
  for (int64_t i = 0; i < n; ++i) least = std::min(least, keys[i]);
  return least;
}

// Puts `key` in place of the top of the max-heap `heap` (std::push_heap's), sifting it
// down: half the work of a pop and a push.
template <typename Key>
void replace_top(std::vector<Key>& heap, const Key& key) {
  const size_t size = heap.size();
  size_t at = 0;
  for (size_t child = 1; child < size; child = 2 * at + 1) {
    if (child + 1 < size && heap[child] < heap[child + 1]) ++child;
    if (!(key < heap[child])) break;
    heap[at] = heap[child];
    at = child;
  }
  heap[at] = key;
}

// Appends to `victims` the live slots of the bucket at `base` that `evictable` gives up
// whose `key`s (distinct, each ending in its slot's `slot_bits`) are the `needed`
// smallest, smallest first: each the smallest left, from each chunk's smallest, found
// by passes that vectorize (3 times faster than a heap on 18 of 400, whose comparisons
// mispredict).
template <typename Evictable, typename Key>
void smallest_keys(const Slots& slots, int64_t base, int64_t rows, size_t needed,
                   Evictable evictable, Key key, int slot_bits, std::vector<int64_t>& victims) {
  constexpr uint64_t kNone = ~uint64_t{0};
  const uint64_t slot_mask = (uint64_t{1} << slot_bits) - 1;
  std::vector<uint64_t>& keys = scratch().keyed;
  keys.resize(rows);
  // Without a branch, so that it vectorizes: a slot that is no candidate gets kNone.
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t candidate = slots.occupied[base + r] & uint8_t{evictable(base + r)};
    keys[r] = key(base + r) | (candidate - 1);
  }
  // Each chunk's smallest, so that taking one rescans only its chunk.
  std::vector<uint64_t>& least = scratch().least;
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  least.resize(chunks);
  for (int64_t c = 0; c < chunks; ++c)
    least[c] = smallest(keys.data() + c * kChunk, std::min(kChunk, rows - c * kChunk));
  for (size_t k = 0; k < needed; ++k) {
    const int64_t c = std::min_element(least.begin(), least.end()) - least.begin();
    if (least[c] == kNone) break;
    const int64_t slot = static_cast<int64_t>(least[c] & slot_mask);
    victims.push_back(slot);
    keys[slot - base] = kNone;
    least[c] = smallest(keys.data() + c * kChunk, std::min(kChunk, rows - c * kChunk));
  }
}

// Appends the first `needed` live slots of the bucket at `base` that `evictable` gives
// up, in `order` (which has no ties), to `victims`; fewer where fewer are given up.
// Few: by `smallest_keys`, where the order fits in one integer (always `Packed`'s;
// `ByHits`' where the bucket's sightings leave room). Otherwise the fewest needed kept
// in a heap whose top is the last of them (a slot earlier in the order replaces it),
// then put in order.
template <typename Evictable, typename Order>
void live_victims(const Slots& slots, const Spec& spec, int64_t base, size_t needed,
                  Evictable evictable, Order order, std::vector<int64_t>& victims) {
  const int64_t rows = spec.rows;
  if (needed <= kFewVictims) {
    if constexpr (std::is_same_v<Order, Packed>) {
      const auto key = [&](int64_t slot) { return order.key(slots, slot); };
      return smallest_keys(slots, base, rows, needed, evictable, key, order.bits, victims);
    } else if constexpr (std::is_same_v<Order, ByHits>) {
      uint64_t most = 0;  // sightings
      for (int64_t slot = base; slot < base + rows; ++slot)
        most = std::max(most, static_cast<uint64_t>(slots.hits[slot]));
      const int slot_bits = index_bits(spec.buckets * spec.rows);
      const int step_bits = bit_length(static_cast<uint64_t>(spec.step));
      if (bit_length(most) + step_bits + slot_bits <= 64) {
        const auto key = [&](int64_t slot) {
          const uint64_t hits = static_cast<uint64_t>(slots.hits[slot]);
          const uint64_t last = static_cast<uint64_t>(slots.last_seen[slot]);
          return (((hits << step_bits) | last) << slot_bits) | static_cast<uint64_t>(slot);
        };
        return smallest_keys(slots, base, rows, needed, evictable, key, slot_bits, victims);
      }
    }
  }
  static thread_local std::vector<decltype(order.key(slots, 0))> ranked;
  ranked.clear();
  for (int64_t slot = base; slot < base + rows; ++slot) {
    if (!slots.occupied[slot] || !evictable(slot)) continue;
    const auto key = order.key(slots, slot);
    if (ranked.size() < needed) {
      ranked.push_back(key);
      std::push_heap(ranked.begin(), ranked.end());
    } else if (key < ranked.front()) {
      replace_top(ranked, key);
    }
  }
  std::sort_heap(ranked.begin(), ranked.end());
  for (const auto& key : ranked) victims.push_back(order.slot(key));
}

// Gives each key of `takers` (places among the distinct keys, in key order) a slot of
// its bucket: the bucket's r-th taker gets its r-th victim (empty slots in slot order,
// then the live slots that `evictable` gives up, in the `order` above), -1 where none
// is left. Writes the taken slots (key, occupied, step, `total` sightings) and records
// the keys they held (`gone`, sorted within a bucket, so in key order where it held
// none) and the new entries of the index (`added`: each taker and its slot, in key
// order).
template <typename Evictable, typename Order>
int64_t take(Slots& slots, const Spec& spec, const std::vector<int64_t>& takers,
             const Distinct& distinct, const std::vector<int64_t>& total, Evictable evictable,
             Order order, std::vector<int64_t>& taken, std::vector<int64_t>& gone,
             std::vector<std::pair<int64_t, int64_t>>& added) {
  int64_t held = 0;
  const BucketOf bucket_of(spec.width);
  std::vector<int64_t> victims;
  for (size_t a = 0; a < takers.size();) {
    const int64_t bucket = bucket_of(distinct.keys[takers[a]]);
    size_t b = a + 1;
    while (b < takers.size() && bucket_of(distinct.keys[takers[b]]) == bucket) ++b;
    const size_t want = b - a;
    const int64_t base = (bucket - spec.first) * spec.rows;
    victims.clear();
    // The empty slots, found by memchr's wide compares.
    const uint8_t* const occupied = slots.occupied + base;
    for (const uint8_t* at = occupied; victims.size() < want;) {
      at = static_cast<const uint8_t*>(std::memchr(at, 0, occupied + spec.rows - at));
      if (at == nullptr) break;
      victims.push_back(base + (at++ - occupied));
    }
    // Live slots only where the empty ones run out.
    const size_t needed = want - victims.size();
    if (needed) live_victims(slots, spec, base, needed, evictable, order, victims);
    // The victims' keys and sightings are read and written below, each a miss: asked
    // for together.
    for (int64_t slot : victims) {
      __builtin_prefetch(slots.keys + slot, 1);
      __builtin_prefetch(slots.hits + slot, 1);
    }
    const size_t held_before = gone.size();
    for (size_t r = 0; r < victims.size(); ++r) {
      const int64_t u = takers[a + r], slot = victims[r];
      if (slots.occupied[slot]) {
        gone.push_back(slots.keys[slot]);
        ++held;
      }
      slots.keys[slot] = distinct.keys[u];
      slots.occupied[slot] = 1;
      slots.last_seen[slot] = spec.step;
      slots.hits[slot] = total[u];
      taken[u] = slot;
      added.emplace_back(u, slot);
    }
    sort_nearly_sorted(gone.begin() + held_before, gone.end());
    a = b;
  }
  return held;
}

// `take` in `ByStep`'s order, `Packed` where the steps leave the slot's bits free.
template <typename Evictable>
int64_t take_by_step(Slots& slots, const Spec& spec, const std::vector<int64_t>& takers,
                     const Distinct& distinct, const std::vector<int64_t>& total,
                     Evictable evictable, std::vector<int64_t>& taken,
                     std::vector<int64_t>& gone, std::vector<std::pair<int64_t, int64_t>>& added) {
  const int bits = std::max(1, index_bits(spec.buckets * spec.rows));
  if (static_cast<uint64_t>(spec.step) < (uint64_t{1} << (64 - bits)))
    return take(slots, spec, takers, distinct, total, evictable, Packed{bits}, taken, gone, added);
  return take(slots, spec, takers, distinct, total, evictable, ByStep{}, taken, gone, added);
}

// A mark for each slot of the map, set at `slots`.
const std::vector<uint8_t>& marks(const Spec& spec, const std::vector<int64_t>& slots) {
  std::vector<uint8_t>& marked = scratch().marked;
  marked.assign(spec.buckets * spec.rows, 0);
  for (int64_t slot : slots) marked[slot] = 1;
  return marked;
}

// The index without the keys `gone` and with `added` (key order; each of the distinct
// `keys`' place and its slot, its place in the index from `places`): the runs of
// entries between changes copied whole.
void merge_index(Slots& slots, std::vector<int64_t>& gone,
                 const std::vector<std::pair<int64_t, int64_t>>& added,
                 const std::vector<int64_t>& keys, const std::vector<int64_t>& places) {
  if (gone.empty() && added.empty()) {
    slots.out_index_size = -1;
    return;
  }
  if (!std::is_sorted(gone.begin(), gone.end())) std::sort(gone.begin(), gone.end());
  const int64_t size = slots.index_size;
  int64_t from = 0, out = 0;
  size_t g = 0, a = 0;
  if (kDenseChanges * static_cast<int64_t>(gone.size() + added.size()) > size) {
    // Changes a few entries apart: one pass over the entries, two predictable compares
    // each, where finding and copying each run between changes costs more.
    const int64_t* const index_keys = slots.index_keys;
    const int64_t* const index_slots = slots.index_slots;
    int64_t* const out_keys = slots.out_index_keys;
    int64_t* const out_slots = slots.out_index_slots;
    const int64_t none = size + 1;
    int64_t insertion = a < added.size() ? places[added[a].first] : none;
    int64_t removal = g < gone.size() ? gone[g] : -1;
    for (int64_t i = 0; i < size; ++i) {
      while (insertion == i) {
        out_keys[out] = keys[added[a].first];
        out_slots[out++] = added[a++].second;
        insertion = a < added.size() ? places[added[a].first] : none;
      }
      if (index_keys[i] == removal) {
        removal = ++g < gone.size() ? gone[g] : -1;
        continue;
      }
      out_keys[out] = index_keys[i];
      out_slots[out++] = index_slots[i];
    }
    for (; a < added.size(); ++a) {
      out_keys[out] = keys[added[a].first];
      out_slots[out++] = added[a].second;
    }
    slots.out_index_size = out;
    return;
  }
  const auto copy = [&](int64_t until) {
    std::copy(slots.index_keys + from, slots.index_keys + until, slots.out_index_keys + out);
    std::copy(slots.index_slots + from, slots.index_slots + until, slots.out_index_slots + out);
    out += until - from;
    from = until;
  };
  while (g < gone.size() || a < added.size()) {
    // The next change: a removal at the gone key's entry, or an insertion before the
    // first entry above the added key (none is equal: added keys were not live).
    const int64_t removal =
        g < gone.size() ? gallop(slots.index_keys, size, from, gone[g]) : size;
    const int64_t insertion = a < added.size() ? places[added[a].first] : size + 1;
    if (insertion <= removal) {
      copy(insertion);
      slots.out_index_keys[out] = keys[added[a].first];
      slots.out_index_slots[out++] = added[a++].second;
    } else {
      copy(removal);
      ++from;
      ++g;
    }
  }
  copy(size);
  slots.out_index_size = out;
}

// Columns [first, first + columns) of `key`'s initial row into `out`: the counter hash
// of (key, table, column), its 24 top bits scaled in float64 and rounded once to float32.
// Cloned: the AVX-512 copy's 64-bit multiplies vectorize (twice the AVX2 copy's speed);
// every copy gives the same values (no fused multiply-add, IEEE rounding either way).
EMBSHARD_CLONES
void initial_row(int64_t key, int64_t first, int64_t columns, int64_t table_key, double low,
                 double scale, float* out) {
  const auto scramble = [](uint64_t z) {
    z ^= z >> 30;
    z *= kMul1;
    z ^= z >> 27;
    return z * kMul2;
  };
  const uint64_t z =
      scramble((static_cast<uint64_t>(key) ^ static_cast<uint64_t>(table_key)) + kGamma);
  const uint64_t start = (z ^ (z >> 31)) + kGamma + static_cast<uint64_t>(first);
  // The 24 bits as an int32, which converts to float64 exactly as they would: a
  // conversion that vectorizes.
  for (int64_t c = 0; c < columns; ++c)
    out[c] = static_cast<float>(
        static_cast<double>(static_cast<int32_t>(scramble(start + c) >> 40)) * scale + low);
}

}  // namespace

extern "C" {

// One IdMap.remap call on `n` (> 0) keys: see storage/id_map.py for the rules.
void embshard_remap(const int64_t* keys, int64_t n, const Spec* spec, Slots* slots,
                    Slots* probation, Result* result) {
  result->outside = 0;
  result->missing = n;
  for (int64_t i = 0; i < n; ++i)
    result->outside += keys[i] < spec->lowest_key || keys[i] > spec->highest_key;
  if (result->outside) return;
  const int64_t step = spec->step;
  const Distinct& d = distinct(keys, n, *spec);
  const size_t u_count = d.keys.size();
  Scratch& kept = scratch();
  std::vector<int64_t>&found = kept.found, &waiting = kept.waiting, &total = kept.total;
  std::vector<int64_t>&places = kept.places, &waiting_places = kept.waiting_places;
  find(*slots, d.keys, found, places);
  total.assign(d.counts.begin(), d.counts.end());
  if (probation) {
    find(*probation, d.keys, waiting, waiting_places);
    for (size_t u = 0; u < u_count; ++u)
      if (waiting[u] >= 0) total[u] += probation->hits[waiting[u]];
  }

  // Live keys are seen; the others with enough sightings are due a slot.
  std::vector<int64_t>&due = kept.due, &seen = kept.seen;
  due.clear();
  seen.clear();
  for (size_t u = 0; u < u_count; ++u) {
    // The seen slots are all over the map: ask for a later one's early.
    if (u + kAhead < u_count && found[u + kAhead] >= 0) {
      __builtin_prefetch(slots->last_seen + found[u + kAhead], 1);
      __builtin_prefetch(slots->hits + found[u + kAhead], 1);
    }
    if (found[u] >= 0) {
      slots->last_seen[found[u]] = step;
      slots->hits[found[u]] += d.counts[u];
      seen.push_back(found[u]);
    } else if (total[u] >= spec->admit_after) {
      due.push_back(static_cast<int64_t>(u));
    }
  }
  std::vector<int64_t>&taken = kept.taken, &gone = kept.gone;
  taken.assign(u_count, -1);
  gone.clear();
  std::vector<std::pair<int64_t, int64_t>>& added = kept.added;
  added.clear();
  if (!due.empty()) {
    const std::vector<uint8_t>& seen_now = marks(*spec, seen);
    const int64_t* last = slots->last_seen;
    const auto not_seen = [&seen_now](int64_t slot) { return !seen_now[slot]; };
    const int64_t ttl = spec->ttl_steps;
    const auto expired = [last, step, ttl](int64_t slot) { return step - last[slot] >= ttl; };
    const auto never = [](int64_t) { return false; };
    switch (spec->policy) {
      case kLru:
        result->evicted = take_by_step(*slots, *spec, due, d, total, not_seen, taken, gone, added);
        break;
      case kLfu:
        result->evicted =
            take(*slots, *spec, due, d, total, not_seen, ByHits{}, taken, gone, added);
        break;
      case kTtl:
        result->evicted = take_by_step(*slots, *spec, due, d, total, expired, taken, gone, added);
        break;
      default:  // nothing is evictable: no order is needed
        result->evicted = take(*slots, *spec, due, d, total, never, ByStep{}, taken, gone, added);
    }
  } else {
    result->evicted = 0;
  }
  result->overflow = 0;
  result->admitted_count = 0;
  for (int64_t u : due) {
    if (taken[u] < 0) {
      ++result->overflow;
      continue;
    }
    result->admitted[result->admitted_count] = taken[u];
    result->admitted_keys[result->admitted_count++] = d.keys[u];
  }
  merge_index(*slots, gone, added, d.keys, places);

  // Probation: admitted keys leave it; keys still waiting are seen, or enter it, taking
  // its empty slots, then those of the candidates seen least recently (not this call).
  result->cleared = 0;
  if (probation) {
    std::vector<int64_t> probation_gone, entering;
    std::vector<std::pair<int64_t, int64_t>> probation_added;
    std::vector<int64_t> stay;
    for (size_t u = 0; u < u_count; ++u) {
      if (found[u] >= 0) continue;
      const int64_t w = waiting[u];
      if (w >= 0 && taken[u] >= 0) {
        probation->occupied[w] = 0;
        probation_gone.push_back(probation->keys[w]);
        ++result->cleared;
      } else if (w >= 0) {
        probation->last_seen[w] = step;
        probation->hits[w] = total[u];
        stay.push_back(w);
      } else if (taken[u] < 0) {
        entering.push_back(static_cast<int64_t>(u));
      }
    }
    if (!entering.empty()) {
      const std::vector<uint8_t>& staying = marks(*spec, stay);
      const auto not_staying = [&staying](int64_t slot) { return !staying[slot]; };
      std::vector<int64_t> probation_taken(u_count, -1);
      take_by_step(*probation, *spec, entering, d, total, not_staying, probation_taken,
                   probation_gone, probation_added);
    }
    merge_index(*probation, probation_gone, probation_added, d.keys, waiting_places);
  }

  for (size_t u = 0; u < u_count; ++u)
    if (found[u] >= 0) taken[u] = found[u];
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    result->rows[i] = taken[d.inverse[i]];
    missing += result->rows[i] < 0;
  }
  result->missing = missing;
}

// The initial float32 rows (n, dim) of `keys`: keys.initial_rows' counter hash, its
// 24 top bits scaled in float64 and rounded once to float32.
void embshard_initial_rows(const int64_t* keys, int64_t n, int64_t dim, int64_t table_key,
                           double low, double scale, float* out) {
  for (int64_t i = 0; i < n; ++i) initial_row(keys[i], 0, dim, table_key, low, scale, out + i * dim);
}

// Admitted keys' rows written in place: each key's initial values, columns [first,
// first + columns) of its row, into row `rows[i]` of `weights` (float32, `stride` floats
// a row), and that row of each of the `states` tensors zeroed (`state_widths[s]` bytes
// from `states[s] + rows[i] * state_strides[s]`), in one pass.
void embshard_admit_rows(const int64_t* keys, const int64_t* rows, int64_t n, int64_t first,
                         int64_t columns, int64_t table_key, double low, double scale,
                         float* weights, int64_t stride, int64_t count, char* const* states,
                         const int64_t* state_strides, const int64_t* state_widths) {
  constexpr int64_t kLine = 64;  // bytes
  for (int64_t i = 0; i < n; ++i) {
    // The rows miss the cache: ask for a later row's lines early.
    if (i + kAhead < n) {
      const char* row = reinterpret_cast<const char*>(weights + rows[i + kAhead] * stride);
      for (int64_t at = 0; at < columns * 4; at += kLine) __builtin_prefetch(row + at, 1);
      for (int64_t s = 0; s < count; ++s)
        __builtin_prefetch(states[s] + rows[i + kAhead] * state_strides[s], 1);
    }
    initial_row(keys[i], first, columns, table_key, low, scale, weights + rows[i] * stride);
    for (int64_t s = 0; s < count; ++s)
      std::memset(states[s] + rows[i] * state_strides[s], 0, state_widths[s]);
  }
}

}  // extern "C"

// The sender's side of dynamic tables (runtime/dynamic_ids.py's DynamicIds): the batch's
// ids feature-major, `counts[f]` of feature f's, one pass each where torch needs a
// per-id feature, gathers of its settings and several passes over all ids.

namespace {

// keys.hash_ids of one raw id: splitmix64's steps on 63 bits. Torch's int64 add and
// multiply wrap as uint64's do, so negative ids get the torch path's bits too.
uint64_t hash_id(uint64_t z) {
  constexpr uint64_t kMask = ~uint64_t{0} >> 1;
  z = (z + (kGamma & kMask)) & kMask;
  z = ((z ^ (z >> 30)) * (kMul1 & kMask)) & kMask;
  z = ((z ^ (z >> 27)) * (kMul2 & kMask)) & kMask;
  return z ^ (z >> 31);
}

// A DynamicIds' settings per feature (its tensors, int64 but the bool flags).
struct Routing {
  const int64_t* width;   // keys (or raw ids) a range spans
  const int64_t* last;    // the last range
  const int64_t* rows;    // rows of a range's block, 0 where first rows are looked up
  const uint8_t* ranged;  // a managed-collision feature: its firsts looked up
  const int64_t* base;    // where its first rows begin in firsts
  const int64_t* firsts;
};

}  // namespace

extern "C" {

// DynamicIds.keyed: the `n` int64 ids into `out`, the hashed features' as their keys.
// Ids past the counts' total (none in a routable batch) are copied.
void embshard_keyed(const int64_t* values, int64_t n, const int64_t* counts, int64_t features,
                    const uint8_t* hashed, int64_t* out) {
  int64_t at = 0;
  for (int64_t f = 0; f < features; ++f) {
    const int64_t end = std::min(n, at + std::max<int64_t>(counts[f], 0));
    if (hashed[f]) {
      for (; at < end; ++at) out[at] = static_cast<int64_t>(hash_id(values[at]));
    } else {
      std::copy(values + at, values + end, out + at);
      at = end;
    }
  }
  std::copy(values + at, values + n, out + at);
}

// DynamicIds.stand_ins: each id's stand-in (its range's first row where it is a key,
// else the id) into `out`, and whether it is a key into `is_key`.
void embshard_stand_ins(const int64_t* keys, int64_t n, const int64_t* counts, int64_t features,
                        const Routing* routing, int64_t* out, uint8_t* is_key) {
  int64_t at = 0;
  for (int64_t f = 0; f < features; ++f) {
    const int64_t end = std::min(n, at + std::max<int64_t>(counts[f], 0));
    const int64_t width = routing->width[f], last = routing->last[f], rows = routing->rows[f];
    const bool ranged = routing->ranged[f], key = rows > 0 || ranged;
    std::fill(is_key + at, is_key + end, key);
    if (!key) {
      std::copy(keys + at, keys + end, out + at);
      at = end;
      continue;
    }
    const int64_t* firsts = routing->firsts + routing->base[f];
    for (; at < end; ++at) {
      // C++'s division truncates where torch's floors; they differ on negative ids only:
      // a ranged feature's bucket is clamped to 0 either way (a flagged id: any row
      // stands in), and a hashed feature's keys are never negative. The product wraps
      // as torch's does.
      const int64_t bucket = std::min(keys[at] / width, last);
      out[at] = ranged ? firsts[std::max<int64_t>(bucket, 0)]
                       : static_cast<int64_t>(static_cast<uint64_t>(bucket) *
                                              static_cast<uint64_t>(rows));
    }
  }
  std::copy(keys + at, keys + n, out + at);
  std::fill(is_key + at, is_key + n, 0);
}

// DynamicIds.put_back: the `n` bucketized ids into `out`, each key (`is_key`) back at
// its place `where` (a permutation of [0, n); places outside it are skipped).
void embshard_put_back(const int64_t* bucketized, const int64_t* where, const int64_t* keys,
                       const uint8_t* is_key, int64_t n, int64_t* out) {
  std::copy(bucketized, bucketized + n, out);
  for (int64_t i = 0; i < n; ++i)
    if (is_key[i] && static_cast<uint64_t>(where[i]) < static_cast<uint64_t>(n))
      out[where[i]] = keys[i];
}

}  // extern "C"
