#include "runtime/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <iomanip>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace pycomm {

namespace {

// The all-gather of one int64 per rank that exchanges result hashes (PYCOMM_VERIFY); its
// buffers are the caller's.
Request hash_exchange() {
  Request rq;
  rq.collective = Collective::AllGather;
  rq.dtype = DataType::Int64;
  rq.count = 1;
  return rq;
}

}  // namespace

Communicator::Communicator(Store& store, int rank, int size, std::string group_name, std::chrono::milliseconds timeout,
                           Config config)
    : rank_(rank),
      size_(size),
      group_name_(std::move(group_name)),
      store_(&store),
      timeout_(timeout),
      config_(std::move(config)),
      sends_to_(size, 0),
      recvs_from_(size, 0),
      receiving_(new std::mutex[size]),
      recorder_(config_.flight_recorder_entries, config_.verify_every) {
  if (size < 1 || rank < 0 || rank >= size)
    fail(ErrorKind::InvalidArgument,
         "pycomm: rank " + std::to_string(rank) + " outside a group of " + std::to_string(size));
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
  if (config_.verify_every) verify_plan_ = make_plan(plan_input(hash_exchange(), 0));
  // Armed after set-up: faults target operations, not the calibration's frames.
  fault_ = FaultInjector::make(faults, rank_);
}

Communicator::~Communicator() {
  // A later transport may ring a doorbell that lives in an earlier one's memory.
  while (!transports_.empty()) transports_.pop_back();
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

PlanInput Communicator::plan_input(const Request& rq, size_t device_team_bytes) const {
  PlanInput in;
  in.collective = rq.collective;
  in.dtype = rq.dtype;
  in.bytes = rq.count * element_size(rq.dtype) * (rq.collective == Collective::AllReduce ? 1 : size_);
  in.options = rq.options;
  in.topology = &topology_;
  in.chunk_bytes = chunk_bytes_;
  in.costs = costs_;
  in.reference_costs = reference_costs_;
  in.network = group_uses_tcp_;
  in.device_memory = rq.device >= 0;
  in.device_team_bytes = device_team_bytes;
  in.from_any_source = rq.collective == Collective::Recv && rq.root == kAnySource;
  return in;
}

Plan Communicator::plan(const Request& rq, size_t device_team_bytes) const {
  const PlanInput in = plan_input(rq, device_team_bytes);
  // The rest of the input (topology, chunk, costs) is fixed for the group's life.
  const auto same = [&](const PlanInput& a) {
    const CallOptions &o = a.options, &p = in.options;
    return a.collective == in.collective && a.dtype == in.dtype && a.bytes == in.bytes && o.algorithm == p.algorithm &&
           o.compression == p.compression && o.compression_block == p.compression_block &&
           o.determinism == p.determinism && a.device_memory == in.device_memory &&
           a.device_team_bytes == in.device_team_bytes && a.from_any_source == in.from_any_source;
  };
  std::lock_guard<std::mutex> lock(plan_memo_mutex_);
  if (!plan_memo_ || !same(plan_memo_->in)) plan_memo_ = PlanMemo{in, make_plan(in)};
  return plan_memo_->plan;
}

std::string Communicator::describe_transports() const {
  std::ostringstream os;
  bool first_transport = true;
  for (const auto& t : transports_) {
    os << (first_transport ? "" : "; ") << t->name() << ": ranks ";
    first_transport = false;
    bool first = true;
    for (int p = 0; p < size_; ++p)
      if (t->channel(p)) {
        os << (first ? "" : ",") << p;
        first = false;
      }
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
    bad(std::string(name) + ": root " + std::to_string(rq.root) + " is not a rank of this group of " +
        std::to_string(size_));
  const bool any_source = rq.collective == Collective::Recv && rq.root == kAnySource;
  if (any_source && size_ < 2) bad("recv from any source in a group of one rank: no rank could send");
  if ((rq.collective == Collective::Send || rq.collective == Collective::Recv) && !any_source &&
      (rq.root < 0 || rq.root >= size_ || rq.root == rank_))
    bad(std::string(name) + ": peer " + std::to_string(rq.root) + " is not another rank of this group of " +
        std::to_string(size_));
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
  s.set_codec(rq.options.compression, rq.options.compression_block);
  s.determinism = static_cast<uint8_t>(rq.options.determinism);
  if (rq.collective == Collective::Send || rq.collective == Collective::Recv) {
    // Numbered on the pair's own stream: sends_to_[p] belongs to p's send lane,
    // recvs_from_[p] to whoever holds receiving_[p]. A recv from any source is numbered
    // once it knows its sender (match).
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
    case Collective::Scatter:
      return rq.count * es * static_cast<uint64_t>(size);
    case Collective::AllToAll: {
      uint64_t n = 0;
      for (size_t c : rq.send_counts) n += c;
      return n * es;
    }
    case Collective::Barrier:
      return 0;
    default:
      return rq.count * es;
  }
}

// The bytes of this rank's output of `rq`, from rq.output.
uint64_t output_bytes(const Request& rq, int rank, int size) {
  const uint64_t es = element_size(rq.dtype);
  switch (rq.collective) {
    case Collective::AllGather:
      return rq.count * es * static_cast<uint64_t>(size);
    case Collective::Gather:
      return rank == rq.root ? rq.count * es * static_cast<uint64_t>(size) : 0;
    case Collective::AllToAll: {
      uint64_t n = 0;
      for (size_t c : rq.recv_counts) n += c;
      return n * es;
    }
    case Collective::Send:
    case Collective::Barrier:
      return 0;
    default:
      return rq.count * es;
  }
}

// The collectives whose results are the same bits on every rank (all-reduce in every
// determinism mode: D0), which PYCOMM_VERIFY compares.
bool identical_on_every_rank(Collective c) {
  return c == Collective::AllReduce || c == Collective::AllGather || c == Collective::Broadcast;
}

// PYCOMM_FAULT's flip: the lowest bit of the first byte of this rank's output, if any.
void flip_output(const Context& cx, const Request& rq) {
  if (!output_bytes(rq, cx.rank, cx.size)) return;
  unsigned char first = 0;
  cx.ops->copy(&first, rq.output, 1);
  first ^= 1;
  cx.ops->copy(rq.output, &first, 1);
}

// Empty when every rank's result hash is the same; else which ranks differ: those outside
// the largest set of ranks with one hash where that set is larger than any other, else
// every set.
std::string disagreement(const std::vector<int64_t>& hashes) {
  std::map<int64_t, std::vector<int>> ranks_of;
  for (size_t r = 0; r < hashes.size(); ++r) ranks_of[hashes[r]].push_back(static_cast<int>(r));
  if (ranks_of.size() == 1) return "";
  std::vector<std::vector<int>> sets;
  for (auto& entry : ranks_of) sets.push_back(std::move(entry.second));
  std::sort(sets.begin(), sets.end(), [](const std::vector<int>& a, const std::vector<int>& b) {
    return a.size() != b.size() ? a.size() > b.size() : a < b;
  });
  const auto ranks = [](const std::vector<int>& set) {
    std::string s = set.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < set.size(); ++i) s += (i ? "," : "") + std::to_string(set[i]);
    return s;
  };
  const std::string what = "results differ between ranks (PYCOMM_VERIFY)";
  if (sets[0].size() > sets[1].size()) {
    std::vector<int> others;
    for (size_t i = 1; i < sets.size(); ++i) others.insert(others.end(), sets[i].begin(), sets[i].end());
    std::sort(others.begin(), others.end());
    return what + ": the result" + (others.size() == 1 ? " of " : "s of ") + ranks(others) +
           (others.size() == 1 ? " differs" : " differ") + " from the majority's (" + ranks(sets[0]) + ")";
  }
  std::string out =
      what + ", with no majority: " + ranks(sets[0]) + (sets[0].size() == 1 ? " holds" : " hold") + " one result";
  for (size_t i = 1; i < sets.size(); ++i) out += ", " + ranks(sets[i]) + " another";
  return out;
}

}  // namespace

Communicator::Choices Communicator::choices(const Request& rq, const Plan& plan) {
  return {name_of(plan.variant), name_of(rq.options.compression), name_of(rq.options.determinism)};
}

void Communicator::post_recv(int peer, int tag) { inboxes_.at(static_cast<size_t>(peer)).posted(tag); }

Plan Communicator::plan_before_running(const Request& rq) const {
  return plan(rq, rq.device >= 0 ? device_team_bytes(rq.device) : 0);
}

std::string Communicator::operation_line(const OpStamp& stamp) const {
  return "pycomm: group '" + group_name_ + "': " + describe(stamp);
}

std::string Communicator::stats_json() const {
  std::string fallback = shm_fallback_;
  {
    std::lock_guard<std::mutex> lock(devices_mutex_);
    if (!device_fallbacks_.empty()) fallback += (fallback.empty() ? "" : "; ") + device_fallbacks_;
  }
  return recorder_.stats_json({group_name_, rank_, size_}, {describe_transports(), chunk_bytes_, fallback});
}

std::string Communicator::flight_recorder_json(const std::string& reason) const {
  return recorder_.dump_json({group_name_, rank_, size_}, reason);
}

std::string Communicator::dump_flight_recorder(const std::string& reason, const std::string& path) const {
  return recorder_.dump({group_name_, rank_, size_}, reason, config_.flight_recorder_dir, path);
}

int Communicator::await_sender(const Context& cx, int tag, std::unique_lock<std::mutex>& held) {
  // Looks at every peer, then sleeps on the doorbell until something arrives or a recv
  // named for a peer lets go of it (a slice at most: peers' liveness is checked per look).
  // A peer whose receive side is busy (a recv named for it is running) is skipped: that
  // recv holds the messages of other tags aside and rings on leaving. A peer that can send
  // no more (it left, failed or aborted) is skipped too: the recv fails with the first
  // such failure only once no peer is left that could send.
  std::vector<char> gone(size_, 0);
  int left = size_ - 1;
  std::optional<Error> first_failure;
  for (;;) {
    const Doorbell::Armed armed(doorbell_);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || gone[p]) continue;
      std::unique_lock<std::mutex> lock(receiving_[p], std::try_to_lock);
      if (!lock) continue;
      try {
        if (inboxes_[p].offers(*channels_[p], tag)) {
          held = std::move(lock);
          return p;
        }
      } catch (const Error& e) {
        gone[p] = 1;
        if (!first_failure) first_failure = e;
        if (--left == 0) throw *first_failure;
      }
    }
    if (cx.deadline.expired())
      fail(ErrorKind::Timeout, "timed out waiting for a send with tag " + std::to_string(tag) + " from any rank");
    armed.wait(
        std::min(std::chrono::milliseconds(kLivenessSlice), cx.deadline.remaining() + std::chrono::milliseconds(1)));
  }
}

int Communicator::match(Context& recv, int tag, std::unique_lock<std::mutex>& held) {
  const int peer = await_sender(recv, tag, held);
  recv.stamp.seq = recvs_from_[peer]++;
  recv.inbox = &inboxes_[peer];
  return peer;
}

void Communicator::fail_poisoned(const std::string& operation) {
  std::lock_guard<std::mutex> lock(poison_mutex_);
  if (!poison_.empty())
    fail(ErrorKind::PeerFailure,
         "pycomm: " + operation + " on group '" + group_name_ + "' not started: the group failed earlier: " + poison_);
}

Plan Communicator::execute(const Request& rq, const Plan* planned) {
  // A recv named for a peer owns that peer's receive side for its whole run (see
  // await_sender); taken before the stamp numbers it.
  std::unique_lock<std::mutex> receiving;
  if (rq.collective == Collective::Recv && rq.root != kAnySource)
    receiving = std::unique_lock<std::mutex>(receiving_[rq.root]);
  // Letting go of it rings the doorbell: a recv from any source may be waiting for it.
  struct LetGo {
    std::unique_lock<std::mutex>& lock;
    const Doorbell& bell;
    ~LetGo() {
      if (!lock.owns_lock()) return;
      lock.unlock();
      bell.ring();
    }
  } let_go{receiving, doorbell_};
  Context cx = context();
  cx.senders = this;
  if (receiving) {
    cx.inbox = &inboxes_[rq.root];
    cx.inbox->started(rq.tag);
  }
  if (rq.device >= 0) {
    // The plan depends on the device's team, which the first collective on the device sets up.
    if (poisoned()) fail_poisoned(name_of(rq.collective));
    try {
      use_device(cx, rq);
    } catch (const Error& e) {
      const std::string what = "pycomm: " + std::string(name_of(rq.collective)) + " on group '" + group_name_ +
                               "' failed on rank " + std::to_string(rank_) +
                               ": setting up cuda:" + std::to_string(rq.device) + ": " + e.what();
      abort(what);
      throw Error(e.kind(), what);
    }
  }
  const Plan plan =
      planned && rq.device < 0 ? *planned : this->plan(rq, cx.device_team ? cx.device_team->capacity() : 0);
  cx.stamp = stamp_for(rq, plan);
  if (poisoned()) fail_poisoned(describe(cx.stamp));
  if (rq.stream && plan.variant != Variant::OneShotFlags)
    fail(ErrorKind::InvalidArgument,
         "pycomm: " + describe(cx.stamp) + " on cuda:" + std::to_string(rq.device) +
             " cannot be enqueued on the caller's stream (a CUDA graph being captured): only all-reduces that the "
             "group's device team runs can (ranks of one host mapping each other's CUDA memory, uncompressed, at most "
             "PYCOMM_CUDA_FLAG_BYTES); this one runs " +
             name_of(plan.variant));
  // Every rank counts the same calls in the same order, so all verify the same ones. A
  // call enqueued on the caller's stream has no result yet to verify: counted, not verified.
  const bool verifying = config_.verify_every && identical_on_every_rank(rq.collective) &&
                         ++identical_results_ % config_.verify_every == 0 && !rq.stream;
  const uint64_t bytes = operation_bytes(rq, size_);
  const auto started = Clock::now();
  const uint64_t record = recorder_.begin(cx.stamp, bytes, rq.device, started);
  if (config_.log_level >= LogLevel::Trace)
    log_line(operation_line(cx.stamp) + ": rank " + std::to_string(rank_) + " starts");
  cx.deadline = Deadline{started + (rq.timeout.count() > 0 ? rq.timeout : timeout_)};
  try {
    if (fault_) fault_->at(FaultPoint::Before, cx.stamp, cx.abort);
    plan.run(cx, rq);
    // Inside the try: a fault raised here fails this operation like any other failure; a
    // flip comes before the verification, which must find it.
    if (fault_) fault_->at(FaultPoint::After, cx.stamp, cx.abort, [&] { flip_output(cx, rq); });
    if (verifying) verify(cx, rq);
  } catch (const Error& e) {
    std::string what = "pycomm: " + describe(cx.stamp) + " on group '" + group_name_ + "' failed on rank " +
                       std::to_string(rank_) + ": " + e.what();
    if (e.kind() == ErrorKind::Timeout)
      what +=
          " within its timeout of " + std::to_string((rq.timeout.count() > 0 ? rq.timeout : timeout_).count()) + " ms";
    recorder_.end(record, what);
    // Results that differ poison the group as any failure does: some rank's are wrong, and
    // so would be all that is computed from them (the job must go back to a checkpoint, or
    // rebuild its group). Every rank finds them alike, from the same hashes, so the
    // transports are not aborted: a peer still taking the exchange's last frames reaches
    // its own verdict rather than "rank r aborted".
    const bool first = e.kind() == ErrorKind::Corruption ? poison(what) : abort(what);
    if (first && config_.flight_recorder_entries) {
      // The failure that poisoned the group: its story is in the flight recorder.
      try {
        what += " (flight recorder: " + dump_flight_recorder(what) + ")";
      } catch (const Error& not_written) {
        log_line(not_written.what());
      }
    }
    throw Error(e.kind(), what);
  }
  const double us = recorder_.end(record);
  if (config_.log_level >= LogLevel::Trace || (config_.log_level >= LogLevel::Info && rank_ == 0)) {
    std::ostringstream line;
    line << operation_line(cx.stamp) << ": ";
    if (config_.log_level >= LogLevel::Trace) line << "rank " << rank_ << " ends: ";
    if (selects_algorithm(rq.collective))
      line << (plan.fallback.empty() ? (rq.options.algorithm == Algorithm::Auto ? "selected" : "requested")
                                     : plan.fallback + ", using " + name_of(plan.algorithm))
           << ", ";
    line << bytes << " B, algorithm " << name_of(plan.variant) << ", compression " << name_of(rq.options.compression)
         << ", determinism " << name_of(rq.options.determinism) << ", " << (verifying ? "verified, " : "") << std::fixed
         << std::setprecision(1) << us << " us";
    log_line(line.str());
  }
  return plan;
}

void Communicator::verify(const Context& cx, const Request& rq) {
  const auto mine = static_cast<int64_t>(cx.ops->hash(rq.output, output_bytes(rq, rank_, size_)));
  std::vector<int64_t> hashes(size_);
  Request exchange = hash_exchange();
  exchange.input = &mine;
  exchange.output = hashes.data();
  Context x = context();  // host memory, whatever memory rq's are in
  x.stamp.seq = cx.stamp.seq;
  x.stamp.collective = cx.stamp.collective;
  x.stamp.verification = 1;
  x.stamp.count = exchange.count;
  x.stamp.dtype = static_cast<uint8_t>(exchange.dtype);
  x.stamp.variant = static_cast<uint8_t>(verify_plan_.variant);
  x.deadline = cx.deadline;
  x.fault = nullptr;  // faults target operations, not their verification
  verify_plan_.run(x, exchange);
  const std::string differ = disagreement(hashes);
  recorder_.verified(differ.empty());
  if (!differ.empty()) fail(ErrorKind::Corruption, differ);
}

bool Communicator::poison(const std::string& reason) {
  std::lock_guard<std::mutex> lock(poison_mutex_);
  if (!poison_.empty()) return false;
  poison_ = reason;
  poisoned_.store(true, std::memory_order_release);
  return true;
}

bool Communicator::abort(const std::string& reason) {
  const bool first = poison(reason);
  abort_transports(reason);
  doorbell_.ring();
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
