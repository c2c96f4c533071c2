// Torch's arguments to a collective: the checks every operation makes of its tensors
// (ValueError naming the operation `op`), and their translation into a core Request.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
#include <vector>

#include "core/request.h"
#include "core/types.h"

namespace pycomm {

// A dense (strided) tensor of a supported dtype on the CPU, or on CUDA in a CUDA build.
void check_tensor(const at::Tensor& t, const char* op);
// The one tensor of `tensors`, checked.
const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op);
// Both checked, and of one dtype.
void check_same(const at::Tensor& a, const at::Tensor& b, const char* op);
// `n` tensors, each like `like` (dtype and number of elements).
void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, size_t n, const char* op);
// The root's list of a gather's outputs or a scatter's inputs (`lists` holds one, of a
// tensor per rank, each like `like`); null on the other ranks, which must pass none.
const std::vector<at::Tensor>* root_list(const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& like,
                                         bool root, size_t n, const char* op, const char* what);

// A Request's timeout for torch's: an unset one is 0, the group's timeout.
std::chrono::milliseconds op_timeout(std::chrono::milliseconds t);
// A request of `c` on `t`'s dtype and device, with `options` and torch's `timeout`; its
// buffers, count and the collective's own fields are the caller's to fill in.
Request tensor_request(Collective c, const at::Tensor& t, std::chrono::milliseconds timeout,
                       const CallOptions& options);

}  // namespace pycomm
