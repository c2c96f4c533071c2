#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/dispatch.h"
#include "device/cpu_codecs.h"
#include "device/device_ops.h"

namespace pycomm {

namespace {

// Folds the terms block by block into an accumulator that stays in L1, so any number of
// terms costs one pass over each operand and one write of the output; the loops over a
// block are branch-free and vectorize. A block is read completely before its output is
// written, which makes `out` aliasing a term safe.
template <class T, ReduceKind K, bool kFinal>
void reduce_terms_loop(void* out, const Term* terms, int k, size_t n, AccOf<T> premul, int world_size) {
  using A = AccOf<T>;
  using N = Numeric<T>;
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    for (int j = 0; j < k; ++j) {
      if (terms[j].form == Form::Input) {
        const T* x = static_cast<const T*>(terms[j].data) + base;
        if (j == 0)
          for (size_t i = 0; i < m; ++i) acc[i] = contribution<K>(N::load(x[i]), premul);
        else
          for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], contribution<K>(N::load(x[i]), premul));
      } else {
        const A* x = static_cast<const A*>(terms[j].data) + base;
        if (j == 0)
          for (size_t i = 0; i < m; ++i) acc[i] = x[i];
        else
          for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], x[i]);
      }
    }
    if constexpr (kFinal) {
      T* o = static_cast<T*>(out) + base;
      for (size_t i = 0; i < m; ++i) o[i] = N::store(finalize<K>(acc[i], world_size));
    } else {
      std::memcpy(static_cast<A*>(out) + base, acc, m * sizeof(A));
    }
  }
}

// ---- Exact mode (the arithmetic is in numerics.h) ----
//
// Elements are summed kExactBlock at a time from k >= 1 rows (one per term), in passes
// that are branch-free loops over the block: the largest magnitude, the grid, the grid
// steps of every term, the rounding back. Only a block holding a non-finite term takes a
// last, scalar pass for those elements. `out` must not alias a row.
constexpr size_t kExactBlock = 256;

void check_exact_terms(int k) {
  if (k > kExactMaxTerms) fail(ErrorKind::InvalidArgument, "pycomm: exact mode adds at most 65536 terms");
}

// amax[i] = the largest magnitude_bits of element i over the rows; returns their maximum.
// (Rows never alias amax: __restrict lets each loop vectorize without a runtime check;
// always inlined, so that the wide clones below vectorize it too.)
template <class A, class M>
__attribute__((always_inline)) inline M largest_magnitudes(const A* const* rows, int k, size_t m, M* __restrict amax) {
  const A* __restrict first = rows[0];
  for (size_t i = 0; i < m; ++i) amax[i] = magnitude_bits(first[i]);
  for (int j = 1; j < k; ++j) {
    const A* __restrict row = rows[j];
    for (size_t i = 0; i < m; ++i) amax[i] = std::max(amax[i], magnitude_bits(row[i]));
  }
  M largest = 0;
  for (size_t i = 0; i < m; ++i) largest = std::max(largest, amax[i]);
  return largest;
}

template <class A, class M>
void exact_nonfinite_pass(const A* const* rows, int k, size_t m, const M* amax, A* out) {
  for (size_t i = 0; i < m; ++i) {
    if (!nonfinite_magnitude(amax[i])) continue;
    uint32_t seen = 0;
    for (int j = 0; j < k; ++j)
      if (!std::isfinite(rows[j][i])) seen |= nonfinite_kind(rows[j][i]);
    out[i] = exact_nonfinite<A>(seen);
  }
}

// The float exact sum is bound by double arithmetic, 2 lanes wide on baseline x86-64: it
// is also compiled for wider vectors, chosen when the program loads by what the CPU has.
// Every clone computes the same bits: each operation is correctly rounded, and the one
// product (a power-of-two scaling) is exact, so fused multiply-adds change nothing.
// Under ThreadSanitizer, the default clone only: the clones' resolver (an ifunc) is
// instrumented too, and the dynamic loader runs it before the TSan runtime is initialised,
// which crashes the program at load (google/sanitizers#342).
#if defined(__SANITIZE_THREAD__)
#define PYCOMM_TSAN_BUILD
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PYCOMM_TSAN_BUILD
#endif
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(PYCOMM_TSAN_BUILD)
#define PYCOMM_WIDE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PYCOMM_WIDE_VECTOR_CLONES
#endif

PYCOMM_WIDE_VECTOR_CLONES
void exact_sum(const float* const* rows, int k, size_t m, float* out) {
  int32_t amax[kExactBlock];
  double up[kExactBlock], sum[kExactBlock];
  const int32_t largest = largest_magnitudes(rows, k, m, amax);
  for (size_t i = 0; i < m; ++i) up[i] = exact_grid(amax[i]).up, sum[i] = 0.0;
  // Grid steps are integers below 2^53 in every partial sum: any grouping adds them
  // exactly, so rows go two at a time (half the traffic on `sum`).
  int j = 0;
  for (; j + 1 < k; j += 2) {
    const float* __restrict a = rows[j], * __restrict b = rows[j + 1];
    for (size_t i = 0; i < m; ++i) sum[i] += exact_grid_steps(a[i], up[i]) + exact_grid_steps(b[i], up[i]);
  }
  if (j < k) {
    const float* __restrict a = rows[j];
    for (size_t i = 0; i < m; ++i) sum[i] += exact_grid_steps(a[i], up[i]);
  }
  for (size_t i = 0; i < m; ++i) out[i] = exact_grid_value(sum[i], exact_grid(amax[i]).down);
  if (nonfinite_magnitude(largest)) exact_nonfinite_pass(rows, k, m, amax, out);
}

void exact_sum(const double* const* rows, int k, size_t m, double* out) {
  int64_t amax[kExactBlock];
  const int64_t largest = largest_magnitudes(rows, k, m, amax);
  for (size_t i = 0; i < m; ++i) {
    const int exponent = exact_exponent64(amax[i]);
    __int128 sum = 0;
    for (int j = 0; j < k; ++j)
      if (std::isfinite(rows[j][i])) sum += exact_grid_steps64(rows[j][i], exponent);
    out[i] = exact_grid_value64(sum, exponent);
  }
  if (nonfinite_magnitude(largest)) exact_nonfinite_pass(rows, k, m, amax, out);
}

// Exact mode only changes sums: MIN and MAX do not depend on the order, PRODUCT is left
// to the fixed rank order of the fold.
template <ReduceKind K>
constexpr bool kSumLike = K == ReduceKind::Sum || K == ReduceKind::Avg || K == ReduceKind::PremulSum;

// reduce_terms_loop's contract, in exact mode, for floating types. A term already holding
// its values in the accumulation format is read in place; others are converted to a row.
template <class T, ReduceKind K, bool kFinal>
void reduce_terms_exact(void* out, const Term* terms, int k, size_t n, AccOf<T> premul, int world_size) {
  using A = AccOf<T>;
  using N = Numeric<T>;
  check_exact_terms(k);
  constexpr bool kInputInPlace = std::is_same_v<T, A> && K != ReduceKind::PremulSum;
  std::vector<A> scratch(kInputInPlace ? 0 : static_cast<size_t>(k) * kExactBlock);  // converted rows
  std::vector<const A*> rows(k);
  A acc[kExactBlock];
  for (size_t base = 0; base < n; base += kExactBlock) {
    const size_t m = std::min(kExactBlock, n - base);
    for (int j = 0; j < k; ++j) {
      if (terms[j].form == Form::Partial || kInputInPlace) {
        rows[j] = static_cast<const A*>(terms[j].data) + base;
      } else {
        const T* x = static_cast<const T*>(terms[j].data) + base;
        A* row = scratch.data() + j * kExactBlock;
        for (size_t i = 0; i < m; ++i) row[i] = contribution<K>(N::load(x[i]), premul);
        rows[j] = row;
      }
    }
    exact_sum(rows.data(), k, m, acc);
    if constexpr (kFinal) {
      T* o = static_cast<T*>(out) + base;
      for (size_t i = 0; i < m; ++i) o[i] = N::store(finalize<K>(acc[i], world_size));
    } else {
      std::memcpy(static_cast<A*>(out) + base, acc, m * sizeof(A));
    }
  }
}

// The uncoded fold: exact where exact mode changes the result, else in rank order.
template <class T, ReduceKind K, bool kFinal>
void fold(const ReduceSpec& spec, void* out, const Term* terms, int k, size_t n, AccOf<T> premul) {
  if constexpr (std::is_floating_point_v<AccOf<T>> && kSumLike<K>)
    if (spec.exact) return reduce_terms_exact<T, K, kFinal>(out, terms, k, n, premul, spec.world_size);
  reduce_terms_loop<T, K, kFinal>(out, terms, k, n, premul, spec.world_size);
}

// The same fold with a codec, one codec block at a time (scales are per block). Input
// terms are quantized on load; Encoded terms are decoded; the output is written in the
// accumulation format, the storage format, or encoded (see Stage). Every operand of a
// block is brought into fp32 in L1 and folded from there, so each one costs a few passes
// over the block in L1 and one over its memory. The codecs' conversions are
// cpu_codecs.h's, in the path in use.
template <class T, ReduceKind K, class Code>
void reduce_terms_coded(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k, size_t n,
                        float premul) {
  using N = Numeric<T>;
  const CodecRuns<T>& runs = codec_runs<T>(spec.codec);
  const CodecRuns<float>& values_runs = codec_runs<float>(spec.codec);
  constexpr size_t kCodeBytes = sizeof(typename Code::Code);
  const size_t block = spec.block;
  // Each encoded operand is a piece of n elements (numerics.h's layout).
  const auto records = [n](const void* piece) { return records_of(static_cast<const char*>(piece), n, kCodeBytes); };
  const Records<char> out_records = records_of(static_cast<char*>(out), n, kCodeBytes);  // an encoded stage's
  // Encoding one contribution quantizes it once, in the encoder: quantizing is idempotent.
  const bool quantize_inputs = !(k == 1 && stage == Stage::Encoded);
  // Exact mode: every term's values of a block first (quantized or decoded), then their
  // exact sum, in sub-blocks of kExactBlock.
  const bool exact = kSumLike<K> && spec.exact;
  // One term whose values nothing but the codec changes (no premultiplication, no exact
  // sum, no division of AVG) goes straight through: an input encoded, records decoded.
  if (k == 1 && !exact) {
    const Term& t = terms[0];
    if (t.form == Form::Input && stage == Stage::Encoded && K != ReduceKind::PremulSum) {
      runs.encode(static_cast<const T*>(t.data), out_records, n, block);
      return zero_padding<Code>(static_cast<char*>(out), n, block);
    }
    if (t.form == Form::Encoded && stage == Stage::Final && K != ReduceKind::Avg)
      return runs.decode(records(t.data), static_cast<T*>(out), n, block);
    if (t.form == Form::Encoded && stage == Stage::Partial)
      return values_runs.decode(records(t.data), static_cast<float*>(out), n, block);
  }
  if (exact) check_exact_terms(k);
  std::vector<float> values(exact ? static_cast<size_t>(k) * block : 0);
  std::vector<const float*> rows(exact ? k : 0);
  float acc[kMaxCodecBlock], v[kMaxCodecBlock];
  // Term j's values of block b in fp32: an input's contribution quantized, partial
  // values as they are, encoded values decoded.
  auto load = [&](int j, size_t b, size_t base, size_t m, float* dst) {
    const Term& t = terms[j];
    switch (t.form) {
      case Form::Input: {
        const T* x = static_cast<const T*>(t.data) + base;
        if (quantize_inputs && K != ReduceKind::PremulSum) {
          runs.quantize(x, dst, m, block);
        } else {
          for (size_t i = 0; i < m; ++i) dst[i] = contribution<K>(N::load(x[i]), premul);
          if (quantize_inputs) values_runs.quantize(dst, dst, m, block);
        }
        break;
      }
      case Form::Partial:
        std::memcpy(dst, static_cast<const float*>(t.data) + base, m * sizeof(float));
        break;
      case Form::Encoded:
        values_runs.decode(records(t.data).from(b, block, kCodeBytes), dst, m, block);
        break;
    }
  };
  for (size_t b = 0, base = 0; base < n; ++b, base += block) {
    const size_t m = std::min(block, n - base);
    if (exact) {
      for (int j = 0; j < k; ++j) load(j, b, base, m, values.data() + j * block);
      for (size_t s = 0; s < m; s += kExactBlock) {
        for (int j = 0; j < k; ++j) rows[j] = values.data() + j * block + s;
        exact_sum(rows.data(), k, std::min(kExactBlock, m - s), acc + s);
      }
    } else {
      load(0, b, base, m, acc);
      for (int j = 1; j < k; ++j) {
        load(j, b, base, m, v);
        for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], v[i]);
      }
    }
    if constexpr (K == ReduceKind::Avg)
      if (stage == Stage::Final || stage == Stage::FinalEncoded)
        for (size_t i = 0; i < m; ++i) acc[i] = finalize<K>(acc[i], spec.world_size);
    switch (stage) {
      case Stage::Partial:
        std::memcpy(static_cast<float*>(out) + base, acc, m * sizeof(float));
        break;
      case Stage::Final: {
        T* o = static_cast<T*>(out) + base;
        for (size_t i = 0; i < m; ++i) o[i] = N::store(acc[i]);
        break;
      }
      case Stage::Encoded:
      case Stage::FinalEncoded:
        values_runs.encode(acc, out_records.from(b, block, kCodeBytes), m, block);
        break;
    }
  }
  if (stage == Stage::Encoded || stage == Stage::FinalEncoded) zero_padding<Code>(static_cast<char*>(out), n, block);
}

// ---- The hash of DeviceOps::hash ----
//
// Blocks of kHashBlock bytes, chained: each block's hash seeds the next, so a buffer
// hashed in place and one copied to the host block by block give the same value. Within
// a block, kHashLanes independent lanes each take every kHashLanes-th 8-byte word (a tail
// is padded with zeros; the length enters the result) through a step that is a bijection
// of the lane for a given word: xor the word, multiply by an odd constant, xor-shift the
// high half down. The lanes then fold into one value, again by steps that are bijections
// of each lane; the seed starts lane 0 alone. So a single word that differs changes its
// lane, hence the block's hash, hence every later block's. The lanes' steps are one loop
// over an array, vectorized in every clone (32 lanes cover the multiply's latency).
constexpr size_t kHashLanes = 32;
constexpr size_t kHashStride = kHashLanes * sizeof(uint64_t);
constexpr size_t kHashBlock = size_t{1} << 20;  // a multiple of kHashStride

inline uint64_t hash_step(uint64_t lane, uint64_t word) {
  const uint64_t x = (lane ^ word) * 0x9e3779b97f4a7c15ull;
  return x ^ (x >> 32);
}

PYCOMM_WIDE_VECTOR_CLONES
uint64_t hash_block(const unsigned char* p, size_t n, uint64_t seed) {
  uint64_t lane[kHashLanes];
  for (size_t l = 0; l < kHashLanes; ++l) lane[l] = l;
  lane[0] = seed;
  uint64_t word[kHashLanes];
  size_t i = 0;
  for (; i + kHashStride <= n; i += kHashStride) {
    std::memcpy(word, p + i, kHashStride);
    for (size_t l = 0; l < kHashLanes; ++l) lane[l] = hash_step(lane[l], word[l]);
  }
  if (i < n) {
    std::memset(word, 0, kHashStride);
    std::memcpy(word, p + i, n - i);
    for (size_t l = 0; l < kHashLanes; ++l) lane[l] = hash_step(lane[l], word[l]);
  }
  uint64_t h = n;
  for (size_t l = 0; l < kHashLanes; ++l) h = hash_step(h, lane[l]);
  return h;
}

// The chain over the blocks of `bytes` bytes; block(at, n) gives the host address of bytes
// [at, at + n).
template <class Block>
uint64_t hash_blocks(size_t bytes, Block block) {
  uint64_t h = 0;
  for (size_t at = 0; at < bytes; at += kHashBlock) {
    const size_t n = std::min(kHashBlock, bytes - at);
    h = hash_block(block(at, n), n, h);
  }
  return h;
}

class CpuOps final : public DeviceOps {
 public:
  std::shared_ptr<char> allocate(size_t bytes) const override {
    return std::shared_ptr<char>(new char[bytes], std::default_delete<char[]>());
  }
  void copy(void* dst, const void* src, size_t bytes) const override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }

  uint64_t hash(const void* data, size_t bytes) const override {
    return hash_blocks(bytes, [&](size_t at, size_t) { return static_cast<const unsigned char*>(data) + at; });
  }

  void reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k, size_t n) const override {
    if (n == 0) return;
    dispatch_dtype(spec.dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      dispatch_reduce(spec.reduction.kind, [&](auto kind) {
        constexpr ReduceKind K = decltype(kind)::value;
        const auto premul = static_cast<AccOf<T>>(spec.reduction.premul);
        if (spec.codec != Compression::None) {
          if constexpr (std::is_same_v<AccOf<T>, float>) {
            dispatch_codec(spec.codec, [&](auto code) {
              reduce_terms_coded<T, K, typename decltype(code)::type>(spec, stage, out, terms, k, n, premul);
            });
          } else {
            fail(ErrorKind::Internal, "pycomm: compression of a type that does not accumulate in float32");
          }
        } else if (stage == Stage::Final) {
          fold<T, K, true>(spec, out, terms, k, n, premul);
        } else {
          fold<T, K, false>(spec, out, terms, k, n, premul);
        }
      });
    });
  }
};

}  // namespace

uint64_t DeviceOps::hash(const void* data, size_t bytes) const {
  std::vector<unsigned char> host(std::min(bytes, kHashBlock));
  return hash_blocks(bytes, [&](size_t at, size_t n) {
    copy(host.data(), static_cast<const char*>(data) + at, n);
    return host.data();
  });
}

const DeviceOps& cpu_ops() {
  static const CpuOps ops;
  return ops;
}

}  // namespace pycomm
