#include "core/perturbation.h"

#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/error.h"

namespace pycomm {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

bool Perturbation::parse(const std::string& spec, int rank, uint64_t& seed, int& max_us) {
  if (spec.empty()) return false;
  char* end = nullptr;
  const char* s = spec.c_str();
  seed = std::strtoull(s, &end, 10);
  bool ok = end != s && *end == ':';
  long us = ok ? std::strtol(end + 1, &end, 10) : -1;
  ok = ok && us >= 0 && us <= 1000000;
  long only = -1;
  if (ok && *end == ':') {
    const char* r = end + 1;
    only = std::strtol(r, &end, 10);
    ok = end != r && only >= 0;
  }
  if (!ok || *end != '\0')
    fail(ErrorKind::InvalidArgument,
         "pycomm: PYCOMM_TEST_PERTURB='" + spec + "' is not <seed>:<max_us>[:<rank>] (max_us <= 1000000)");
  max_us = static_cast<int>(us);
  return only < 0 || only == rank;
}

Perturbation::Perturbation(uint64_t seed, int rank, int max_us)
    : seed_(mix(seed ^ mix(static_cast<uint64_t>(rank) + 1))), max_us_(max_us) {}

void Perturbation::before_send() const {
  const uint64_t frame = frames_.fetch_add(1, std::memory_order_relaxed);
  const auto us = static_cast<int64_t>(mix(seed_ + frame) % static_cast<uint64_t>(max_us_ + 1));
  if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

}  // namespace pycomm
