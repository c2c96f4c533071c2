// Torch-free tests of the device path's host logic, without a GPU: a stand-in device
// runtime whose "device memory" is host memory (ops forwarded to the CPU ops, slot arenas
// that the threads playing the ranks map by address) carries collectives on device
// requests over the slot-arena shared-memory transport (as CUDA IPC does) and over TCP
// channels staged through device slots (which page-lock the TCP slots while they live).
// Every result must equal the host path's, bit for bit, for every algorithm, compressed
// and not, in every determinism mode. A stand-in team (threads meeting on a board) shows
// which all-reduces the communicator hands to a device team, and that an abort reaches it.
// Point-to-point on device requests travels over the host channels, every byte of the
// device buffers copied by the device's ops, and sets up nothing of the device path.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "barrier.h"
#include "check.h"
#include "runtime/communicator.h"
#include "runtime/device_runtime.h"
#include "world.h"

using namespace pycomm;

namespace {

// Page-locking, as the staged channels ask for it: every range must start a page, and be
// released by the time its communicator is gone.
std::atomic<int> pins_made{0}, pins_held{0};
// Bytes the device ops copied on this thread (a rank's, in these tests).
thread_local size_t device_bytes_copied = 0;

class HostOps final : public DeviceOps {
 public:
  std::shared_ptr<void> pin(void* host, size_t bytes) const override {
    CHECK(reinterpret_cast<uintptr_t>(host) % 4096 == 0 && bytes > 0,
          "pinned range %p (%zu bytes) does not start a page", host, bytes);
    ++pins_made;
    ++pins_held;
    return std::shared_ptr<void>(host, [](void*) { --pins_held; });
  }
  std::shared_ptr<char> allocate(size_t bytes) const override { return cpu_ops().allocate(bytes); }
  void copy(void* dst, const void* src, size_t bytes) const override {
    device_bytes_copied += bytes;
    cpu_ops().copy(dst, src, bytes);
  }
  void reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k, size_t n) const override {
    cpu_ops().reduce_terms(spec, stage, out, terms, k, n);
  }
};

// Set by a rank's thread whose process, as it were, cannot map other ranks' device memory
// (a process that sees only its own GPU).
thread_local bool maps_refused = false;
std::atomic<int> probes_mapped{0};

// Slots in this process's memory; the handle is the address (ranks are threads here).
class HostArena final : public SlotArena {
 public:
  const char* kind() const override { return "host-arena"; }
  std::string allocate(size_t bytes) override {
    memory_.reset(new char[bytes]);
    return std::to_string(reinterpret_cast<uintptr_t>(memory_.get()));
  }
  char* base() override { return memory_.get(); }
  char* map(const std::string& handle, int peer) override {
    if (maps_refused) fail(ErrorKind::PeerFailure, "cannot map the memory of rank " + std::to_string(peer));
    ++probes_mapped;
    return reinterpret_cast<char*>(std::stoull(handle));
  }

 private:
  std::unique_ptr<char[]> memory_;
};

// Where the members of a stand-in team meet: each call, every member copies its input
// here, waits for all, folds them in rank order and waits until all have folded (only
// then may a member's copy change).
struct TeamBoard {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<std::vector<char>> inputs;
  int joined = 0;
  uint64_t arrived = 0, folded = 0;
};

std::mutex boards_mutex;
std::map<std::string, std::shared_ptr<TeamBoard>> boards;  // by key, until every member joined
std::atomic<int> teams_made{0}, team_calls{0}, team_stream_calls{0};

// DeviceTeam's contract in host memory (a timeout at the deadline, a PeerFailure on
// abort, refusal after either), the CPU ops' bits.
class HostTeam final : public DeviceTeam {
 public:
  explicit HostTeam(const TransportSetup& s) : rank_(s.rank), size_(s.size), capacity_(s.config->cuda_flag_bytes) {
    const std::string key = s.key_prefix + "@" + std::to_string(reinterpret_cast<uintptr_t>(s.store));
    std::lock_guard<std::mutex> lock(boards_mutex);
    std::shared_ptr<TeamBoard>& board = boards[key];
    if (!board) {
      board = std::make_shared<TeamBoard>();
      board->inputs.resize(s.size);
    }
    board_ = board;
    if (++board->joined == s.size) boards.erase(key);
  }
  size_t capacity() const override { return capacity_; }
  // On a caller's stream as without one: host memory has no stream to enqueue on.
  void all_reduce(const ReduceSpec& spec, void* out, const void* in, size_t n, const Deadline& deadline,
                  void* stream) override {
    CHECK(n * element_size(spec.dtype) <= capacity_, "team all-reduce of %zu elements past its capacity", n);
    ++team_calls;
    if (stream) ++team_stream_calls;
    std::unique_lock<std::mutex> lock(board_->mutex);
    if (failed_) fail(ErrorKind::PeerFailure, "the team failed earlier");
    const uint64_t all = ++calls_ * size_;
    const auto wait_for = [&](const uint64_t& count) {
      const bool met = board_->changed.wait_until(lock, deadline.at, [&] { return count >= all || aborted_; });
      if (met && !aborted_) return;
      failed_ = true;
      if (aborted_) fail(ErrorKind::PeerFailure, "team aborted");
      fail(ErrorKind::Timeout, "timed out waiting for the team");
    };
    const auto* bytes = static_cast<const char*>(in);
    board_->inputs[rank_].assign(bytes, bytes + n * element_size(spec.dtype));
    ++board_->arrived;
    board_->changed.notify_all();
    wait_for(board_->arrived);
    std::vector<Term> terms;
    for (const std::vector<char>& input : board_->inputs) terms.push_back({input.data(), Form::Input});
    cpu_ops().reduce_terms(spec, Stage::Final, out, terms.data(), size_, n);
    ++board_->folded;
    board_->changed.notify_all();
    wait_for(board_->folded);
  }
  void abort() override {
    std::lock_guard<std::mutex> lock(board_->mutex);
    aborted_ = true;
    board_->changed.notify_all();
  }

 private:
  const int rank_, size_;
  const size_t capacity_;
  std::shared_ptr<TeamBoard> board_;
  uint64_t calls_ = 0;
  bool aborted_ = false, failed_ = false;  // guarded by board_->mutex
};

class HostRuntime final : public DeviceRuntime {
 public:
  const char* name() const override { return "host-test"; }
  std::unique_ptr<DeviceOps> make_ops(int) const override { return std::make_unique<HostOps>(); }
  std::unique_ptr<SlotArena> make_slot_arena(int) const override { return std::make_unique<HostArena>(); }
  void enqueue_reduce_terms(int, void*, const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k,
                            size_t n) const override {
    cpu_ops().reduce_terms(spec, stage, out, terms, k, n);
  }
  void enqueue_reduce_segments(int, void*, const ReduceSpec& spec, Stage stage, void* plain, void* slots,
                               const SegmentSlots& pairs) const override {
    cpu_ops().reduce_segments(spec, stage, plain, slots, pairs);
  }
  void enqueue_write_words(int, void*, int64_t* dst, const int64_t* words, int n) const override {
    std::copy(words, words + n, dst);
  }
  void enqueue_judge_stamps(int, void*, const StampTable& table, int64_t* verdict) const override {
    judge_stamps(table, verdict);
  }
  std::unique_ptr<DeviceTeam> make_team(int, const TransportSetup& setup) const override {
    ++teams_made;
    return std::make_unique<HostTeam>(setup);
  }
};

float value(int rank, size_t i) {
  const float magnitudes[] = {1e-3f, 1.0f, 3e2f, 7e4f};
  return static_cast<float>(static_cast<int>((i * 7919 + rank * 104729) % 2001) - 1000) * magnitudes[(i + rank) % 4] /
         997.0f;
}

// An in-place float32 all-reduce of `data`, on "device" 0 or the host.
Request all_reduce_of(std::vector<float>& data, bool on_device, const CallOptions& options = {}) {
  Request rq;
  rq.options = options;
  rq.count = data.size();
  rq.input = rq.output = data.data();
  rq.device = on_device ? 0 : -1;
  return rq;
}

void run(Communicator& comm, Request rq) {
  comm.validate(rq);
  comm.execute(rq);
}

void test_device_matches_host(int n, TransportChoice transport, int ranks_per_node) {
  const auto configure = [&](Config& cfg) {
    cfg.transport = transport;
    cfg.ranks_per_node = ranks_per_node;
    cfg.cuda_chunk_bytes = 8192;
  };
  with_world(n, configure, [&](int r, Communicator& comm) {
    const size_t count = 5003;
    for (Algorithm a : {Algorithm::Auto, Algorithm::Ring, Algorithm::Tree, Algorithm::OneShot, Algorithm::TwoShot,
                        Algorithm::Hierarchical})
      for (Compression c : {Compression::None, Compression::Fp8E4M3})
        for (Determinism d : {Determinism::Default, Determinism::Ordered, Determinism::Exact}) {
          std::vector<float> host(count), device(count);
          for (size_t i = 0; i < count; ++i) host[i] = device[i] = value(r, i);
          const CallOptions options{a, c, 0, d};  // block 0: the default
          for (bool on_device : {false, true}) run(comm, all_reduce_of(on_device ? device : host, on_device, options));
          // The device path may choose another algorithm for Auto; the others match.
          if (a != Algorithm::Auto || d != Determinism::Default)
            CHECK(std::memcmp(host.data(), device.data(), count * sizeof(float)) == 0,
                  "n=%d rank %d %s %s determinism %d: device bits differ from host bits", n, r, name_of(a), name_of(c),
                  static_cast<int>(d));
        }
    // Reduce-scatter and all-gather, repeated so that device slots are reused across calls.
    std::vector<float> mine(count * n), device(count * n), host(count * n);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = value(r, i);
    for (int rep = 0; rep < 20; ++rep)
      for (Collective c : {Collective::ReduceScatter, Collective::AllGather})
        for (int on_device : {0, 1}) {
          Request rq;
          rq.collective = c;
          rq.input = mine.data();
          rq.output = (on_device ? device : host).data();
          rq.count = count;
          rq.device = on_device ? 0 : -1;
          comm.validate(rq);
          comm.execute(rq);
          const size_t out = c == Collective::ReduceScatter ? count : count * n;
          if (on_device)
            CHECK(std::memcmp(host.data(), device.data(), out * sizeof(float)) == 0,
                  "n=%d rank %d rep %d: device %s differs from host", n, r, rep, name_of(c));
        }
  });
}

bool on_team(bool oneshot, Compression c, size_t bytes, size_t capacity) {
  return oneshot && c == Compression::None && bytes <= capacity;
}

// Which all-reduces a team carries: one-shot (chosen or selected), uncompressed, up to its
// capacity, in every determinism mode, with the host path's bits; nothing else.
void test_team_carries_small_oneshots(int n) {
  constexpr size_t kCapacity = 4096;
  const int made = teams_made, calls = team_calls;
  std::atomic<int> expected{0};
  with_world(
      n, [](Config& cfg) { cfg.cuda_flag_bytes = kCapacity; },
      [&](int r, Communicator& comm) {
        for (size_t count : {size_t{1}, size_t{1000}, kCapacity / sizeof(float), kCapacity / sizeof(float) + 1})
          for (Algorithm a : {Algorithm::Auto, Algorithm::OneShot, Algorithm::Ring, Algorithm::TwoShot})
            for (Compression c : {Compression::None, Compression::Bf16})
              for (Determinism d : {Determinism::Default, Determinism::Exact})
                for (ReduceKind k : {ReduceKind::Sum, ReduceKind::Avg, ReduceKind::Max}) {
                  std::vector<float> host(count), device(count);
                  for (size_t i = 0; i < count; ++i) host[i] = device[i] = value(r, i);
                  for (bool on_device : {false, true}) {
                    Request rq = all_reduce_of(on_device ? device : host, on_device, CallOptions{a, c, 0, d});
                    rq.reduction.kind = k;
                    run(comm, rq);
                  }
                  const bool oneshot = a == Algorithm::Auto || a == Algorithm::OneShot;
                  if (on_team(oneshot, c, count * sizeof(float), kCapacity)) ++expected;
                  // Auto may choose another algorithm on the host, whose order differs.
                  if (a != Algorithm::Auto || d != Determinism::Default)
                    CHECK(std::memcmp(host.data(), device.data(), count * sizeof(float)) == 0,
                          "n=%d rank %d count %zu %s %s determinism %d op %s: team bits differ from host bits", n, r,
                          count, name_of(a), name_of(c), static_cast<int>(d), name_of(k));
                }
      });
  CHECK(teams_made - made == n, "%d teams made for a group of %d on one host", teams_made - made, n);
  CHECK(team_calls - calls == expected, "the team carried %d all-reduces, expected %d", team_calls - calls,
        expected.load());
}

// A request on the caller's stream (as while a CUDA graph captures it) runs on the team
// when the team serves it, and otherwise fails before anything moves, naming why.
void test_calls_on_the_callers_stream() {
  constexpr size_t kCapacity = 4096;
  const int calls = team_calls, on_stream = team_stream_calls;
  int stream_token = 0;
  with_world(
      2, [](Config& cfg) { cfg.cuda_flag_bytes = kCapacity; },
      [&](int r, Communicator& comm) {
        std::vector<float> data(100, r + 1.0f);
        Request rq = all_reduce_of(data, true);
        rq.stream = &stream_token;
        run(comm, rq);
        CHECK(data[0] == 3.0f && data[99] == 3.0f, "rank %d: on the caller's stream the sum is %g, expected 3", r,
              data[0]);
        const auto refused = [&](const char* what, Request bad) {
          bad.stream = &stream_token;
          try {
            run(comm, bad);
            CHECK(false, "rank %d: %s on the caller's stream ran", r, what);
          } catch (const Error& e) {
            CHECK(e.kind() == ErrorKind::InvalidArgument &&
                      std::strstr(e.what(), "cannot be enqueued on the caller's stream") != nullptr,
                  "rank %d: %s on the caller's stream: %s", r, what, e.what());
          }
        };
        refused("a compressed all-reduce", all_reduce_of(data, true, CallOptions{Algorithm::Auto, Compression::Bf16}));
        std::vector<float> large(kCapacity / sizeof(float) + 1, 1.0f);
        refused("an all-reduce past the team's size", all_reduce_of(large, true));
        refused("a ring all-reduce", all_reduce_of(data, true, CallOptions{Algorithm::Ring}));
        // The group goes on: the refusals moved nothing.
        run(comm, all_reduce_of(data, true));
        CHECK(data[0] == 6.0f, "rank %d: after the refusals the sum is %g, expected 6", r, data[0]);
      });
  CHECK(team_stream_calls - on_stream == 2, "%d team calls on a caller's stream, expected 2 (one a rank)",
        team_stream_calls - on_stream);
  CHECK(team_calls - calls == 4, "%d team calls, expected 4", team_calls - calls);
}

// PYCOMM_CUDA_FLAG_BYTES=0: no team.
void test_no_team_without_flag_bytes() {
  const int made = teams_made;
  with_world(
      2, [](Config& cfg) { cfg.cuda_flag_bytes = 0; },
      [&](int, Communicator& comm) {
        std::vector<float> data(16, 1.0f);
        run(comm, all_reduce_of(data, true));
        CHECK(data[0] == 2.0f, "host-driven all-reduce gave %g, expected 2", data[0]);
      });
  CHECK(teams_made == made, "%d team members made with PYCOMM_CUDA_FLAG_BYTES=0", teams_made - made);
}

// A rank that cannot map its peers' device memory gets its pairs staged through host
// memory (the others keep CUDA IPC), with the host path's bits and no team (which needs
// every pair mapped); PYCOMM_CUDA_IPC=off stages every pair and maps nothing. Rank 0 and
// stats say which pairs are staged, and why.
void test_pairs_that_cannot_map_are_staged() {
  for (CudaIpc ipc : {CudaIpc::Auto, CudaIpc::Off}) {
    const int made = teams_made, mapped = probes_mapped;
    with_world(
        3,
        [&](Config& cfg) {
          cfg.cuda_ipc = ipc;
          cfg.cuda_chunk_bytes = 8192;
        },
        [&](int r, Communicator& comm) {
          maps_refused = r == 1;
          for (Algorithm a : {Algorithm::Ring, Algorithm::OneShot, Algorithm::TwoShot})
            for (Compression c : {Compression::None, Compression::Bf16}) {
              std::vector<float> host(3001), device(3001);
              for (size_t i = 0; i < host.size(); ++i) host[i] = device[i] = value(r, i);
              for (bool on_device : {false, true})
                run(comm, all_reduce_of(on_device ? device : host, on_device, {a, c}));
              CHECK(std::memcmp(host.data(), device.data(), host.size() * sizeof(float)) == 0,
                    "rank %d %s %s: device bits differ from host bits with pairs staged", r, name_of(a), name_of(c));
            }
          const std::string stats = comm.stats_json();
          const std::string staged = ipc == CudaIpc::Off ? "rank pairs 0-1, 0-2, 1-2 staged through host memory"
                                                         : "rank pairs 0-1, 1-2 staged through host memory";
          CHECK(stats.find(staged) != std::string::npos, "rank %d: stats do not say '%s': %s", r, staged.c_str(),
                stats.c_str());
          const char* why = ipc == CudaIpc::Off ? "PYCOMM_CUDA_IPC=off" : "on rank 1: cannot map the memory of rank 0";
          CHECK(stats.find(why) != std::string::npos, "rank %d: stats do not say why ('%s'): %s", r, why,
                stats.c_str());
          maps_refused = false;
        });
    CHECK(teams_made == made, "%d team members made where a pair is staged", teams_made - made);
    if (ipc == CudaIpc::Off) CHECK(probes_mapped == mapped, "%d probes mapped with IPC off", probes_mapped - mapped);
  }
}

// An abort reaches a member waiting in its team (a PeerFailure, long before the
// deadline); a member whose peer never comes times out at the deadline.
void test_abort_reaches_the_team() {
  std::vector<Communicator*> comms(3);
  std::atomic<int> ready{0}, finished{0};
  const int calls_before = team_calls;
  with_world(
      3, [](Config& cfg) { cfg.cuda_flag_bytes = 4096; },
      [&](int r, Communicator& comm) {
        comms[r] = &comm;
        std::vector<float> data(16, 1.0f);
        Request rq = all_reduce_of(data, true);
        comm.validate(rq);
        comm.execute(rq);  // sets up the device path, on every rank
        ++ready;
        while (ready < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        // No communicator is destroyed before every rank is done with it.
        const auto done = [&] {
          ++finished;
          while (finished < 3) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        };
        if (r == 1) {  // never joins the second call; aborts rank 0's once ranks 0 and 2 are in it
          while (team_calls < calls_before + 3 + 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          comms[0]->abort("test: abort rank 0");
          return done();
        }
        rq.timeout = std::chrono::milliseconds(r == 0 ? 20000 : 1500);
        const auto start = Clock::now();
        ErrorKind kind = ErrorKind::Internal;
        try {
          comm.execute(rq);
        } catch (const Error& e) {
          kind = e.kind();
        }
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        done();
        if (r == 0)
          CHECK(kind == ErrorKind::PeerFailure && seconds < 10,
                "rank 0: error kind %d after %.1f s, expected a PeerFailure", static_cast<int>(kind), seconds);
        else
          CHECK(kind == ErrorKind::Timeout && seconds > 1.4 && seconds < 10,
                "rank 2: error kind %d after %.1f s, expected a Timeout at 1.5 s", static_cast<int>(kind), seconds);
      });
}

// A message's contents: its sender's, its tag's and its element's own.
std::vector<float> message(int src, int tag, size_t count) {
  std::vector<float> m(count);
  for (size_t i = 0; i < count; ++i) m[i] = value(src * 16 + tag, i);
  return m;
}

// Ranks 0 and 1 send and receive from "device" memory, rank 2 from host memory, over
// shared memory or TCP: every pair both ways (empty, one element, several frames), a recv
// from any source on either memory, and a message of one tag held while a recv of another
// takes the next (the held path into device memory). The bits arrive as sent, the plan
// names p2p-via-host on device memory and p2p on host memory, the device ops copy exactly
// the device buffers' bytes, and no device team or staged channel is made. A collective
// on device memory then sets up the device path with the ops point-to-point made.
void test_p2p_on_device(TransportChoice transport) {
  constexpr int kRanks = 3;
  Barrier p2p_done(kRanks);
  const int teams_before = teams_made, pins_before = pins_made;
  with_world(
      kRanks, [&](Config& cfg) { cfg.transport = transport; },
      [&](int r, Communicator& comm) {
        const bool on_device = r < 2;
        const std::string expected = on_device ? "p2p-via-host" : "p2p";
        // Runs this rank's side of a message of `count` elements, received into `data`.
        const auto transfer = [&](Collective c, int peer, int tag, std::vector<float>& data, int* source = nullptr) {
          Request rq;
          rq.collective = c;
          rq.count = data.size();
          rq.input = rq.output = data.data();
          rq.root = peer;
          rq.tag = tag;
          rq.source = source;
          rq.device = on_device ? 0 : -1;
          comm.validate(rq);
          const size_t copied_before = device_bytes_copied;
          const Plan plan = comm.execute(rq);
          const size_t copied = device_bytes_copied - copied_before,
                       bytes = on_device ? data.size() * sizeof(float) : 0;
          CHECK(name_of(plan.variant) == expected, "rank %d %s tag %d: planned %s, expected %s", r, name_of(c), tag,
                name_of(plan.variant), expected.c_str());
          CHECK(copied == bytes, "rank %d %s tag %d: the device ops copied %zu bytes, expected %zu", r, name_of(c), tag,
                copied, bytes);
        };
        const auto check_received = [&](const std::vector<float>& got, int src, int tag) {
          const std::vector<float> sent = message(src, tag, got.size());
          CHECK(got.empty() || std::memcmp(got.data(), sent.data(), got.size() * sizeof(float)) == 0,
                "rank %d: %zu elements of tag %d from rank %d differ from those sent", r, got.size(), tag, src);
        };

        const std::pair<int, int> every_pair[] = {{0, 2}, {2, 0}, {0, 1}, {1, 0}, {1, 2}, {2, 1}};
        for (size_t count : {size_t{0}, size_t{1}, size_t{5003}})
          for (auto [src, dst] : every_pair) {
            std::vector<float> data = r == src ? message(src, 3, count) : std::vector<float>(count, -1.0f);
            if (r == src) transfer(Collective::Send, dst, 3, data);
            if (r == dst) {
              transfer(Collective::Recv, src, 3, data);
              check_received(data, src, 3);
            }
          }

        for (int receiver : {0, 2}) {  // from the other two ranks, whichever comes first
          if (r != receiver) {
            std::vector<float> data = message(r, 5, 777);
            transfer(Collective::Send, receiver, 5, data);
            continue;
          }
          std::vector<int> sources;
          for (int k = 0; k < kRanks - 1; ++k) {
            std::vector<float> data(777, -1.0f);
            int source = -1;
            transfer(Collective::Recv, kAnySource, 5, data, &source);
            check_received(data, source, 5);
            sources.push_back(source);
          }
          CHECK(sources.size() == 2 && sources[0] != sources[1] && sources[0] != r && sources[1] != r,
                "rank %d received from any source from ranks %d and %d", r, sources[0], sources[1]);
        }

        if (r == 1) {
          for (int tag : {7, 8}) {
            std::vector<float> data = message(1, tag, 1000 + 500 * (tag - 7));
            transfer(Collective::Send, 0, tag, data);
          }
        } else if (r == 0) {
          for (int tag : {8, 7}) {  // tag 7's message is held while the recv of tag 8 passes it
            std::vector<float> data(1000 + 500 * (tag - 7), -1.0f);
            transfer(Collective::Recv, 1, tag, data);
            check_received(data, 1, tag);
          }
        }

        if (p2p_done.wait())
          CHECK(teams_made == teams_before && pins_made == pins_before,
                "point-to-point made %d device team members and pinned %d host ranges", teams_made - teams_before,
                pins_made - pins_before);
        p2p_done.wait();  // the others set up nothing before that check
        std::vector<float> data(1000, static_cast<float>(r + 1));
        Request rq = all_reduce_of(data, true);
        run(comm, rq);
        CHECK(data[0] == 6.0f && data[999] == 6.0f,
              "rank %d: device all-reduce after point-to-point gave %g, expected 6", r, data[0]);
      });
}

}  // namespace

int main() {
  static const HostRuntime runtime;
  register_device_runtime(&runtime);
  // 2 nodes of 2 (hierarchical) in one process: one host to CUDA IPC, so one team of 4.
  test_device_matches_host(4, TransportChoice::Auto, 2);
  CHECK(pins_made == 0, "%d host ranges pinned with no staged channel", pins_made.load());
  CHECK(teams_made == 4, "%d team members made for a group of 4 on one host", teams_made.load());
  test_device_matches_host(3, TransportChoice::Tcp, 0);   // every frame staged over TCP
  CHECK(pins_made == 3 * 2 * 2, "%d host ranges pinned, expected 2 per staged channel", pins_made.load());
  CHECK(pins_held == 0, "%d pinned host ranges outlived their channels", pins_held.load());
  CHECK(teams_made == 4, "%d team members made for a group without IPC", teams_made - 4);
  test_team_carries_small_oneshots(3);
  test_team_carries_small_oneshots(2);
  test_no_team_without_flag_bytes();
  test_calls_on_the_callers_stream();
  test_pairs_that_cannot_map_are_staged();
  test_abort_reaches_the_team();
  test_p2p_on_device(TransportChoice::Auto);  // shared memory
  test_p2p_on_device(TransportChoice::Tcp);
  std::printf("test_device_path: %s (%d failures)\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
