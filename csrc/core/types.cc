#include "types.h"

#include "error.h"

namespace pycomm {

size_t element_size(DataType t) {
  switch (t) {
    case DataType::Float64: case DataType::Int64: return 8;
    case DataType::Float32: case DataType::Int32: return 4;
    case DataType::Float16: case DataType::BFloat16: return 2;
    case DataType::Int8: case DataType::UInt8: case DataType::Bool: return 1;
  }
  return 0;
}

DataType accumulation_type(DataType t) {
  switch (t) {
    case DataType::Float16: case DataType::BFloat16: return DataType::Float32;
    case DataType::Bool: return DataType::UInt8;
    default: return t;
  }
}

const char* name_of(DataType t) {
  switch (t) {
    case DataType::Float32: return "float32";
    case DataType::Float64: return "float64";
    case DataType::Float16: return "float16";
    case DataType::BFloat16: return "bfloat16";
    case DataType::Int8: return "int8";
    case DataType::UInt8: return "uint8";
    case DataType::Int32: return "int32";
    case DataType::Int64: return "int64";
    case DataType::Bool: return "bool";
  }
  return "?";
}

const char* name_of(ReduceKind k) {
  switch (k) {
    case ReduceKind::Sum: return "sum";
    case ReduceKind::Avg: return "avg";
    case ReduceKind::Product: return "product";
    case ReduceKind::Min: return "min";
    case ReduceKind::Max: return "max";
    case ReduceKind::BitAnd: return "band";
    case ReduceKind::BitOr: return "bor";
    case ReduceKind::BitXor: return "bxor";
    case ReduceKind::PremulSum: return "premul_sum";
  }
  return "?";
}

const char* name_of(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "allreduce";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::AllGather: return "allgather";
    case Collective::Broadcast: return "broadcast";
    case Collective::Reduce: return "reduce";
    case Collective::Gather: return "gather";
    case Collective::Scatter: return "scatter";
    case Collective::AllToAll: return "alltoall";
    case Collective::Send: return "send";
    case Collective::Recv: return "recv";
    case Collective::Barrier: return "barrier";
  }
  return "?";
}

bool reduces(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}

bool has_root(Collective c) {
  return c == Collective::Broadcast || c == Collective::Reduce || c == Collective::Gather ||
         c == Collective::Scatter;
}

bool selects_algorithm(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::AllGather;
}

const char* name_of(Compression c) {
  switch (c) {
    case Compression::None: return "none";
    case Compression::Fp16: return "fp16";
    case Compression::Bf16: return "bf16";
    case Compression::Fp8E4M3: return "fp8_e4m3";
    case Compression::Fp8E5M2: return "fp8_e5m2";
  }
  return "?";
}

size_t code_size(Compression c) {
  return c == Compression::Fp8E4M3 || c == Compression::Fp8E5M2 ? 1 : 2;
}

Compression applied_compression(Collective c, DataType t, Compression requested) {
  const bool floating = t == DataType::Float32 || t == DataType::Float16 || t == DataType::BFloat16;
  if (requested == Compression::None || !selects_algorithm(c) || !floating || code_size(requested) >= element_size(t))
    return Compression::None;
  return requested;
}

const char* name_of(Algorithm a) {
  switch (a) {
    case Algorithm::Auto: return "auto";
    case Algorithm::Ring: return "ring";
    case Algorithm::Tree: return "tree";
    case Algorithm::Hierarchical: return "hierarchical";
    case Algorithm::OneShot: return "oneshot";
    case Algorithm::TwoShot: return "twoshot";
  }
  return "?";
}

bool is_floating(DataType t) {
  return t == DataType::Float32 || t == DataType::Float64 || t == DataType::Float16 ||
         t == DataType::BFloat16;
}

void check_reducible(DataType t, const Reduction& r) {
  const bool bitwise = r.kind == ReduceKind::BitAnd || r.kind == ReduceKind::BitOr ||
                       r.kind == ReduceKind::BitXor;
  if (bitwise && is_floating(t))
    fail(ErrorKind::InvalidArgument, std::string("pycomm: bitwise reduction ") + name_of(r.kind) +
                                         " is not defined for " + name_of(t));
  if ((r.kind == ReduceKind::Avg || r.kind == ReduceKind::PremulSum) && t == DataType::Bool)
    fail(ErrorKind::InvalidArgument,
         std::string("pycomm: ") + name_of(r.kind) + " is not defined for bool");
  if (r.kind == ReduceKind::PremulSum && !is_floating(t))
    fail(ErrorKind::InvalidArgument,
         std::string("pycomm: premul_sum needs a floating dtype, got ") + name_of(t));
}

namespace {
template <class E, size_t N>
E parse_enum(const std::string& s, const char* knob, const std::pair<const char*, E> (&table)[N]) {
  std::string accepted;
  for (const auto& [name, value] : table) {
    if (s == name) return value;
    accepted += accepted.empty() ? name : std::string("|") + name;
  }
  fail(ErrorKind::InvalidArgument,
       std::string("pycomm: invalid ") + knob + " '" + s + "' (expected " + accepted + ")");
}
}  // namespace

Algorithm parse_algorithm(const std::string& s) {
  static const std::pair<const char*, Algorithm> table[] = {
      {"auto", Algorithm::Auto}, {"ring", Algorithm::Ring}, {"tree", Algorithm::Tree},
      {"hierarchical", Algorithm::Hierarchical}, {"oneshot", Algorithm::OneShot},
      {"twoshot", Algorithm::TwoShot}};
  return parse_enum(s, "algorithm", table);
}

Compression parse_compression(const std::string& s) {
  static const std::pair<const char*, Compression> table[] = {
      {"none", Compression::None}, {"fp16", Compression::Fp16}, {"bf16", Compression::Bf16},
      {"fp8_e4m3", Compression::Fp8E4M3}, {"fp8_e5m2", Compression::Fp8E5M2}};
  return parse_enum(s, "compression", table);
}

Determinism parse_determinism(const std::string& s) {
  static const std::pair<const char*, Determinism> table[] = {
      {"0", Determinism::Default}, {"1", Determinism::Ordered}, {"exact", Determinism::Exact}};
  return parse_enum(s, "determinism", table);
}

const char* name_of(Determinism d) {
  switch (d) {
    case Determinism::Default: return "0";
    case Determinism::Ordered: return "1";
    case Determinism::Exact: return "exact";
  }
  return "?";
}

}  // namespace pycomm
