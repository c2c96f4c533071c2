// The wire codecs on whole tensors, for Python: what compression does to a contribution
// (pycomm.quantize), the bytes it sends (pycomm.encode) and their values (pycomm.decode);
// and the reduction itself (pycomm._C.reduce, for tests and benchmarks of the kernels).
// They run the device ops of the tensor's device (CPU or CUDA), the code the collectives
// run, so a test of these is a test of those.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "binding/tables.h"

namespace pycomm {

// `t` (float32, float16 or bfloat16, any shape) encoded as a flat uint8 tensor of
// blocks [fp32 scale][codes], blocks starting at element 0 of the flattened tensor;
// written into `out` when given (contiguous uint8 of the encoded size).
at::Tensor encode_tensor(const at::Tensor& t, const std::string& codec, int64_t block,
                         const std::optional<at::Tensor>& out);
// The values of `encoded` (from encode_tensor with the same codec and block) as a flat
// tensor of `numel` elements of `dtype`; written into `out` when given (contiguous, of
// that dtype and numel).
at::Tensor decode_tensor(const at::Tensor& encoded, const std::string& codec, int64_t block, int64_t numel,
                         at::ScalarType dtype, const std::optional<at::Tensor>& out);
// Element-wise reduction of `terms` (each a rank's contribution: PREMUL_SUM scales each,
// AVG divides by `world_size`), folded in the order given, or exactly (`exact`: exact
// mode's sum); into `out` when given.
at::Tensor reduce_tensors(const std::vector<at::Tensor>& terms, const c10d::ReduceOp& op, int64_t world_size,
                          bool exact, const std::optional<at::Tensor>& out);
// The group's default block (PYCOMM_COMPRESSION_BLOCK).
int64_t default_compression_block();

}  // namespace pycomm
