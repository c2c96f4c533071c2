// Data types, reduce ops and per-call options of the torch-free core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {

enum class DataType : uint8_t {
  Float32, Float64, Float16, BFloat16, Int8, UInt8, Int32, Int64, Bool,
};

enum class Collective : uint8_t {
  AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, Gather, Scatter, AllToAll,
  Send, Recv, Barrier,
};
const char* name_of(Collective c);
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
const char* name_of(DataType t);
const char* name_of(ReduceKind k);
bool is_floating(DataType t);

// Throws pycomm::InvalidArgument when `t` cannot be reduced with `r` (e.g. AVG on bool,
// bitwise ops on floats). Bool reductions are logical: SUM/MAX = OR, PRODUCT/MIN = AND.
void check_reducible(DataType t, const Reduction& r);

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
const char* name_of(Compression c);
size_t code_size(Compression c);  // bytes per element on the wire (without the scales)
// The codec a call of collective `c` on `t` runs with when `requested` is asked for:
// compression applies where it saves bytes of floating data (all-reduce, reduce-scatter
// and all-gather of float32 with any codec, of 16-bit floats with fp8 codecs); every
// other call runs uncompressed, so a group-wide PYCOMM_COMPRESSION never touches integers.
Compression applied_compression(Collective c, DataType t, Compression requested);

const char* name_of(Algorithm a);
Algorithm parse_algorithm(const std::string& s);
Compression parse_compression(const std::string& s);
Determinism parse_determinism(const std::string& s);
const char* name_of(Determinism d);  // "0", "1", "exact": what PYCOMM_DETERMINISTIC takes

}  // namespace pycomm
