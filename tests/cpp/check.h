// The assertion of the torch-free C++ tests: counts failures, prints each, and goes on,
// so that one run reports every failing check. main() returns failures != 0.
#pragma once

#include <cstdio>

static int failures = 0;
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      ++failures;                                               \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                               \
    }                                                           \
  } while (0)
