// Small shared pieces of the core: errno messages, spinning, the store helper.
#include <sched.h>

#include <cerrno>
#include <cstring>

#include "core/deadline.h"
#include "core/error.h"
#include "core/store.h"

namespace pycomm {

std::string errno_message(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

bool spin_until(const std::function<bool()>& ready, const SpinPolicy& policy) {
  if (ready()) return true;
  if (policy.spin.count() <= 0) return false;
  const auto until = Clock::now() + policy.spin;
  do {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    sched_yield();
  } while (Clock::now() < until);
  return ready();
}

std::vector<std::string> all_gather_strings(Store& store, const std::string& prefix, int rank,
                                            int size, const std::string& mine, const Deadline& deadline) {
  store.set(prefix + "/" + std::to_string(rank), mine);
  std::vector<std::string> all(size);
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      all[r] = mine;
      continue;
    }
    const std::string key = prefix + "/" + std::to_string(r);
    if (!store.wait(key, deadline.remaining()))
      fail(ErrorKind::Timeout, "pycomm: timed out creating a group: rank " + std::to_string(r) +
                                   " did not join (rank " + std::to_string(rank) + " waited for it)");
    all[r] = store.get(key);
  }
  return all;
}

}  // namespace pycomm
