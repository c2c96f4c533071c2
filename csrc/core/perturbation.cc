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

// The next ":<non-negative integer>" field at `p`, or -1 when there is none.
long long field(const char*& p, bool& ok) {
  if (*p != ':') return -1;
  char* end = nullptr;
  const long long v = std::strtoll(p + 1, &end, 10);
  ok = ok && end != p + 1 && v >= 0;
  p = end;
  return v;
}

}  // namespace

bool Perturbation::parse(const std::string& text, int rank, Spec& spec) {
  if (text.empty()) return false;
  const char* p = text.c_str();
  char* end = nullptr;
  spec.seed = std::strtoull(p, &end, 10);
  bool ok = end != p && *end == ':';
  p = end;
  const long long us = field(p, ok);
  const long long only = field(p, ok);
  spec.step = field(p, ok);
  if (!ok || us < 0 || us > 1000000 || *p != '\0')
    fail(ErrorKind::InvalidArgument,
         "pycomm: PYCOMM_TEST_PERTURB='" + text + "' is not <seed>:<max_us>[:<rank>[:<step>]] (max_us <= 1000000)");
  spec.max_us = static_cast<int>(us);
  return only < 0 || only == rank;
}

Perturbation::Perturbation(const Spec& spec, int rank)
    : spec_(spec), stream_(mix(spec.seed ^ mix(static_cast<uint64_t>(rank) + 1))) {}

void Perturbation::before_send(uint64_t seq) const {
  int64_t us;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (seq != seq_) seq_ = seq, frames_in_seq_ = 0;
    const uint64_t in_seq = frames_in_seq_++, frame = frames_++;
    us = spec_.step < 0 ? static_cast<int64_t>(mix(stream_ + frame) % static_cast<uint64_t>(spec_.max_us + 1))
         : static_cast<int64_t>(in_seq) == spec_.step ? spec_.max_us
                                                      : 0;
  }
  if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

}  // namespace pycomm
