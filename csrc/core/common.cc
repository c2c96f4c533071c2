// Small shared pieces of the core: errno messages, spinning, the store helper.
#include <sched.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/deadline.h"
#include "core/error.h"
#include "core/store.h"

namespace pycomm {

std::string errno_message(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string mebibytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", bytes / (1 << 20));
  return text;
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

std::vector<std::string> all_gather_strings(Store& store, const std::string& prefix, int rank, int size,
                                            const std::string& mine, const Deadline& deadline) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + "/" + std::to_string(r));
  store.set(keys[rank], mine);
  return get_all(store, keys, deadline, [&](size_t r) {
    return "pycomm: timed out creating a group: rank " + std::to_string(r) + " did not join (rank " +
           std::to_string(rank) + " waited for it)";
  });
}

std::vector<std::string> get_all(Store& store, const std::vector<std::string>& keys, const Deadline& deadline,
                                 const std::function<std::string(size_t)>& missing) {
  bool all = false;
  try {
    all = store.wait(keys, deadline.remaining());
  } catch (const std::exception&) {  // the store's own timeout or failure: name what is missing
  }
  if (!all)
    for (size_t i = 0; i < keys.size(); ++i)
      if (!store.check(keys[i])) fail(ErrorKind::Timeout, missing(i));
  return store.multi_get(keys);
}

}  // namespace pycomm
