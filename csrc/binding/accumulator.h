// The binned exact sums of core/numerics.h on CPU tensors: the per-element state of
// pycomm.exact_data_parallel's gradient accumulator (an int8 bin index and two float64
// bins per element). Every function checks that its tensors are contiguous, on the CPU,
// of one length and of the dtypes named.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace pycomm {

// Adds each tensor of `terms` (float32, float16 or bfloat16, all of one dtype), element by
// element, into the state (`index` int8, `hi` and `lo` float64): several at once read and
// write the state once. `empty`: the state holds no term yet, and its contents are
// neither read nor need to be initialized (the first terms of a state).
void add_to_bins(at::Tensor& index, at::Tensor& hi, at::Tensor& lo, const std::vector<at::Tensor>& terms, bool empty);

// Shifts the state to the indices `to` (int8, each at least the state's own): the form in
// which states of several ranks add exactly.
void align_bins(at::Tensor& index, at::Tensor& hi, at::Tensor& lo, const at::Tensor& to);

// Adds the state (`other_index`, `other_hi`, `other_lo`) into the state (`index`, `hi`,
// `lo`): both aligned to the larger index, then their bins added (exactly, while the two
// hold at most binned_max_terms() terms together).
void merge_bins(at::Tensor& index, at::Tensor& hi, at::Tensor& lo, const at::Tensor& other_index,
                const at::Tensor& other_hi, const at::Tensor& other_lo);

// out (float32, float16 or bfloat16) = the state's sum / divisor: the sum rounded once to
// float32 where divisor is 1 (or a power of two), else divided in float64 first; NaN is
// the positive quiet NaN.
void value_of_bins(at::Tensor& out, const at::Tensor& hi, const at::Tensor& lo, double divisor);

// How many terms a state adds exactly (kBinnedMaxTerms).
int64_t binned_max_terms();

}  // namespace pycomm
