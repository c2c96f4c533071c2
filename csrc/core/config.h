// Every environment knob, declared once (name, default, meaning) and read once, when a
// group is created. The README's table is checked against kKnobs by the tests.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/types.h"

namespace pycomm {

struct Knob {
  const char* name;
  const char* default_value;
  const char* meaning;
};

const std::vector<Knob>& knobs();

enum class TransportChoice : uint8_t { Auto, Shm, Tcp };
enum class LogLevel : uint8_t { Warn, Info, Trace };
enum class KernelChoice : uint8_t { Auto, Cuda, Triton };

constexpr int kCollectiveCount = static_cast<int>(Collective::Barrier) + 1;

struct Config {
  CallOptions defaults;               // PYCOMM_ALGO, PYCOMM_COMPRESSION, PYCOMM_DETERMINISTIC
  Algorithm algorithm_of[kCollectiveCount] = {};  // PYCOMM_ALGO, per collective

  CallOptions options_for(Collective c) const {
    CallOptions o = defaults;
    o.algorithm = algorithm_of[static_cast<int>(c)];
    return o;
  }
  TransportChoice transport = TransportChoice::Auto;
  int ranks_per_node = 0;             // 0: group ranks into nodes by host
  std::string socket_ifname;          // empty: loopback within a host, else first up interface
  std::string link_costs_file;        // empty: measure link costs at group creation
  size_t shm_chunk_bytes = 0;
  size_t tcp_chunk_bytes = 0;
  size_t cuda_chunk_bytes = 0;
  size_t cuda_flag_bytes = 0;         // the largest flag-synchronized all-reduce on CUDA (0: none)
  bool cuda_flags_time_sliced = false; // ... also where ranks time-slice one GPU
  KernelChoice kernels = KernelChoice::Auto;  // CUDA tensors on the layered path
  int pipeline_depth = 0;             // slots per channel direction
  size_t eager_bytes = 0;             // asynchronous collectives this small run at once
  size_t compression_block = 0;       // elements per scale of the scaled codecs
  int spin_us = -1;                   // -1: spin only when local ranks <= cores
  LogLevel log_level = LogLevel::Warn;
  size_t flight_recorder_entries = 0; // operations kept per group
  std::string flight_recorder_dir;    // where its files go (never empty)
  std::string test_perturb;           // PYCOMM_TEST_PERTURB (tests only)
  std::string fault;                  // PYCOMM_FAULT (tests only; see fault.h)

  // Reads every knob from the environment; a malformed value is an InvalidArgument error.
  static Config from_env();
};

// Writes `line` and a newline to stderr in one write, so that the lines of concurrent
// ranks and threads do not interleave.
void log_line(const std::string& line);

}  // namespace pycomm
