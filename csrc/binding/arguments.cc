#include "binding/arguments.h"

#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/Types.hpp>

#include "binding/tables.h"
#include "runtime/device_runtime.h"

namespace pycomm {

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), "pycomm: ", op, ": undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "pycomm: ", op,
                    " expects CPU or CUDA tensors, got a tensor on ", t.device());
  TORCH_CHECK_VALUE(t.device().is_cpu() || has_device_runtime(), "pycomm: ", op, ": ", kNoCudaBuild);
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "pycomm: ", op, " expects dense tensors, got layout ", t.layout());
  to_core(t.scalar_type());
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "pycomm: ", op, " takes exactly one tensor per call, got ", tensors.size());
  check_tensor(tensors[0], op);
  return tensors[0];
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* op) {
  check_tensor(a, op);
  check_tensor(b, op);
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "pycomm: ", op, ": dtypes differ (", a.scalar_type(), " vs ",
                    b.scalar_type(), ")");
}

void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, size_t n, const char* op) {
  TORCH_CHECK_VALUE(list.size() == n, "pycomm: ", op, ": expected a list of ", n, " tensors (one per rank), got ",
                    list.size());
  for (const auto& t : list) {
    check_same(t, like, op);
    TORCH_CHECK_VALUE(t.numel() == like.numel(), "pycomm: ", op, ": every tensor in the list must have ", like.numel(),
                      " elements, got ", t.numel());
  }
}

const std::vector<at::Tensor>* root_list(const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& like,
                                         bool root, size_t n, const char* op, const char* what) {
  if (!root) {
    TORCH_CHECK_VALUE(lists.empty() || (lists.size() == 1 && lists[0].empty()), "pycomm: ", op,
                      ": only the root passes ", what, " tensors");
    return nullptr;
  }
  TORCH_CHECK_VALUE(lists.size() == 1, "pycomm: ", op, ": the root takes one ", what, " list, got ", lists.size());
  check_list(lists[0], like, n, op);
  return &lists[0];
}

std::chrono::milliseconds op_timeout(std::chrono::milliseconds t) {
  return t == c10d::kUnsetTimeout ? std::chrono::milliseconds(0) : t;
}

Request tensor_request(Collective c, const at::Tensor& t, std::chrono::milliseconds timeout,
                       const CallOptions& options) {
  Request rq;
  rq.collective = c;
  rq.dtype = to_core(t.scalar_type());
  rq.options = options;
  rq.timeout = op_timeout(timeout);
  rq.device = t.is_cuda() ? t.get_device() : -1;
  return rq;
}

}  // namespace pycomm
