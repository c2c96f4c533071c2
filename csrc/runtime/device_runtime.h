// An accelerator's runtime, as the core sees it: ops on its memory, shared device memory
// for transports, and teams of devices that synchronize collectives themselves. The core
// links against no accelerator library; the CUDA build of the extension's module
// registers its runtime when it is loaded (csrc/cuda).
#pragma once

#include <cstdint>
#include <memory>

#include "device/device_ops.h"
#include "transport/transport.h"

namespace pycomm {

// One call's stamps of the layered path (pycomm/layered/stamps.py), as int64 words: row p
// (`row_stride` words after row p - 1) holds rank p's stamp in its first `words` words,
// `mine` this rank's; row `skip` (-1: none) is not compared.
struct StampTable {
  const int64_t* rows = nullptr;
  size_t count = 0, row_stride = 0;
  const int64_t* mine = nullptr;
  int words = 0, skip = -1;
};
// The verdict on stamps: kVerdictWords int64 words, all 0 until a disagreement is found.
// judge_stamps, where verdict[0] is 0 and some row p != skip differs from `mine`, writes
// the first difference in row order, (p, f) the first of row p: {1, p, f, rows[p][f],
// mine[f], mine[1], mine[2]} (mine[1], mine[2]: the call's sequence number and collective).
// A verdict once written stays: the first disagreement is the one reported.
constexpr int kVerdictWords = 7;
// At most this many words of a stamp.
constexpr int kMaxStampWords = 16;
void judge_stamps(const StampTable& table, int64_t* verdict);

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual const char* name() const = 0;  // "cuda"
  // Ops on the memory of device `index`, on an internal stream of their own, complete
  // when each call returns (the DeviceOps contract). Several threads may call them at
  // once: a group's point-to-point lanes share its ops of a device.
  virtual std::unique_ptr<DeviceOps> make_ops(int index) const = 0;
  // DeviceOps::reduce_terms on device `index`'s memory, enqueued on `stream` (a stream of
  // that device, e.g. the caller's current one) and not waited for: for callers that order
  // their work by the stream, as the layered path does between the mover's collectives.
  virtual void enqueue_reduce_terms(int index, void* stream, const ReduceSpec& spec, Stage stage, void* out,
                                    const Term* terms, int k, size_t n) const = 0;
  // DeviceOps::reduce_segments, enqueued likewise: one kernel launch for every pair.
  virtual void enqueue_reduce_segments(int index, void* stream, const ReduceSpec& spec, Stage stage, void* plain,
                                       void* slots, const SegmentSlots& pairs) const = 0;
  // The layered path's stamps, enqueued likewise, nothing copied from the host: `n` words
  // (at most kMaxStampWords, passed to the kernel as its arguments) written to `dst`, in
  // device memory; judge_stamps of a table in device memory, `verdict` in page-locked host
  // memory that the device writes and the host reads without waiting for the stream.
  virtual void enqueue_write_words(int index, void* stream, int64_t* dst, const int64_t* words, int n) const = 0;
  virtual void enqueue_judge_stamps(int index, void* stream, const StampTable& table, int64_t* verdict) const = 0;
  // Whether `stream`, a stream of device `index`, is being captured into a graph: its
  // work is then recorded, not run, and nothing may wait for it on the host.
  virtual bool capturing(int /*index*/, void* /*stream*/) const { return false; }
  // Slot payloads in device `index`'s memory, mappable by processes of this host.
  virtual std::unique_ptr<SlotArena> make_slot_arena(int index) const = 0;
  // This rank's member of a team of the whole group on device `index`, made by every
  // rank with the set-up of its transport to the others' device memory (so every rank is
  // on this host; the team's keys are below setup.key_prefix + "/team"). Its capacity is
  // setup.config->cuda_flag_bytes. Members wait for each other's kernels, so a team is
  // made only where they run at the same time, unless setup.config says
  // cuda_flags is Always. Null where the runtime has no team (the same answer on every
  // rank).
  virtual std::unique_ptr<DeviceTeam> make_team(int /*index*/, const TransportSetup& /*setup*/) const {
    return nullptr;
  }
};

// Called once, at load time, by the module of a build with an accelerator.
void register_device_runtime(const DeviceRuntime* runtime);
bool has_device_runtime();
extern const char* const kNoCudaBuild;  // why a CUDA tensor cannot be used
// The registered runtime; throws a clear error when pycomm was built without one.
const DeviceRuntime& device_runtime();

}  // namespace pycomm
