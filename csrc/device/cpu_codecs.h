// The CPU codecs' conversions (the wire format is numerics.h's): runs of records encoded
// from, or decoded to, a storage type. A scalar path, the reference, and the same
// conversions vectorized for AVX2 (with F16C) and AVX-512, chosen at run time by what the
// CPU has. Every path writes the same bits for every input: the scalar path is the
// specification, and the others are tested bit for bit against it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "core/types.h"

namespace pycomm {

// The largest block (elements per record) of the CPU codecs.
constexpr size_t kMaxCodecBlock = 4096;

// n elements of storage type T (float, Half or BFloat16) in records of `block` elements
// (block <= kMaxCodecBlock), the last of which may be shorter: their codes at `codes`, one
// after another, and their scales at `scales` (numerics.h's Records: a whole piece, or its
// records from some block on). Neither address need be aligned.
template <class T>
struct CodecRuns {
  // The records of x's elements.
  void (*encode)(const T* x, Records<char> enc, size_t n, size_t block);
  // The values of those records, rounded to T as Numeric<T>::store rounds.
  void (*decode)(Records<const char> enc, T* x, size_t n, size_t block);
  // v = decode(encode(x)) in fp32, without writing the records. v may be x itself (T = float).
  void (*quantize)(const T* x, float* v, size_t n, size_t block);
};

// The runs of the path in use.
template <class T>
const CodecRuns<T>& codec_runs(Compression codec);

// The paths this CPU runs, by name: "scalar" first, then "avx2" and "avx512" where the CPU
// has them. The best is in use unless set_cpu_codec_path chose another.
std::vector<std::string> cpu_codec_paths();
std::string cpu_codec_path();
// For tests and benchmarks, which compare the paths: an InvalidArgument Error for a path
// this CPU does not run. Takes effect for the calls that start after it.
void set_cpu_codec_path(const std::string& name);

}  // namespace pycomm
