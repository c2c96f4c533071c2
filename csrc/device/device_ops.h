// Device ops: the arithmetic an algorithm performs on buffers, for one kind of memory.
// Algorithms call only these (plus a transport), so each algorithm is written once for
// CPU and GPU memory alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/deadline.h"
#include "core/segments.h"
#include "core/types.h"

namespace pycomm {

// Partial values travel in the accumulation format (fp32 for 16-bit floats) so that a
// result is rounded once, at Stage::Final, where AVG's division also happens.
// With a codec: Encoded writes the (unfinalized) value encoded, as a contribution or a
// partial goes on the wire; FinalEncoded finalizes first, as a result goes on the wire.
enum class Stage { Partial, Final, Encoded, FinalEncoded };

struct ReduceSpec {
  DataType dtype = DataType::Float32;
  Reduction reduction;   // already normalized for the dtype (see normalized())
  int world_size = 1;
  // Compression of floating data (float32, float16, bfloat16) on the wire; `block`
  // elements per scale. Blocks start at element 0 of every operand, so callers pass
  // operands that start on a block boundary of the tensor.
  Compression codec = Compression::None;
  size_t block = 0;
  // Exact mode (PYCOMM_DETERMINISTIC=exact): floating SUM, AVG and PREMUL_SUM add the
  // terms of each element exactly, in fixed point (see cpu_ops.cc), so the result depends
  // only on the multiset of terms, never on their order or count of zeros.
  bool exact = false;
};

// One operand of a reduction: a rank's input in the storage format (its contribution:
// PREMUL_SUM scales it), partial values already in the accumulation format, or values as
// the codec encoded them. With a codec, an Input is quantized as it is loaded, exactly as
// if it had been encoded and decoded: every contribution is quantized once, whether it
// crossed the wire or stayed on its rank, so every rank reduces the same operands.
enum class Form : uint8_t { Input, Partial, Encoded };
struct Term {
  const void* data;
  Form form;
};

// The pairs of a fold over segments (the layered path's codec steps: every segment of a
// call encoded, or decoded, by one kernel launch): segment s of a plain operand, cut as
// `segments` cuts it, and slot s of a slotted operand, slot s starting s * slot_bytes in;
// segment `skip` (-1: none) is left out, its slot untouched. Each pair is a single-term
// fold: an encoding stage (Encoded, FinalEncoded) folds the segment (a contribution) into
// its slot, any other stage the slot's encoded values into the segment (in that stage's
// form: the accumulation type for Partial).
struct SegmentSlots {
  Segments segments;
  size_t slot_bytes = 0;
  int skip = -1;
  PYCOMM_HD bool encodes(Stage stage) const { return stage == Stage::Encoded || stage == Stage::FinalEncoded; }
};

// Contract for transports and algorithms: every call returns once its work is complete
// in memory (a GPU implementation synchronizes its stream), so a buffer written by one
// call may be published to a peer right after it, and a peer's buffer read by one call
// may be handed back right after it.
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  // Uninitialized scratch memory of this device, released with its last owner.
  virtual std::shared_ptr<char> allocate(size_t bytes) const = 0;
  // Any direction between this device's memory and host memory.
  virtual void copy(void* dst, const void* src, size_t bytes) const = 0;
  // Page-locks host memory so that copies between it and this device need no bounce
  // buffer, until the returned handle goes (before the memory is freed). Null where there
  // is nothing to gain or the system refuses: copies work the same, only slower.
  virtual std::shared_ptr<void> pin(void* /*host*/, size_t /*bytes*/) const { return nullptr; }
  // out[i] = t[0][i] (+) t[1][i] (+) ... (+) t[k-1][i] for i < n, folded left in the
  // order given (the order is part of the result's bits for floating sums), k >= 1.
  // Partial writes the accumulation format; Final finalizes (AVG divides by world_size)
  // and rounds once to the storage format. `out` may alias any term's data exactly.
  virtual void reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k,
                            size_t n) const = 0;
  // A 64-bit hash of the `bytes` bytes at `data` (this device's memory): a function of the
  // bytes alone, the same on every device, so that ranks compare results by their hashes
  // (PYCOMM_VERIFY). Buffers of one length that differ in a single aligned 8-byte word
  // always hash differently; any other difference collides with probability about 2^-64.
  // This default copies the bytes to the host a block at a time and hashes them there
  // (for device memory: one more read of the buffer, over the bus); host memory is hashed
  // in place.
  virtual uint64_t hash(const void* data, size_t bytes) const;

  // out = contribution(local) (+) incoming; `incoming` null: the contribution alone.
  void reduce(const ReduceSpec& spec, Stage stage, void* out, const void* local, const void* incoming, size_t n) const {
    const Term terms[2] = {{local, Form::Input}, {incoming, Form::Partial}};
    reduce_terms(spec, stage, out, terms, incoming ? 2 : 1, n);
  }

  // reduce_terms of every pair of `pairs` (see SegmentSlots), `slots` holding the codec's
  // encoding (spec.codec is not None).
  void reduce_segments(const ReduceSpec& spec, Stage stage, void* plain, void* slots, const SegmentSlots& pairs) const {
    const size_t element = element_size(stage == Stage::Partial ? accumulation_type(spec.dtype) : spec.dtype);
    for (size_t s = 0; s < pairs.segments.parts; ++s) {
      const size_t n = pairs.segments.length(s);
      if (static_cast<int>(s) == pairs.skip || n == 0) continue;
      char* segment = static_cast<char*>(plain) + pairs.segments.begin(s) * element;
      char* slot = static_cast<char*>(slots) + s * pairs.slot_bytes;
      const bool encodes = pairs.encodes(stage);
      const Term term{encodes ? segment : slot, encodes ? Form::Input : Form::Encoded};
      reduce_terms(spec, stage, encodes ? slot : segment, &term, 1, n);
    }
  }
};

const DeviceOps& cpu_ops();

// Collectives that devices synchronize among themselves (a team: every rank of a group,
// all on one host, each device mapping the others' memory). Each member's kernel puts its
// input in its own memory, raises a flag in each peer's, waits for theirs and reduces: no
// host thread takes part between the launch and the completion. Made by the device
// runtime (runtime/device_runtime.h).
class DeviceTeam {
 public:
  virtual ~DeviceTeam() = default;
  // The largest all-reduce, in bytes.
  virtual size_t capacity() const = 0;
  // out = every member's `in` (n elements, at most capacity() bytes) reduced in rank
  // order per `spec` (uncoded; the final stage): the bits of the host-driven one-shot.
  // Complete on return, unless `stream` is given (a stream of the caller's, one a CUDA
  // graph captures, say): then enqueued on it after what it holds, and not waited for; a
  // failure of that call is raised by the team's next call. A peer that has not arrived
  // by `deadline` is a Timeout, an exited peer or abort() a PeerFailure; after a failure
  // the team refuses every call.
  virtual void all_reduce(const ReduceSpec& spec, void* out, const void* in, size_t n, const Deadline& deadline,
                          void* stream) = 0;
  // Makes a waiting all_reduce give up; any thread.
  virtual void abort() = 0;
};

}  // namespace pycomm
