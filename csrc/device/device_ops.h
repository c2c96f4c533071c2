// Device ops: the arithmetic an algorithm performs on buffers, for one kind of memory.
// Algorithms call only these (plus a transport), so each algorithm is written once for
// CPU and GPU memory alike.
#pragma once

#include <cstddef>

#include "core/types.h"

namespace pycomm {

// Partial values travel in the accumulation format (fp32 for 16-bit floats) so that a
// result is rounded once, at Stage::Final, where AVG's division also happens.
enum class Stage { Partial, Final };

struct ReduceSpec {
  DataType dtype = DataType::Float32;
  Reduction reduction;   // already normalized for the dtype (see normalized())
  int world_size = 1;
};

// Bool reductions are logical: SUM/MAX become MAX (or), PRODUCT/MIN become MIN (and).
Reduction normalized(DataType t, Reduction r);

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual void copy(void* dst, const void* src, size_t bytes) const = 0;
  // out[i] = contribution(local[i]) (+) incoming[i] for i < n, where (+) is the reduction.
  // `local` is this rank's own input in the storage format (PREMUL_SUM scales it);
  // `incoming` holds partial values in the accumulation format, or is null (then out is
  // this rank's contribution alone). Partial writes the accumulation format; Final
  // finalizes and rounds to the storage format. `out` may alias `local`.
  virtual void reduce(const ReduceSpec& spec, Stage stage, void* out, const void* local,
                      const void* incoming, size_t n) const = 0;
};

const DeviceOps& cpu_ops();

}  // namespace pycomm
