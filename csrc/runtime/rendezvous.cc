// Group creation: every rank publishes who and where it is (pid, host, the knobs every
// rank must share, world size), checks the others' against its own, groups the ranks into
// nodes, and connects its transports.
#include <sched.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "runtime/communicator.h"

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

std::string random_secret() {
  unsigned char raw[32];
  if (getrandom(raw, sizeof raw, 0) != static_cast<ssize_t>(sizeof raw))
    fail(ErrorKind::Internal, errno_message("pycomm: getrandom"));
  std::string hex;
  char b[3];
  for (unsigned char c : raw) {
    std::snprintf(b, sizeof b, "%02x", c);
    hex += b;
  }
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
  for (const auto& [name, value] : c.same_on_every_rank)
    out += (out.empty() ? "" : std::string(1, kItemSep)) + name + "=" + value;
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

}  // namespace

int cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

// The same boot of the same machine, mount, pid and network namespace (a network
// namespace stands for a separate host in multi-host tests).
std::string host_key() {
  return hostname() + "|" + read_first_line("/proc/sys/kernel/random/boot_id") + "|" +
         link_target("/proc/self/ns/mnt") + "|" + link_target("/proc/self/ns/pid") + "|" +
         link_target("/proc/self/ns/net");
}

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
    if (claims > 1) found += "; " + rank + " was claimed by " + std::to_string(claims) + " processes";
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
    fail(ErrorKind::InvalidArgument, "pycomm: creating group '" + group_name_ +
                                         "': another process already joined as rank " + std::to_string(rank_) +
                                         " (every process needs a rank of its own)");
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
    const bool same_host = p.shares_host_with(ranks_[rank_]);
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
  std::unique_ptr<ShmSegment> segment = fit_shared_memory(store, prefix, setup, shm_peers, tcp_peers);
  // Every rank computes the same shm/tcp split for every pair, so all agree on whether
  // TCP is in use anywhere in the group (some pair is on different hosts or nodes exactly
  // when some rank differs from rank 0, or shared memory had no room) and hence on
  // chunk_bytes_.
  bool group_uses_tcp = size_ > 1 && (config_.transport == TransportChoice::Tcp || shm_chunk_bytes_ == 0);
  for (const PeerInfo& p : ranks_)
    if (!p.shares_host_with(ranks_[0]) || p.node != ranks_[0].node) group_uses_tcp = true;
  chunk_bytes_ = config_.frame_bytes(group_uses_tcp);
  if (shm_chunk_bytes_) chunk_bytes_ = std::min(chunk_bytes_, shm_chunk_bytes_);
  group_uses_tcp_ = group_uses_tcp;

  // Transports are created in the same order on every rank, each only where it has
  // peers; set-up waits only on peers that create the same transport.
  // The doorbell: the shm transport's when there is one, which comes first.
  own_doorbell_ = std::make_unique<DoorbellWord>();
  doorbell_ = Doorbell(own_doorbell_.get());
  setup.linger = timeout_;
  for (bool shm : {true, false}) {
    setup.peers = shm ? shm_peers : tcp_peers;
    if (setup.peers.empty()) continue;
    setup.doorbell = doorbell_;
    transports_.push_back(shm ? make_shm_transport(setup, std::move(segment)) : make_tcp_transport(setup));
    if (DoorbellWord* word = transports_.back()->doorbell()) doorbell_ = Doorbell(word);
    for (int p : setup.peers) channels_[p] = transports_.back()->channel(p);
  }
  // Messages received ahead of their recv: at most what the pair's slots hold.
  for (int p = 0; p < size_; ++p)
    inboxes_.emplace_back(channels_[p] ? channels_[p]->chunk_bytes() * static_cast<size_t>(config_.pipeline_depth) : 0);
  calibrate(store, prefix);
  if (rank_ == 0 && !shm_fallback_.empty() && config_.log_level >= LogLevel::Warn)
    log_line("pycomm: group '" + group_name_ + "': " + shm_fallback_);
  if (config_.log_level >= LogLevel::Info) {
    std::ostringstream os;
    os << "pycomm: group '" << group_name_ << "' rank " << rank_ << "/" << size_ << " node " << ranks_[rank_].node
       << ": " << describe_transports() << ", chunk " << chunk_bytes_ << " B, spin " << spin_us
       << " us; link costs intra " << costs_.intra.latency_us << " us + " << costs_.intra.bytes_per_us / 1e3
       << " GB/s, inter " << costs_.inter.latency_us << " us + " << costs_.inter.bytes_per_us / 1e3
       << " GB/s (reference: intra " << reference_costs_.intra.latency_us << " us + "
       << reference_costs_.intra.bytes_per_us / 1e3 << " GB/s, inter " << reference_costs_.inter.latency_us << " us + "
       << reference_costs_.inter.bytes_per_us / 1e3 << " GB/s)";
    if (config_.verify_every)
      os << "; verifying 1 in " << config_.verify_every << " all-reduces, all-gathers and broadcasts (PYCOMM_VERIFY)";
    log_line(os.str());
  }
}

// A /dev/shm may lack room for the group's rings (Docker's default is 64 MiB; 16 ranks
// take 240 MiB at the default chunk). Every rank with shared-memory peers reserves its
// segment, and all learn through the store whether every one fitted: if not, every rank
// lets go of its segment, waits until all have, and all try rings of half the chunk, down
// to kMinShmChunkBytes; past that the pairs of a node go over TCP on loopback, or, with
// PYCOMM_TRANSPORT=shm, group creation fails on every rank. Every rank takes part, those
// without such peers too, since the chunk is the group's frame size and the transports
// enter its plans: the outcome is the same on every rank. Sets shm_chunk_bytes_ (0: no
// shared memory) and shm_fallback_; returns this rank's segment (null: none).
std::unique_ptr<ShmSegment> Communicator::fit_shared_memory(Store& store, const std::string& prefix,
                                                            TransportSetup& setup, std::vector<int>& shm_peers,
                                                            std::vector<int>& tcp_peers) {
  constexpr size_t kMinShmChunkBytes = 16 << 10;
  bool group_uses_shm = false;
  for (const PeerInfo& p : ranks_)
    for (const PeerInfo& q : ranks_) group_uses_shm |= p.rank != q.rank && p.shares_host_with(q) && p.node == q.node;
  shm_chunk_bytes_ = 0;
  if (!group_uses_shm || config_.transport == TransportChoice::Tcp) return nullptr;
  // What the segments of this rank's host take at `chunk`: a ring per node peer each.
  const auto host_bytes = [&](size_t chunk) {
    TransportSetup each = setup;
    each.chunk_bytes = chunk;
    size_t bytes = 0;
    for (const PeerInfo& q : ranks_) {
      if (!q.shares_host_with(ranks_[rank_])) continue;
      each.peers.assign(topology_.nodes[q.node].size() - 1, 0);
      if (!each.peers.empty()) bytes += shm_segment_bytes(each);
    }
    return bytes;
  };
  const std::string advice =
      "; raise the size of /dev/shm (docker run --shm-size, say) or lower "
      "PYCOMM_SHM_CHUNK_BYTES or PYCOMM_PIPELINE_DEPTH";
  std::string first_shortage;
  for (size_t chunk = config_.shm_chunk_bytes, attempt = 0;; chunk /= 2, ++attempt) {
    setup.peers = shm_peers;
    setup.chunk_bytes = chunk;
    std::string shortage;
    std::unique_ptr<ShmSegment> segment = shm_peers.empty() ? nullptr : reserve_shm_segment(setup, shortage);
    if (!segment && !shm_peers.empty())
      shortage = "on host " + ranks_[rank_].hostname + ", " + shortage + " of the " +
                 mebibytes(static_cast<double>(host_bytes(chunk))) + " its ranks' rings take";
    const std::string round = prefix + "/shmfit/" + std::to_string(attempt);
    std::string short_on;  // the first rank's shortage, in rank order: the same on every rank
    for (const std::string& s : all_gather_strings(store, round, rank_, size_, shortage, setup.deadline))
      if (short_on.empty() && !s.empty()) short_on = s;
    if (short_on.empty()) {
      shm_chunk_bytes_ = chunk;
      if (attempt)
        shm_fallback_ = "shared memory has no room for rings of " + std::to_string(config_.shm_chunk_bytes) +
                        "-byte slots (" + first_shortage + "): rings of " + std::to_string(chunk) +
                        "-byte slots instead" + advice;
      setup.peers.clear();
      return segment;
    }
    if (first_shortage.empty()) first_shortage = short_on;
    // Room freed here is room for any rank's next try: no rank makes its next segment
    // before every rank has let go of this one.
    segment.reset();
    all_gather_strings(store, round + "/released", rank_, size_, "", setup.deadline);
    if (chunk / 2 >= kMinShmChunkBytes) continue;
    if (config_.transport == TransportChoice::Shm)
      fail(ErrorKind::InvalidArgument, "pycomm: creating group '" + group_name_ + "': shared memory has no room for " +
                                           "rings of " + std::to_string(chunk) + "-byte slots (" + short_on +
                                           ") nor of " + std::to_string(config_.shm_chunk_bytes) + " (" +
                                           first_shortage + "), and PYCOMM_TRANSPORT=shm rules out TCP" + advice);
    shm_fallback_ = "shared memory has no room for the group's rings (" + first_shortage +
                    "): TCP on loopback between the ranks of a node instead" + advice;
    tcp_peers.insert(tcp_peers.end(), shm_peers.begin(), shm_peers.end());
    std::sort(tcp_peers.begin(), tcp_peers.end());
    shm_peers.clear();
    setup.peers.clear();
    return nullptr;
  }
}

}  // namespace pycomm
