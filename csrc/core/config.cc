#include "core/config.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "core/error.h"

namespace pycomm {

template <>
const EnumTable<TransportChoice>& table_of<TransportChoice>() {
  static const EnumTable<TransportChoice> t{
      "transport", {{TransportChoice::Auto, "auto"}, {TransportChoice::Shm, "shm"}, {TransportChoice::Tcp, "tcp"}}};
  return t;
}

template <>
const EnumTable<LogLevel>& table_of<LogLevel>() {
  static const EnumTable<LogLevel> t{"log level",
                                     {{LogLevel::Warn, "WARN"}, {LogLevel::Info, "INFO"}, {LogLevel::Trace, "TRACE"}}};
  return t;
}

template <>
const EnumTable<KernelChoice>& table_of<KernelChoice>() {
  static const EnumTable<KernelChoice> t{
      "kernels", {{KernelChoice::Auto, "auto"}, {KernelChoice::Cuda, "cuda"}, {KernelChoice::Triton, "triton"}}};
  return t;
}

template <>
const EnumTable<CudaFlags>& table_of<CudaFlags>() {
  static const EnumTable<CudaFlags> t{"CUDA flags", {{CudaFlags::Auto, "auto"}, {CudaFlags::Always, "always"}}};
  return t;
}
template <>
const EnumTable<CudaIpc>& table_of<CudaIpc>() {
  static const EnumTable<CudaIpc> t{"CUDA IPC", {{CudaIpc::Auto, "auto"}, {CudaIpc::Off, "off"}}};
  return t;
}

namespace {

// The parsers of the rows below: each stores the value in its member and returns it as
// ranks compare it (canonical: "4096" for "04096"), or fails naming the knob.
[[noreturn]] void malformed(const Setting& s, const std::string& expected) {
  fail(ErrorKind::InvalidArgument, "pycomm: " + s.name + "='" + s.value + "' (expected " + expected + ")");
}

template <class T>
std::string integer(const Setting& s, long long lo, long long hi, T& member) {
  char* end = nullptr;
  const long long v = std::strtoll(s.value.c_str(), &end, 10);
  if (s.value.empty() || *end != '\0' || v < lo || v > hi)
    malformed(s, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  member = static_cast<T>(v);
  return std::to_string(v);
}

size_t power_of_two(const Setting& s, long long lo, long long hi) {
  size_t v = 0;
  integer(s, lo, hi, v);
  if (v & (v - 1)) malformed(s, "a power of two");
  return v;
}

// Chunks hold whole elements of every type and keep slots 64-byte aligned.
std::string chunk_bytes(const Setting& s, long long hi, size_t& member) {
  integer(s, 4096, hi, member);
  member &= ~size_t{63};
  return std::to_string(member);
}

template <class E>
std::string chosen(const Setting& s, E& member) {
  std::string accepted;
  for (const auto& [value, name] : table_of<E>().entries) {
    if (s.value == name) {
      member = value;
      return name;
    }
    accepted += (accepted.empty() ? "" : "|") + std::string(name);
  }
  malformed(s, accepted);
}

// "ring" sets every collective; "allreduce=tree,reducescatter=ring" sets those named
// (collective names as in logs, underscores optional) and leaves the others on auto.
void parse_algorithms(const Setting& s, Config& c) {
  if (s.value.find('=') == std::string::npos) {
    chosen(s, c.defaults.algorithm);
    for (auto& a : c.algorithm_of) a = c.defaults.algorithm;
    return;
  }
  std::string rest = s.value;
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
      fail(ErrorKind::InvalidArgument,
           "pycomm: PYCOMM_ALGO item '" + item + "' is not <collective>=<algorithm> (e.g. allreduce=ring)");
    chosen(Setting{s.name, item.substr(eq + 1)}, c.algorithm_of[found]);
  }
}

// The parsers of most rows: a member of Config and its range.
template <auto Member, long long lo, long long hi>
std::string integer_knob(Config& c, const Setting& s) {
  return integer(s, lo, hi, c.*Member);
}
template <auto Member, long long hi>
std::string chunk_knob(Config& c, const Setting& s) {
  return chunk_bytes(s, hi, c.*Member);
}
template <auto Member>
std::string enum_knob(Config& c, const Setting& s) {
  return chosen(s, c.*Member);
}
template <auto Member>
std::string text_knob(Config& c, const Setting& s) {
  return c.*Member = s.value;
}

constexpr bool kSameOnEveryRank = true, kPerRank = false;

}  // namespace

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = {
      {"PYCOMM_ALGO", "auto",
       "Algorithm: auto|ring|tree|hierarchical|oneshot|twoshot for every collective, or per collective: "
       "allreduce=tree,reducescatter=ring.",
       kPerRank,
       [](Config& c, const Setting& s) {
         parse_algorithms(s, c);
         return s.value;
       }},
      {"PYCOMM_COMPRESSION", "none", "Wire compression of floating reductions: none|fp16|bf16|fp8_e4m3|fp8_e5m2.",
       kPerRank, [](Config& c, const Setting& s) { return chosen(s, c.defaults.compression); }},
      {"PYCOMM_COMPRESSION_BLOCK", "256",
       "Elements per fp32 scale of the compression codecs (bf16 keeps the scale 1): a power of two, 16 to 1024.",
       kPerRank,
       [](Config& c, const Setting& s) {
         c.compression_block = c.defaults.compression_block =
             power_of_two(s, kMinCompressionBlock, kMaxCompressionBlock);
         return std::to_string(c.compression_block);
       }},
      {"PYCOMM_DETERMINISTIC", "0", "Determinism level: 0 (every rank identical, run to run), 1 (fixed order), exact.",
       kPerRank, [](Config& c, const Setting& s) { return chosen(s, c.defaults.determinism); }},
      {"PYCOMM_VERIFY", "0",
       "Every N-th all-reduce, all-gather and broadcast of a group (counted together), each rank hashes its result and "
       "the ranks compare the hashes: results that differ fail the call on every rank, naming the ranks that differ "
       "from the majority, and the group fails. 0: off.",
       kSameOnEveryRank, integer_knob<&Config::verify_every, 0, 1LL << 40>},
      {"PYCOMM_TRANSPORT", "auto",
       "auto: shared memory between ranks of one node, TCP across nodes; shm or tcp forces one.", kSameOnEveryRank,
       enum_knob<&Config::transport>},
      {"PYCOMM_RANKS_PER_NODE", "0", "Treat consecutive groups of N ranks as one node (0: group by host).",
       kSameOnEveryRank, integer_knob<&Config::ranks_per_node, 0, 1 << 20>},
      {"PYCOMM_SOCKET_IFNAME", "",
       "Network interface (name, or one of its IPv4 addresses) TCP listens on (default: loopback within a host, else "
       "the first up interface).",
       kPerRank, text_knob<&Config::socket_ifname>},
      {"PYCOMM_LINK_COSTS", "",
       "Calibration file of link costs for algorithm selection: read if it exists, else written after measuring "
       "(default: measure at group creation).",
       kPerRank, text_knob<&Config::link_costs_file>},
      {"PYCOMM_SHM_CHUNK_BYTES", "262144", "Payload bytes per shared-memory slot: the pipelining chunk.",
       kSameOnEveryRank, chunk_knob<&Config::shm_chunk_bytes, 64 << 20>},
      {"PYCOMM_CUDA_CHUNK_BYTES", "4194304",
       "Payload bytes per slot between ranks' CUDA memory on one host (CUDA IPC): the pipelining chunk of collectives "
       "on CUDA tensors.",
       kSameOnEveryRank, chunk_knob<&Config::cuda_chunk_bytes, 256 << 20>},
      {"PYCOMM_CUDA_FLAG_BYTES", "67108864",
       "All-reduces on CUDA tensors of at most this many bytes, in a group whose ranks all share one host and map each "
       "other's CUDA memory, run as one kernel per rank that synchronizes with its peers through flags in device "
       "memory, pipelined through two slots of min(this, PYCOMM_CUDA_CHUNK_BYTES) bytes per rank, with no host thread "
       "between chunks; 0: always host-driven.",
       kSameOnEveryRank, integer_knob<&Config::cuda_flag_bytes, 0, size_t{1} << 40>},
      {"PYCOMM_CUDA_FLAGS", "auto",
       "Where the flag-synchronized one-shot runs: auto (when the ranks' kernels can run at the same time: each rank "
       "on its own GPU, or GPUs shared through MPS) or always (also where processes time-slice one GPU: right, but "
       "every wait lasts a time slice).",
       kSameOnEveryRank, enum_knob<&Config::cuda_flags>},
      {"PYCOMM_CUDA_IPC", "auto",
       "Between ranks of one host, collectives on CUDA tensors move frames through each other's CUDA memory (CUDA "
       "IPC): auto, for every pair whose devices map each other's memory (probed when the group first uses the device; "
       "the other pairs are staged through host memory, as across hosts), or off, staging every pair.",
       kSameOnEveryRank, enum_knob<&Config::cuda_ipc>},
      {"PYCOMM_KERNELS", "auto",
       "Kernels for CUDA tensors where pycomm reduces over another backend (the layered path): auto (pycomm's CUDA "
       "kernels in a CUDA build, else its Triton kernels), cuda or triton.",
       kPerRank, enum_knob<&Config::kernels>},
      {"PYCOMM_TCP_CHUNK_BYTES", "1048576", "Payload bytes per TCP frame: the pipelining chunk.", kSameOnEveryRank,
       chunk_knob<&Config::tcp_chunk_bytes, 64 << 20>},
      {"PYCOMM_PIPELINE_DEPTH", "4", "Slots per channel direction (frames in flight between two ranks), 2 to 64.",
       kSameOnEveryRank, integer_knob<&Config::pipeline_depth, 2, 64>},
      {"PYCOMM_EAGER_BYTES", "65536",
       "Asynchronous collectives on tensors of at most this many bytes run on the calling thread when the group is "
       "idle (their Work comes back completed); 0: always on the worker thread.",
       kPerRank, integer_knob<&Config::eager_bytes, 0, 1LL << 40>},
      {"PYCOMM_SPIN_US", "-1",
       "Microseconds a waiter polls (yielding the core between polls) before blocking; -1: 50 when local ranks <= "
       "cores, else 30.",
       kPerRank, integer_knob<&Config::spin_us, -1, 1000000>},
      {"PYCOMM_TEST_PERTURB", "",
       "Test hook: <seed>:<max_us>[:<rank>[:<step>]] makes ranks (or one rank) sleep a pseudo-random 0..max_us "
       "microseconds before every frame they send, to reorder arrivals; with <step>, exactly max_us before the step-th "
       "frame (from 0) of each collective only.",
       kPerRank, text_knob<&Config::test_perturb>},
      {"PYCOMM_FAULT", "",
       "Test hook: <rank>:<op>:<seq>:<point>:<action>[:<arg>][,...] injects a fault on one rank at an operation (op as "
       "logs name it, or *; seq as errors show it, or *) at point before|during|during@<k>|after: kill (SIGKILL), stop "
       "(SIGSTOP), exit[:<status>] (_exit), raise (an Internal error), delay:<ms>, drop (abort the rank's transports), "
       "corrupt[:seq|count|bytes] (a header field of the frame, during only) or flip (one bit of this rank's output, "
       "after only).",
       kPerRank, text_knob<&Config::fault>},
      {"PYCOMM_DEBUG", "WARN",
       "Logging to stderr: WARN|INFO|TRACE (INFO: a line per group, and rank 0 logs a line per operation when it ends: "
       "sequence number, op, bytes, dtype, algorithm, compression, determinism level, time; TRACE: every rank logs "
       "each operation's start and end, and every frame it sends or receives).",
       kPerRank, enum_knob<&Config::log_level>},
      {"PYCOMM_FLIGHT_RECORDER", "64",
       "Operations each rank's flight recorder keeps per group (0: none); written as JSON when an operation fails or "
       "times out, and on demand (pycomm.dump_flight_recorder).",
       kPerRank, integer_knob<&Config::flight_recorder_entries, 0, 1 << 20>},
      {"PYCOMM_FLIGHT_RECORDER_DIR", "",
       "Directory of the flight recorder's files pycomm-flight-recorder-<group>-rank<r>-pid<pid>.json (default: "
       "$TMPDIR, else /tmp).",
       kPerRank,
       [](Config& c, const Setting& s) {
         const char* tmp = std::getenv("TMPDIR");
         return c.flight_recorder_dir = !s.value.empty() ? s.value : tmp && *tmp ? tmp : "/tmp";
       }},
  };
  return table;
}

Config Config::from_env(const std::map<std::string, std::string>& settings) {
  for (const auto& s : settings) {
    if (std::any_of(knobs().begin(), knobs().end(), [&](const Knob& k) { return s.first == k.name; })) continue;
    std::string names;
    for (const Knob& k : knobs()) names += (names.empty() ? "" : ", ") + std::string(k.name);
    fail(ErrorKind::InvalidArgument, "pycomm: unknown option " + s.first + " (the knobs are " + names + ")");
  }
  Config c;
  for (const Knob& k : knobs()) {
    const auto given = settings.find(k.name);
    const char* env = std::getenv(k.name);
    const std::string v = given != settings.end() ? given->second : env ? env : "";
    const std::string value = k.apply(c, Setting{k.name, v.empty() ? k.default_value : v});
    if (k.same_on_every_rank) c.same_on_every_rank.emplace_back(k.name, value);
  }
  return c;
}

void log_line(const std::string& line) {
  const std::string out = line + "\n";
  ssize_t ignored = write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

}  // namespace pycomm
