// Turns a runtime DataType / ReduceKind into a compile-time type / constant, once, so each
// kernel is written once as a template (no per-dtype copies).
#pragma once

#include <type_traits>

#include "core/error.h"
#include "core/numerics.h"
#include "core/types.h"

namespace pycomm {

template <class T>
struct TypeTag {
  using type = T;
};

template <class F>
decltype(auto) dispatch_dtype(DataType t, F&& f) {
  switch (t) {
    case DataType::Float32:
      return f(TypeTag<float>{});
    case DataType::Float64:
      return f(TypeTag<double>{});
    case DataType::Float16:
      return f(TypeTag<Half>{});
    case DataType::BFloat16:
      return f(TypeTag<BFloat16>{});
    case DataType::Int8:
      return f(TypeTag<int8_t>{});
    case DataType::UInt8:
      return f(TypeTag<uint8_t>{});
    case DataType::Int32:
      return f(TypeTag<int32_t>{});
    case DataType::Int64:
      return f(TypeTag<int64_t>{});
    case DataType::Bool:
      return f(TypeTag<Bool8>{});
  }
  fail(ErrorKind::Internal, "pycomm: unknown dtype");
}

template <ReduceKind K>
using KindTag = std::integral_constant<ReduceKind, K>;

template <class F>
decltype(auto) dispatch_reduce(ReduceKind k, F&& f) {
  switch (k) {
    case ReduceKind::Sum:
      return f(KindTag<ReduceKind::Sum>{});
    case ReduceKind::Avg:
      return f(KindTag<ReduceKind::Avg>{});
    case ReduceKind::Product:
      return f(KindTag<ReduceKind::Product>{});
    case ReduceKind::Min:
      return f(KindTag<ReduceKind::Min>{});
    case ReduceKind::Max:
      return f(KindTag<ReduceKind::Max>{});
    case ReduceKind::BitAnd:
      return f(KindTag<ReduceKind::BitAnd>{});
    case ReduceKind::BitOr:
      return f(KindTag<ReduceKind::BitOr>{});
    case ReduceKind::BitXor:
      return f(KindTag<ReduceKind::BitXor>{});
    case ReduceKind::PremulSum:
      return f(KindTag<ReduceKind::PremulSum>{});
  }
  fail(ErrorKind::Internal, "pycomm: unknown reduce op");
}

// Compression::None has no code format and is not dispatched here.
template <class F>
decltype(auto) dispatch_codec(Compression c, F&& f) {
  switch (c) {
    case Compression::Fp16:
      return f(TypeTag<CodeFp16>{});
    case Compression::Bf16:
      return f(TypeTag<CodeBf16>{});
    case Compression::Fp8E4M3:
      return f(TypeTag<CodeFp8E4M3>{});
    case Compression::Fp8E5M2:
      return f(TypeTag<CodeFp8E5M2>{});
    case Compression::None:
      break;
  }
  fail(ErrorKind::Internal, "pycomm: no code format for this compression");
}

// Bytes of n elements encoded with `codec` in blocks of `block` elements.
inline size_t encoded_bytes(Compression codec, size_t block, size_t n) {
  return dispatch_codec(codec, [&](auto tag) { return encoded_size<typename decltype(tag)::type>(n, block); });
}

// The most elements, whole blocks, whose encoding with `codec` fits in `bytes`.
inline size_t encoded_elements_within(Compression codec, size_t block, size_t bytes) {
  return dispatch_codec(codec, [&](auto tag) { return elements_within<typename decltype(tag)::type>(bytes, block); });
}

inline size_t accum_size(DataType t) {
  return dispatch_dtype(t, [](auto tag) { return sizeof(AccOf<typename decltype(tag)::type>); });
}

}  // namespace pycomm
