// The sparse (COO) SUM all-reduce, as Gloo serves it, in ATen on the host: built on a
// gather of host tensors across the group and the dense all-reduce's fold.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace pycomm {

// Every rank's `mine` (host memory, of equal sizes on every rank) as rows of one tensor,
// in rank order; every rank of the group calls it alike.
using GatherHost = std::function<at::Tensor(const at::Tensor& mine)>;

// The sum of every rank's `input` over a group of `world_size` ranks, as a coalesced
// sparse tensor on `input`'s device (`exact`: exact mode's sum). Every rank calls it
// alike, with tensors of one shape (sizes, numbers of sparse and dense dimensions), which
// it checks.
at::Tensor sparse_sum(const at::Tensor& input, int64_t world_size, bool exact, const GatherHost& gather);

}  // namespace pycomm
