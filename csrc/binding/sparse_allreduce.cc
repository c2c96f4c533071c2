#include "binding/sparse_allreduce.h"

#include <ATen/ops/_sparse_coo_tensor_unsafe.h>
#include <ATen/ops/_unique2.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <tuple>
#include <vector>

#include "binding/codecs.h"

namespace pycomm {

// Every rank's coalesced indices and values are gathered, padded to the largest count of
// entries, and each index present on any rank is folded over the ranks in rank order by
// the dense all-reduce's own fold (reduce_tensors: 16-bit values accumulate in fp32; the
// exact sum in exact mode), a rank without the index contributing -0.0, the sum's
// identity. Every rank computes the same fold of the same data: identical bits on every
// rank in every mode, the exact mode's independent of the ranks' order and number too.
at::Tensor sparse_sum(const at::Tensor& input, int64_t world_size, bool exact, const GatherHost& gather) {
  const at::Tensor local = input.coalesce().cpu();
  const int64_t sparse_dim = local.sparse_dim(), nnz = local._nnz(), n = world_size;
  std::vector<int64_t> shape = {sparse_dim, local.dense_dim()};
  shape.insert(shape.end(), local.sizes().begin(), local.sizes().end());
  std::vector<int64_t> meta = {nnz};
  meta.insert(meta.end(), shape.begin(), shape.end());
  // The ranks' counts of entries and shapes; a rank whose tensor has another number of
  // dimensions gathers another count, which the operation's stamp reports as a mismatch.
  const at::Tensor metas = gather(at::tensor(meta, at::kLong));
  const auto shape_of = [&](int64_t r) { return metas[r].narrow(0, 1, static_cast<int64_t>(shape.size())); };
  for (int64_t r = 1; r < n; ++r)
    TORCH_CHECK_VALUE(at::equal(shape_of(r), shape_of(0)), "pycomm: sparse all-reduce: rank ", r,
                      " has a tensor of (sparse dims, dense dims, sizes) ", shape_of(r), ", rank 0 ", shape_of(0));
  const at::Tensor counts_tensor = metas.select(1, 0).contiguous();
  const std::vector<int64_t> counts(counts_tensor.data_ptr<int64_t>(), counts_tensor.data_ptr<int64_t>() + n);
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<int64_t> padded_values_shape = local._values().sizes().vec();
  padded_values_shape[0] = most;
  at::Tensor indices = at::zeros({sparse_dim, most}, at::kLong);
  at::Tensor values = at::zeros(padded_values_shape, local._values().options());
  indices.narrow(1, 0, nnz).copy_(local._indices());
  values.narrow(0, 0, nnz).copy_(local._values());
  const at::Tensor all_indices = gather(indices).view({n, sparse_dim, most});
  std::vector<int64_t> all_values_shape = padded_values_shape;
  all_values_shape.insert(all_values_shape.begin(), n);
  const at::Tensor all_values = gather(values).view(all_values_shape);

  // The union of the ranks' indices, sorted, and where each rank's entries fall in it:
  // an index is its row-major position within the sparse dimensions.
  const at::Tensor sparse_sizes = at::tensor(local.sizes().slice(0, sparse_dim).vec(), at::kLong).unsqueeze(1);
  at::Tensor strides = at::ones({sparse_dim, 1}, at::kLong);
  for (int64_t d = sparse_dim - 2; d >= 0; --d) strides[d] = strides[d + 1].mul(sparse_sizes[d + 1]);
  std::vector<at::Tensor> linear;
  for (int64_t r = 0; r < n; ++r) linear.push_back(all_indices[r].narrow(1, 0, counts[r]).mul(strides).sum(0));
  at::Tensor unique, position;
  std::tie(unique, position, std::ignore) = at::_unique2(at::cat(linear), /*sorted=*/true, /*return_inverse=*/true);
  std::vector<int64_t> term_shape = padded_values_shape;
  term_shape[0] = unique.numel();
  const bool floating = at::isFloatingType(local.scalar_type());
  std::vector<at::Tensor> terms;
  int64_t offset = 0;
  for (int64_t r = 0; r < n; ++r) {
    terms.push_back(at::full(term_shape, floating ? -0.0 : 0.0, local._values().options()));
    terms.back().index_copy_(0, position.narrow(0, offset, counts[r]), all_values[r].narrow(0, 0, counts[r]));
    offset += counts[r];
  }
  const at::Tensor sum = reduce_tensors(terms, c10d::ReduceOp::SUM, n, exact, std::nullopt).view(term_shape);
  const at::Tensor unique_indices = unique.unsqueeze(0).div(strides, "floor").remainder(sparse_sizes);
  return at::_sparse_coo_tensor_unsafe(unique_indices, sum, local.sizes(), local.options())
      ._coalesced_(true)
      .to(input.device());
}

}  // namespace pycomm
