#include "binding/accumulator.h"

#include <algorithm>

#include <ATen/Parallel.h>

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
  TORCH_CHECK_VALUE(index.scalar_type() == at::kChar && hi.scalar_type() == at::kDouble &&
                        lo.scalar_type() == at::kDouble,
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

// x86-64's baseline (SSE2) cannot vectorize binned_add_finite's mix of int8 and double
// lanes; an AVX2 clone does, chosen when the library loads (the pass then runs at the
// memory's rate: 38 bytes per term).
#if defined(__x86_64__) && defined(__GNUC__)
#define PYCOMM_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PYCOMM_VECTOR_CLONES
#endif

// binned_add of terms [begin, end): runs of kRun finite terms without a branch per term.
// kEmpty: the state holds no term yet, and is written without being read.
template <class T, bool kEmpty, bool kFinite>
inline void add_term(const T* x, int8_t* i, double* h, double* l, int64_t k) {
  int8_t index = kEmpty ? kNoBin : i[k];
  double hi = kEmpty ? 0.0 : h[k], lo = kEmpty ? 0.0 : l[k];
  if constexpr (kFinite)
    binned_add_finite(index, hi, lo, Numeric<T>::load(x[k]));
  else
    binned_add(index, hi, lo, Numeric<T>::load(x[k]));
  i[k] = index, h[k] = hi, l[k] = lo;
}

template <class T, bool kEmpty>
PYCOMM_VECTOR_CLONES void add_terms(const T* x, int8_t* i, double* h, double* l, int64_t begin, int64_t end) {
  constexpr int64_t kRun = 256;
  for (int64_t run = begin; run < end; run += kRun) {
    const int64_t stop = std::min(end, run + kRun);
    int32_t largest = 0;
    for (int64_t k = run; k < stop; ++k) largest = std::max(largest, magnitude_bits(Numeric<T>::load(x[k])));
    if (!nonfinite_magnitude(largest))
      for (int64_t k = run; k < stop; ++k) add_term<T, kEmpty, true>(x, i, h, l, k);
    else
      for (int64_t k = run; k < stop; ++k) add_term<T, kEmpty, false>(x, i, h, l, k);
  }
}

}  // namespace

int64_t binned_max_terms() { return kBinnedMaxTerms; }

void add_to_bins(at::Tensor& index, at::Tensor& hi, at::Tensor& lo, const at::Tensor& terms, bool empty) {
  check_state(index, hi, lo);
  check(terms, index.numel(), "the gradient");
  dispatch_gradient(terms.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(terms.data_ptr());
    int8_t* i = index.data_ptr<int8_t>();
    double *h = hi.data_ptr<double>(), *l = lo.data_ptr<double>();
    at::parallel_for(0, index.numel(), kGrain, [&](int64_t begin, int64_t end) {
      if (empty)
        add_terms<T, true>(x, i, h, l, begin, end);
      else
        add_terms<T, false>(x, i, h, l, begin, end);
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
    for (int64_t k = begin; k < end; ++k) {
      TORCH_CHECK_VALUE(t[k] >= i[k], "pycomm: exact accumulator: a state cannot be aligned to a lower bin");
      pycomm::binned_align(i[k], h[k], l[k], t[k]);
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
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const double sum = pycomm::binned_value(h[k], l[k]);
        const float v = sum != sum ? exact_nonfinite<float>(1u) : static_cast<float>(sum / divisor);
        o[k] = Numeric<T>::store(v);
      }
    });
  });
}

}  // namespace pycomm
