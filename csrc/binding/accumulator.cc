#include "binding/accumulator.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "binding/tables.h"
#include "core/dispatch.h"

namespace pycomm {
namespace {

constexpr int64_t kGrain = 1 << 15;

void check(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "pycomm: the exact accumulator runs on CPU tensors; ", what, " is on ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "pycomm: exact accumulator: ", what, " must be contiguous");
  TORCH_CHECK_VALUE(t.numel() == n, "pycomm: exact accumulator: ", what, " has ", t.numel(), " elements, not ", n);
}

void check_state(const at::Tensor& index, const at::Tensor& hi, const at::Tensor& lo) {
  const int64_t n = index.numel();
  check(index, n, "the index");
  check(hi, n, "hi");
  check(lo, n, "lo");
  TORCH_CHECK_VALUE(
      index.scalar_type() == at::kChar && hi.scalar_type() == at::kDouble && lo.scalar_type() == at::kDouble,
      "pycomm: exact accumulator: the state is an int8 index and float64 hi and lo");
}

// Calls f(TypeTag<T>) for the float types the accumulator takes.
template <class F>
void dispatch_gradient(at::ScalarType dtype, F&& f) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "pycomm: the exact accumulator takes float32, float16 or bfloat16 gradients, not ", dtype);
  dispatch_dtype(to_core(dtype), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<AccOf<T>, float>) f(tag);
  });
}

// x86-64's baseline (SSE2) cannot vectorize these loops' mix of int8, int32 and double
// lanes; an AVX2 clone does, chosen when the library loads.
#if defined(__x86_64__) && defined(__GNUC__)
#define PYCOMM_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PYCOMM_VECTOR_CLONES
#endif

constexpr int64_t kRun = 256;

// Adds the terms x[0..count) at element k, one by one (binned_add: any term, NaN and
// infinities included). `empty`: the state holds no term yet.
template <class T>
void add_one_by_one(const T* const* x, int count, int8_t* i, double* h, double* l, int64_t k, bool empty) {
  int8_t index = empty ? kNoBin : i[k];
  double hi = empty ? 0.0 : h[k], lo = empty ? 0.0 : l[k];
  for (int j = 0; j < count; ++j) binned_add(index, hi, lo, Numeric<T>::load(x[j][k]));
  i[k] = index, h[k] = hi, l[k] = lo;
}

// binned_add of `count` terms into elements [begin, end), in runs of kRun elements. A run
// whose terms are all finite is added in passes: the run's new indices (the largest bin
// of the state and its terms), the state aligned to them once, then each term added within
// its bins (binned_add_within, with the bins' units computed once). This gives
// binned_add's bits, since a state depends only on the multiset of its terms; each pass
// vectorizes, and the state is read and written once for all the terms. The terms are
// added in the bins' units (the run's bins as integers: q = x / 2^(32 I) exactly, its
// integer part into hi, the next 32 bits into lo), scaled back once: every step is exact,
// as in binned_add_within. std::trunc in place of trunc_small: the same integer (or -0.0
// for +0.0, which changes no bin), and one instruction where vectorized.
template <class T, bool empty>
PYCOMM_VECTOR_CLONES void add_runs(const T* const* x, int count, int8_t* i, double* h, double* l, int64_t begin,
                                   int64_t end) {
  int32_t from[kRun], to[kRun];
  double hi[kRun], lo[kRun], down[kRun], up[kRun];
  for (int64_t run = begin; run < end; run += kRun) {
    const int64_t len = std::min(end - run, kRun);
    int32_t largest = 0;
    for (int64_t k = 0; k < len; ++k) from[k] = to[k] = empty ? kNoBin : i[run + k];
    for (int j = 0; j < count; ++j) {
      const T* t = x[j] + run;
      for (int64_t k = 0; k < len; ++k) {
        const int32_t a = magnitude_bits(Numeric<T>::load(t[k]));
        largest = std::max(largest, a);
        to[k] = std::max(to[k], a != 0 ? bin_of_magnitude(a) : int32_t{kNoBin});
      }
    }
    if (nonfinite_magnitude(largest)) {
      for (int64_t k = run; k < run + len; ++k) add_one_by_one(x, count, i, h, l, k, empty);
      continue;
    }
    for (int64_t k = 0; k < len; ++k) {
      hi[k] = empty ? 0.0 : h[run + k], lo[k] = empty ? 0.0 : l[run + k];
      binned_raise(to[k] - from[k], hi[k], lo[k]);
      const int32_t b = to[k] == kNoBin ? 0 : to[k];  // no bin: every term is 0, any finite unit will do
      down[k] = bin_unit(-b), up[k] = bin_unit(b);
      hi[k] *= down[k], lo[k] *= down[k] * 0x1p32;  // a non-finite hi stays itself
    }
    for (int j = 0; j < count; ++j) {
      const T* t = x[j] + run;
      for (int64_t k = 0; k < len; ++k) {  // binned_add_within, in units
        const double q = Numeric<T>::load(t[k]) * down[k];
        const double top = std::trunc(q);
        hi[k] += top;
        lo[k] += std::trunc((q - top) * 0x1p32);
      }
    }
    for (int64_t k = 0; k < len; ++k)
      i[run + k] = static_cast<int8_t>(to[k]), h[run + k] = hi[k] * up[k], l[run + k] = lo[k] * (up[k] * 0x1p-32);
  }
}

PYCOMM_VECTOR_CLONES bool same_indices(const int8_t* a, const int8_t* b, int64_t n) {
  int8_t differ = 0;
  for (int64_t k = 0; k < n; ++k) differ |= a[k] ^ b[k];
  return differ == 0;
}

// The states' values / divisor, rounded once (float32, then T as value_of_bins says).
template <class T>
PYCOMM_VECTOR_CLONES void value_runs(T* o, const double* h, const double* l, int64_t begin, int64_t end,
                                     double divisor) {
  for (int64_t k = begin; k < end; ++k) {
    const double sum = binned_value(h[k], l[k]);
    o[k] = Numeric<T>::store(sum != sum ? exact_nonfinite<float>(1u) : static_cast<float>(sum / divisor));
  }
}

}  // namespace

int64_t binned_max_terms() { return kBinnedMaxTerms; }

void add_to_bins(at::Tensor& index, at::Tensor& hi, at::Tensor& lo, const std::vector<at::Tensor>& terms, bool empty) {
  check_state(index, hi, lo);
  TORCH_CHECK_VALUE(!terms.empty() || !empty, "pycomm: exact accumulator: an empty state needs at least one term");
  if (terms.empty()) return;
  for (const auto& t : terms) {
    check(t, index.numel(), "a gradient");
    TORCH_CHECK_VALUE(t.scalar_type() == terms[0].scalar_type(),
                      "pycomm: exact accumulator: the gradients added "
                      "together are of one dtype, not ",
                      terms[0].scalar_type(), " and ", t.scalar_type());
  }
  dispatch_gradient(terms[0].scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::vector<const T*> x;
    for (const auto& t : terms) x.push_back(static_cast<const T*>(t.data_ptr()));
    int8_t* i = index.data_ptr<int8_t>();
    double *h = hi.data_ptr<double>(), *l = lo.data_ptr<double>();
    at::parallel_for(0, index.numel(), kGrain, [&](int64_t begin, int64_t end) {
      const int count = static_cast<int>(x.size());
      empty ? add_runs<T, true>(x.data(), count, i, h, l, begin, end)
            : add_runs<T, false>(x.data(), count, i, h, l, begin, end);
    });
  });
}

void align_bins(at::Tensor& index, at::Tensor& hi, at::Tensor& lo, const at::Tensor& to) {
  check_state(index, hi, lo);
  check(to, index.numel(), "the target index");
  TORCH_CHECK_VALUE(to.scalar_type() == at::kChar, "pycomm: exact accumulator: the target index is int8");
  const int8_t* t = to.data_ptr<int8_t>();
  int8_t* i = index.data_ptr<int8_t>();
  double *h = hi.data_ptr<double>(), *l = lo.data_ptr<double>();
  at::parallel_for(0, index.numel(), kGrain, [&](int64_t begin, int64_t end) {
    // Most elements have their bin on every rank (a bin spans 32 binades): where nothing
    // rises, the state is neither read nor written.
    for (int64_t run = begin; run < end; run += kRun) {
      const int64_t stop = std::min(end, run + kRun);
      if (same_indices(i + run, t + run, stop - run)) continue;
      for (int64_t k = run; k < stop; ++k) {
        TORCH_CHECK_VALUE(t[k] >= i[k], "pycomm: exact accumulator: a state cannot be aligned to a lower bin");
        pycomm::binned_align(i[k], h[k], l[k], t[k]);
      }
    }
  });
}

void merge_bins(at::Tensor& index, at::Tensor& hi, at::Tensor& lo, const at::Tensor& other_index,
                const at::Tensor& other_hi, const at::Tensor& other_lo) {
  check_state(index, hi, lo);
  check_state(other_index, other_hi, other_lo);
  check(other_index, index.numel(), "the other state");
  int8_t* i = index.data_ptr<int8_t>();
  double *h = hi.data_ptr<double>(), *l = lo.data_ptr<double>();
  const int8_t* oi = other_index.data_ptr<int8_t>();
  const double *oh = other_hi.data_ptr<double>(), *ol = other_lo.data_ptr<double>();
  at::parallel_for(0, index.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      int8_t theirs = oi[k];
      double their_hi = oh[k], their_lo = ol[k];
      const int8_t to = std::max(i[k], theirs);
      pycomm::binned_align(i[k], h[k], l[k], to);
      pycomm::binned_align(theirs, their_hi, their_lo, to);
      h[k] += their_hi;
      l[k] += their_lo;
    }
  });
}

void value_of_bins(at::Tensor& out, const at::Tensor& hi, const at::Tensor& lo, double divisor) {
  const int64_t n = out.numel();
  check(out, n, "the output");
  check(hi, n, "hi");
  check(lo, n, "lo");
  TORCH_CHECK_VALUE(hi.scalar_type() == at::kDouble && lo.scalar_type() == at::kDouble,
                    "pycomm: exact accumulator: hi and lo are float64");
  TORCH_CHECK_VALUE(divisor > 0, "pycomm: exact accumulator: divisor ", divisor, " is not positive");
  dispatch_gradient(out.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data_ptr());
    const double *h = hi.data_ptr<double>(), *l = lo.data_ptr<double>();
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { value_runs<T>(o, h, l, begin, end, divisor); });
  });
}

}  // namespace pycomm
