// The CUDA kernels' conversions (cuda/conversions.cuh) against numerics.h's, bit for bit,
// on the host, where the CUDA headers' intrinsics compute in software what the
// instructions compute on the device. For each codec: its encoding of every float32 it may
// convert (finite values up to its kTarget; NaN and infinities), one at a time and in
// pairs (and for fp8, the instruction's rounding of the finite ones, which the host's
// DeviceCode does not use), and its decoding of every code. Sampled by default: both signs of every exponent,
// each with every pattern of the mantissa's 12 upper bits (every rounding position of the
// codes, their ties included) times lower bits 0, 1, 0x3ff, 0x400, 0x401, 0x7ff and a
// pseudo-random one. With --all: every float32 pattern (on every core). Prints one line
// per codec; exits 1 on any difference.
#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/conversions.cuh"

namespace pycomm {
namespace {

std::atomic<uint64_t> differences{0};

void report(const char* codec, const char* what, uint32_t input, uint32_t got, uint32_t want) {
  if (differences.fetch_add(1) < 20)
    std::fprintf(stderr, "FAIL %s %s of 0x%08x: 0x%08x, numerics.h 0x%08x\n", codec, what, input, got, want);
}

// Whether `bits` is a float32 a codec converts: NaN, an infinity, or finite up to kTarget.
template <class Code>
bool in_domain(uint32_t bits) {
  const uint32_t ax = bits & 0x7fffffffu;
  return ax >= 0x7f800000u || bit_cast_<float>(ax) <= Code::kTarget;
}

template <class Code>
void check_encoding(const char* codec, uint32_t bits, uint32_t partner) {
  using D = DeviceCode<Code>;
  const float v = bit_cast_<float>(bits), w = bit_cast_<float>(partner);
  const uint32_t want = Code::encode(v);
  if (D::encode(v) != want) report(codec, "encode", bits, D::encode(v), want);
  uint32_t a, b;
  D::encode_pair(v, w, a, b);
  if (a != want) report(codec, "encode_pair (first)", bits, a, want);
  if (b != Code::encode(w)) report(codec, "encode_pair (second)", partner, b, Code::encode(w));
  if constexpr (sizeof(typename Code::Code) == 1) {  // the instruction the device rounds with from sm_89 on
    const uint32_t pair = fp8_instruction_pair<Code>(v, w);
    if (!nonfinite_magnitude(magnitude_bits(v)) && (pair & 0xffu) != want)
      report(codec, "fp8 instruction (first)", bits, pair & 0xffu, want);
    if (!nonfinite_magnitude(magnitude_bits(w)) && (pair >> 8) != Code::encode(w))
      report(codec, "fp8 instruction (second)", partner, pair >> 8, Code::encode(w));
  }
}

template <class Code>
void check_patterns(const char* codec, uint64_t begin, uint64_t end, uint64_t step_of(uint64_t)) {
  for (uint64_t i = begin; i < end; ++i) {
    const uint32_t bits = static_cast<uint32_t>(step_of(i));
    if (!in_domain<Code>(bits)) continue;
    // Its partner in a pair: another value of the domain (a NaN, an infinity or a zero).
    const uint32_t partner = (i % 4 == 0) ? 0x7fc00001u : (i % 4 == 1) ? 0xff800000u : (i % 4 == 2) ? 0x80000000u : 0;
    check_encoding<Code>(codec, bits, partner);
  }
}

uint64_t every_pattern(uint64_t i) { return i; }

// Sample i of the sampled sweep: sign, exponent, 12 upper mantissa bits, one of 7 lower.
uint64_t sampled_pattern(uint64_t i) {
  static constexpr uint32_t kLower[] = {0, 1, 0x3ff, 0x400, 0x401, 0x7ff, 0x2a5};
  const uint32_t lower = kLower[i % 7];
  const uint32_t upper = static_cast<uint32_t>(i / 7) % 4096;
  const uint32_t exponent = static_cast<uint32_t>(i / 7 / 4096) % 256;
  const uint32_t sign = static_cast<uint32_t>(i / 7 / 4096 / 256) % 2;
  return sign << 31 | exponent << 23 | upper << 11 | lower;
}
constexpr uint64_t kSamples = 2ull * 256 * 4096 * 7;

template <class Code>
void check_codec(const char* codec, bool all) {
  using D = DeviceCode<Code>;
  const uint64_t before = differences.load();
  for (uint32_t c = 0; c < (1u << (8 * sizeof(typename Code::Code))); ++c) {
    const uint32_t got = bit_cast_<uint32_t>(D::decode(c)), want = bit_cast_<uint32_t>(Code::decode(c));
    if (got != want) report(codec, "decode", c, got, want);
  }
  const uint64_t count = all ? (1ull << 32) : kSamples;
  const unsigned threads = all ? std::max(1u, std::thread::hardware_concurrency()) : 1;
  std::vector<std::thread> workers;
  for (unsigned t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      check_patterns<Code>(codec, count * t / threads, count * (t + 1) / threads,
                           all ? every_pattern : sampled_pattern);
    });
  for (std::thread& w : workers) w.join();
  std::printf("%-9s %s float32 patterns, every code: %" PRIu64 " differences\n", codec, all ? "all 2^32" : "sampled",
              differences.load() - before);
}

}  // namespace
}  // namespace pycomm

int main(int argc, char** argv) {
  const bool all = argc > 1 && std::strcmp(argv[1], "--all") == 0;
  pycomm::check_codec<pycomm::CodeFp16>("fp16", all);
  pycomm::check_codec<pycomm::CodeBf16>("bf16", all);
  pycomm::check_codec<pycomm::CodeFp8E4M3>("fp8_e4m3", all);
  pycomm::check_codec<pycomm::CodeFp8E5M2>("fp8_e5m2", all);
  return pycomm::differences.load() == 0 ? 0 : 1;
}
