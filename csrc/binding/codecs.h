// The wire codecs on whole tensors, for Python: what compression does to a contribution
// (pycomm.quantize), the bytes it sends (pycomm.encode) and their values (pycomm.decode).
// They run the same block code as the collectives, so a test of these is a test of those.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

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
// The group's default block (PYCOMM_COMPRESSION_BLOCK).
int64_t default_compression_block();

}  // namespace pycomm
