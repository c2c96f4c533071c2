// The assertion of the torch-free C++ tests: counts failures, prints each, and goes on,
// so that one run reports every failing check. main() returns failures != 0.
// Thread-safe: ranks are threads that check concurrently. The count is a plain int for
// main() to read once the threads are joined, incremented atomically; each failure's line
// is written whole (the stream stays locked across its three writes).
#pragma once

#include <cstdio>

static int failures = 0;
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      __atomic_fetch_add(&failures, 1, __ATOMIC_RELAXED);       \
      flockfile(stderr);                                        \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                               \
      funlockfile(stderr);                                      \
    }                                                           \
  } while (0)
