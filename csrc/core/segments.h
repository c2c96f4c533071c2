// How a buffer is cut over ranks (or parts): the same cut on the host and in kernels.
#pragma once

#include <cstddef>

#include "core/numerics.h"  // PYCOMM_HD

namespace pycomm {

// Balanced split of `count` elements into `parts` contiguous segments of whole units of
// `unit` elements (the last unit may be short); the first units % parts segments hold one
// unit more. Compressed data uses the codec's block as the unit, so that segments start
// on block boundaries of the tensor.
struct Segments {
  size_t count, parts, unit = 1;
  PYCOMM_HD size_t begin(size_t i) const {
    const size_t units = (count + unit - 1) / unit, rest = units % parts;
    const size_t first = (i * (units / parts) + (i < rest ? i : rest)) * unit;
    return first < count ? first : count;
  }
  PYCOMM_HD size_t length(size_t i) const { return begin(i + 1) - begin(i); }
};

}  // namespace pycomm
