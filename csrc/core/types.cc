#include "core/types.h"

#include "core/error.h"

namespace pycomm {

void fail_unknown_name(const char* noun, const std::string& text, const std::vector<std::string>& accepted) {
  std::string list;
  for (const std::string& name : accepted) list += (list.empty() ? "" : "|") + name;
  fail(ErrorKind::InvalidArgument, std::string("pycomm: invalid ") + noun + " '" + text + "' (expected " + list + ")");
}

template <>
const EnumTable<DataType>& table_of<DataType>() {
  static const EnumTable<DataType> t{"dtype",
                                     {{DataType::Float32, "float32"},
                                      {DataType::Float64, "float64"},
                                      {DataType::Float16, "float16"},
                                      {DataType::BFloat16, "bfloat16"},
                                      {DataType::Int8, "int8"},
                                      {DataType::UInt8, "uint8"},
                                      {DataType::Int32, "int32"},
                                      {DataType::Int64, "int64"},
                                      {DataType::Bool, "bool"}}};
  return t;
}

template <>
const EnumTable<ReduceKind>& table_of<ReduceKind>() {
  static const EnumTable<ReduceKind> t{"reduce op",
                                       {{ReduceKind::Sum, "sum"},
                                        {ReduceKind::Avg, "avg"},
                                        {ReduceKind::Product, "product"},
                                        {ReduceKind::Min, "min"},
                                        {ReduceKind::Max, "max"},
                                        {ReduceKind::BitAnd, "band"},
                                        {ReduceKind::BitOr, "bor"},
                                        {ReduceKind::BitXor, "bxor"},
                                        {ReduceKind::PremulSum, "premul_sum"}}};
  return t;
}

template <>
const EnumTable<Collective>& table_of<Collective>() {
  static const EnumTable<Collective> t{"collective",
                                       {{Collective::AllReduce, "allreduce"},
                                        {Collective::ReduceScatter, "reduce_scatter"},
                                        {Collective::AllGather, "allgather"},
                                        {Collective::Broadcast, "broadcast"},
                                        {Collective::Reduce, "reduce"},
                                        {Collective::Gather, "gather"},
                                        {Collective::Scatter, "scatter"},
                                        {Collective::AllToAll, "alltoall"},
                                        {Collective::Send, "send"},
                                        {Collective::Recv, "recv"},
                                        {Collective::Barrier, "barrier"}}};
  return t;
}

template <>
const EnumTable<Algorithm>& table_of<Algorithm>() {
  static const EnumTable<Algorithm> t{"algorithm",
                                      {{Algorithm::Auto, "auto"},
                                       {Algorithm::Ring, "ring"},
                                       {Algorithm::Tree, "tree"},
                                       {Algorithm::Hierarchical, "hierarchical"},
                                       {Algorithm::OneShot, "oneshot"},
                                       {Algorithm::TwoShot, "twoshot"}}};
  return t;
}

template <>
const EnumTable<Compression>& table_of<Compression>() {
  static const EnumTable<Compression> t{"compression",
                                        {{Compression::None, "none"},
                                         {Compression::Fp16, "fp16"},
                                         {Compression::Bf16, "bf16"},
                                         {Compression::Fp8E4M3, "fp8_e4m3"},
                                         {Compression::Fp8E5M2, "fp8_e5m2"}}};
  return t;
}

template <>
const EnumTable<Determinism>& table_of<Determinism>() {
  static const EnumTable<Determinism> t{
      "determinism", {{Determinism::Default, "0"}, {Determinism::Ordered, "1"}, {Determinism::Exact, "exact"}}};
  return t;
}

template <>
const EnumTable<Variant>& table_of<Variant>() {
  static const EnumTable<Variant> t{"variant",
                                    {{Variant::Ring, "ring"},
                                     {Variant::DirectRing, "direct+ring"},
                                     {Variant::OneShot, "oneshot"},
                                     {Variant::OneShotFlags, "oneshot-flags"},
                                     {Variant::TwoShot, "twoshot"},
                                     {Variant::Tree, "tree"},
                                     {Variant::Hierarchical, "hierarchical"},
                                     {Variant::Direct, "direct"},
                                     {Variant::Chain, "chain"},
                                     {Variant::Pairwise, "pairwise"},
                                     {Variant::P2P, "p2p"},
                                     {Variant::Dissemination, "dissemination"},
                                     {Variant::RecursiveDoubling, "recursive-doubling"},
                                     {Variant::RecursiveHalving, "recursive-halving"},
                                     {Variant::Bruck, "bruck"},
                                     {Variant::LayeredDirect, "layered-direct"},
                                     {Variant::LayeredPairwise, "layered-pairwise"},
                                     {Variant::LayeredDirectHostGather, "layered-direct+host-gather"},
                                     {Variant::LayeredHierarchical, "layered-hierarchical"},
                                     {Variant::LayeredOneShot, "layered-oneshot"},
                                     {Variant::P2PViaHost, "p2p-via-host"}}};
  return t;
}

size_t element_size(DataType t) {
  switch (t) {
    case DataType::Float64:
    case DataType::Int64:
      return 8;
    case DataType::Float32:
    case DataType::Int32:
      return 4;
    case DataType::Float16:
    case DataType::BFloat16:
      return 2;
    case DataType::Int8:
    case DataType::UInt8:
    case DataType::Bool:
      return 1;
  }
  return 0;
}

DataType accumulation_type(DataType t) {
  switch (t) {
    case DataType::Float16:
    case DataType::BFloat16:
      return DataType::Float32;
    case DataType::Bool:
      return DataType::UInt8;
    default:
      return t;
  }
}

bool reduces(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}

bool has_root(Collective c) {
  return c == Collective::Broadcast || c == Collective::Reduce || c == Collective::Gather || c == Collective::Scatter;
}

bool selects_algorithm(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::AllGather;
}

size_t code_size(Compression c) { return c == Compression::Fp8E4M3 || c == Compression::Fp8E5M2 ? 1 : 2; }

Compression applied_compression(Collective c, DataType t, Compression requested) {
  const bool floating = t == DataType::Float32 || t == DataType::Float16 || t == DataType::BFloat16;
  if (requested == Compression::None || !selects_algorithm(c) || !floating || code_size(requested) >= element_size(t))
    return Compression::None;
  return requested;
}

bool is_floating(DataType t) {
  return t == DataType::Float32 || t == DataType::Float64 || t == DataType::Float16 || t == DataType::BFloat16;
}

Reduction normalized(DataType t, Reduction r) {
  if (t == DataType::Bool) {
    if (r.kind == ReduceKind::Sum) r.kind = ReduceKind::Max;
    if (r.kind == ReduceKind::Product) r.kind = ReduceKind::Min;
  }
  return r;
}

void check_reducible(DataType t, const Reduction& r) {
  const bool bitwise = r.kind == ReduceKind::BitAnd || r.kind == ReduceKind::BitOr || r.kind == ReduceKind::BitXor;
  if (bitwise && is_floating(t))
    fail(ErrorKind::InvalidArgument,
         std::string("pycomm: bitwise reduction ") + name_of(r.kind) + " is not defined for " + name_of(t));
  if ((r.kind == ReduceKind::Avg || r.kind == ReduceKind::PremulSum) && t == DataType::Bool)
    fail(ErrorKind::InvalidArgument, std::string("pycomm: ") + name_of(r.kind) + " is not defined for bool");
  if (r.kind == ReduceKind::PremulSum && !is_floating(t))
    fail(ErrorKind::InvalidArgument, std::string("pycomm: premul_sum needs a floating dtype, got ") + name_of(t));
}

}  // namespace pycomm
