// Every environment knob is one row of knobs(): its name, default, meaning, whether every
// rank of a group must have the same value, and the parser that checks its range and
// sets its member of Config. Parsing (Config::from_env, once per group), the agreement
// check at group creation and its message, pycomm.knobs() and the knob table of docs/env.md (checked
// by the tests) all derive from the rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/types.h"

namespace pycomm {

// Elements per fp32 scale of the compression codecs (PYCOMM_COMPRESSION_BLOCK, the block
// of pycomm.encode and the like): a power of two in this range.
constexpr long long kMinCompressionBlock = 16;
constexpr long long kMaxCompressionBlock = 1024;

struct Config;

// A knob's value as the environment gives it (or its default).
struct Setting {
  std::string name, value;
};

struct Knob {
  const char* name;
  const char* default_value;
  const char* meaning;
  // Frames, layouts or the path a call takes depend on it: ranks that differ fail at
  // group creation, naming the knob, instead of hanging until the deadline.
  bool same_on_every_rank;
  // Sets its member of `c` from `s`, or fails (InvalidArgument) naming the knob and what
  // it accepts; returns the value as ranks compare it.
  std::string (*apply)(Config& c, const Setting& s);
};

const std::vector<Knob>& knobs();

enum class TransportChoice : uint8_t { Auto, Shm, Tcp };
enum class LogLevel : uint8_t { Warn, Info, Trace };
enum class KernelChoice : uint8_t { Auto, Cuda, Triton };
// Where the flag-synchronized one-shot runs: auto (ranks' kernels run at the same time)
// or always (also where processes time-slice one GPU).
enum class CudaFlags : uint8_t { Auto, Always };
enum class CudaIpc : uint8_t { Auto, Off };
template <>
const EnumTable<TransportChoice>& table_of<TransportChoice>();
template <>
const EnumTable<LogLevel>& table_of<LogLevel>();
template <>
const EnumTable<KernelChoice>& table_of<KernelChoice>();
template <>
const EnumTable<CudaFlags>& table_of<CudaFlags>();
template <>
const EnumTable<CudaIpc>& table_of<CudaIpc>();

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
  // The payload of one frame of a group's host operations, the same on every channel: the
  // smaller chunk where the group uses TCP anywhere.
  size_t frame_bytes(bool group_uses_tcp) const {
    return group_uses_tcp && tcp_chunk_bytes < shm_chunk_bytes ? tcp_chunk_bytes : shm_chunk_bytes;
  }
  size_t shm_chunk_bytes = 0;
  size_t tcp_chunk_bytes = 0;
  size_t cuda_chunk_bytes = 0;
  size_t cuda_flag_bytes = 0;         // the largest flag-synchronized all-reduce on CUDA (0: none)
  CudaFlags cuda_flags = CudaFlags::Auto;
  CudaIpc cuda_ipc = CudaIpc::Auto;        // Off: every pair of CUDA memories staged through the host
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
  // PYCOMM_VERIFY: every verify_every-th all-reduce, all-gather and broadcast of the group
  // (counted together) checks that every rank holds the same result bits; 0: none.
  uint64_t verify_every = 0;
  // The knobs every rank must share, (name, value as compared), in table order.
  std::vector<std::pair<std::string, std::string>> same_on_every_rank;

  // Reads every knob from `settings` (a group's own, by knob name: pycomm.Options), else
  // from the environment; an unknown name or a malformed value is an InvalidArgument error.
  static Config from_env(const std::map<std::string, std::string>& settings = {});
};

// Writes `line` and a newline to stderr in one write, so that the lines of concurrent
// ranks and threads do not interleave.
void log_line(const std::string& line);

}  // namespace pycomm
