#include "core/config.h"

#include <algorithm>
#include <unistd.h>

#include <cstdlib>

#include "core/error.h"

namespace pycomm {

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = {
      {"PYCOMM_ALGO", "auto", "Algorithm: auto|ring|tree|hierarchical|oneshot|twoshot for every collective, or per collective: allreduce=tree,reducescatter=ring."},
      {"PYCOMM_COMPRESSION", "none", "Wire compression of floating reductions: none|fp16|bf16|fp8_e4m3|fp8_e5m2."},
      {"PYCOMM_COMPRESSION_BLOCK", "256", "Elements per fp32 scale of the compression codecs (bf16 keeps the scale 1): a power of two, 16 to 1024."},
      {"PYCOMM_DETERMINISTIC", "0", "Determinism level: 0 (every rank identical, run to run), 1 (fixed order), exact."},
      {"PYCOMM_TRANSPORT", "auto", "auto: shared memory between ranks of one node, TCP across nodes; shm or tcp forces one."},
      {"PYCOMM_RANKS_PER_NODE", "0", "Treat consecutive groups of N ranks as one node (0: group by host)."},
      {"PYCOMM_SOCKET_IFNAME", "", "Network interface (name, or one of its IPv4 addresses) TCP listens on (default: loopback within a host, else the first up interface)."},
      {"PYCOMM_LINK_COSTS", "", "Calibration file of link costs for algorithm selection: read if it exists, else written after measuring (default: measure at group creation)."},
      {"PYCOMM_SHM_CHUNK_BYTES", "262144", "Payload bytes per shared-memory slot: the pipelining chunk."},
      {"PYCOMM_CUDA_CHUNK_BYTES", "4194304", "Payload bytes per slot between ranks' CUDA memory on one host (CUDA IPC): the pipelining chunk of collectives on CUDA tensors."},
      {"PYCOMM_CUDA_FLAG_BYTES", "65536", "One-shot all-reduces on CUDA tensors of at most this many bytes, in a group whose ranks all share one host and map each other's CUDA memory, run as one kernel per rank that synchronizes with its peers through flags in device memory, with no host thread in between; 0: always host-driven."},
      {"PYCOMM_CUDA_FLAGS", "auto", "Where the flag-synchronized one-shot runs: auto (when the ranks' kernels can run at the same time: each rank on its own GPU, or GPUs shared through MPS) or always (also where processes time-slice one GPU: right, but every wait lasts a time slice)."},
      {"PYCOMM_KERNELS", "auto", "Kernels for CUDA tensors where pycomm reduces over another backend (the layered path): auto (pycomm's CUDA kernels in a CUDA build, else its Triton kernels), cuda or triton."},
      {"PYCOMM_TCP_CHUNK_BYTES", "1048576", "Payload bytes per TCP frame: the pipelining chunk."},
      {"PYCOMM_PIPELINE_DEPTH", "4", "Slots per channel direction (frames in flight between two ranks), 2 to 64."},
      {"PYCOMM_EAGER_BYTES", "65536", "Asynchronous collectives on tensors of at most this many bytes run on the calling thread when the group is idle (their Work comes back completed); 0: always on the worker thread."},
      {"PYCOMM_SPIN_US", "-1", "Microseconds a waiter polls (yielding the core between polls) before blocking; -1: 50 when local ranks <= cores, else 30."},
      {"PYCOMM_TEST_PERTURB", "", "Test hook: <seed>:<max_us>[:<rank>[:<step>]] makes ranks (or one rank) sleep a pseudo-random 0..max_us microseconds before every frame they send, to reorder arrivals; with <step>, exactly max_us before the step-th frame (from 0) of each collective only."},
      {"PYCOMM_FAULT", "", "Test hook: <rank>:<op>:<seq>:<point>:<action>[:<arg>][,...] injects a fault on one rank at an operation (op as logs name it, or *; seq as errors show it, or *) at point before|during|during@<k>|after: kill (SIGKILL), stop (SIGSTOP), exit[:<status>] (_exit), raise (an Internal error), delay:<ms>, drop (abort the rank's transports) or corrupt[:seq|count|bytes] (a header field of the frame, during only)."},
      {"PYCOMM_DEBUG", "WARN", "Logging to stderr: WARN|INFO|TRACE (INFO: a line per group, and rank 0 logs a line per operation when it ends: sequence number, op, bytes, dtype, algorithm, compression, determinism level, time; TRACE: every rank logs each operation's start and end, and every frame it sends or receives)."},
      {"PYCOMM_FLIGHT_RECORDER", "64", "Operations each rank's flight recorder keeps per group (0: none); written as JSON when an operation fails or times out, and on demand (pycomm.dump_flight_recorder)."},
      {"PYCOMM_FLIGHT_RECORDER_DIR", "", "Directory of the flight recorder's files pycomm-flight-recorder-<group>-rank<r>-pid<pid>.json (default: $TMPDIR, else /tmp)."},
  };
  return table;
}

namespace {

std::string knob_value(const char* name) {
  for (const auto& k : knobs()) {
    if (std::string(k.name) != name) continue;
    const char* v = std::getenv(name);
    return v && *v ? std::string(v) : std::string(k.default_value);
  }
  fail(ErrorKind::Internal, std::string("pycomm: undeclared knob ") + name);
}

long long int_knob(const char* name, long long lo, long long hi) {
  const std::string s = knob_value(name);
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < lo || v > hi)
    fail(ErrorKind::InvalidArgument, std::string("pycomm: ") + name + "='" + s +
                                         "' is not an integer in [" + std::to_string(lo) + ", " +
                                         std::to_string(hi) + "]");
  return v;
}

// "ring" sets every collective; "allreduce=tree,reducescatter=ring" sets those named
// (collective names as in logs, underscores optional) and leaves the others on auto.
void parse_algorithms(const std::string& value, Config& c) {
  if (value.find('=') == std::string::npos) {
    c.defaults.algorithm = parse<Algorithm>(value);
    for (auto& a : c.algorithm_of) a = c.defaults.algorithm;
    return;
  }
  std::string rest = value;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string item = rest.substr(0, comma);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    const size_t eq = item.find('=');
    std::string name = item.substr(0, eq);
    name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
    int found = -1;
    for (int i = 0; i < kCollectiveCount; ++i) {
      std::string known = name_of(static_cast<Collective>(i));
      known.erase(std::remove(known.begin(), known.end(), '_'), known.end());
      if (known == name) found = i;
    }
    if (eq == std::string::npos || found < 0)
      fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_ALGO item '" + item + "' is not <collective>=<algorithm> (e.g. allreduce=ring)");
    c.algorithm_of[found] = parse<Algorithm>(item.substr(eq + 1));
  }
}

}  // namespace

Config Config::from_env() {
  Config c;
  parse_algorithms(knob_value("PYCOMM_ALGO"), c);
  c.defaults.compression = parse<Compression>(knob_value("PYCOMM_COMPRESSION"));
  c.compression_block = static_cast<size_t>(int_knob("PYCOMM_COMPRESSION_BLOCK", 16, 1024));
  if (c.compression_block & (c.compression_block - 1))
    fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_COMPRESSION_BLOCK=" + std::to_string(c.compression_block) +
                                         " is not a power of two");
  c.defaults.compression_block = c.compression_block;
  c.defaults.determinism = parse<Determinism>(knob_value("PYCOMM_DETERMINISTIC"));
  const std::string t = knob_value("PYCOMM_TRANSPORT");
  if (t == "auto") c.transport = TransportChoice::Auto;
  else if (t == "shm") c.transport = TransportChoice::Shm;
  else if (t == "tcp") c.transport = TransportChoice::Tcp;
  else fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_TRANSPORT='" + t + "' (expected auto|shm|tcp)");
  c.ranks_per_node = static_cast<int>(int_knob("PYCOMM_RANKS_PER_NODE", 0, 1 << 20));
  c.socket_ifname = knob_value("PYCOMM_SOCKET_IFNAME");
  c.link_costs_file = knob_value("PYCOMM_LINK_COSTS");
  c.shm_chunk_bytes = static_cast<size_t>(int_knob("PYCOMM_SHM_CHUNK_BYTES", 4096, 64 << 20));
  c.tcp_chunk_bytes = static_cast<size_t>(int_knob("PYCOMM_TCP_CHUNK_BYTES", 4096, 64 << 20));
  c.cuda_chunk_bytes = static_cast<size_t>(int_knob("PYCOMM_CUDA_CHUNK_BYTES", 4096, 256 << 20));
  c.cuda_flag_bytes = static_cast<size_t>(int_knob("PYCOMM_CUDA_FLAG_BYTES", 0, 64 << 20));
  const std::string kernels = knob_value("PYCOMM_KERNELS");
  if (kernels == "auto") c.kernels = KernelChoice::Auto;
  else if (kernels == "cuda") c.kernels = KernelChoice::Cuda;
  else if (kernels == "triton") c.kernels = KernelChoice::Triton;
  else fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_KERNELS='" + kernels + "' (expected auto|cuda|triton)");
  const std::string flags = knob_value("PYCOMM_CUDA_FLAGS");
  if (flags != "auto" && flags != "always")
    fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_CUDA_FLAGS='" + flags + "' (expected auto|always)");
  c.cuda_flags_time_sliced = flags == "always";
  c.pipeline_depth = static_cast<int>(int_knob("PYCOMM_PIPELINE_DEPTH", 2, 64));
  c.spin_us = static_cast<int>(int_knob("PYCOMM_SPIN_US", -1, 1000000));
  c.eager_bytes = static_cast<size_t>(int_knob("PYCOMM_EAGER_BYTES", 0, 1LL << 40));
  c.test_perturb = knob_value("PYCOMM_TEST_PERTURB");
  c.fault = knob_value("PYCOMM_FAULT");
  c.flight_recorder_entries = static_cast<size_t>(int_knob("PYCOMM_FLIGHT_RECORDER", 0, 1 << 20));
  c.flight_recorder_dir = knob_value("PYCOMM_FLIGHT_RECORDER_DIR");
  if (c.flight_recorder_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    c.flight_recorder_dir = tmp && *tmp ? tmp : "/tmp";
  }
  const std::string d = knob_value("PYCOMM_DEBUG");
  if (d == "WARN") c.log_level = LogLevel::Warn;
  else if (d == "INFO") c.log_level = LogLevel::Info;
  else if (d == "TRACE") c.log_level = LogLevel::Trace;
  else fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_DEBUG='" + d + "' (expected WARN|INFO|TRACE)");
  // Chunks hold whole elements of every type and keep slots 64-byte aligned.
  c.shm_chunk_bytes &= ~size_t{63};
  c.tcp_chunk_bytes &= ~size_t{63};
  c.cuda_chunk_bytes &= ~size_t{63};
  return c;
}

void log_line(const std::string& line) {
  const std::string out = line + "\n";
  ssize_t ignored = write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

}  // namespace pycomm
