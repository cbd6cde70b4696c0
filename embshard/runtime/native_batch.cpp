// embshard's CPU kernels for every step's stage 1 (runtime/batch.py, sparse_ops.py,
// input_dist.py): the batch check, the row-wise routing of its ids, and the packing
// and unpacking of the ids all-to-all, each what FBGEMM's operations (which run on
// CUDA) give, in a fraction of the time of their scalar CPU loops and in one op each.
// Plain C entry points over raw buffers (runtime/native.py loads them with ctypes).

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Where a bag that starts at `at` ends among `n` ids: its length cut short where it is
// negative or runs past them, so that a bad batch's bags never read out of bounds.
template <typename L>
int64_t bag_end(int64_t at, L length, int64_t n) {
  return std::min(n, at + std::max<int64_t>(length, 0));
}

}  // namespace

// The batch check (runtime/batch.py): how many problems a batch has, in two passes over
// its lengths table [features, batch] and its ids, feature by feature: 1 for lengths
// that are negative or do not add up to the `n` ids, else the ids outside
// [0, rows_less_one[f] + 1) of their feature. What FBGEMM's bounds check finds (given
// `id - 1` against `rows - 1`, as batch.py gives it), counted as one problem where the
// lengths are bad. The first pass also writes `routable`: the lengths, or where they
// are bad one bag holding every id (LocalBatch.routable_lengths). The loops vectorize.
namespace {

template <typename L, typename I>
int64_t bounds_check(const L* lengths, int64_t features, int64_t batch, const I* ids, int64_t n,
                     const int64_t* rows_less_one, L* routable) {
  std::vector<int64_t> totals(features);
  int64_t all = 0;
  bool negative = false;
  for (int64_t f = 0; f < features; ++f) {
    const L* bags = lengths + f * batch;
    L* out = routable + f * batch;
    int64_t total = 0;
    for (int64_t b = 0; b < batch; ++b) {
      out[b] = bags[b];
      total += bags[b];
      negative |= bags[b] < 0;
    }
    totals[f] = total;
    all += total;
  }
  if (negative || all != n) {
    std::fill(routable, routable + features * batch, L{0});
    if (features && batch) routable[0] = static_cast<L>(n);
    return 1;
  }
  int64_t at = 0, problems = 0;
  for (int64_t f = 0; f < features; ++f) {
    // Unsigned: a negative id is above every bound.
    const uint64_t last = static_cast<uint64_t>(rows_less_one[f]);
    int64_t outside = 0;
    for (int64_t i = at; i < at + totals[f]; ++i)
      outside += static_cast<uint64_t>(static_cast<int64_t>(ids[i])) > last;
    problems += outside;
    at += totals[f];
  }
  return problems;
}

}  // namespace

// Each (lengths, ids) dtype pair a batch's kernels take, int32 or int64, as
// X(suffix, L, I): the kernels' C names end in the suffix (runtime/native.py's _BITS).
#define EMBSHARD_LENGTHS_AND_IDS(X) \
  X(32_32, int32_t, int32_t) X(32_64, int32_t, int64_t) X(64_32, int64_t, int32_t) \
  X(64_64, int64_t, int64_t)

extern "C" {

// bounds_check for each (lengths, ids) dtype pair, its count into *out.
#define EMBSHARD_BOUNDS_CHECK(SUFFIX, L, I)                                                   \
  void embshard_bounds_check_##SUFFIX(const L* lengths, int64_t features, int64_t batch,     \
                                      const I* ids, int64_t n, const int64_t* rows_less_one, \
                                      int64_t* out, L* routable) {                           \
    *out = bounds_check(lengths, features, batch, ids, n, rows_less_one, routable);          \
  }
EMBSHARD_LENGTHS_AND_IDS(EMBSHARD_BOUNDS_CHECK)
#undef EMBSHARD_BOUNDS_CHECK

}  // extern "C"

// Row-wise routing (runtime/sparse_ops.py): FBGEMM's block_bucketize_sparse_features
// given each feature's row boundaries, in two passes over the ids where FBGEMM's CPU
// operation makes two binary searches an id. Bucket p of feature f holds the ids in
// [bounds[f][p], bounds[f][p + 1]), less bounds[f][p]; an id outside every bucket (a
// bad batch's: negative ones are read unsigned, as FBGEMM reads them) goes to bucket
// id % buckets as id / buckets. Outputs are bucket-major: every bag of bucket 0, then
// of bucket 1; a bag's ids keep their order. `order` (if given) is where each id went.
// A feature whose rows are all in one bucket (a table-wise or column-wise table's in a
// plan with row-wise ones) is copied as it is once its ids are seen to be inside it.
// Lengths that are negative or overrun the ids are read as if cut short: a bad batch's
// routable lengths add up, and nothing is read or written out of bounds.
namespace {

constexpr uint32_t kOutside = 1u << 31;  // a bucket code's mark of an id outside all

// The bucket of `id` among `bounds` (`width` values from 0, those past the buckets + 1
// all ones), marked kOutside where it is outside them all. K: the width where it is
// known when compiling (compares the compiler unrolls), else 0. Compares without a
// branch: a binary search's branches mispredict on ids spread over the buckets.
template <int K, typename U>
uint32_t bucket_code(U id, const uint64_t* bounds, int64_t width, int64_t buckets) {
  int64_t p = -1;
  for (int64_t k = 0; k < (K ? K : width); ++k) p += bounds[k] <= id;
  if (p >= 0 && p < buckets) return static_cast<uint32_t>(p);
  return static_cast<uint32_t>(id % static_cast<U>(buckets)) | kOutside;
}

// One feature's ids [first, end) and bags [bag, bag + batch), the lengths cut short.
struct Span {
  int64_t first, end, bag;
};

// The bucket that holds all of a feature's rows, [0, bounds[buckets]), where one does
// (every other bucket empty), else -1.
int64_t only_bucket(const uint64_t* bounds, int64_t buckets) {
  int64_t only = 0;
  while (only < buckets && bounds[only + 1] == 0) ++only;
  if (bounds[0] != 0 || only == buckets || bounds[only + 1] != bounds[buckets]) return -1;
  return only;
}

// Whether every id of [first, end) is below `rows`, read unsigned.
template <typename I>
bool all_below(const I* ids, int64_t first, int64_t end, uint64_t rows) {
  using U = std::make_unsigned_t<I>;
  bool below = true;
  for (int64_t i = first; i < end; ++i) below &= static_cast<U>(ids[i]) < rows;
  return below;
}

// Each feature's span and, where its rows are all in one bucket and so are its ids,
// that bucket (else -1); each (bucket, bag)'s count into new_lengths, and for the other
// features each id's bucket code into `codes`.
template <int K, typename L, typename I>
void count_buckets(const L* lengths, int64_t features, int64_t batch, const I* ids, int64_t n,
                   const uint64_t* boundaries, int64_t width, int64_t buckets, uint32_t* codes,
                   L* new_lengths, std::vector<Span>& spans, std::vector<int64_t>& whole) {
  using U = std::make_unsigned_t<I>;
  const int64_t bags = features * batch;
  std::fill(new_lengths, new_lengths + buckets * bags, L{0});
  int64_t at = 0;
  for (int64_t f = 0; f < features; ++f) {
    const uint64_t* bounds = boundaries + f * width;
    Span span{at, at, f * batch};
    for (int64_t bag = span.bag; bag < span.bag + batch; ++bag)
      span.end = bag_end(span.end, lengths[bag], n);
    spans[f] = span;
    int64_t only = only_bucket(bounds, buckets);
    if (only >= 0 && !all_below(ids, span.first, span.end, bounds[buckets])) only = -1;
    whole[f] = only;
    for (int64_t bag = span.bag; bag < span.bag + batch; ++bag) {
      const int64_t end = bag_end(at, lengths[bag], n);
      if (only >= 0) {
        new_lengths[only * bags + bag] = static_cast<L>(end - at);
        at = end;
      }
      for (; at < end; ++at) {
        const uint32_t code = bucket_code<K>(static_cast<U>(ids[at]), bounds, width, buckets);
        codes[at] = code;
        ++new_lengths[(code & ~kOutside) * bags + bag];
      }
    }
  }
}

template <typename L, typename I, typename W>
void block_bucketize(const L* lengths, int64_t features, int64_t batch, const I* ids, int64_t n,
                     const uint64_t* boundaries, int64_t width, int64_t buckets,
                     const W* weights, L* new_lengths, I* new_ids, W* new_weights, I* order) {
  using U = std::make_unsigned_t<I>;
  static thread_local std::vector<uint32_t> codes;
  static thread_local std::vector<int64_t> next, whole;
  static thread_local std::vector<Span> spans;
  codes.resize(n);
  spans.resize(features);
  whole.resize(features);
  const auto count = [&](auto k) {
    count_buckets<decltype(k)::value>(lengths, features, batch, ids, n, boundaries, width,
                                      buckets, codes.data(), new_lengths, spans, whole);
  };
  switch (width) {
    case 3: count(std::integral_constant<int, 3>{}); break;
    case 5: count(std::integral_constant<int, 5>{}); break;
    case 9: count(std::integral_constant<int, 9>{}); break;
    case 17: count(std::integral_constant<int, 17>{}); break;
    default: count(std::integral_constant<int, 0>{});
  }
  // Each (bucket, bag)'s next place in the outputs.
  const int64_t bags = features * batch;
  next.resize(buckets * bags);
  int64_t total = 0;
  for (int64_t j = 0; j < buckets * bags; ++j) {
    next[j] = total;
    total += new_lengths[j];
  }
  for (int64_t f = 0; f < features; ++f) {
    const uint64_t* bounds = boundaries + f * width;
    const Span span = spans[f];
    if (whole[f] >= 0) {  // its ids as they are, from its first bag's place in its bucket
      const int64_t to = next[whole[f] * bags + span.bag] - span.first;
      for (int64_t i = span.first; i < span.end; ++i) {
        new_ids[to + i] = ids[i];
        if (new_weights) new_weights[to + i] = weights[i];
        if (order) order[i] = static_cast<I>(to + i);
      }
      continue;
    }
    int64_t at = span.first;
    for (int64_t bag = span.bag; bag < span.bag + batch; ++bag) {
      const int64_t end = bag_end(at, lengths[bag], n);
      for (; at < end; ++at) {
        const uint32_t code = codes[at], p = code & ~kOutside;
        U id = static_cast<U>(ids[at]);
        if (__builtin_expect(code & kOutside, 0))  // a bad batch's: no division otherwise
          id /= static_cast<U>(buckets);
        else
          id -= static_cast<U>(bounds[p]);
        const int64_t to = next[p * bags + bag]++;
        new_ids[to] = static_cast<I>(id);
        if (new_weights) new_weights[to] = weights[at];
        if (order) order[at] = static_cast<I>(to);
      }
    }
  }
}

}  // namespace

extern "C" {

// block_bucketize for each (lengths, ids) dtype pair, with weights of 4 bytes (float32)
// or none. `boundaries`: [features, width]; widths 3, 5, 9 and 17 take the fastest path
// (runtime/native.py pads to them).
#define EMBSHARD_BLOCK_BUCKETIZE(SUFFIX, L, I)                                                \
  void embshard_block_bucketize_##SUFFIX(                                                    \
      const L* lengths, int64_t features, int64_t batch, const I* ids, int64_t n,            \
      const uint64_t* boundaries, int64_t width, int64_t buckets, const uint32_t* weights,   \
      L* new_lengths, I* new_ids, uint32_t* new_weights, I* order) {                         \
    block_bucketize(lengths, features, batch, ids, n, boundaries, width, buckets, weights,   \
                    new_lengths, new_ids, new_weights, order);                               \
  }
EMBSHARD_LENGTHS_AND_IDS(EMBSHARD_BLOCK_BUCKETIZE)
#undef EMBSHARD_BLOCK_BUCKETIZE

}  // extern "C"

// The ids all-to-all's payload (runtime/input_dist.py's pack): for each destination in
// turn, the lengths rows it takes of the [rows, batch] lengths table (`send_rows`, in
// order, `rows_per_dest` of them each), then those rows' ids, then their weights' bits,
// all as the payload's type. What FBGEMM's permute_2D_sparse_data and a cat do, in one
// pass over the ids. Rows whose ids would run past the ids given, or the payload past
// `size`, are cut short: nothing is read or written out of bounds.
namespace {

template <typename L, typename I, typename D>
void pack(const L* lengths, int64_t rows, int64_t batch, const I* ids, int64_t n,
          const uint32_t* weights, const int32_t* send_rows, const int64_t* rows_per_dest,
          int64_t dests, D* payload, int64_t size) {
  static thread_local std::vector<int64_t> first;  // each row's first id
  first.resize(rows + 1);
  first[0] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t total = 0;
    for (int64_t b = 0; b < batch; ++b) total += lengths[r * batch + b];
    first[r + 1] = bag_end(first[r], total, n);
  }
  int64_t at = 0;
  const int32_t* row = send_rows;
  for (int64_t d = 0; d < dests; ++d) {
    const int32_t* end = row + rows_per_dest[d];
    for (const int32_t* r = row; r < end; ++r)
      for (int64_t b = 0; b < batch && at < size; ++b)
        payload[at++] = static_cast<D>(lengths[*r * batch + b]);
    for (const int32_t* r = row; r < end; ++r)
      for (int64_t i = first[*r]; i < first[*r + 1] && at < size; ++i)
        payload[at++] = static_cast<D>(ids[i]);
    if (weights)
      for (const int32_t* r = row; r < end; ++r)
        for (int64_t i = first[*r]; i < first[*r + 1] && at < size; ++i)
          payload[at++] = static_cast<D>(static_cast<int32_t>(weights[i]));
    row = end;
  }
}

}  // namespace

extern "C" {

// pack for each (lengths, ids) dtype pair and payload type, int32 or int64 (the names
// end in the three's bits); weights float32.
#define EMBSHARD_PACK(NAME, L, I, D)                                                         \
  void NAME(const L* lengths, int64_t rows, int64_t batch, const I* ids, int64_t n,         \
            const uint32_t* weights, const int32_t* send_rows, const int64_t* rows_per_dest, \
            int64_t dests, D* payload, int64_t size) {                                      \
    pack(lengths, rows, batch, ids, n, weights, send_rows, rows_per_dest, dests, payload,    \
         size);                                                                              \
  }
#define EMBSHARD_PACK_TO_BOTH(SUFFIX, L, I)                 \
  EMBSHARD_PACK(embshard_pack_##SUFFIX##_32, L, I, int32_t) \
  EMBSHARD_PACK(embshard_pack_##SUFFIX##_64, L, I, int64_t)
EMBSHARD_LENGTHS_AND_IDS(EMBSHARD_PACK_TO_BOTH)
#undef EMBSHARD_PACK_TO_BOTH
#undef EMBSHARD_PACK

}  // extern "C"

// The TBE's input from what the ids all-to-all brought (runtime/input_dist.py's
// unpack). Source r's chunk is its bags' lengths (slot by slot, `batch_sizes[r]` a
// slot), their ids, then (`weighted`) their weights' float32 bits, all of the buffer's
// type; the TBE takes the bags slot by slot, each slot's sources in rank order: its
// ids, its bags' offsets (from 0, one more than the bags) and its weights. What
// FBGEMM's permute_1D_sparse_data and complete cumsum do after cutting the chunks, in
// one pass. Lengths that are negative or overrun their chunk's ids are read as if cut
// short: nothing is read or written out of bounds.
namespace {

template <typename D>
void unpack(const D* received, const int64_t* sizes, const int64_t* batch_sizes,
            int64_t sources, int64_t slots, bool weighted, D* values, D* offsets,
            uint32_t* weights) {
  struct Chunk {
    const D* lengths;
    const D* ids;
    int64_t count;
  };
  static thread_local std::vector<Chunk> chunks;
  static thread_local std::vector<int64_t> first;  // [source][slot]: its first id
  chunks.resize(sources);
  first.resize(sources * slots);
  const D* at = received;
  for (int64_t r = 0; r < sources; ++r) {
    const int64_t bags = slots * batch_sizes[r];
    const int64_t count = std::max<int64_t>(sizes[r] - bags, 0) / (weighted ? 2 : 1);
    chunks[r] = {at, at + bags, count};
    int64_t taken = 0;
    for (int64_t s = 0; s < slots; ++s) {
      first[r * slots + s] = taken;
      for (int64_t j = s * batch_sizes[r]; j < (s + 1) * batch_sizes[r]; ++j)
        taken = bag_end(taken, at[j], count);
    }
    at += sizes[r];
  }
  int64_t bag = 0, out = 0;
  offsets[0] = 0;
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t r = 0; r < sources; ++r) {
      const Chunk& chunk = chunks[r];
      const int64_t start = first[r * slots + s];
      int64_t taken = start;
      for (int64_t j = s * batch_sizes[r]; j < (s + 1) * batch_sizes[r]; ++j) {
        taken = bag_end(taken, chunk.lengths[j], chunk.count);
        offsets[++bag] = static_cast<D>(out + taken - start);
      }
      std::copy(chunk.ids + start, chunk.ids + taken, values + out);
      if (weighted)
        for (int64_t i = start; i < taken; ++i)
          weights[out + i - start] = static_cast<uint32_t>(chunk.ids[chunk.count + i]);
      out += taken - start;
    }
}

}  // namespace

extern "C" {

// unpack for an int32 or int64 buffer.
#define EMBSHARD_UNPACK(NAME, D)                                                           \
  void NAME(const D* received, const int64_t* sizes, const int64_t* batch_sizes,          \
            int64_t sources, int64_t slots, bool weighted, D* values, D* offsets,         \
            uint32_t* weights) {                                                          \
    unpack(received, sizes, batch_sizes, sources, slots, weighted, values, offsets,       \
           weights);                                                                      \
  }
EMBSHARD_UNPACK(embshard_unpack_32, int32_t)
EMBSHARD_UNPACK(embshard_unpack_64, int64_t)
#undef EMBSHARD_UNPACK

}  // extern "C"
