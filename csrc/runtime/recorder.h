// What a group remembers of its own operations, for people looking at a live or failed
// job: counters per collective and algorithm (pycomm.stats), and a flight recorder of the
// last operations with their state and times, written out as JSON on demand and when an
// operation fails (a timeout included), so that the ranks' files show which operation each
// rank was in and which ranks never reached it.
//
// Thread-safe: the group's worker thread records, any thread reads.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/wire.h"

namespace pycomm {

enum class OpState : uint8_t { Running, Completed, Failed };

struct OpRecord {
  uint64_t id = 0;          // 1, 2, ... over every operation of the group on this rank
  OpStamp stamp;            // the fingerprint every frame of the operation carries
  uint64_t bytes = 0;       // S of the operation (nccl-tests convention: the whole array)
  int device = -1;          // CUDA device of its tensors; -1: host memory
  OpState state = OpState::Running;
  int64_t start_unix_us = 0;                   // wall clock, comparable across ranks
  std::chrono::steady_clock::time_point start; // for durations
  double duration_us = 0;   // Completed/Failed: how long it ran
  std::string error;        // Failed: the error
};

struct OpTotals {
  uint64_t calls = 0, failures = 0, bytes = 0;
  double seconds = 0;
};

class Recorder {
 public:
  // Keeps the last `capacity` operations (0: none; counters are always kept). The group
  // verifies every `verify_every`-th operation that must agree on every rank (0: none).
  explicit Recorder(size_t capacity, uint64_t verify_every = 0) : capacity_(capacity), verify_every_(verify_every) {}

  // Begins an operation that started at `start` (now, on the steady clock).
  uint64_t begin(const OpStamp& stamp, uint64_t bytes, int device, std::chrono::steady_clock::time_point start);
  // Ends operation `id`: completed when `error` is empty, else failed. Returns how long it
  // ran, in microseconds.
  double end(uint64_t id, const std::string& error = {});
  // An operation's results were compared across ranks: `agreed`, or found to differ.
  void verified(bool agreed);

  // JSON texts (UTF-8 objects). `who` names the group and rank: {"group", "rank", "size"}.
  struct Who {
    std::string group;
    int rank = 0, size = 0;
  };
  // How the group's ranks are connected, as set up.
  struct Setup {
    std::string transports;  // "shm: ranks 1,2; tcp: ranks 3"
    size_t chunk_bytes = 0;  // the frame size
    std::string fallback;    // what runs instead of the configured transports, and why; empty: they run
  };
  // {"group", "rank", "size", "setup": {"transports", "chunk_bytes", "fallback": text or
  // null} (where setup.transports is not empty), "collectives": {collective: {algorithm:
  // {calls, failures, bytes, time_s}}}, "verify": {every, verified, mismatches}, "last":
  // the last operation ended, or null}.
  std::string stats_json(const Who& who, const Setup& setup) const;
  std::string stats_json(const Who& who) const { return stats_json(who, Setup()); }
  // {"format": "pycomm.flight_recorder/1", "group", "rank", "size", "pid", "host",
  //  "reason", "dumped_unix_us", "capacity", "entries": [record, ...]} (oldest first).
  std::string dump_json(const Who& who, const std::string& reason) const;
  // Writes dump_json to `path`, or where that is empty to this rank's file in `dir` (named
  // for the group, kept to [A-Za-z0-9_.-], the rank and the process); returns the path.
  // Throws InvalidArgument when it cannot write it.
  std::string dump(const Who& who, const std::string& reason, const std::string& dir, const std::string& path) const;

 private:
  const size_t capacity_;
  const uint64_t verify_every_;
  mutable std::mutex mutex_;
  uint64_t verified_ = 0, mismatches_ = 0;
  uint64_t next_id_ = 0;
  // The last capacity_ operations begun, a ring: operation id at (id - 1) % capacity_.
  std::vector<OpRecord> recent_;
  std::vector<OpRecord> running_;          // begun, not ended (one, or a few on p2p lanes)
  OpRecord last_;                          // the last operation ended (id 0: none yet)
  std::map<std::pair<uint8_t, uint8_t>, OpTotals> totals_;  // by (collective, variant) of the stamp
};

// Writes `text` to `path` (through a temporary file in its directory, then renamed, so a
// reader never sees half a dump); returns false when it could not.
bool write_file_atomically(const std::string& path, const std::string& text);

}  // namespace pycomm
