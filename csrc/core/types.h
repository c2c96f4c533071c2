// Data types, reduce ops and per-call options of the torch-free core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pycomm {

// Every enum's strings live in one table, defined beside the enum's other code
// (table_of<E>()); names, parsing, error messages and the vocabularies Python reads all
// come from it.
template <class E>
struct EnumTable {
  const char* noun;                                  // "algorithm": for error messages
  std::vector<std::pair<E, const char*>> entries;    // in the order messages list them
};
template <class E>
const EnumTable<E>& table_of();

template <class E>
const char* name_of(E value) {
  for (const auto& [e, name] : table_of<E>().entries)
    if (e == value) return name;
  return "?";
}
template <class E>
std::vector<std::string> names() {
  std::vector<std::string> out;
  for (const auto& entry : table_of<E>().entries) out.push_back(entry.second);
  return out;
}
// "invalid <noun> '<text>' (expected a|b|c)" as an InvalidArgument error.
[[noreturn]] void fail_unknown_name(const char* noun, const std::string& text,
                                    const std::vector<std::string>& accepted);
template <class E>
E parse(const std::string& text) {
  for (const auto& [e, name] : table_of<E>().entries)
    if (text == name) return e;
  fail_unknown_name(table_of<E>().noun, text, names<E>());
}

enum class DataType : uint8_t {
  Float32,
  Float64,
  Float16,
  BFloat16,
  Int8,
  UInt8,
  Int32,
  Int64,
  Bool,
};

enum class Collective : uint8_t {
  AllReduce,
  ReduceScatter,
  AllGather,
  Broadcast,
  Reduce,
  Gather,
  Scatter,
  AllToAll,
  Send,
  Recv,
  Barrier,
};
// The classes of collectives the core treats alike.
bool reduces(Collective c);            // AllReduce, ReduceScatter, Reduce: take a reduce op
bool has_root(Collective c);           // Broadcast, Reduce, Gather, Scatter
bool selects_algorithm(Collective c);  // AllReduce, ReduceScatter, AllGather: several algorithms, compression

enum class ReduceKind : uint8_t { Sum, Avg, Product, Min, Max, BitAnd, BitOr, BitXor, PremulSum };

// A reduction as the core executes it. PremulSum carries its factor; Avg divides by the
// world size once, when the final value is rounded.
struct Reduction {
  ReduceKind kind = ReduceKind::Sum;
  double premul = 1.0;
};

size_t element_size(DataType t);
// The type partial results are kept in (AccOf in numerics.h): float32 for 16-bit floats,
// uint8 for bool, the type itself otherwise.
DataType accumulation_type(DataType t);
bool is_floating(DataType t);

// Throws pycomm::InvalidArgument when `t` cannot be reduced with `r` (e.g. AVG on bool,
// bitwise ops on floats). Bool reductions are logical: SUM/MAX = OR, PRODUCT/MIN = AND.
void check_reducible(DataType t, const Reduction& r);
// The reduction as the core runs it: bool's logical ones as MAX (or) and MIN (and).
Reduction normalized(DataType t, Reduction r);

// What the caller may choose per group (environment) or per call. Fields later issues
// give meaning to (compression, determinism) are carried from the start so the request
// path does not change shape.
enum class Algorithm : uint8_t { Auto, Ring, Tree, Hierarchical, OneShot, TwoShot };
enum class Compression : uint8_t { None, Fp16, Bf16, Fp8E4M3, Fp8E5M2 };
enum class Determinism : uint8_t { Default, Ordered, Exact };

struct CallOptions {
  Algorithm algorithm = Algorithm::Auto;
  Compression compression = Compression::None;  // None wherever it would not apply
  size_t compression_block = 0;                  // elements per scale (a power of two)
  Determinism determinism = Determinism::Default;
};
size_t code_size(Compression c);  // bytes per element on the wire (without the scales)
// The codec a call of collective `c` on `t` runs with when `requested` is asked for:
// compression applies where it saves bytes of floating data (all-reduce, reduce-scatter
// and all-gather of float32 with any codec, of 16-bit floats with fp8 codecs); every
// other call runs uncompressed, so a group-wide PYCOMM_COMPRESSION never touches integers.
Compression applied_compression(Collective c, DataType t, Compression requested);

// What runs a collective, as frames' stamps, logs, stats, the flight recorder and
// Work.algorithm name it. A requested Algorithm is a family; the plan (runtime/plan.h)
// picks the variant that runs it for the call's compression and determinism: the
// all-reduce asked for as "ring" in a deterministic mode or with a codec is a direct
// reduce-scatter and a ring all-gather, "direct+ring"; the reduce-scatter asked for as
// "oneshot", or as "ring" in those modes, is "direct"; the tree family's all-reduce is
// "recursive-doubling" where latency-bound, "tree" (double binary) where it pipelines;
// its reduce-scatter is "recursive-halving", its all-gather "bruck". Point-to-point is
// "p2p", and "p2p-via-host" on device memory (its frames copied between that memory and
// the host channels' slots).
enum class Variant : uint8_t {
  Ring,
  DirectRing,
  OneShot,
  OneShotFlags,
  TwoShot,
  Tree,
  Hierarchical,
  Direct,
  Chain,
  Pairwise,
  P2P,
  Dissemination,
  RecursiveDoubling,
  RecursiveHalving,
  Bruck,
  // pycomm's reductions over a group of another backend (pycomm/layered/): its direct
  // algorithm, the same with every transfer a pairwise send, or with its results gathered
  // across hosts then within them, its hierarchical one (within hosts, then across them),
  // and its one-shot (every rank's whole data in the all-gather each call opens with).
  LayeredDirect,
  LayeredPairwise,
  LayeredDirectHostGather,
  LayeredHierarchical,
  LayeredOneShot,
  P2PViaHost,
};

// Names: "float32", "sum", "allreduce", "fp8_e4m3", "ring", "exact" (what
// PYCOMM_DETERMINISTIC takes: 0, 1, exact), "direct+ring".
template <>
const EnumTable<DataType>& table_of<DataType>();
template <>
const EnumTable<ReduceKind>& table_of<ReduceKind>();
template <>
const EnumTable<Collective>& table_of<Collective>();
template <>
const EnumTable<Algorithm>& table_of<Algorithm>();
template <>
const EnumTable<Compression>& table_of<Compression>();
template <>
const EnumTable<Determinism>& table_of<Determinism>();
template <>
const EnumTable<Variant>& table_of<Variant>();

}  // namespace pycomm
