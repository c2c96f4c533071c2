#include "binding/tables.h"

#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/Types.hpp>

namespace pycomm {

DataType to_core(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DataType::Float32;
    case at::kDouble:
      return DataType::Float64;
    case at::kHalf:
      return DataType::Float16;
    case at::kBFloat16:
      return DataType::BFloat16;
    case at::kChar:
      return DataType::Int8;
    case at::kByte:
      return DataType::UInt8;
    case at::kInt:
      return DataType::Int32;
    case at::kLong:
      return DataType::Int64;
    case at::kBool:
      return DataType::Bool;
    default:
      C10_THROW_ERROR(ValueError,
                      std::string("pycomm: unsupported dtype ") + c10::toString(t) +
                          " (supported: float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool)");
  }
}

Reduction to_core(const c10d::ReduceOp& op) {
  Reduction r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      r.kind = ReduceKind::Sum;
      break;
    case c10d::ReduceOp::AVG:
      r.kind = ReduceKind::Avg;
      break;
    case c10d::ReduceOp::PRODUCT:
      r.kind = ReduceKind::Product;
      break;
    case c10d::ReduceOp::MIN:
      r.kind = ReduceKind::Min;
      break;
    case c10d::ReduceOp::MAX:
      r.kind = ReduceKind::Max;
      break;
    case c10d::ReduceOp::BAND:
      r.kind = ReduceKind::BitAnd;
      break;
    case c10d::ReduceOp::BOR:
      r.kind = ReduceKind::BitOr;
      break;
    case c10d::ReduceOp::BXOR:
      r.kind = ReduceKind::BitXor;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      r.kind = ReduceKind::PremulSum;
      const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      if (!s) C10_THROW_ERROR(ValueError, "pycomm: PREMUL_SUM without its factor");
      r.premul = s->tensor_factor.defined() ? s->tensor_factor.to(at::kCPU).item<double>() : s->double_factor;
      break;
    }
    default:
      C10_THROW_ERROR(ValueError, "pycomm: unsupported reduce op " + std::to_string(static_cast<int>(op.op_)));
  }
  return r;
}

std::exception_ptr torch_exception(const Error& e) {
  try {
    rethrow_for_torch(e);
  } catch (...) {
    return std::current_exception();
  }
}

void rethrow_for_torch(const Error& e) {
  if (e.kind() == ErrorKind::InvalidArgument) C10_THROW_ERROR(ValueError, e.what());
  C10_THROW_ERROR(DistBackendError, e.what());
}

}  // namespace pycomm
