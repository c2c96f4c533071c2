// Test hook: faults injected at a chosen point of a chosen operation on a chosen rank, so
// that tests can drive every failure path of docs/design.md, 'Fault model', from the outside.
//
// PYCOMM_FAULT=<spec>[,<spec>...], read when a group is created; the same value may be
// given to every rank, since each spec names the rank it applies to:
//
//   <rank>:<op>:<seq>:<point>:<action>[:<arg>]
//
//   rank    the group rank that misbehaves (specs naming another rank are ignored there)
//   op      the operation as logs and errors name it (allreduce, reduce_scatter, allgather,
//           broadcast, reduce, gather, scatter, alltoall, send, recv, barrier; underscores
//           optional), or * for any
//   seq     its sequence number as errors show it ("allreduce #3": 3), or * for any
//   point   before     when the operation starts on this rank, before it sends anything
//           during     before the first frame this rank sends in the operation;
//           during@<k> before its k-th frame (from 0); never when it sends fewer frames
//           after      once the operation has completed on this rank
//   action  kill       SIGKILL this process: a crash, nothing runs afterwards
//           stop       SIGSTOP this process: a hung rank (SIGCONT resumes it right here)
//           exit[:<c>] _exit(c), c in 0..255 (default 0): the process ends with a normal
//                      status, mid-operation, without destructors, atexit handlers or
//                      Python's finalization; the kernel closes its sockets
//           raise      throw an Internal error naming the fault: the operation fails on
//                      this rank like any failure (the group is poisoned, peers are told)
//           delay:<ms> sleep <ms> milliseconds (0..3600000), then go on
//           drop       abort this rank's transports (what Transport::abort does: TCP
//                      sends an Abort frame and shuts its sockets down, shm raises the
//                      segment's abort flag), without failing the operation itself: this
//                      rank fails at its next wait, its peers with "rank <r> aborted"
//           corrupt[:<field>]  (point during only) alter a field of the frame's header:
//                      seq (default) or count (one bit flipped: 2^20), or bytes (one
//                      less, one more when 0), so that the receiver's header check
//                      reports a mismatch naming this rank
//           flip       (point after only) flip the lowest bit of the first byte of this
//                      rank's output of the operation, where it has one: silent data
//                      corruption, which only verification (PYCOMM_VERIFY) reports,
//                      since the flip comes before the result is hashed
//
// A spec fires at every operation it matches (with seq *, at each one). A malformed value
// is an InvalidArgument error at group creation. Unset, nothing is done: the communicator
// and the algorithms test one pointer per operation and per frame.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/wire.h"

namespace pycomm {

enum class FaultPoint : uint8_t { Before, During, After };
enum class FaultAction : uint8_t { Kill, Stop, Exit, Raise, Delay, Drop, Corrupt, Flip };
enum class HeaderField : uint8_t { Seq, Count, Bytes };

struct FaultSpec {
  int rank = 0;
  int collective = -1;  // Collective; -1: any
  int64_t seq = -1;     // -1: any
  FaultPoint point = FaultPoint::Before;
  uint64_t frame = 0;   // During: the frame's index within the operation
  FaultAction action = FaultAction::Raise;
  int exit_status = 0;
  int delay_ms = 0;
  HeaderField field = HeaderField::Seq;
  std::string text;     // as written, for messages
};

class FaultInjector {
 public:
  // Aborts this rank's transports with a reason (the communicator's Context::abort).
  using Abort = std::function<void(const std::string&)>;
  // Flips one bit of this rank's output of the operation (null: it has none).
  using Flip = std::function<void()>;

  // Every spec of `text`; InvalidArgument when any is malformed. Empty text: none.
  static std::vector<FaultSpec> parse(const std::string& text);
  // `specs` of every rank; keeps those of `rank`. Null when none is left (the hook's off).
  static std::unique_ptr<FaultInjector> make(const std::vector<FaultSpec>& specs, int rank);

  // At point Before or After of the operation stamped `op`; thread-safe. `flip` serves
  // the flip action (After only).
  void at(FaultPoint point, const OpStamp& op, const Abort& abort, const Flip& flip = nullptr) const;
  // Before this rank sends the frame `header` (During); may corrupt `header`. Thread-safe
  // (hierarchical algorithms send from two threads).
  void before_send(FrameHeader& header, const Abort& abort) const;

 private:
  explicit FaultInjector(std::vector<FaultSpec> specs);
  void fire(const FaultSpec& s, const OpStamp& op, const std::string& where, const Abort& abort, FrameHeader* header,
            const Flip& flip) const;

  // Frames sent so far in the latest operation that spec i matched.
  struct FrameCount {
    OpStamp op;
    bool seen = false;
    uint64_t frames = 0;
  };
  std::vector<FaultSpec> specs_;
  mutable std::mutex mutex_;
  mutable std::vector<FrameCount> counts_;  // by spec; guarded by mutex_
};

}  // namespace pycomm
