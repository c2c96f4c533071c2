#include "runtime/communicator.h"

#include <sched.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <iomanip>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "runtime/device_runtime.h"

namespace pycomm {
namespace {

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string link_target(const char* path) {
  char buf[256];
  const ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::string hostname() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

// Equal exactly for processes that can map each other's /dev/shm segments and see each
// other's pids: the same boot of the same machine, mount, pid and network namespace (a
// network namespace stands for a separate host in multi-host tests).
std::string host_key() {
  return hostname() + "|" + read_first_line("/proc/sys/kernel/random/boot_id") + "|" +
         link_target("/proc/self/ns/mnt") + "|" + link_target("/proc/self/ns/pid") + "|" +
         link_target("/proc/self/ns/net");
}

std::string random_secret() {
  unsigned char raw[32];
  if (getrandom(raw, sizeof raw, 0) != static_cast<ssize_t>(sizeof raw))
    fail(ErrorKind::Internal, errno_message("pycomm: getrandom"));
  std::string hex;
  char b[3];
  for (unsigned char c : raw) { std::snprintf(b, sizeof b, "%02x", c); hex += b; }
  return hex;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

// The knobs every rank must share, as one rendezvous field: "NAME=value" items joined by
// kItemSep, which no knob value contains (each is a number or a word of its table).
constexpr char kItemSep = '\x1e';
std::string shared_knobs(const Config& c) {
  std::string out;
  for (const auto& [name, value] : c.same_on_every_rank) out += (out.empty() ? "" : std::string(1, kItemSep)) + name + "=" + value;
  return out;
}

// "PYCOMM_CUDA_FLAG_BYTES=0 where rank 0 (this rank) has 65536, ...": the knobs of
// `theirs` (a shared_knobs() field) that differ from `mine`, this rank's.
std::string knob_differences(const std::string& theirs, const Config& mine, int rank) {
  std::map<std::string, std::string> other;
  for (const std::string& item : split(theirs, kItemSep)) {
    const size_t eq = item.find('=');
    if (eq != std::string::npos) other[item.substr(0, eq)] = item.substr(eq + 1);
  }
  std::string out;
  for (const auto& [name, value] : mine.same_on_every_rank) {
    const auto it = other.find(name);
    const std::string theirs_value = it == other.end() ? "(missing)" : it->second;
    if (theirs_value != value)
      out += (out.empty() ? "" : ", ") + name + "=" + theirs_value + " where rank " + std::to_string(rank) +
             " (this rank) has " + value;
  }
  return out;
}

int cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

}  // namespace

Communicator::Communicator(Store& store, int rank, int size, std::string group_name,
                           std::chrono::milliseconds timeout, Config config)
    : rank_(rank), size_(size), group_name_(std::move(group_name)), store_(&store), timeout_(timeout),
      config_(std::move(config)), sends_to_(size, 0), recvs_from_(size, 0), receiving_(new std::mutex[size]),
      recorder_(config_.flight_recorder_entries) {
  if (size < 1 || rank < 0 || rank >= size)
    fail(ErrorKind::InvalidArgument, "pycomm: rank " + std::to_string(rank) + " outside a group of " + std::to_string(size));
  // Parsed before the store is touched, so that a malformed spec leaves nothing behind.
  const std::vector<FaultSpec> faults = FaultInjector::parse(config_.fault);
  // Distinct instances of a group that reuse one store (re-initialisation in the same
  // processes) get distinct keys: every rank of instance i draws from [i*size+1, (i+1)*size].
  const int64_t ticket = store.add("pycomm/instances", 1);
  prefix_ = "pycomm/" + std::to_string((ticket - 1) / size);
  const std::string& prefix = prefix_;
  Perturbation::Spec perturbation;
  if (Perturbation::parse(config_.test_perturb, rank_, perturbation))
    perturb_ = std::make_unique<Perturbation>(perturbation, rank_);
  if (config_.log_level >= LogLevel::Trace)
    frame_trace_.reset(new FrameTrace{"pycomm: group '" + group_name_ + "' rank " + std::to_string(rank_) + ": "});
  connect(store, prefix);
  // Armed after set-up: faults target operations, not the calibration's frames.
  fault_ = FaultInjector::make(faults, rank_);
}

Communicator::~Communicator() = default;

// Rendezvous data: pid, hostname, host key, shared knobs, world size; fields are
// separated by \x1f, which none of them contains.
constexpr char kSep = '\x1f';
constexpr size_t kRendezvousFields = 5;

// Counters (Store::add never waits, unlike Store::wait) that each rank bumps as it starts:
// <prefix>/size/<rank> by its world size, then <prefix>/claims/<rank> by one.
std::string Communicator::start_up_disagreements(Store& store, const std::string& prefix) const {
  std::string found;
  for (int r = 0; r < size_; ++r) {
    const std::string rank = "rank " + std::to_string(r);
    const int64_t claims = store.add(prefix + "/claims/" + std::to_string(r), 0);  // 0: not arrived
    const int64_t size = store.add(prefix + "/size/" + std::to_string(r), 0);
    if (claims > 1)
      found += "; " + rank + " was claimed by " + std::to_string(claims) + " processes";
    else if (claims == 1 && size != size_)
      found += "; " + rank + " was started with world size " + std::to_string(size) + ", this rank with " +
               std::to_string(size_);
  }
  return found;
}

void Communicator::connect(Store& store, const std::string& prefix) {
  // The counters start_up_disagreements() reads. A second process started as this rank
  // fails at once; the others time out below, and the diagnosis names the duplicate.
  store.add(prefix + "/size/" + std::to_string(rank_), size_);
  if (store.add(prefix + "/claims/" + std::to_string(rank_), 1) > 1)
    fail(ErrorKind::InvalidArgument, "pycomm: creating group '" + group_name_ + "': another process already joined as rank " +
                                         std::to_string(rank_) + " (every process needs a rank of its own)");
  std::ostringstream mine;
  mine << getpid() << kSep << hostname() << kSep << host_key() << kSep << shared_knobs(config_) << kSep << size_;
  std::vector<std::string> all;
  try {
    all = all_gather_strings(store, prefix + "/rank", rank_, size_, mine.str(), Deadline::after(timeout_));
  } catch (const Error& e) {
    // A missing rank is often a misconfigured one: say what the counters tell.
    if (e.kind() != ErrorKind::Timeout) throw;
    fail(ErrorKind::Timeout, e.what() + start_up_disagreements(store, prefix));
  }
  std::map<std::string, int> node_of_host;
  ranks_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    const auto f = split(all[r], kSep);
    if (f.size() != kRendezvousFields)
      fail(ErrorKind::Mismatch, "pycomm: rank " + std::to_string(r) + " published malformed rendezvous data");
    if (f[4] != std::to_string(size_))
      fail(ErrorKind::InvalidArgument, "pycomm: creating group '" + group_name_ + "': rank " + std::to_string(r) +
                                           " was started with world size " + f[4] + ", this rank (rank " +
                                           std::to_string(rank_) + ") with " + std::to_string(size_));
    if (f[3] != shared_knobs(config_))
      fail(ErrorKind::InvalidArgument, "pycomm: creating group '" + group_name_ + "': rank " + std::to_string(r) +
                                           " has " + knob_differences(f[3], config_, rank_) +
                                           "; these knobs must be the same on every rank");
    PeerInfo& p = ranks_[r];
    p.rank = r;
    p.pid = std::stoi(f[0]);
    p.hostname = f[1];
    p.host_key = f[2];
    const int next_node = static_cast<int>(node_of_host.size());
    p.node = config_.ranks_per_node > 0 ? r / config_.ranks_per_node
                                        : node_of_host.emplace(p.host_key, next_node).first->second;
  }

  std::vector<int> node_of;
  for (const PeerInfo& p : ranks_) node_of.push_back(p.node);
  topology_ = Topology::from_node_of(node_of);

  if (rank_ == 0) store.set(prefix + "/secret", random_secret());
  const std::string secret = store.get(prefix + "/secret");

  // Shared memory within a node when the processes can share it; TCP otherwise.
  std::vector<int> shm_peers, tcp_peers;
  int local_ranks = 0;
  for (const PeerInfo& p : ranks_) {
    const bool same_host = p.host_key == ranks_[rank_].host_key;
    local_ranks += same_host;
    if (p.rank == rank_) continue;
    const bool same_node = same_host && p.node == ranks_[rank_].node;
    if (config_.transport == TransportChoice::Shm && !same_host)
      fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_TRANSPORT=shm but " + p.describe() + " is on another host");
    (same_node && config_.transport != TransportChoice::Tcp ? shm_peers : tcp_peers).push_back(p.rank);
  }

  TransportSetup setup;
  setup.store = &store;
  setup.key_prefix = prefix;
  setup.rank = rank_;
  setup.size = size_;
  setup.ranks = ranks_;
  setup.secret = secret;
  setup.config = &config_;
  // Oversubscribed ranks poll for less time; their polls yield the core (spin_until), so
  // the peer they wait for gets to run, which beats a futex sleep and wake by far.
  const int spin_us = config_.spin_us >= 0 ? config_.spin_us : (local_ranks <= cores_available() ? 50 : 30);
  setup.spin.spin = std::chrono::microseconds(spin_us);
  spin_ = setup.spin;
  setup.deadline = Deadline::after(timeout_);
  channels_.assign(size_, nullptr);
  chunk_bytes_ = config_.shm_chunk_bytes;
  // Every rank computes the same shm/tcp split for every pair, so all agree on whether
  // TCP is in use anywhere in the group and hence on chunk_bytes_.
  bool group_uses_tcp = false;
  for (const PeerInfo& a : ranks_)
    for (const PeerInfo& b : ranks_)
      if (a.rank != b.rank && (config_.transport == TransportChoice::Tcp || a.host_key != b.host_key || a.node != b.node))
        group_uses_tcp = true;
  if (group_uses_tcp) chunk_bytes_ = std::min(chunk_bytes_, config_.tcp_chunk_bytes);
  group_uses_tcp_ = group_uses_tcp;

  // Transports are created in the same order on every rank, each only where it has
  // peers; set-up waits only on peers that create the same transport.
  for (bool shm : {true, false}) {
    setup.peers = shm ? shm_peers : tcp_peers;
    if (setup.peers.empty()) continue;
    transports_.push_back(shm ? make_shm_transport(setup) : make_tcp_transport(setup));
    for (int p : setup.peers) channels_[p] = transports_.back()->channel(p);
  }
  calibrate(store, prefix);
  if (config_.log_level >= LogLevel::Info) {
    std::ostringstream os;
    os << "pycomm: group '" << group_name_ << "' rank " << rank_ << "/" << size_ << " node "
       << ranks_[rank_].node << ": " << describe_transports() << ", chunk " << chunk_bytes_
       << " B, spin " << spin_us << " us; link costs intra " << costs_.intra.latency_us << " us + "
       << costs_.intra.bytes_per_us / 1e3 << " GB/s, inter " << costs_.inter.latency_us << " us + "
       << costs_.inter.bytes_per_us / 1e3 << " GB/s";
    log_line(os.str());
  }
}

// Link costs are measured on one pair per link class (the lowest-numbered pair within a
// node, and across nodes) and shared through the store, so that every rank selects
// algorithms from the same numbers. With PYCOMM_LINK_COSTS naming an existing file, rank
// 0 reads it instead ("intra <latency_us> <bytes_per_us>" and "inter ..." lines); naming
// a missing file, rank 0 writes the measured costs there.
void Communicator::calibrate(Store& store, const std::string& prefix) {
  const std::string& file = config_.link_costs_file;
  if (rank_ == 0) {
    std::ifstream in(file);
    std::stringstream text;
    if (!file.empty() && in) text << in.rdbuf();
    store.set(prefix + "/linkcost/file", text.str());
  }
  const std::string cached = store.get(prefix + "/linkcost/file");
  LinkCost* classes[2] = {&costs_.intra, &costs_.inter};
  const char* names[2] = {"intra", "inter"};
  for (int cls = 0; cls < 2; ++cls) {
    std::string value;
    std::istringstream lines(cached);
    for (std::string line; std::getline(lines, line);)
      if (line.rfind(std::string(names[cls]) + " ", 0) == 0) value = line.substr(std::strlen(names[cls]) + 1);
    if (value.empty()) {
      int a = -1, b = -1;
      for (int i = 0; i < size_ && a < 0; ++i)
        for (int j = i + 1; j < size_ && a < 0; ++j)
          if ((topology_.node_of[i] == topology_.node_of[j]) == (cls == 0)) { a = i; b = j; }
      if (a < 0) continue;  // no such link: the class does not matter
      const std::string key = prefix + "/linkcost/" + names[cls];
      Context cx = context();
      cx.stamp.collective = static_cast<uint8_t>(Collective::Barrier);
      cx.deadline = Deadline::after(timeout_);
      // Within a node the latency is a step of the whole node's ranks at once (they may
      // outnumber the cores); across nodes, and for bandwidth, the lone pair's.
      const std::vector<int>& node = topology_.nodes[topology_.node_of[a]];
      double step_us = 0;
      if (cls == 0 && topology_.node_of[rank_] == topology_.node_of[a]) step_us = step_latency_us(cx.team(node));
      if (rank_ == a || rank_ == b) {
        LinkCost c = ping_pong(cx, rank_ == a ? b : a, rank_ == a);
        if (cls == 0) c.latency_us = step_us;
        if (rank_ == a) store.set(key, std::to_string(c.latency_us) + " " + std::to_string(c.bytes_per_us));
      }
      value = store.get(key);
    }
    std::istringstream fields(value);
    if (!(fields >> classes[cls]->latency_us >> classes[cls]->bytes_per_us) || classes[cls]->bytes_per_us <= 0)
      fail(ErrorKind::InvalidArgument, "pycomm: malformed link costs '" + value + "' (PYCOMM_LINK_COSTS=" + file + ")");
  }
  if (rank_ == 0 && !file.empty() && cached.empty()) {
    std::ofstream out(file);
    out << "intra " << costs_.intra.latency_us << " " << costs_.intra.bytes_per_us << "\n"
        << "inter " << costs_.inter.latency_us << " " << costs_.inter.bytes_per_us << "\n";
  }
}

struct Communicator::DevicePath {
  std::unique_ptr<DeviceOps> ops;                // first: everything below uses it
  std::unique_ptr<Transport> ipc;                // to ranks of this host; null: none
  std::vector<std::unique_ptr<Channel>> staged;  // to the others, over the host channels
  std::vector<Channel*> channels;                // by group rank; null for self
  std::unique_ptr<DeviceTeam> team;              // the whole group on this host; null: none
  size_t chunk_bytes = 0;
  Workspace workspace;
  explicit DevicePath(std::unique_ptr<DeviceOps> o) : ops(std::move(o)), workspace(*ops) {}
};

// Every rank makes its path in the same collective (its first on CUDA tensors), so the
// store keys of the n-th path made in this group agree whichever device each rank uses.
Communicator::DevicePath& Communicator::device_path(int device) {
  {
    std::lock_guard<std::mutex> lock(devices_mutex_);
    const auto it = devices_.find(device);
    if (it != devices_.end()) return *it->second;
  }
  const DeviceRuntime& runtime = device_runtime();
  auto path = std::make_unique<DevicePath>(runtime.make_ops(device));
  TransportSetup setup;
  setup.store = store_;
  setup.key_prefix = prefix_ + "/device/" + std::to_string(devices_.size());
  setup.rank = rank_;
  setup.size = size_;
  setup.ranks = ranks_;
  setup.config = &config_;
  setup.chunk_bytes = config_.cuda_chunk_bytes;
  setup.spin = spin_;
  setup.deadline = Deadline::after(timeout_);
  for (const PeerInfo& p : ranks_)
    if (p.rank != rank_ && p.host_key == ranks_[rank_].host_key && config_.transport != TransportChoice::Tcp)
      setup.peers.push_back(p.rank);
  if (!setup.peers.empty()) path->ipc = make_shm_transport(setup, runtime.make_slot_arena(device));
  if (path->ipc && setup.peers.size() + 1 == static_cast<size_t>(size_) && config_.cuda_flag_bytes)
    path->team = runtime.make_team(device, setup);
  path->channels.assign(size_, nullptr);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Channel* ipc = path->ipc ? path->ipc->channel(p) : nullptr;
    if (!ipc) path->staged.push_back(make_staged_channel(*channels_[p], *path->ops));
    path->channels[p] = ipc ? ipc : path->staged.back().get();
  }
  // The same on every rank: the smallest slot of any channel in the group.
  path->chunk_bytes = group_uses_tcp_ ? std::min(config_.cuda_chunk_bytes, config_.tcp_chunk_bytes)
                                      : config_.cuda_chunk_bytes;
  if (config_.log_level >= LogLevel::Info)
    log_line("pycomm: group '" + group_name_ + "' rank " + std::to_string(rank_) + ": " + runtime.name() + ":" +
             std::to_string(device) + ": " + std::to_string(setup.peers.size()) + " peers over " +
             (path->ipc ? path->ipc->name() : "-") + ", " + std::to_string(path->staged.size()) +
             " staged through host memory, chunk " + std::to_string(path->chunk_bytes) + " B" +
             (path->team ? ", flag-synchronized one-shot up to " + std::to_string(path->team->capacity()) + " B"
                         : ""));
  std::lock_guard<std::mutex> lock(devices_mutex_);
  return *devices_.emplace(device, std::move(path)).first->second;
}

Context Communicator::context() const {
  Context cx;
  cx.rank = rank_;
  cx.size = size_;
  cx.world = size_;
  cx.channels = &channels_;
  cx.topology = &topology_;
  cx.ops = &cpu_ops();
  cx.chunk_bytes = chunk_bytes_;
  // Transports only: the caller's failure then poisons the group with the full story.
  cx.abort = [this](const std::string& reason) { abort_transports(reason); };
  cx.perturb = perturb_.get();
  cx.fault = fault_.get();
  cx.trace = frame_trace_.get();
  cx.workspace = &workspace_;
  return cx;
}

Plan Communicator::plan(const Request& rq, size_t device_team_bytes) const {
  PlanInput in;
  in.collective = rq.collective;
  in.dtype = rq.dtype;
  in.bytes = rq.count * element_size(rq.dtype) * (rq.collective == Collective::AllReduce ? 1 : size_);
  in.options = rq.options;
  in.topology = &topology_;
  in.chunk_bytes = chunk_bytes_;
  in.costs = costs_;
  in.device_memory = rq.device >= 0;
  in.device_team_bytes = device_team_bytes;
  return make_plan(in);
}

size_t Communicator::device_team_bytes(int device) const {
  std::lock_guard<std::mutex> lock(devices_mutex_);
  const auto it = devices_.find(device);
  return it != devices_.end() && it->second->team ? it->second->team->capacity() : 0;
}

std::string Communicator::describe_transports() const {
  std::ostringstream os;
  bool first_transport = true;
  for (const auto& t : transports_) {
    os << (first_transport ? "" : "; ") << t->name() << ": ranks ";
    first_transport = false;
    bool first = true;
    for (int p = 0; p < size_; ++p)
      if (t->channel(p)) { os << (first ? "" : ",") << p; first = false; }
  }
  return transports_.empty() ? "no peers" : os.str();
}

void Communicator::validate(Request& rq) const {
  const auto bad = [](const std::string& what) { fail(ErrorKind::InvalidArgument, "pycomm: " + what); };
  const char* name = name_of(rq.collective);
  if (reduces(rq.collective)) {
    check_reducible(rq.dtype, rq.reduction);
    rq.reduction = normalized(rq.dtype, rq.reduction);
  }
  if (has_root(rq.collective) && (rq.root < 0 || rq.root >= size_))
    bad(std::string(name) + ": root " + std::to_string(rq.root) + " is not a rank of this group of " + std::to_string(size_));
  const bool any_source = rq.collective == Collective::Recv && rq.root == kAnySource;
  if (any_source && size_ < 2) bad("recv from any source in a group of one rank: no rank could send");
  if ((rq.collective == Collective::Send || rq.collective == Collective::Recv) && !any_source &&
      (rq.root < 0 || rq.root >= size_ || rq.root == rank_))
    bad(std::string(name) + ": peer " + std::to_string(rq.root) + " is not another rank of this group of " + std::to_string(size_));
  if (rq.collective == Collective::AllToAll &&
      (rq.send_counts.size() != static_cast<size_t>(size_) || rq.recv_counts.size() != static_cast<size_t>(size_)))
    bad("alltoall: split sizes must list one count per rank");
  rq.options.compression = applied_compression(rq.collective, rq.dtype, rq.options.compression);
  if (rq.options.compression != Compression::None && !rq.options.compression_block)
    rq.options.compression_block = config_.compression_block;
}

OpStamp Communicator::stamp_for(const Request& rq, const Plan& plan) {
  OpStamp s;
  s.variant = static_cast<uint8_t>(plan.variant);
  s.count = rq.count;
  s.dtype = static_cast<uint8_t>(rq.dtype);
  s.reduce = static_cast<uint8_t>(rq.reduction.kind);
  s.collective = static_cast<uint8_t>(rq.collective);
  s.root = rq.root;
  s.compression = static_cast<uint8_t>(rq.options.compression);
  s.determinism = static_cast<uint8_t>(rq.options.determinism);
  if (rq.options.compression != Compression::None)
    while ((size_t{1} << s.compression_block) < rq.options.compression_block) ++s.compression_block;
  if (rq.collective == Collective::Send || rq.collective == Collective::Recv) {
    // Numbered on the pair's own stream: sends_to_[p] belongs to p's send lane,
    // recvs_from_[p] to whoever holds receiving_[p]. A recv from any source is numbered
    // once it knows its sender (receive_from_any).
    s.root = rq.tag;
    if (rq.collective == Collective::Send) s.seq = sends_to_[rq.root]++;
    else if (rq.root != kAnySource) s.seq = recvs_from_[rq.root]++;
  } else {
    s.seq = ++collective_seq_;
  }
  return s;
}

namespace {

// S of an operation as nccl-tests counts it: the whole array (per-rank counts times ranks).
uint64_t operation_bytes(const Request& rq, int size) {
  const uint64_t es = element_size(rq.dtype);
  switch (rq.collective) {
    case Collective::ReduceScatter:
    case Collective::AllGather:
    case Collective::Gather:
    case Collective::Scatter: return rq.count * es * static_cast<uint64_t>(size);
    case Collective::AllToAll: {
      uint64_t n = 0;
      for (size_t c : rq.send_counts) n += c;
      return n * es;
    }
    case Collective::Barrier: return 0;
    default: return rq.count * es;
  }
}

}  // namespace

Communicator::Choices Communicator::choices(const Request& rq, const Plan& plan) {
  return {name_of(plan.variant), name_of(rq.options.compression), name_of(rq.options.determinism)};
}

Communicator::Choices Communicator::choices(const Request& rq) const {
  return choices(rq, plan(rq, rq.device >= 0 ? device_team_bytes(rq.device) : 0));
}

std::string Communicator::operation_line(const OpStamp& stamp) const {
  return "pycomm: group '" + group_name_ + "': " + describe(stamp);
}

std::string Communicator::stats_json() const {
  return recorder_.stats_json({group_name_, rank_, size_});
}

std::string Communicator::flight_recorder_json(const std::string& reason) const {
  return recorder_.dump_json({group_name_, rank_, size_}, reason);
}

std::string Communicator::dump_flight_recorder(const std::string& reason, const std::string& path) const {
  std::string file = path;
  if (file.empty()) {
    std::string group = group_name_;  // a file name: keep [A-Za-z0-9_.-]
    for (char& c : group)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') c = '_';
    file = config_.flight_recorder_dir + "/pycomm-flight-recorder-" + group + "-rank" + std::to_string(rank_) +
           "-pid" + std::to_string(getpid()) + ".json";
  }
  if (!write_file_atomically(file, flight_recorder_json(reason)))
    fail(ErrorKind::InvalidArgument, errno_message("pycomm: cannot write the flight recorder to " + file));
  return file;
}

int Communicator::await_sender(const Context& cx, int tag, std::unique_lock<std::mutex>& held) {
  // No channel offers a wait on several peers at once (a futex per shm ring, a condition
  // per TCP transport), so this polls, sleeping between rounds from 20 us up to 1 ms: a
  // waiting receiver costs no core, whatever the ranks per core. A peer whose receive
  // side is busy (a recv named for it is running) is skipped: that recv takes its frames.
  // A peer that can send no more (it left, failed or aborted) is skipped too: the recv
  // fails with the first such failure only once no peer is left that could send.
  std::vector<char> gone(size_, 0);
  int left = size_ - 1;
  std::optional<Error> first_failure;
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || gone[p]) continue;
      std::unique_lock<std::mutex> lock(receiving_[p], std::try_to_lock);
      if (!lock) continue;
      std::optional<FrameHeader> next;
      try {
        next = channels_[p]->peek_recv();
      } catch (const Error& e) {
        gone[p] = 1;
        if (!first_failure) first_failure = e;
        if (--left == 0) throw *first_failure;
        continue;
      }
      if (next && next->op.collective == static_cast<uint8_t>(Collective::Send) && next->op.root == tag) {
        held = std::move(lock);
        return p;
      }
    }
    if (cx.deadline.expired())
      fail(ErrorKind::Timeout, "timed out waiting for a send with tag " + std::to_string(tag) + " from any rank");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void Communicator::receive_from_any(Context& cx, const Request& rq) {
  std::unique_lock<std::mutex> held;
  Request matched = rq;
  matched.root = await_sender(cx, rq.tag, held);
  cx.stamp.seq = recvs_from_[matched.root]++;
  p2p_recv(cx, matched);
  if (rq.source) *rq.source = matched.root;
}

void Communicator::fail_if_poisoned(const std::string& operation) {
  std::lock_guard<std::mutex> lock(poison_mutex_);
  if (!poison_.empty())
    fail(ErrorKind::PeerFailure, "pycomm: " + operation + " on group '" + group_name_ +
                                     "' not started: the group failed earlier: " + poison_);
}

Plan Communicator::execute(const Request& rq) {
  // A recv named for a peer owns that peer's receive side for its whole run (see
  // await_sender); taken before the stamp numbers it.
  std::unique_lock<std::mutex> receiving;
  if (rq.collective == Collective::Recv && rq.root != kAnySource)
    receiving = std::unique_lock<std::mutex>(receiving_[rq.root]);
  Context cx = context();
  if (rq.device >= 0) {
    // The plan depends on the device's team, which the first operation on the device sets up.
    fail_if_poisoned(name_of(rq.collective));
    DevicePath* d = nullptr;
    try {
      d = &device_path(rq.device);
    } catch (const Error& e) {
      const std::string what = "pycomm: " + std::string(name_of(rq.collective)) + " on group '" + group_name_ +
                               "' failed on rank " + std::to_string(rank_) + ": setting up cuda:" +
                               std::to_string(rq.device) + ": " + e.what();
      abort(what);
      throw Error(e.kind(), what);
    }
    cx.ops = d->ops.get();
    cx.channels = &d->channels;
    cx.chunk_bytes = d->chunk_bytes;
    cx.workspace = &d->workspace;
    cx.device_team = d->team.get();
  }
  const Plan plan = this->plan(rq, cx.device_team ? cx.device_team->capacity() : 0);
  cx.stamp = stamp_for(rq, plan);
  fail_if_poisoned(describe(cx.stamp));
  const uint64_t bytes = operation_bytes(rq, size_);
  const uint64_t record = recorder_.begin(cx.stamp, bytes, rq.device);
  if (config_.log_level >= LogLevel::Trace)
    log_line(operation_line(cx.stamp) + ": rank " + std::to_string(rank_) + " starts");
  const auto started = std::chrono::steady_clock::now();
  cx.deadline = Deadline::after(rq.timeout.count() > 0 ? rq.timeout : timeout_);
  try {
    if (fault_) fault_->at(FaultPoint::Before, cx.stamp, cx.abort);
    if (rq.collective == Collective::Recv && rq.root == kAnySource) receive_from_any(cx, rq);
    else plan.run(cx, rq);
    // Inside the try: a fault raised here fails this operation like any other failure.
    if (fault_) fault_->at(FaultPoint::After, cx.stamp, cx.abort);
  } catch (const Error& e) {
    std::string what = "pycomm: " + describe(cx.stamp) + " on group '" + group_name_ + "' failed on rank " +
                       std::to_string(rank_) + ": " + e.what();
    if (e.kind() == ErrorKind::Timeout)
      what += " within its timeout of " + std::to_string((rq.timeout.count() > 0 ? rq.timeout : timeout_).count()) + " ms";
    recorder_.end(record, what);
    if (abort(what) && config_.flight_recorder_entries) {
      // The failure that poisoned the group: its story is in the flight recorder.
      try {
        what += " (flight recorder: " + dump_flight_recorder(what) + ")";
      } catch (const Error& not_written) {
        log_line(not_written.what());
      }
    }
    throw Error(e.kind(), what);
  }
  recorder_.end(record);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started).count();
  if (config_.log_level >= LogLevel::Trace || (config_.log_level >= LogLevel::Info && rank_ == 0)) {
    std::ostringstream line;
    line << operation_line(cx.stamp) << ": ";
    if (config_.log_level >= LogLevel::Trace) line << "rank " << rank_ << " ends: ";
    if (selects_algorithm(rq.collective))
      line << (plan.fallback.empty() ? (rq.options.algorithm == Algorithm::Auto ? "selected" : "requested")
                                     : plan.fallback + ", using " + name_of(plan.algorithm))
           << ", ";
    line << bytes << " B, algorithm " << name_of(plan.variant) << ", compression "
         << name_of(rq.options.compression) << ", determinism " << name_of(rq.options.determinism) << ", "
         << std::fixed << std::setprecision(1) << us << " us";
    log_line(line.str());
  }
  return plan;
}

bool Communicator::abort(const std::string& reason) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(poison_mutex_);
    if (poison_.empty()) {
      poison_ = reason;
      first = true;
    }
  }
  abort_transports(reason);
  return first;
}

void Communicator::abort_transports(const std::string& reason) const {
  for (auto& t : transports_) t->abort(reason);
  std::lock_guard<std::mutex> lock(devices_mutex_);
  for (auto& [device, path] : devices_) {
    if (path->ipc) path->ipc->abort(reason);
    if (path->team) path->team->abort();
  }
}

}  // namespace pycomm
