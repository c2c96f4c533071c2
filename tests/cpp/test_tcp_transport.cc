// Tests of the TCP transport: threads of one process play the ranks, with real sockets on
// loopback and an in-process Store. A standalone program: exit status 0 when every check
// passed.
//
// Build and run from the repository root:
//   g++ -std=c++17 -O2 -Wall -Wextra -pthread -Icsrc -Itests/cpp csrc/core/*.cc csrc/transport/tcp_*.cc
//       tests/cpp/test_tcp_transport.cc -o /tmp/test_tcp && /tmp/test_tcp
// PYCOMM_TEST_ONLY=<part of a case name> runs the matching cases only.
// Under valgrind or sanitizers, stretch the timing bounds: PYCOMM_TEST_SLACK=10.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "barrier.h"
#include "core/config.h"
#include "core/error.h"
#include "memory_store.h"
#include "test_ranks.h"
#include "transport/transport.h"

using namespace pycomm;
using pycomm_test::MemoryStore;
using pycomm_test::test_ranks;
using std::chrono::milliseconds;

namespace {

std::atomic<int> g_failures{0};
std::mutex g_print;

void report_failure(const char* file, int line, const std::string& what) {
  std::lock_guard<std::mutex> lk(g_print);
  std::fprintf(stderr, "FAIL %s:%d: %s\n", file, line, what.c_str());
  ++g_failures;
}

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) report_failure(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)
#define CHECK_MSG(cond, msg)                                                          \
  do {                                                                                \
    if (!(cond)) report_failure(__FILE__, __LINE__, std::string(#cond ": ") + (msg)); \
  } while (0)

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

double slack() {
  const char* s = std::getenv("PYCOMM_TEST_SLACK");
  return s && *s ? std::atof(s) : 1.0;
}
milliseconds scaled(int ms) { return milliseconds(static_cast<long long>(ms * slack())); }

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Runs `body` once per error expected; returns the Error thrown (kind Internal and an
// explanatory message when nothing was thrown).
Error catch_error(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    return Error(ErrorKind::Internal, std::string("unexpected exception type: ") + e.what());
  }
  return Error(ErrorKind::Internal, "no error was thrown");
}

// One group of `n` ranks sharing a store, a config and a secret.
struct Group {
  int n;
  std::unique_ptr<MemoryStore> store;
  Config config;
  std::vector<PeerInfo> ranks;
  std::string prefix;
  std::string secret = "0123456789abcdef0123456789abcdef";
  milliseconds setup_timeout = scaled(10000);

  Group(int size, size_t chunk, int depth, milliseconds store_timeout = std::chrono::seconds(30))
      : n(size), store(std::make_unique<MemoryStore>(store_timeout)) {
    static std::atomic<int> instance{0};
    prefix = "test/" + std::to_string(instance++);
    config.tcp_chunk_bytes = chunk;
    config.pipeline_depth = depth;
    ranks = test_ranks(n);
  }

  TransportSetup setup(int rank) const {
    TransportSetup s;
    s.store = store.get();
    s.key_prefix = prefix;
    s.rank = rank;
    s.size = n;
    for (int p = 0; p < n; ++p)
      if (p != rank) s.peers.push_back(p);
    s.ranks = ranks;
    s.secret = secret;
    s.config = &config;
    s.deadline = Deadline::after(setup_timeout);
    return s;
  }

  std::unique_ptr<Transport> connect(int rank) const { return make_tcp_transport(setup(rank)); }
};

// ---- Waits seen from outside. The abort and peer-exit tests must fail a wait that is
// already asleep: a wait that starts after the failure throws it too, at once, and proves
// nothing about being woken. The transport has no hook for "asleep in a wait"; the kernel
// shows it: /proc/self/task/<tid>/syscall names the system call a thread is blocked in
// ("running" while it runs). A TCP wait sleeps in poll() (a receive on a connected
// channel: its socket and the abort eventfd) or in a futex wait with a timeout (the
// channel's condition variable, kLivenessSlice at a time: a send, or a receive not yet
// connected); a wait for the channel's mutex has no timeout and does not count.

pid_t this_thread_id() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// Whether thread `tid` of this process is asleep in one of a transport wait's calls now.
bool asleep_in_wait(pid_t tid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/syscall", static_cast<int>(tid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  long nr = -1;
  unsigned long arg[6] = {};
  const int got =
      std::fscanf(f, "%ld %lx %lx %lx %lx %lx %lx", &nr, &arg[0], &arg[1], &arg[2], &arg[3], &arg[4], &arg[5]);
  std::fclose(f);
  if (got != 7) return false;  // running, or stopped outside a system call ("-1 sp pc")
#ifdef SYS_poll
  if (nr == SYS_poll) return true;
#endif
  if (nr == SYS_ppoll) return true;
  return nr == SYS_futex && arg[3] != 0;  // its timeout
}

// One thread's wait, for another thread to act only once that wait sleeps. The waiter
// calls enter() right before the call that must block and leave() once it returned.
class WaitProbe {
 public:
  void enter() { tid_.store(this_thread_id()); }
  void leave() { left_.store(true); }
  // Returns true once the waiter sleeps in its wait; false, reporting a failure, when its
  // call returned first or it was not asleep within `limit`.
  bool await_asleep(const std::string& who, milliseconds limit) {
    const auto until = Clock::now() + limit;
    for (;;) {
      if (left_.load()) {
        report_failure(__FILE__, __LINE__, who + " returned before it slept in its wait");
        return false;
      }
      const pid_t tid = tid_.load();
      if (tid != 0 && asleep_in_wait(tid)) return true;
      if (Clock::now() > until) {
        report_failure(__FILE__, __LINE__, who + " never slept in its wait");
        return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // the look's period, not a delay
    }
  }

 private:
  std::atomic<pid_t> tid_{0};
  std::atomic<bool> left_{false};
};

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Runs fn(rank) on one thread per rank; an exception escaping fn is a test failure.
void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        report_failure(__FILE__, __LINE__, "rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  for (auto& t : threads) t.join();
}

// Frame i from `src` to `dst`: its size and its contents are functions of (src, dst, i).
size_t frame_size(size_t i, size_t chunk) {
  if (i % 13 == 0) return 0;
  if (i % 5 == 0) return chunk;
  return (i * 7919) % (chunk + 1);
}
uint8_t frame_byte(int src, int dst, size_t i, size_t j) {
  return static_cast<uint8_t>(src * 131 + dst * 17 + i * 7 + j * 3 + (j >> 8));
}
FrameHeader frame_header(int src, size_t i, size_t bytes) {
  FrameHeader h;
  h.bytes = static_cast<uint32_t>(bytes);
  h.op.seq = i;
  h.op.count = bytes;
  h.op.collective = static_cast<uint8_t>(Collective::Send);
  h.op.root = src;
  return h;
}

// Odd frames go through send_host() from a buffer overwritten as soon as it returns:
// what the socket did not take at once must have been copied (whole, partly sent, or
// behind frames still queued when bursts fill the socket).
void send_test_frame(Channel& ch, int src, int dst, size_t i, const Deadline& d) {
  const size_t bytes = frame_size(i, ch.chunk_bytes());
  if (i % 2 == 1) {
    std::vector<uint8_t> buf(bytes);
    for (size_t j = 0; j < bytes; ++j) buf[j] = frame_byte(src, dst, i, j);
    ch.send_host(frame_header(src, i, bytes), buf.data(), d);
    std::fill(buf.begin(), buf.end(), uint8_t{0xEE});
    return;
  }
  auto* slot = static_cast<uint8_t*>(ch.begin_send(d));
  for (size_t j = 0; j < bytes; ++j) slot[j] = frame_byte(src, dst, i, j);
  ch.end_send(frame_header(src, i, bytes));
}

// Returns false (after reporting) on the first wrong byte.
bool recv_test_frame(Channel& ch, int src, int dst, size_t i, const Deadline& d) {
  const size_t bytes = frame_size(i, ch.chunk_bytes());
  const auto* slot = static_cast<const uint8_t*>(ch.begin_recv(frame_header(src, i, bytes), d));
  bool ok = true;
  for (size_t j = 0; j < bytes && ok; ++j)
    if (slot[j] != frame_byte(src, dst, i, j)) {
      report_failure(__FILE__, __LINE__,
                     "payload mismatch in frame " + std::to_string(i) + " from rank " + std::to_string(src) +
                         " to rank " + std::to_string(dst) + " at byte " + std::to_string(j));
      ok = false;
    }
  ch.end_recv();
  return ok;
}

// (1) Ring: every rank sends k frames to the right while receiving k from the left. Each
// rank first sends a burst of 2 * depth frames, so that all ranks sit in begin_send at
// once, relying on the I/O threads to drain into the neighbours' free slots.
void test_ring(int n, size_t chunk, int depth, size_t k) {
  Group g(n, chunk, depth);
  run_ranks(n, [&](int r) {
    auto t = g.connect(r);
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    Channel& out = *t->channel(right);
    Channel& in = *t->channel(left);
    CHECK(out.chunk_bytes() == chunk);
    CHECK(out.peer() == right && in.peer() == left);
    CHECK(t->channel(r) == nullptr && t->channel(n) == nullptr && t->channel(-1) == nullptr);
    const Deadline d = Deadline::after(scaled(30000));
    const size_t burst = std::min(k, static_cast<size_t>(2 * depth));
    for (size_t i = 0; i < burst; ++i) send_test_frame(out, r, right, i, d);
    bool ok = true;
    for (size_t i = 0; i < k && ok; ++i) {
      if (i + burst < k) send_test_frame(out, r, right, i + burst, d);
      ok = recv_test_frame(in, left, r, i, d);
    }
  });
}

// (2) All-to-all, two patterns: pairwise steps (send to r+s while receiving from r-s,
// frame by frame), then every rank sends `depth` frames to every peer before receiving.
void test_all_to_all(int n, size_t chunk, int depth, size_t per_pair) {
  Group g(n, chunk, depth);
  run_ranks(n, [&](int r) {
    auto t = g.connect(r);
    const Deadline d = Deadline::after(scaled(30000));
    for (int s = 1; s < n; ++s) {
      const int dst = (r + s) % n, src = (r + n - s) % n;
      for (size_t i = 0; i < per_pair; ++i) {
        send_test_frame(*t->channel(dst), r, dst, i, d);
        if (!recv_test_frame(*t->channel(src), src, r, i, d)) return;
      }
    }
    const size_t base = per_pair;
    for (int p = 0; p < n; ++p)
      if (p != r)
        for (int i = 0; i < depth; ++i) send_test_frame(*t->channel(p), r, p, base + i, d);
    for (int p = 0; p < n; ++p)
      if (p != r)
        for (int i = 0; i < depth; ++i)
          if (!recv_test_frame(*t->channel(p), p, r, base + i, d)) return;
  });
}

int open_descriptors() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

// (2b) Connections on demand. Of 8 ranks, each connects at creation to the 5 at a
// power-of-two distance around the ring (20 pairs, 40 sockets in this process); the
// all-to-all then needs the 8 other pairs, made on first use, 16 sockets more, and nothing
// more when it runs again. The lower rank of a pair connects as soon as it uses the pair,
// even to receive: its receive then times out waiting for data, not for a connection.
void test_connections_on_demand() {
  constexpr int n = 8;
  Group g(n, 4096, 2);
  Barrier created(n + 1), counted_created(n + 1), probed(n), done(n + 1), counted(n + 1);
  const int before = open_descriptors();
  std::thread counter([&] {
    created.wait();
    const int made = open_descriptors() - before;
    // 40 sockets, 16 eventfds (the I/O thread's wake-up and the abort), 8 epoll
    // instances, 8 listeners.
    CHECK_MSG(made == 40 + 16 + 8 + 8, std::to_string(made) + " descriptors after creation");
    counted_created.wait();
    done.wait();
    CHECK_MSG(open_descriptors() - before == made + 16,
              std::to_string(open_descriptors() - before - made) + " descriptors more after the all-to-all");
    counted.wait();
  });
  run_ranks(n, [&](int r) {
    auto t = g.connect(r);
    created.wait();
    counted_created.wait();
    if (r == 0) {  // rank 5 (distance 3) has not used the pair: rank 0 connects to receive
      bool connected = false;
      for (const auto start = Clock::now(); !connected && Clock::now() - start < scaled(10000);) {
        Error e =
            catch_error([&] { t->channel(5)->begin_recv(frame_header(5, 0, 0), Deadline::after(milliseconds(100))); });
        CHECK_MSG(e.kind() == ErrorKind::Timeout, e.what());
        connected = !contains(e.what(), "not connected");
      }
      CHECK_MSG(connected, "rank 0's receive from rank 5 never connected the pair");
    }
    probed.wait();
    const Deadline d = Deadline::after(scaled(30000));
    bool ok = true;
    for (int round = 0; round < 2 && ok; ++round) {
      for (int p = 0; p < n; ++p)
        if (p != r) send_test_frame(*t->channel(p), r, p, round, d);
      for (int p = 0; p < n && ok; ++p)
        if (p != r) ok = recv_test_frame(*t->channel(p), p, r, round, d);
    }
    done.wait();
    counted.wait();
  });
  counter.join();
}

// (2c) A peer that has gone before a pair connected on demand: its listener refuses the
// connection, and the channel fails at once (not at its deadline), naming it.
void test_gone_before_connecting() {
  constexpr int n = 8;
  Group g(n, 4096, 2);
  Barrier created(n), left(n);
  run_ranks(n, [&](int r) {
    auto t = g.connect(r);
    created.wait();
    if (r == 0) t.reset();  // rank 0 leaves: its listener closes
    left.wait();
    if (r != 5) return;  // rank 5 (distance 3 from rank 0) has no connection to it yet
    const auto start = Clock::now();
    Error e = catch_error([&] { t->channel(0)->begin_recv(frame_header(0, 0, 0), Deadline::after(scaled(20000))); });
    CHECK_MSG(e.kind() == ErrorKind::PeerFailure && contains(e.what(), "refused") &&
                  contains(e.what(), g.ranks[0].describe()),
              e.what());
    CHECK_MSG(seconds_since(start) < 2.0 * slack(), std::to_string(seconds_since(start)));
    Error send = catch_error([&] { send_test_frame(*t->channel(0), 5, 0, 0, Deadline::after(scaled(20000))); });
    CHECK_MSG(send.kind() == ErrorKind::PeerFailure, send.what());
  });
}

// Many empty frames back and forth (the barrier's pattern): exercises the wake-ups.
void test_ping_pong() {
  Group g(2, 4096, 2);
  const int rounds = 2000;
  double us = 0;
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    Channel& ch = *t->channel(1 - r);
    const Deadline d = Deadline::after(scaled(30000));
    const auto start = Clock::now();
    for (int i = 0; i < rounds; ++i) {
      FrameHeader h = frame_header(0, i, 0);
      if (r == 0) {
        ch.begin_send(d);
        ch.end_send(h);
        ch.begin_recv(h, d);
        ch.end_recv();
      } else {
        ch.begin_recv(h, d);
        ch.end_recv();
        ch.begin_send(d);
        ch.end_send(h);
      }
    }
    if (r == 0) us = seconds_since(start) * 1e6 / rounds;
  });
  std::printf("  ping-pong of empty frames: %.1f us per round trip\n", us);
}

// Bulk throughput on loopback, for information only (no bound is checked).
void test_throughput() {
  const size_t chunk = 1 << 20, total = size_t{256} << 20;
  Group g(2, chunk, 4);
  double seconds = 0;
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    Channel& ch = *t->channel(1 - r);
    const Deadline d = Deadline::after(scaled(60000));
    const auto start = Clock::now();
    for (size_t off = 0, i = 0; off < total; off += chunk, ++i) {
      // Both directions at once: send one, receive one.
      void* slot = ch.begin_send(d);
      std::memset(slot, static_cast<int>(i), chunk);
      ch.end_send(frame_header(r, i, chunk));
      const auto* in = static_cast<const uint8_t*>(ch.begin_recv(frame_header(1 - r, i, chunk), d));
      CHECK(in[0] == static_cast<uint8_t>(i) && in[chunk - 1] == static_cast<uint8_t>(i));
      ch.end_recv();
    }
    if (r == 0) seconds = seconds_since(start);
  });
  std::printf("  bidirectional 1 MiB frames: %.0f MB/s each way\n", total / seconds / 1e6);
}

// One way, a reader that starts late: rank 0's frames fill its slots and both socket
// buffers, so send_host() finds frames queued ahead of it and sockets that take part of a
// frame; every byte still arrives, in order.
void test_send_host_into_full_socket() {
  const size_t chunk = 1 << 20, frames = 24;
  Group g(2, chunk, 4);
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    Channel& ch = *t->channel(1 - r);
    const Deadline d = Deadline::after(scaled(30000));
    if (r == 0) {
      for (size_t i = 0; i < frames; ++i) send_test_frame(ch, 0, 1, i, d);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // lets the sender run ahead
    for (size_t i = 0; i < frames; ++i)
      if (!recv_test_frame(ch, 0, 1, i, d)) return;
  });
}

// (3) A frame of another operation or size is a Mismatch naming the peer.
void test_mismatch() {
  Group g(2, 4096, 2);
  Barrier done(2);
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    Channel& ch = *t->channel(1 - r);
    const Deadline d = Deadline::after(scaled(10000));
    if (r == 0) {
      FrameHeader h = frame_header(0, 5, 16);
      std::memset(ch.begin_send(d), 1, 16);
      ch.end_send(h);
      FrameHeader h2 = frame_header(0, 6, 16);
      std::memset(ch.begin_send(d), 1, 16);
      ch.end_send(h2);
    } else {
      Error e = catch_error([&] { ch.begin_recv(frame_header(0, 6, 16), d); });
      CHECK_MSG(e.kind() == ErrorKind::Mismatch, e.what());
      CHECK_MSG(contains(e.what(), g.ranks[0].describe()), e.what());
      CHECK_MSG(contains(e.what(), "#5") && contains(e.what(), "#6"), e.what());
      ch.end_recv();
      FrameHeader bigger = frame_header(0, 6, 16);
      bigger.bytes = 32;
      Error e2 = catch_error([&] { ch.begin_recv(bigger, d); });
      CHECK_MSG(e2.kind() == ErrorKind::Mismatch, e2.what());
      CHECK_MSG(contains(e2.what(), "sent 16 bytes where 32"), e2.what());
    }
    done.wait();
  });
}

// (4) Waits end at the deadline with a Timeout naming the peer, for receiving and sending.
void test_timeout() {
  Group g(2, 4096, 2);
  Barrier done(2);
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    Channel& ch = *t->channel(1 - r);
    if (r == 1) {
      const auto start = Clock::now();
      Error e = catch_error([&] { ch.begin_recv(frame_header(0, 0, 0), Deadline::after(milliseconds(200))); });
      const double took = seconds_since(start);
      CHECK_MSG(e.kind() == ErrorKind::Timeout, e.what());
      CHECK_MSG(contains(e.what(), "timed out") && contains(e.what(), g.ranks[0].describe()), e.what());
      CHECK_MSG(took >= 0.195 && took < 0.2 + 1.0 * slack(), std::to_string(took));
      done.wait();
    } else {
      done.wait();
      // Rank 1 never reads: the slots and the kernel's buffers fill, then begin_send times out.
      const Deadline d = Deadline::after(scaled(1500));
      size_t sent = 0;
      Error e = catch_error([&] {
        for (; sent < 1000000; ++sent) send_test_frame(ch, 0, 1, sent, d);
      });
      CHECK_MSG(e.kind() == ErrorKind::Timeout, e.what());
      CHECK_MSG(contains(e.what(), "timed out") && contains(e.what(), g.ranks[1].describe()), e.what());
      CHECK(sent > 2);
    }
    done.wait();
  });
}

// (5a) abort() on rank 0 fails the waits of every other rank promptly with its reason, and
// every wait of rank 0 itself. Rank 0 aborts once every other rank sleeps in its receive
// from rank 0, so that the abort must wake them.
void test_abort(int n) {
  Group g(n, 4096, 2);
  Barrier ready(n);
  const std::string reason = "test abort: disk on fire";
  std::vector<WaitProbe> receives(n);
  Clock::time_point aborted_at{};
  std::vector<Clock::time_point> failed_at(n);
  run_ranks(n, [&](int r) {
    auto t = g.connect(r);
    ready.wait();
    if (r == 0) {
      for (int p = 1; p < n; ++p) receives[p].await_asleep("rank " + std::to_string(p) + "'s receive", scaled(10000));
      aborted_at = Clock::now();
      t->abort(reason);
      t->abort("a second abort is ignored");
      Error e = catch_error([&] { t->channel(1)->begin_recv(frame_header(1, 0, 0), Deadline::after(scaled(10000))); });
      CHECK_MSG(e.kind() == ErrorKind::PeerFailure && contains(e.what(), reason), e.what());
      Error e2 = catch_error([&] { t->channel(n - 1)->begin_send(Deadline::after(scaled(10000))); });
      CHECK_MSG(e2.kind() == ErrorKind::PeerFailure && contains(e2.what(), reason), e2.what());
    } else {
      receives[r].enter();
      Error e = catch_error([&] { t->channel(0)->begin_recv(frame_header(0, 0, 0), Deadline::after(scaled(20000))); });
      failed_at[r] = Clock::now();
      receives[r].leave();
      CHECK_MSG(e.kind() == ErrorKind::PeerFailure, e.what());
      CHECK_MSG(contains(e.what(), reason) && contains(e.what(), g.ranks[0].describe() + " aborted"), e.what());
      // The failure is sticky.
      Error again = catch_error([&] { t->channel(0)->begin_send(Deadline::after(scaled(1000))); });
      CHECK_MSG(again.kind() == ErrorKind::PeerFailure && contains(again.what(), reason), again.what());
    }
    ready.wait();
  });
  // Woken by the abort, and promptly.
  for (int r = 1; r < n; ++r) {
    const double late = seconds_between(aborted_at, failed_at[r]);
    CHECK_MSG(late >= 0 && late < 1.0 * slack(), "rank " + std::to_string(r) + ": " + std::to_string(late) + " s");
  }
}

// (5b) The reason also reaches a rank that is blocked sending to the aborting rank while
// its own inbound slots from it are full (the Abort frame sits unread in the kernel).
// Rank 0 aborts once rank 1 sleeps in a send: rank 0 reads nothing, so rank 1's frames
// fill its slots and the kernel's buffers.
void test_abort_reaches_blocked_sender() {
  const int depth = 2;
  Group g(2, 4096, depth);
  Barrier ready(2);
  const std::string reason = "test abort while the peer is blocked";
  WaitProbe sends;
  Clock::time_point aborted_at{}, failed_at{};
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    Channel& ch = *t->channel(1 - r);
    const Deadline d = Deadline::after(scaled(20000));
    if (r == 0) {
      for (int i = 0; i < depth + 8; ++i) send_test_frame(ch, 0, 1, i, d);
      ready.wait();
      sends.await_asleep("rank 1's send", scaled(10000));
      aborted_at = Clock::now();
      t->abort(reason);
    } else {
      ready.wait();
      size_t sent = 0;
      sends.enter();
      Error e = catch_error([&] {
        for (; sent < 10000000; ++sent) send_test_frame(ch, 1, 0, sent, d);
      });
      failed_at = Clock::now();
      sends.leave();
      CHECK_MSG(e.kind() == ErrorKind::PeerFailure, e.what());
      CHECK_MSG(contains(e.what(), reason), e.what());
      // Frames that arrived before the abort are still there to read.
      CHECK(recv_test_frame(ch, 0, 1, 0, d));
    }
  });
  const double late = seconds_between(aborted_at, failed_at);
  CHECK_MSG(late >= 0 && late < 1.0 * slack(), std::to_string(late));
}

// (5c) A peer that goes away (here: destroys its transport without abort) fails the waits
// on it promptly; frames it sent before leaving are still delivered first.
void test_peer_gone() {
  const int depth = 2;
  const size_t frames = 2 * depth + 5;
  Group g(2, 4096, depth);
  Barrier sent(2);
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    Channel& ch = *t->channel(1 - r);
    const Deadline d = Deadline::after(scaled(20000));
    if (r == 0) {
      for (size_t i = 0; i < frames; ++i) send_test_frame(ch, 0, 1, i, d);
      t.reset();  // flushes what was committed, then closes
      sent.wait();
    } else {
      sent.wait();
      std::this_thread::sleep_for(milliseconds(100));
      for (size_t i = 0; i < frames; ++i)
        if (!recv_test_frame(ch, 0, 1, i, d)) return;
      const auto start = Clock::now();
      Error e = catch_error([&] { ch.begin_recv(frame_header(0, frames, 0), d); });
      CHECK_MSG(e.kind() == ErrorKind::PeerFailure, e.what());
      CHECK_MSG(contains(e.what(), "connection to " + g.ranks[0].describe() + " lost"), e.what());
      CHECK_MSG(seconds_since(start) < 1.0 * slack(), std::to_string(seconds_since(start)));
      Error e2 = catch_error([&] { ch.begin_send(d); });
      CHECK_MSG(e2.kind() == ErrorKind::PeerFailure && contains(e2.what(), g.ranks[0].describe()), e2.what());
    }
  });
}

// A rank blocked in begin_recv notices its peer closing while it waits: rank 2 leaves
// once ranks 0 and 1 sleep in their receives from it.
void test_peer_gone_while_waiting() {
  Group g(3, 4096, 2);
  Barrier ready(3);
  std::vector<WaitProbe> receives(3);
  Clock::time_point gone_at{};
  std::vector<Clock::time_point> failed_at(3);
  run_ranks(3, [&](int r) {
    auto t = g.connect(r);
    ready.wait();
    if (r == 2) {
      for (int p = 0; p < 2; ++p) receives[p].await_asleep("rank " + std::to_string(p) + "'s receive", scaled(10000));
      gone_at = Clock::now();
      t.reset();
    } else {
      receives[r].enter();
      Error e = catch_error([&] { t->channel(2)->begin_recv(frame_header(2, 0, 0), Deadline::after(scaled(20000))); });
      failed_at[r] = Clock::now();
      receives[r].leave();
      CHECK_MSG(e.kind() == ErrorKind::PeerFailure && contains(e.what(), g.ranks[2].describe() + " lost"), e.what());
      // The channel between the survivors still works.
      Channel& other = *t->channel(1 - r);
      const Deadline d = Deadline::after(scaled(10000));
      send_test_frame(other, r, 1 - r, 0, d);
      CHECK(recv_test_frame(other, 1 - r, r, 0, d));
    }
  });
  // Woken by the peer's leaving, and promptly.
  for (int r = 0; r < 2; ++r) {
    const double late = seconds_between(gone_at, failed_at[r]);
    CHECK_MSG(late >= 0 && late < 1.0 * slack(), "rank " + std::to_string(r) + ": " + std::to_string(late) + " s");
  }
}

// The handshake as a stranger would send it (mirrors the wire format in tcp_wire.h).
struct RawHello {
  uint32_t magic = 0x70634843;
  uint32_t version = 2;
  int32_t from_rank = 1;
  int32_t to_rank = 0;
  uint32_t secret_bytes = 0;
  uint32_t reserved = 0;
  unsigned char secret[64] = {};
};
static_assert(sizeof(RawHello) == 88, "hello layout");

int raw_connect(const std::string& addr) {
  const size_t colon = addr.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))));
  inet_pton(AF_INET, addr.substr(0, colon).c_str(), &a.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{static_cast<time_t>(5 * slack()), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// True when the other side closed the connection (EOF or reset) rather than answering.
bool closed_by_peer(int fd) {
  char c;
  const ssize_t n = ::recv(fd, &c, 1, 0);
  return n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE));
}

// (6) Connections that fail authentication are closed, and the group still forms.
void test_bad_handshakes() {
  Group g(3, 4096, 2);
  std::atomic<bool> strangers_done{false};
  std::mutex mu;
  std::condition_variable cv;
  std::thread stranger([&] {
    const std::string addr = g.store->get(g.prefix + "/tcp/addr/0");
    const auto send_hello = [&](const RawHello& h) {
      const int fd = raw_connect(addr);
      CHECK(fd >= 0);
      if (fd < 0) return;
      CHECK(::send(fd, &h, sizeof h, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof h));
      CHECK_MSG(closed_by_peer(fd), "a bad hello was not rejected");
      ::close(fd);
    };
    RawHello wrong_secret;  // claims rank 1's place with a wrong secret
    wrong_secret.secret_bytes = static_cast<uint32_t>(g.secret.size());
    std::memcpy(wrong_secret.secret, g.secret.data(), g.secret.size());
    wrong_secret.secret[3] ^= 1;
    send_hello(wrong_secret);
    RawHello short_secret = wrong_secret;  // a prefix of the right secret
    std::memcpy(short_secret.secret, g.secret.data(), g.secret.size());
    short_secret.secret_bytes = 8;
    send_hello(short_secret);
    RawHello bad_rank = short_secret;  // right secret, but not a rank that connects to 0
    bad_rank.secret_bytes = static_cast<uint32_t>(g.secret.size());
    bad_rank.from_rank = 7;
    send_hello(bad_rank);
    RawHello bad_magic = bad_rank;
    bad_magic.from_rank = 2;
    bad_magic.magic = 0x12345678;
    send_hello(bad_magic);
    // Garbage, and a silent connection that stays open through the set-up.
    const int junk = raw_connect(addr);
    const char garbage[100] = "GET / HTTP/1.0\r\n\r\n";
    CHECK(::send(junk, garbage, sizeof garbage, MSG_NOSIGNAL) == sizeof garbage);
    CHECK_MSG(closed_by_peer(junk), "garbage was not rejected");
    ::close(junk);
    const int silent = raw_connect(addr);
    CHECK(silent >= 0);
    {
      std::lock_guard<std::mutex> lk(mu);
      strangers_done = true;
    }
    cv.notify_all();
    std::this_thread::sleep_for(milliseconds(500));
    ::close(silent);
  });
  run_ranks(3, [&](int r) {
    if (r != 0) {  // the real peers come after the strangers
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return strangers_done.load(); });
    }
    auto t = g.connect(r);
    const Deadline d = Deadline::after(scaled(10000));
    for (int p = 0; p < 3; ++p)
      if (p != r) send_test_frame(*t->channel(p), r, p, 1, d);
    for (int p = 0; p < 3; ++p)
      if (p != r) CHECK(recv_test_frame(*t->channel(p), p, r, 1, d));
  });
  stranger.join();
}

bool read_exact(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// Plays rank 1 of `g` by hand: handshakes with rank 0 over a raw socket (checking the
// Ack), then checks one frame from rank 0 byte for byte (48-byte header, then payload),
// then sends `tail` (raw bytes: frames or garbage) and finally leaves as `end` says.
enum class End { WaitForClose, Close, Reset };
void fake_rank1(const Group& g, const std::string& tail, End end) {
  g.store->set(g.prefix + "/tcp/addr/1", "127.0.0.1:1");  // every rank publishes one; never used here
  const int fd = raw_connect(g.store->get(g.prefix + "/tcp/addr/0"));
  CHECK(fd >= 0);
  if (fd < 0) return;
  RawHello h;
  h.secret_bytes = static_cast<uint32_t>(g.secret.size());
  std::memcpy(h.secret, g.secret.data(), g.secret.size());
  CHECK(::send(fd, &h, sizeof h, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof h));
  RawHello ack;
  CHECK(read_exact(fd, &ack, sizeof ack));
  CHECK(ack.magic == 0x70634841 && ack.version == 2 && ack.from_rank == 0 && ack.to_rank == 1);
  CHECK(ack.secret_bytes == g.secret.size() && std::memcmp(ack.secret, g.secret.data(), g.secret.size()) == 0);
  FrameHeader got;
  CHECK(read_exact(fd, &got, sizeof got));
  CHECK(got.magic == kFrameMagic && got.kind == static_cast<uint16_t>(FrameKind::Data) && got.bytes == 100);
  CHECK(got.op == frame_header(0, 9, 100).op);
  std::vector<uint8_t> payload(100);
  CHECK(read_exact(fd, payload.data(), payload.size()));
  for (size_t j = 0; j < payload.size(); ++j) CHECK(payload[j] == frame_byte(0, 1, 9, j));
  // One good frame, then the tail.
  std::string out;
  FrameHeader good = frame_header(1, 4, 10);
  out.append(reinterpret_cast<const char*>(&good), sizeof good);
  for (size_t j = 0; j < 10; ++j) out += static_cast<char>(frame_byte(1, 0, 4, j));
  out += tail;
  CHECK(::send(fd, out.data(), out.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(out.size()));
  if (end == End::Reset) {
    std::this_thread::sleep_for(milliseconds(100));
    linger lg{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  } else if (end == End::WaitForClose) {
    // Rank 0 must drop a connection that sent it garbage.
    char c;
    CHECK_MSG(::recv(fd, &c, 1, 0) == 0, "rank 0 kept the connection open");
  }
  ::close(fd);
}

std::string header_bytes(const FrameHeader& h) { return std::string(reinterpret_cast<const char*>(&h), sizeof h); }

// The wire format seen from outside, and what rank 0 makes of bad input from a peer that
// passed the handshake: a malformed header, an Abort frame, a connection reset.
void test_raw_peer() {
  struct Variant {
    std::string tail;
    End end;
    ErrorKind kind;
    std::string message;
  };
  FrameHeader too_big = frame_header(1, 5, 10);
  too_big.bytes = 4097;
  FrameHeader bad_magic = frame_header(1, 5, 10);
  bad_magic.magic = 0xdeadbeef;
  FrameHeader bad_kind = frame_header(1, 5, 10);
  bad_kind.kind = 7;
  FrameHeader abort = FrameHeader{};
  abort.kind = static_cast<uint16_t>(FrameKind::Abort);
  abort.bytes = 19;
  const std::vector<Variant> variants = {
      {header_bytes(too_big), End::WaitForClose, ErrorKind::Mismatch, "malformed frame from "},
      {header_bytes(bad_magic), End::WaitForClose, ErrorKind::Mismatch, "malformed frame from "},
      {header_bytes(bad_kind), End::WaitForClose, ErrorKind::Mismatch, "malformed frame from "},
      {header_bytes(abort) + "out of memory on GPU", End::WaitForClose, ErrorKind::PeerFailure,
       " aborted: out of memory on GP"},
      {"", End::Reset, ErrorKind::PeerFailure, " lost: Connection reset by peer"},
      {"", End::Close, ErrorKind::PeerFailure, " lost: closed"},
      {header_bytes(frame_header(1, 5, 10)) + "abc", End::Close, ErrorKind::PeerFailure,
       " lost: closed in the middle of a frame"},
  };
  for (const auto& v : variants) {
    const auto vstart = Clock::now();
    Group g(2, 4096, 2);
    std::thread fake([&] { fake_rank1(g, v.tail, v.end); });
    try {
      auto t = g.connect(0);
      Channel& ch = *t->channel(1);
      const Deadline d = Deadline::after(scaled(10000));
      auto* slot = static_cast<uint8_t*>(ch.begin_send(d));
      for (size_t j = 0; j < 100; ++j) slot[j] = frame_byte(0, 1, 9, j);
      ch.end_send(frame_header(0, 9, 100));
      const auto* in = static_cast<const uint8_t*>(ch.begin_recv(frame_header(1, 4, 10), d));
      for (size_t j = 0; j < 10; ++j) CHECK(in[j] == frame_byte(1, 0, 4, j));
      ch.end_recv();
      Error e = catch_error([&] { ch.begin_recv(frame_header(1, 5, 10), d); });
      CHECK_MSG(e.kind() == v.kind && contains(e.what(), v.message) && contains(e.what(), g.ranks[1].describe()),
                std::string(e.what()) + " (expected '" + v.message + "')");
      Error e2 = catch_error([&] { ch.begin_send(d); });
      CHECK_MSG(e2.kind() == v.kind && contains(e2.what(), v.message), e2.what());
    } catch (const std::exception& e) {
      report_failure(__FILE__, __LINE__, e.what());
    }
    fake.join();
    CHECK_MSG(seconds_since(vstart) < 2.0 * slack(), v.message);
  }
}

// A peer with the wrong secret never gets in: set-up fails with an error naming it.
void test_wrong_secret_peer() {
  Group g(2, 4096, 2);
  g.setup_timeout = milliseconds(800);
  run_ranks(2, [&](int r) {
    TransportSetup s = g.setup(r);
    if (r == 1) s.secret = "not the group's secret";
    Error e = catch_error([&] { make_tcp_transport(s); });
    CHECK_MSG(e.kind() == ErrorKind::Timeout, e.what());
    CHECK_MSG(contains(e.what(), g.ranks[1 - r].describe()), e.what());
  });
}

// Set-up errors name the peers that did not connect.
void test_setup_errors() {
  {  // rank 1 never shows up: rank 0 times out waiting for it
    Group g(2, 4096, 2);
    g.setup_timeout = milliseconds(300);
    const auto start = Clock::now();
    Error e = catch_error([&] { g.connect(0); });
    CHECK_MSG(e.kind() == ErrorKind::Timeout && contains(e.what(), g.ranks[1].describe()), e.what());
    CHECK(seconds_since(start) < 0.3 + 1.0 * slack());
  }
  {  // rank 0 published an address nobody listens on: rank 1 retries, then names it
    Group g(2, 4096, 2);
    g.setup_timeout = milliseconds(400);
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);  // a port that is bound, not listening
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    g.store->set(g.prefix + "/tcp/addr/0", "127.0.0.1:" + std::to_string(ntohs(a.sin_port)));
    Error e = catch_error([&] { g.connect(1); });
    CHECK_MSG(
        e.kind() == ErrorKind::Timeout && contains(e.what(), g.ranks[0].describe()) && contains(e.what(), "refused"),
        e.what());
    ::close(fd);
  }
  {  // rank 0 never publishes: the store's timeout, with the peer named
    Group g(2, 4096, 2, milliseconds(200));
    Error e = catch_error([&] { g.connect(1); });
    CHECK_MSG(e.kind() == ErrorKind::Timeout && contains(e.what(), g.ranks[0].describe()), e.what());
  }
  {  // garbage in the store
    Group g(2, 4096, 2);
    g.store->set(g.prefix + "/tcp/addr/0", "not-an-address");
    Error e = catch_error([&] { g.connect(1); });
    CHECK_MSG(e.kind() == ErrorKind::Mismatch && contains(e.what(), g.ranks[0].describe()), e.what());
  }
  {  // a secret longer than the handshake carries
    Group g(2, 4096, 2);
    g.secret = std::string(65, 'x');
    Error e = catch_error([&] { g.connect(0); });
    CHECK_MSG(e.kind() == ErrorKind::InvalidArgument, e.what());
  }
}

// The address rank 0 listens on, with PYCOMM_SOCKET_IFNAME=`ifname`, when rank 1 is on
// another "host"; a frame goes each way over it first.
std::string listened_on(const std::string& ifname) {
  Group g(2, 4096, 2);
  g.ranks[1].host_key = "another-host";
  g.config.socket_ifname = ifname;
  run_ranks(2, [&](int r) {
    auto t = g.connect(r);
    const Deadline d = Deadline::after(scaled(10000));
    send_test_frame(*t->channel(1 - r), r, 1 - r, 3, d);
    CHECK(recv_test_frame(*t->channel(1 - r), 1 - r, r, 3, d));
  });
  return g.store->get(g.prefix + "/tcp/addr/0");
}

// Interface choice: ranks on different "hosts" listen on a real interface (or the named one).
void test_interfaces() {
  const std::string addr = listened_on("");
  std::printf("  across hosts, rank 0 listened on %s\n", addr.c_str());
  CHECK_MSG(addr.rfind("0.0.0.0", 0) != 0, addr);
  for (const char* loopback : {"lo", "127.0.0.1"}) {  // by name or by address
    const std::string named = listened_on(loopback);
    CHECK_MSG(named.rfind("127.0.0.1:", 0) == 0, named);
  }
  {
    Group g(2, 4096, 2);
    g.ranks[1].host_key = "another-host";
    g.config.socket_ifname = "nosuchif0";
    Error e = catch_error([&] { g.connect(0); });
    CHECK_MSG(e.kind() == ErrorKind::InvalidArgument && contains(e.what(), "nosuchif0"), e.what());
  }
}

// A one-rank group and a rank without peers need no sockets.
void test_trivial() {
  Group g(1, 4096, 2);
  auto t = g.connect(0);
  CHECK(std::string(t->name()) == "tcp");
  CHECK(t->channel(0) == nullptr);
  t->abort("nothing to abort");
}

struct Case {
  const char* name;
  std::function<void()> run;
};

}  // namespace

int main() {
  const std::vector<Case> cases = {
      {"trivial", test_trivial},
      {"ring n=2", [] { test_ring(2, 4096, 2, 400); }},
      {"ring n=3", [] { test_ring(3, 4096, 2, 400); }},
      {"ring n=4", [] { test_ring(4, 4096, 4, 400); }},
      {"ring n=3 depth 1", [] { test_ring(3, 4096, 1, 200); }},
      {"ring n=4 256 KiB frames", [] { test_ring(4, 256 << 10, 2, 40); }},
      {"all-to-all n=2", [] { test_all_to_all(2, 4096, 2, 50); }},
      {"all-to-all n=3", [] { test_all_to_all(3, 4096, 3, 50); }},
      {"all-to-all n=4", [] { test_all_to_all(4, 8192, 2, 50); }},
      {"all-to-all n=7", [] { test_all_to_all(7, 4096, 2, 20); }},
      {"connections on demand", test_connections_on_demand},
      {"gone before connecting", test_gone_before_connecting},
      {"ping-pong", test_ping_pong},
      {"throughput", test_throughput},
      {"send_host into a full socket", test_send_host_into_full_socket},
      {"mismatch", test_mismatch},
      {"timeout", test_timeout},
      {"abort n=2", [] { test_abort(2); }},
      {"abort n=3", [] { test_abort(3); }},
      {"abort n=4", [] { test_abort(4); }},
      {"abort reaches a blocked sender", test_abort_reaches_blocked_sender},
      {"peer gone", test_peer_gone},
      {"peer gone while waiting", test_peer_gone_while_waiting},
      {"bad handshakes", test_bad_handshakes},
      {"wrong secret peer", test_wrong_secret_peer},
      {"raw peer", test_raw_peer},
      {"set-up errors", test_setup_errors},
      {"interfaces", test_interfaces},
  };
  const char* only = std::getenv("PYCOMM_TEST_ONLY");
  for (const auto& c : cases) {
    if (only && *only && !contains(c.name, only)) continue;
    const int before = g_failures;
    const auto start = Clock::now();
    c.run();
    std::printf("%s %s (%.2f s)\n", g_failures == before ? "ok  " : "FAIL", c.name, seconds_since(start));
    std::fflush(stdout);
  }
  if (g_failures) {
    std::printf("%d check(s) failed\n", g_failures.load());
    return 1;
  }
  std::printf("all TCP transport tests passed\n");
  return 0;
}
