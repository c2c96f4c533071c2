// Translations between torch and core types, and of core errors into torch exceptions.
#pragma once

#include <c10/core/ScalarType.h>

#include "core/error.h"
#include "core/types.h"

// Declared only: the binding's units that merely pass a ReduceOp on stay out of
// torch/csrc/distributed/c10d/Types.hpp (with ATen/ATen.h, most of a unit's compile time).
namespace c10d {
struct ReduceOp;
}  // namespace c10d

namespace pycomm {

DataType to_core(at::ScalarType t);               // ValueError for unsupported dtypes
Reduction to_core(const c10d::ReduceOp& op);      // ValueError for unsupported ops

// Rethrows `e` as the exception torch users expect: ValueError for bad input,
// DistBackendError for failures of communication.
[[noreturn]] void rethrow_for_torch(const Error& e);
std::exception_ptr torch_exception(const Error& e);

// Runs `f` at the binding's edge, where Python calls in: a core Error leaves as the
// exception torch users expect (rethrow_for_torch).
template <class F>
auto guard(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    rethrow_for_torch(e);
  }
}

}  // namespace pycomm
