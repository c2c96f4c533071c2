// Fuzz test of the TCP wire protocol: what a rank makes of hostile bytes on its sockets.
//
// First the decoders of tcp_wire.h, fed bytes directly:
//   0. Decoders. Hellos cut at every length, over-long, with every bit flipped, mutated or
//      random: decode_hello() accepts only a valid one (but for the sender's rank, which
//      is its caller's to check) and rejects the others with a printable error. Mutated
//      frame headers: header_error() passes exactly the readable ones. A recorded session's
//      frames cut at every length, and mutated: find_abort_reason() finds the Abort's
//      reason only once it is whole, and returns only printable text.
// Then raw sockets play the attacker against real TCP transports (loopback, in-process
// store):
//   1. Handshake. Random bytes, mutated, truncated and over-long Hellos, ranks out of
//      range or already taken, slow senders, floods and immediate closes, thrown at a rank
//      that is setting up its group (the "listener"). It must close each of them without
//      answering, keep serving the others meanwhile, and still form its group with the
//      real peers at the end (while flooded). Then the other direction: a fake acceptor
//      answers a connecting rank with bad Acks; the rank must drop them and retry.
//   2. Frames. A peer that knows the secret completes the handshake, sends one good frame,
//      then a frame with mutated header fields (a table of fixed cases, then random ones).
//      The receiver sits in begin_recv() with a short deadline.
//   3. Sessions. The bytes of a recorded valid session (Hello, frames, Abort), with random
//      bit flips, byte writes, insertions, deletions, replays and truncation. A session
//      whose Hello changed goes to the listener of phase 1 (it must be dropped); any other
//      to a fresh receiver, under the rules of phase 2.
// The receiver's rules: begin_recv() throws an Error of kind Mismatch or PeerFailure (or
// Timeout, only while the peer holds its connection open) that names "rank 1", in
// printable text, by the deadline plus a margin; frames are delivered exactly when their
// checked header fields are right. Crashes and out-of-bounds accesses show under
// -fsanitize=address,undefined (make sanitize).
//
// Deterministic for a seed: random case i of phase p draws from its own generator seeded
// with (seed, p, i), so a failure message's seed and case number reproduce it (with
// PYCOMM_FUZZ_ITERATIONS above the number and a budget to reach it). The fixed cases
// always run; they include the reproducers of the bugs this test found.
//   PYCOMM_FUZZ_SEED        the seed (default kDefaultSeed)
//   PYCOMM_FUZZ_ITERATIONS  random cases per phase (default 5000)
//   PYCOMM_FUZZ_SECONDS     time budget of the random cases, all phases (default 25): a
//                           phase that runs out stops early and prints how far it got
//   PYCOMM_TEST_SLACK       stretches the timing margins (make sanitize sets 10)
//
// Build and run from the repository root (or make core-test / make sanitize):
//   g++ -std=c++17 -O2 -pthread -Icsrc -Itests/cpp $(ls csrc/core/*.cc csrc/device/*.cc
//       csrc/transport/*.cc csrc/algorithms/*.cc csrc/runtime/*.cc) tests/cpp/test_wire_fuzz.cc -o /tmp/wire_fuzz
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "core/config.h"
#include "core/error.h"
#include "core/numerics.h"
#include "core/types.h"
#include "memory_store.h"
#include "test_ranks.h"
#include "transport/tcp_socket.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

using namespace pycomm;
using pycomm_test::MemoryStore;
using pycomm_test::test_ranks;
using std::chrono::milliseconds;

namespace {

// ---- Knobs and small helpers. ----

constexpr uint64_t kDefaultSeed = 20240607;
constexpr size_t kChunk = 4096;  // every group's TCP chunk
constexpr int kDepth = 2;
constexpr milliseconds kRecvDeadline{2000};  // begin_recv() while the peer closes its end
constexpr milliseconds kHoldDeadline{300};   // ... while it holds its end open (a timeout)

uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* s = std::getenv(name);
  return s && *s ? std::strtoull(s, nullptr, 0) : fallback;
}

double slack() {
  const char* s = std::getenv("PYCOMM_TEST_SLACK");
  return s && *s ? std::atof(s) : 1.0;
}
milliseconds scaled(int ms) { return milliseconds(static_cast<long long>(ms * slack())); }

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Error messages reach exceptions and logs: no NULs, control characters or non-ASCII bytes
// from a peer.
bool printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

const char* kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::InvalidArgument:
      return "InvalidArgument";
    case ErrorKind::Timeout:
      return "Timeout";
    case ErrorKind::PeerFailure:
      return "PeerFailure";
    case ErrorKind::Mismatch:
      return "Mismatch";
    case ErrorKind::Corruption:
      return "Corruption";
    case ErrorKind::Internal:
      return "Internal";
  }
  return "?";
}

using Rng = std::mt19937_64;

Rng case_rng(uint64_t seed, int phase, uint64_t index) {
  std::seed_seq s{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(phase),
                  static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32)};
  return Rng(s);
}
size_t below(Rng& rng, size_t n) { return n ? std::uniform_int_distribution<size_t>(0, n - 1)(rng) : 0; }
std::string random_bytes(Rng& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// The random cases of each phase share PYCOMM_FUZZ_SECONDS.
struct Budget {
  uint64_t iterations;
  Clock::time_point until;
  bool more(uint64_t done) const { return done < iterations && Clock::now() < until; }
};

template <class T>
std::string bytes_of(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof v);
}

// ---- The wire format seen from outside (mirrors tcp_wire.h and core/wire.h). ----

constexpr uint32_t kHelloMagic = 0x70634843;
constexpr uint32_t kAckMagic = 0x70634841;
constexpr size_t kMaxReason = 1024;
const std::string kSecret = "0123456789abcdef0123456789abcdef";

struct RawHello {
  uint32_t magic = kHelloMagic;
  uint32_t version = 2;
  int32_t from_rank = -1;
  int32_t to_rank = -1;
  uint32_t secret_bytes = 0;
  uint32_t reserved = 0;
  unsigned char secret[64] = {};
};
static_assert(sizeof(RawHello) == 88, "Hello is a wire format");
constexpr size_t kHelloBytes = sizeof(RawHello);

RawHello make_hello(uint32_t magic, int from, int to) {
  RawHello h{magic, 2, from, to, static_cast<uint32_t>(kSecret.size()), 0, {}};
  std::memcpy(h.secret, kSecret.data(), kSecret.size());
  return h;
}
bool operator==(const RawHello& a, const RawHello& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Rank 1's valid Hello to rank 0, with `mutate` applied.
std::string hello_with(const std::function<void(RawHello&)>& mutate) {
  RawHello h = make_hello(kHelloMagic, 1, 0);
  mutate(h);
  return bytes_of(h);
}
const std::string kValidHello = hello_with([](RawHello&) {});

// Frame `seq` of the test's p2p stream: a send of `bytes` uint8 elements, tag 1.
FrameHeader data_header(uint64_t seq, uint32_t bytes) {
  FrameHeader h;
  h.bytes = bytes;
  h.op.seq = seq;
  h.op.count = bytes;
  h.op.collective = static_cast<uint8_t>(Collective::Send);
  h.op.dtype = static_cast<uint8_t>(DataType::UInt8);
  h.op.root = 1;
  return h;
}
std::string payload(uint64_t seq, size_t bytes) {
  std::string p(bytes, '\0');
  for (size_t j = 0; j < bytes; ++j) p[j] = static_cast<char>(seq * 131 + j * 7 + (j >> 8));
  return p;
}
// A header and `sent` payload bytes (by default what it announces, at most 8 KiB).
std::string frame(const FrameHeader& h, size_t sent = SIZE_MAX) {
  return bytes_of(h) + payload(h.op.seq, std::min<size_t>(sent, std::min<size_t>(h.bytes, 8192)));
}
std::string data_frame(uint64_t seq, uint32_t bytes) { return frame(data_header(seq, bytes)); }
FrameHeader header_with(const std::function<void(FrameHeader&)>& mutate) {
  FrameHeader h = data_header(1, 10);
  mutate(h);
  return h;
}
// An Abort frame announcing `declared` reason bytes, of which `reason` is sent.
std::string abort_frame(const std::string& reason, uint32_t declared) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::Abort);
  h.bytes = declared;
  return bytes_of(h) + reason;
}
std::string abort_frame(const std::string& reason) { return abort_frame(reason, static_cast<uint32_t>(reason.size())); }

// ---- Raw sockets: the attacker's side. ----

class RawSocket {
 public:
  RawSocket() = default;
  explicit RawSocket(int fd) : fd_(fd) {}
  // A blocking connection to "a.b.c.d:port"; ok() is false when it failed.
  explicit RawSocket(const std::string& address) {
    const size_t colon = address.rfind(':');
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(std::atoi(address.c_str() + colon + 1)));
    inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
    fd_ = tcp::Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    timeval tv{2, 0};  // a send never blocks a case for long
    setsockopt(fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (::connect(fd(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) close();
  }

  bool ok() const { return static_cast<bool>(fd_); }
  int fd() const { return fd_.get(); }
  void close() { fd_.reset(); }
  // Closes with a reset instead of an orderly shutdown.
  void reset() {
    linger lg{1, 0};
    setsockopt(fd(), SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close();
  }
  // Best effort: false once the other side is gone (it may close on the first bad byte).
  bool send(const std::string& bytes) {
    for (size_t off = 0; off < bytes.size();) {
      const ssize_t n = ::send(fd(), bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  void shutdown_write() { ::shutdown(fd(), SHUT_WR); }

  // Reads exactly `n` bytes within `within`.
  bool read(void* buf, size_t n, milliseconds within) {
    const auto until = Clock::now() + within;
    auto* p = static_cast<char*>(buf);
    while (n > 0) {
      if (!readable(until)) return false;
      const ssize_t got = ::recv(fd(), p, n, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      p += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  }

  // What the other side does next, within `within`.
  enum class Next { Closed, Data, Nothing };
  Next next(milliseconds within) {
    if (!readable(Clock::now() + within)) return Next::Nothing;
    char c;
    const ssize_t n = ::recv(fd(), &c, 1, MSG_DONTWAIT);
    if (n > 0) return Next::Data;
    return n == 0 || errno == ECONNRESET || errno == EPIPE ? Next::Closed : Next::Nothing;
  }

 private:
  bool readable(Clock::time_point until) {
    for (;;) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
      pollfd p{fd(), POLLIN, 0};
      const int n = ::poll(&p, 1, static_cast<int>(std::max<long long>(left, 0)));
      if (n < 0 && errno == EINTR) continue;
      return n > 0;
    }
  }

  tcp::Fd fd_;
};

// A fake rank's listening socket on loopback.
class RawListener {
 public:
  RawListener() {
    fd_ = RawSocket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(fd_.fd(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd_.fd(), 16);
    ::getsockname(fd_.fd(), reinterpret_cast<sockaddr*>(&a), &len);
    address_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  const std::string& address() const { return address_; }
  // The next connection within `within`; !ok() when none came.
  RawSocket accept(milliseconds within) {
    pollfd p{fd_.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(within.count())) <= 0) return RawSocket();
    return RawSocket(::accept4(fd_.fd(), nullptr, nullptr, SOCK_CLOEXEC));
  }

 private:
  RawSocket fd_;
  std::string address_;
};

// ---- Groups of real transports. ----

struct Group {
  std::unique_ptr<MemoryStore> store = std::make_unique<MemoryStore>();
  Config config;
  std::vector<PeerInfo> ranks;
  std::string prefix;

  explicit Group(int size) {
    static std::atomic<int> instance{0};
    prefix = "fuzz/" + std::to_string(instance++);
    config.tcp_chunk_bytes = kChunk;
    config.pipeline_depth = kDepth;
    ranks = test_ranks(size);
  }

  std::unique_ptr<Transport> connect(int rank, std::vector<int> peers, milliseconds setup) const {
    TransportSetup s;
    s.store = store.get();
    s.key_prefix = prefix;
    s.rank = rank;
    s.size = static_cast<int>(ranks.size());
    s.peers = std::move(peers);
    s.ranks = ranks;
    s.secret = kSecret;
    s.config = &config;
    s.deadline = Deadline::after(setup);
    return make_tcp_transport(s);
  }
  std::string address_key(int rank) const { return prefix + "/tcp/addr/" + std::to_string(rank); }
  std::string address(int rank) const { return store->get(address_key(rank)); }  // waits for it
  // A rank the test plays by hand publishes an address too, as every rank does (read by
  // the real ranks for connections on demand; never connected to here).
  void played_by_hand(int rank) const { store->set(address_key(rank), "127.0.0.1:1"); }
};

// ---- The receiver's side and its rules. ----

struct Received {
  size_t delivered = 0;        // frames that begin_recv() returned
  std::optional<Error> error;  // what the first failing begin_recv() threw
  double seconds = 0;          // how long that call took
  std::string unexpected;      // an exception of another type, or a failed set-up
};

// Receives `expect` in order, then one frame more, which was never sent: every session
// ends in an Error.
Received receive(Channel& ch, const std::vector<FrameHeader>& expect, milliseconds deadline) {
  Received r;
  for (size_t i = 0; i <= expect.size(); ++i) {
    const FrameHeader want = i < expect.size() ? expect[i] : data_header(i, 10);
    const auto start = Clock::now();
    try {
      ch.begin_recv(want, Deadline::after(deadline));
      ch.end_recv();
      ++r.delivered;
    } catch (const Error& e) {
      r.error = e;
      r.seconds = seconds_since(start);
      break;
    } catch (const std::exception& e) {
      r.unexpected = std::string("an exception that is no pycomm::Error: ") + e.what();
      break;
    }
  }
  return r;
}

// The rules of the file comment, for a session whose peer (rank 1) closed its end, or held
// it open.
void check_reported(const Received& r, bool peer_closed, milliseconds deadline, const std::string& label) {
  CHECK(r.unexpected.empty(), "%s: %s", label.c_str(), r.unexpected.c_str());
  if (!r.error) {
    CHECK(!r.unexpected.empty(), "%s: the receiver got a frame that was never sent", label.c_str());
    return;
  }
  const Error& e = *r.error;
  const bool kind_ok = e.kind() == ErrorKind::Mismatch || e.kind() == ErrorKind::PeerFailure ||
                       (e.kind() == ErrorKind::Timeout && !peer_closed);
  CHECK(kind_ok, "%s: %s error: %s", label.c_str(), kind_name(e.kind()), e.what());
  CHECK(contains(e.what(), "rank 1 ("), "%s: the error does not name the peer: %s", label.c_str(), e.what());
  CHECK(printable(e.what()), "%s: the error is not printable text: %s", label.c_str(), e.what());
  // The margins tell a hang from a slow, shared machine.
  const double limit = std::chrono::duration<double>(deadline + kLivenessSlice + scaled(1000)).count();
  CHECK(r.seconds <= limit, "%s: begin_recv() returned after %.2f s (deadline %.2f s): %s", label.c_str(), r.seconds,
        std::chrono::duration<double>(deadline).count(), e.what());
}

enum class End { Close, Hold };

// Rank 1 over a raw socket against rank 0, a real transport of a fresh group: sends
// `session`'s Hello, reads the Ack, sends the rest of `session`, then closes its end or,
// for End::Hold, keeps it open until rank 0 is done. Rank 0 receives `expect`, then one
// frame more (see receive()).
Received run_session(const std::string& session, const std::vector<FrameHeader>& expect, End end,
                     const std::string& label) {
  const auto start = Clock::now();
  const milliseconds deadline = end == End::Hold ? kHoldDeadline : kRecvDeadline;
  Group g(2);
  g.played_by_hand(1);
  std::mutex mu;
  std::condition_variable cv;
  bool receiver_done = false;
  std::string attacker_error;
  std::thread attacker([&] {
    RawSocket s(g.address(0));
    RawHello ack;
    // The Ack is read before the rest is sent: closing with it unread would reset the
    // connection, which may discard frames rank 0 has not read yet.
    if (!s.send(session.substr(0, kHelloBytes)) || !s.read(&ack, sizeof ack, scaled(5000)) ||
        !(ack == make_hello(kAckMagic, 0, 1)))
      attacker_error = "no valid Ack from rank 0";
    s.send(session.substr(std::min(kHelloBytes, session.size())));
    if (end == End::Hold) {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return receiver_done; });
    }
  });
  Received r;
  try {
    auto t = g.connect(0, {1}, scaled(5000));
    r = receive(*t->channel(1), expect, deadline);
  } catch (const std::exception& e) {
    r.unexpected = std::string("rank 0's set-up failed: ") + e.what();
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    receiver_done = true;
  }
  cv.notify_all();
  attacker.join();
  CHECK(attacker_error.empty(), "%s: %s", label.c_str(), attacker_error.c_str());
  // Set-up and tear-down are quick too: nothing lingers on a failed peer.
  const double limit = std::chrono::duration<double>(deadline + scaled(3000)).count();
  CHECK(seconds_since(start) <= limit, "%s: the session took %.2f s", label.c_str(), seconds_since(start));
  return r;
}

// ---- Phase 1: handshakes. ----

// Connects to `address`, sends `bytes`, half-closes, and says what the rank did: "" when it
// closed the connection without a word within `within`.
std::string expect_dropped(const std::string& address, const std::string& bytes, milliseconds within) {
  RawSocket s(address);
  if (!s.ok()) return "cannot connect";
  s.send(bytes);  // fails once the rank closed on the first bad bytes
  s.shutdown_write();
  switch (s.next(within)) {
    case RawSocket::Next::Closed:
      return "";
    case RawSocket::Next::Data:
      return "the rank answered (it took the connection for a peer's)";
    case RawSocket::Next::Nothing:
      break;
  }
  return "the rank kept the connection open";
}

// Frame `seq` of 10 bytes through a real channel, and its check at the other end.
void send_frame(Channel& ch, uint64_t seq, const Deadline& d) {
  std::memcpy(ch.begin_send(d), payload(seq, 10).data(), 10);
  ch.end_send(data_header(seq, 10));
}
void check_frame_payload(Channel& ch, uint64_t seq, const Deadline& d, const char* what) {
  CHECK(std::memcmp(ch.begin_recv(data_header(seq, 10), d), payload(seq, 10).data(), 10) == 0, "%s: payload", what);
  ch.end_recv();
}

// Rank 0 of a three-rank group, in set-up (its constructor) while phases 1 and 3 throw
// connections at it. Rank 2 is played over a raw socket from the start, so that rank 2
// is taken; the real rank 1 connects at the end, in finish().
class Listener {
 public:
  explicit Listener(milliseconds lifetime) : g_(3) {
    g_.played_by_hand(2);
    rank0_ = std::thread([this, lifetime] {
      try {
        t0_ = g_.connect(0, {1, 2}, lifetime);
      } catch (const std::exception& e) {
        error_ = e.what();
      }
    });
    address_ = g_.address(0);
    rank2_ = RawSocket(address_);
    RawHello ack;
    rank2_.send(bytes_of(make_hello(kHelloMagic, 2, 0)));
    CHECK(rank2_.read(&ack, sizeof ack, scaled(5000)) && ack == make_hello(kAckMagic, 0, 2),
          "listener: no valid Ack for rank 2");
  }
  ~Listener() {
    if (rank0_.joinable()) rank0_.join();
  }

  const std::string& address() const { return address_; }

  // The real rank 1 connects; then frames flow between rank 0 and ranks 1 and 2.
  void finish() {
    std::unique_ptr<Transport> t1;
    try {
      t1 = g_.connect(1, {0}, scaled(10000));
    } catch (const std::exception& e) {
      CHECK(false, "listener: the real rank 1 could not connect: %s", e.what());
    }
    rank0_.join();
    CHECK(t0_ != nullptr, "listener: rank 0 did not form its group: %s", error_.c_str());
    if (!t0_ || !t1) return;
    try {
      const Deadline d = Deadline::after(scaled(5000));
      send_frame(*t0_->channel(1), 7, d);
      check_frame_payload(*t1->channel(0), 7, d, "listener: rank 0 to rank 1");
      send_frame(*t1->channel(0), 8, d);
      check_frame_payload(*t0_->channel(1), 8, d, "listener: rank 1 to rank 0");
      send_frame(*t0_->channel(2), 9, d);
      std::string got(data_frame(9, 10).size(), '\0');
      CHECK(rank2_.read(&got[0], got.size(), scaled(5000)) && got == data_frame(9, 10),
            "listener: rank 0 to the raw rank 2");
      rank2_.send(data_frame(10, 10));
      check_frame_payload(*t0_->channel(2), 10, d, "listener: the raw rank 2 to rank 0");
    } catch (const std::exception& e) {
      CHECK(false, "listener: frames after set-up: %s", e.what());
    }
  }

 private:
  Group g_;
  std::thread rank0_;
  std::unique_ptr<Transport> t0_;  // written by rank0_, read after joining it
  std::string error_;              // likewise
  std::string address_;
  RawSocket rank2_;
};

// How a handshake case leaves: half-closes and waits for the rank to close (checked), or
// closes or resets at once (nothing to check but the rank's health afterwards).
enum class Leave { Wait, Close, Reset };

struct HandshakeCase {
  const char* name;
  std::string bytes;
  Leave leave = Leave::Wait;
};

std::vector<HandshakeCase> handshake_cases() {
  const auto hello = [](const std::function<void(RawHello&)>& m) { return hello_with(m); };
  const auto bad_secret = [](RawHello& h) { h.secret[5] ^= 1; };
  std::string tls = "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03";
  tls.resize(kHelloBytes + 100, '\x5a');
  return {
      {"nothing, half-closed", ""},
      {"one byte", "\x43"},
      {"a valid Hello cut at 87 bytes", kValidHello.substr(0, kHelloBytes - 1)},
      {"a valid Hello cut at 4 bytes", kValidHello.substr(0, 4)},
      {"an HTTP request", std::string("GET / HTTP/1.0\r\nHost: x\r\n\r\n") + std::string(80, ' ')},
      {"a TLS client hello", tls},
      {"88 zero bytes", std::string(kHelloBytes, '\0')},
      {"88 0xff bytes", std::string(kHelloBytes, '\xff')},
      {"a frame header and payload", data_frame(0, 100)},
      {"wrong magic", hello([](RawHello& h) { h.magic = 0x12345678; })},
      {"an Ack's magic", hello([](RawHello& h) { h.magic = kAckMagic; })},
      {"a frame's magic", hello([](RawHello& h) { h.magic = kFrameMagic; })},
      {"version 0", hello([](RawHello& h) { h.version = 0; })},
      {"version 1", hello([](RawHello& h) { h.version = 1; })},
      {"version 0xffffffff", hello([](RawHello& h) { h.version = UINT32_MAX; })},
      {"to rank 1", hello([](RawHello& h) { h.to_rank = 1; })},
      {"to rank -1", hello([](RawHello& h) { h.to_rank = -1; })},
      {"to rank 3 (the size)", hello([](RawHello& h) { h.to_rank = 3; })},
      {"from rank 0 (itself)", hello([](RawHello& h) { h.from_rank = 0; })},
      {"from rank -1", hello([](RawHello& h) { h.from_rank = -1; })},
      {"from rank 3 (the size)", hello([](RawHello& h) { h.from_rank = 3; })},
      {"from rank INT_MAX", hello([](RawHello& h) { h.from_rank = INT_MAX; })},
      {"from rank INT_MIN", hello([](RawHello& h) { h.from_rank = INT_MIN; })},
      {"from rank 2 again (taken)", hello([](RawHello& h) { h.from_rank = 2; })},
      {"secret off by one bit", hello(bad_secret)},
      {"secret length 0", hello([](RawHello& h) { h.secret_bytes = 0; })},
      {"secret length 8 (a prefix)", hello([](RawHello& h) { h.secret_bytes = 8; })},
      {"secret length 33", hello([](RawHello& h) { h.secret_bytes = 33; })},
      {"secret length 64", hello([](RawHello& h) { h.secret_bytes = 64; })},
      {"secret length 65", hello([](RawHello& h) { h.secret_bytes = 65; })},
      {"secret length 0xffffffff", hello([](RawHello& h) { h.secret_bytes = UINT32_MAX; })},
      {"secret padding not zero", hello([](RawHello& h) { h.secret[63] = 'x'; })},
      {"reserved not zero", hello([](RawHello& h) { h.reserved = 1; })},
      {"a bad Hello and 64 KiB more", hello(bad_secret) + std::string(64 << 10, 'A')},
      {"a bad Hello, then a valid one", hello(bad_secret) + kValidHello},
      {"connect and close", "", Leave::Close},
      {"connect and reset", "", Leave::Reset},
      {"a valid Hello cut at 50 bytes, then close", kValidHello.substr(0, 50), Leave::Close},
      {"a valid Hello cut at 50 bytes, then reset", kValidHello.substr(0, 50), Leave::Reset},
  };
}

// Connections that dribble a bad Hello a byte every 10 ms, or send half a Hello and then
// nothing, while the main thread's cases run: those must be served meanwhile, and the
// complete Hellos dropped. Runs on its own thread; returns the problems seen.
std::vector<std::string> slow_senders(const std::string& address) {
  std::vector<std::string> problems;
  std::vector<std::string> hellos;
  for (int i = 0; i < 3; ++i) hellos.push_back(hello_with([i](RawHello& h) { h.secret[i] ^= 0x20; }));
  std::vector<RawSocket> dribblers, stallers;
  for (size_t i = 0; i < hellos.size(); ++i) dribblers.emplace_back(address);
  for (int i = 0; i < 2; ++i) {
    stallers.emplace_back(address);
    stallers.back().send(kValidHello.substr(0, 40));
  }
  for (size_t b = 0; b < kHelloBytes; ++b) {
    for (size_t i = 0; i < dribblers.size(); ++i) dribblers[i].send(hellos[i].substr(b, 1));
    std::this_thread::sleep_for(milliseconds(10));
  }
  for (auto& s : dribblers)
    if (s.next(scaled(2000)) != RawSocket::Next::Closed) problems.push_back("a slow bad Hello was not dropped");
  for (auto& s : stallers)
    if (s.next(milliseconds(0)) == RawSocket::Next::Data) problems.push_back("half a Hello was answered");
  return problems;
}

// `s` after 1 to 4 of: bit flips, byte writes, insertions, deletions, truncation, random
// runs, replays of a region; positions drawn from `regions` (offset, length in the
// unmutated `s`) so that small headers are hit as often as long payloads.
using Region = std::pair<size_t, size_t>;
std::string mutate(Rng& rng, std::string s, const std::vector<Region>& regions) {
  const size_t ops = 1 + below(rng, 4);
  for (size_t k = 0; k < ops; ++k) {
    const Region& r = regions[below(rng, regions.size())];
    const size_t pos = std::min(s.size(), r.first + below(rng, r.second + 1));
    switch (below(rng, 7)) {
      case 0:  // flip a bit
        if (pos < s.size()) s[pos] = static_cast<char>(s[pos] ^ (1 << below(rng, 8)));
        break;
      case 1: {  // write an edge value or a random byte
        static const unsigned char values[] = {0x00, 0x01, 0x7f, 0x80, 0xff};
        if (pos < s.size()) s[pos] = static_cast<char>(below(rng, 2) ? values[below(rng, 5)] : rng());
        break;
      }
      case 2:
        s.insert(pos, random_bytes(rng, 1 + below(rng, 16)));
        break;
      case 3:
        s.erase(pos, 1 + below(rng, 16));
        break;
      case 4:
        s.resize(pos);
        break;
      case 5: {  // overwrite a field-sized run with random bytes
        const size_t run = std::min<size_t>(1 + below(rng, 8), s.size() - pos);
        s.replace(pos, run, random_bytes(rng, run));
        break;
      }
      default: {  // replay a region elsewhere (a frame sent twice, out of order)
        const Region& from = regions[below(rng, regions.size())];
        if (from.first < s.size()) s.insert(pos, s.substr(from.first, from.second));
        break;
      }
    }
  }
  return s;
}

// Not rank 1's valid Hello as the first 88 bytes: the listener must drop it.
bool hello_changed(const std::string& s) {
  return s.size() < kHelloBytes || s.compare(0, kHelloBytes, kValidHello) != 0;
}

void run_handshake_case(const Listener& l, const HandshakeCase& c, const std::string& label) {
  if (c.leave == Leave::Wait) {
    const std::string verdict = expect_dropped(l.address(), c.bytes, scaled(2000));
    CHECK(verdict.empty(), "%s: %s", label.c_str(), verdict.c_str());
    return;
  }
  RawSocket s(l.address());
  CHECK(s.ok(), "%s: cannot connect", label.c_str());
  s.send(c.bytes);
  if (c.leave == Leave::Reset) s.reset();
}

void phase_handshake(const Listener& l, uint64_t seed, const Budget& budget) {
  const auto start = Clock::now();
  std::vector<std::string> slow_problems;
  std::thread slow([&] { slow_problems = slow_senders(l.address()); });
  for (const auto& c : handshake_cases()) run_handshake_case(l, c, std::string("handshake: ") + c.name);
  uint64_t i = 0;
  for (; budget.more(i); ++i) {
    Rng rng = case_rng(seed, 1, i);
    HandshakeCase c{"random", ""};
    if (below(rng, 4) == 0) {
      c.bytes = random_bytes(rng, below(rng, 200));
    } else {
      c.bytes = mutate(rng, kValidHello, {{0, kHelloBytes}});
      if (!hello_changed(c.bytes)) c.bytes[below(rng, kHelloBytes)] ^= static_cast<char>(1 + below(rng, 255));
    }
    if (below(rng, 8) == 0) c.leave = below(rng, 2) ? Leave::Close : Leave::Reset;
    run_handshake_case(l, c, "handshake: random case " + std::to_string(i) + " (seed " + std::to_string(seed) + ")");
  }
  slow.join();
  for (const auto& p : slow_problems) CHECK(false, "handshake: slow senders: %s", p.c_str());
  std::printf("  handshake: %zu fixed cases, %llu random, slow senders alongside (%.1f s)\n", handshake_cases().size(),
              static_cast<unsigned long long>(i), seconds_since(start));
}

// ---- Phase 1, the other direction: a fake acceptor answers a connecting rank. ----

struct AckCase {
  const char* name;
  std::string reply;  // to the first connection; the second gets a valid Ack
};

std::vector<AckCase> ack_cases() {
  const auto ack = [](const std::function<void(RawHello&)>& m) {
    RawHello h = make_hello(kAckMagic, 0, 1);
    m(h);
    return bytes_of(h);
  };
  return {
      {"close at once", ""},
      {"half an Ack, then close", ack([](RawHello&) {}).substr(0, 40)},
      {"88 bytes of garbage", std::string(kHelloBytes, '\x5a')},
      {"a Hello's magic", ack([](RawHello& h) { h.magic = kHelloMagic; })},
      {"version 1", ack([](RawHello& h) { h.version = 1; })},
      {"from rank 1 (not the peer)", ack([](RawHello& h) { h.from_rank = 1; })},
      {"to rank 0 (not this rank)", ack([](RawHello& h) { h.to_rank = 0; })},
      {"wrong secret", ack([](RawHello& h) { h.secret[0] ^= 1; })},
      {"secret length 0", ack([](RawHello& h) { h.secret_bytes = 0; })},
      {"reserved not zero", ack([](RawHello& h) { h.reserved = 1; })},
  };
}

// Rank 1, a real transport, connects to a fake rank 0 whose first answer is `c.reply`: it
// must close that connection, connect again, and take the valid Ack and a frame.
void run_ack_case(const AckCase& c) {
  const std::string label = std::string("acceptor: ") + c.name;
  Group g(2);
  RawListener fake;
  g.store->set(g.address_key(0), fake.address());
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string problem;
  std::thread rank0([&] {
    RawSocket first = fake.accept(scaled(5000));
    RawHello hello;
    if (!first.read(&hello, sizeof hello, scaled(5000)) || !(hello == make_hello(kHelloMagic, 1, 0))) {
      problem = "no valid Hello from rank 1";
      return;
    }
    first.send(c.reply);
    if (c.reply.size() < kHelloBytes) first.close();
    else if (first.next(scaled(2000)) != RawSocket::Next::Closed) problem = "rank 1 kept a connection with a bad Ack";
    RawSocket second = fake.accept(scaled(5000));
    if (!second.read(&hello, sizeof hello, scaled(5000))) problem = "rank 1 did not connect again";
    second.send(bytes_of(make_hello(kAckMagic, 0, 1)) + data_frame(0, 10));
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return done; });
  });
  try {
    auto t = g.connect(1, {0}, scaled(5000));
    Channel& ch = *t->channel(0);
    const void* p = ch.begin_recv(data_header(0, 10), Deadline::after(scaled(5000)));
    CHECK(std::memcmp(p, payload(0, 10).data(), 10) == 0, "%s: payload", label.c_str());
    ch.end_recv();
  } catch (const std::exception& e) {
    CHECK(false, "%s: %s", label.c_str(), e.what());
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    done = true;
  }
  cv.notify_all();
  rank0.join();
  CHECK(problem.empty(), "%s: %s", label.c_str(), problem.c_str());
}

// A fake rank 0 that only ever answers with a wrong secret: rank 1's set-up times out,
// naming rank 0 and why.
void run_always_bad_acceptor() {
  Group g(2);
  RawListener fake;
  g.store->set(g.address_key(0), fake.address());
  std::atomic<bool> stop{false};
  std::thread rank0([&] {
    while (!stop) {
      RawSocket s = fake.accept(milliseconds(50));
      RawHello hello;
      if (s.ok() && s.read(&hello, sizeof hello, milliseconds(1000)))
        s.send(bytes_of(make_hello(kAckMagic, 0, 1)).replace(30, 1, "!"));
    }
  });
  const auto start = Clock::now();
  try {
    g.connect(1, {0}, milliseconds(600));
    CHECK(false, "acceptor: rank 1 took a wrong secret");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::Timeout && contains(e.what(), "rank 0 (") &&
              contains(e.what(), "invalid handshake reply"),
          "acceptor: %s", e.what());
  }
  CHECK(seconds_since(start) < 0.6 + 1.0 * slack(), "acceptor: set-up overran its deadline");
  stop = true;
  rank0.join();
}

void phase_acceptor() {
  const auto start = Clock::now();
  for (const auto& c : ack_cases()) run_ack_case(c);
  run_always_bad_acceptor();
  std::printf("  acceptor: %zu bad Acks, then a wrong secret for good (%.1f s)\n", ack_cases().size(),
              seconds_since(start));
}

// ---- Phase 2: frames from an authenticated peer. ----

// Rank 1 sends the valid frame 0 (10 bytes), then `bad` where rank 0 expects frame 1 (10
// bytes), then leaves as `end` says. Rank 0 must get frame 0, then an Error of `kind`
// containing `message`.
struct FrameCase {
  const char* name;
  std::string bad;
  ErrorKind kind;
  const char* message;
  End end = End::Close;
};

std::vector<FrameCase> frame_cases() {
  using K = ErrorKind;
  const auto with = [](const std::function<void(FrameHeader&)>& m) { return frame(header_with(m)); };
  const auto cut = [](size_t n) { return bytes_of(data_header(1, 10)).substr(0, n); };
  const std::string good = data_frame(1, 10);
  return {
      {"magic 0", with([](FrameHeader& h) { h.magic = 0; }), K::Mismatch, "bad magic"},
      {"magic byte-swapped", with([](FrameHeader& h) { h.magic = __builtin_bswap32(kFrameMagic); }), K::Mismatch,
       "bad magic"},
      {"kind 0", with([](FrameHeader& h) { h.kind = 0; }), K::Mismatch, "unknown frame kind 0"},
      {"kind 3", with([](FrameHeader& h) { h.kind = 3; }), K::Mismatch, "unknown frame kind 3"},
      {"kind 0xffff", with([](FrameHeader& h) { h.kind = 0xffff; }), K::Mismatch, "unknown frame kind 65535"},
      {"bytes 0", with([](FrameHeader& h) { h.bytes = 0; }), K::Mismatch, "sent 0 bytes where 10"},
      {"bytes 9", with([](FrameHeader& h) { h.bytes = 9; }), K::Mismatch, "sent 9 bytes where 10"},
      {"bytes 11", with([](FrameHeader& h) { h.bytes = 11; }), K::Mismatch, "sent 11 bytes where 10"},
      {"bytes = chunk", with([](FrameHeader& h) { h.bytes = kChunk; }), K::Mismatch, "sent 4096 bytes where 10"},
      {"bytes = chunk + 1", with([](FrameHeader& h) { h.bytes = kChunk + 1; }), K::Mismatch, "exceeds this rank's"},
      {"bytes 2^31", with([](FrameHeader& h) { h.bytes = 1u << 31; }), K::Mismatch, "exceeds this rank's"},
      {"bytes 0xffffffff", with([](FrameHeader& h) { h.bytes = UINT32_MAX; }), K::Mismatch, "exceeds this rank's"},
      {"seq + 1", with([](FrameHeader& h) { h.op.seq = 2; }), K::Mismatch, "ranks called different"},
      {"frame 0 replayed", data_frame(0, 10), K::Mismatch, "ranks called different"},
      {"seq 2^64 - 1", with([](FrameHeader& h) { h.op.seq = UINT64_MAX; }), K::Mismatch, "ranks called different"},
      {"count + 1", with([](FrameHeader& h) { h.op.count = 11; }), K::Mismatch, "ranks called different"},
      {"count 2^64 - 1", with([](FrameHeader& h) { h.op.count = UINT64_MAX; }), K::Mismatch, "called different"},
      {"another collective", with([](FrameHeader& h) { h.op.collective = static_cast<uint8_t>(Collective::Recv); }),
       K::Mismatch, "ranks called different"},
      {"collective 11 (out of range)", with([](FrameHeader& h) { h.op.collective = 11; }), K::Mismatch,
       "collective 11"},
      {"collective 255", with([](FrameHeader& h) { h.op.collective = 255; }), K::Mismatch, "collective 255"},
      {"dtype 9 (out of range)", with([](FrameHeader& h) { h.op.dtype = 9; }), K::Mismatch, "dtype 9"},
      {"reduce op 200", with([](FrameHeader& h) { h.op.reduce = 200; }), K::Mismatch, "reduce op 200"},
      {"variant 21 (out of range: past P2PViaHost, the last)", with([](FrameHeader& h) {
         static_assert(static_cast<int>(Variant::P2PViaHost) == 20, "the first variant out of range moved");
         h.op.variant = 21;
       }),
       K::Mismatch, "variant 21"},
      {"root -1", with([](FrameHeader& h) { h.op.root = -1; }), K::Mismatch, "ranks called different"},
      {"root INT_MIN", with([](FrameHeader& h) { h.op.root = INT_MIN; }), K::Mismatch, "ranks called different"},
      {"compression 5 (out of range)", with([](FrameHeader& h) { h.op.compression = 5; }), K::Mismatch,
       "compression 5"},
      {"compression block 2^63", with([](FrameHeader& h) {
         h.op.compression = 1;
         h.op.compression_block = 63;
       }),
       K::Mismatch, "ranks called different"},
      {"compression block 2^64", with([](FrameHeader& h) {
         h.op.compression = 1;
         h.op.compression_block = 64;
       }),
       K::Mismatch, "compression block 64"},
      {"compression block 2^255", with([](FrameHeader& h) {
         h.op.compression = 1;
         h.op.compression_block = 255;
       }),
       K::Mismatch, "compression block 255"},
      {"coded pieces of another layout", with([](FrameHeader& h) {
         static_assert(kCodeLayout != 1, "layout 1, the interleaved records, is another layout");
         h.op.compression = 1;
         h.op.compression_block = 8;
         h.op.code_layout = 1;
       }),
       K::Mismatch, "fp16/256, code layout 1,"},
      {"determinism 3 (out of range)", with([](FrameHeader& h) { h.op.determinism = 3; }), K::Mismatch,
       "determinism 3"},
      {"Abort, empty reason", abort_frame(""), K::PeerFailure, " aborted: "},
      {"Abort, 1024-byte reason", abort_frame(std::string(kMaxReason, 'r')), K::PeerFailure, " aborted: rrrr"},
      {"Abort, 1025-byte reason", abort_frame(std::string(kMaxReason + 1, 'r')), K::Mismatch,
       "abort reason of 1025 bytes"},
      {"Abort, 2^32 - 1 byte reason", abort_frame("r", UINT32_MAX), K::Mismatch, "abort reason of 4294967295 bytes"},
      {"Abort, control bytes and no terminator", abort_frame(std::string("a\0b\n\x1b[2J\xff", 9)), K::PeerFailure,
       " aborted: a\\x00b\\x0a\\x1b[2J\\xff"},
      {"Abort, cut short", abort_frame("0123456789", 100), K::PeerFailure, "closed in the middle of a frame"},
      {"Abort, cut short and held", abort_frame("0123456789", 100), K::Timeout, "timed out", End::Hold},
      {"header cut at 20 bytes", cut(20), K::PeerFailure, "closed in the middle of a frame"},
      {"header cut at 47 bytes", cut(47), K::PeerFailure, "closed in the middle of a frame"},
      {"header cut at 20 bytes and held", cut(20), K::Timeout, "timed out", End::Hold},
      {"payload cut at 5 bytes", good.substr(0, good.size() - 5), K::PeerFailure, "closed in the middle of a frame"},
      {"payload cut and held", good.substr(0, good.size() - 5), K::Timeout, "timed out", End::Hold},
      {"nothing", "", K::PeerFailure, " lost: closed"},
      {"nothing, held", "", K::Timeout, "timed out", End::Hold},
      {"48 zero bytes", std::string(sizeof(FrameHeader), '\0'), K::Mismatch, "bad magic"},
      {"a Hello again", kValidHello, K::Mismatch, "bad magic"},
  };
}

// The header fields a random case overwrites, with values near the edges.
struct Field {
  const char* name;
  size_t offset, size;
};
#define FIELD(m) \
  Field { #m, offsetof(FrameHeader, m), sizeof(FrameHeader{}.m) }
const Field kFields[] = {
    FIELD(magic),          FIELD(kind),
    FIELD(reserved),       FIELD(bytes),
    FIELD(reserved2),      FIELD(op.seq),
    FIELD(op.count),       FIELD(op.collective),
    FIELD(op.dtype),       FIELD(op.reduce),
    FIELD(op.variant),     FIELD(op.root),
    FIELD(op.compression), FIELD(op.compression_block),
    FIELD(op.determinism), FIELD(op.verification),
    FIELD(op.code_layout), FIELD(op.reserved),
};
#undef FIELD

void write_edge_value(Rng& rng, FrameHeader& h, const Field& f) {
  uint64_t old = 0;
  auto* base = reinterpret_cast<unsigned char*>(&h) + f.offset;
  const size_t n = std::min<size_t>(f.size, 8);
  std::memcpy(&old, base, n);  // little-endian, like the wire
  const uint64_t mask = n == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * n)) - 1;
  const uint64_t edges[] = {0,
                            1,
                            2,
                            10,
                            11,
                            0x7f,
                            0x80,
                            kChunk,
                            kChunk + 1,
                            kMaxReason,
                            kMaxReason + 1,
                            mask >> 1,
                            (mask >> 1) + 1,
                            mask,
                            old + 1,
                            old - 1,
                            rng()};
  const uint64_t v = edges[below(rng, sizeof edges / sizeof edges[0])] & mask;
  std::memcpy(base, &v, n);
}

// A frame is delivered exactly when these match the receiver's expectation.
bool checked_fields_equal(const FrameHeader& a, const FrameHeader& b) {
  return a.magic == b.magic && a.kind == b.kind && a.bytes == b.bytes && a.op == b.op;
}

void phase_frames(uint64_t seed, const Budget& budget) {
  const auto start = Clock::now();
  const std::vector<FrameHeader> expect = {data_header(0, 10), data_header(1, 10)};
  const std::string hello_and_frame0 = kValidHello + data_frame(0, 10);
  for (const auto& c : frame_cases()) {
    const std::string label = std::string("frames: ") + c.name;
    const Received r = run_session(hello_and_frame0 + c.bad, expect, c.end, label);
    check_reported(r, c.end == End::Close, c.end == End::Hold ? kHoldDeadline : kRecvDeadline, label);
    CHECK(r.delivered == 1, "%s: %zu frames delivered, 1 expected", label.c_str(), r.delivered);
    if (r.error)
      CHECK(r.error->kind() == c.kind && contains(r.error->what(), c.message), "%s: %s error: %s (expected %s '%s')",
            label.c_str(), kind_name(r.error->kind()), r.error->what(), kind_name(c.kind), c.message);
  }
  uint64_t i = 0;
  for (; budget.more(i); ++i) {
    Rng rng = case_rng(seed, 2, i);
    FrameHeader h = expect[1];
    std::string label = "frames: random case " + std::to_string(i) + " (seed " + std::to_string(seed) + "):";
    for (size_t k = 1 + below(rng, 3); k > 0; --k) {
      const Field& f = kFields[below(rng, sizeof kFields / sizeof kFields[0])];
      write_edge_value(rng, h, f);
      label += std::string(" ") + f.name;
    }
    const Received r = run_session(hello_and_frame0 + frame(h), expect, End::Close, label);
    check_reported(r, true, kRecvDeadline, label);
    const size_t want = checked_fields_equal(h, expect[1]) ? 2 : 1;
    CHECK(r.delivered == want, "%s: %zu frames delivered, %zu expected", label.c_str(), r.delivered, want);
  }
  std::printf("  frames: %zu fixed cases, %llu random (%.1f s)\n", frame_cases().size(),
              static_cast<unsigned long long>(i), seconds_since(start));
}

// ---- Phase 3: mutations of a recorded session. ----

// Rank 1's Hello, frames of 10, 0, chunk and 100 bytes, and an Abort: the bytes and the
// regions mutations aim at (the Hello, each header, each payload, the reason).
struct Session {
  std::string bytes = kValidHello;
  std::vector<Region> regions = {{0, kHelloBytes}};
  std::vector<FrameHeader> expect;

  Session() {
    const uint32_t sizes[] = {10, 0, kChunk, 100};
    for (uint64_t seq = 0; seq < 4; ++seq) {
      expect.push_back(data_header(seq, sizes[seq]));
      add(data_frame(seq, sizes[seq]));
    }
    add(abort_frame("rank 1 gave up"));
  }
  void add(const std::string& frame) {
    regions.push_back({bytes.size(), sizeof(FrameHeader)});
    if (frame.size() > sizeof(FrameHeader))
      regions.push_back({bytes.size() + sizeof(FrameHeader), frame.size() - sizeof(FrameHeader)});
    bytes += frame;
  }
};

void phase_sessions(const Listener& l, uint64_t seed, const Budget& budget) {
  const auto start = Clock::now();
  const Session recorded;
  {  // unmutated: frames, then the Abort's reason (which may overtake frames still queued
     // in the kernel when the receiver's slots are full: tcp_channel_io.cc peeks for it)
    const Received r = run_session(recorded.bytes, recorded.expect, End::Close, "sessions: recorded");
    CHECK(r.error && contains(r.error->what(), "aborted: rank 1 gave up"), "sessions: the recorded session: %s",
          r.error ? r.error->what() : "no error");
  }
  uint64_t i = 0, to_listener = 0;
  for (; budget.more(i); ++i) {
    Rng rng = case_rng(seed, 3, i);
    const std::string s = mutate(rng, recorded.bytes, recorded.regions);
    const std::string label = "sessions: case " + std::to_string(i) + " (seed " + std::to_string(seed) + ")";
    if (hello_changed(s)) {
      ++to_listener;
      const std::string verdict = expect_dropped(l.address(), s, scaled(2000));
      CHECK(verdict.empty(), "%s: %s", label.c_str(), verdict.c_str());
      continue;
    }
    check_reported(run_session(s, recorded.expect, End::Close, label), true, kRecvDeadline, label);
  }
  std::printf("  sessions: %llu mutated, %llu of them with a changed Hello, to the listener (%.1f s)\n",
              static_cast<unsigned long long>(i), static_cast<unsigned long long>(to_listener), seconds_since(start));
}

// ---- Phase 0: the decoders (tcp_wire.h), fed bytes directly. ----

// `got` is a rejection as the decoders must give it: said, in printable text.
bool clear_error(const char* got) { return got && *got && printable(got); }
bool clear_error(const std::string& got) { return clear_error(got.c_str()); }

// The bytes the decoder took as a Hello to rank 0 are rank 1's valid Hello, but for the
// sender's rank (the caller's to check).
bool valid_but_sender(const std::string& bytes) {
  if (bytes.size() != kHelloBytes) return false;
  std::string as_rank1 = bytes;
  const int32_t one = 1;
  std::memcpy(&as_rank1[offsetof(RawHello, from_rank)], &one, sizeof one);
  return as_rank1 == kValidHello;
}

// decode_hello() on `bytes`: accepted only when valid but for the sender, else rejected
// with a clear error. Returns what is wrong, or "".
std::string decode_verdict(const std::string& bytes) {
  const tcp::DecodedHello d = tcp::decode_hello(bytes.data(), bytes.size(), tcp::kHelloMagic, 0, kSecret);
  if (!d.error) return valid_but_sender(bytes) ? "" : "accepted";
  return clear_error(d.error) ? "" : std::string("rejected without a clear error: '") + d.error + "'";
}

// header_error() on `h`: "" exactly for a header a channel of kChunk-byte slots may read
// the payload of, else a clear error. Returns what is wrong, or "".
std::string header_verdict(const FrameHeader& h) {
  const std::string got = tcp::header_error(h, kChunk);
  const bool data = h.kind == static_cast<uint16_t>(FrameKind::Data) && h.bytes <= kChunk;
  const bool abort = h.kind == static_cast<uint16_t>(FrameKind::Abort) && h.bytes <= kMaxReason;
  const bool ok = h.magic == kFrameMagic && (data || abort);
  if (ok) return got.empty() ? "" : "a valid header rejected: " + got;
  return clear_error(got) ? "" : "an invalid header accepted or rejected unclearly: '" + got + "'";
}

// find_abort_reason() on received bytes: none, or printable text of at most kMaxReason
// bytes, each shown in at most 4 characters.
std::string scan_verdict(const std::string& bytes) {
  const auto got = tcp::find_abort_reason(bytes.data(), bytes.size(), kChunk);
  return !got || (printable(*got) && got->size() <= 4 * kMaxReason) ? "" : "an unprintable or over-long reason";
}

void phase_decoders(uint64_t seed, const Budget& budget) {
  const auto start = Clock::now();
  // The library's encoding is the format this test mirrors.
  CHECK(bytes_of(tcp::make_hello(tcp::kHelloMagic, 1, 0, kSecret)) == kValidHello, "decoders: make_hello()");
  CHECK(tcp::kHelloBytes == kHelloBytes, "decoders: the Hello's size");
  CHECK(tcp::abort_frame("rank 1 gave up") == abort_frame("rank 1 gave up"), "decoders: abort_frame()");
  CHECK(tcp::abort_frame(std::string(kMaxReason + 5, 'r')) == abort_frame(std::string(kMaxReason, 'r')),
        "decoders: abort_frame() cuts the reason to kMaxReason bytes");
  {
    const tcp::DecodedHello d = tcp::decode_hello(kValidHello.data(), kHelloBytes, tcp::kHelloMagic, 0, kSecret);
    CHECK(!d.error && bytes_of(d.message) == kValidHello, "decoders: a valid Hello: %s", d.error ? d.error : "");
  }
  // Each kind is only itself; every length but the message's is rejected.
  for (const uint32_t kind : {tcp::kAckMagic, tcp::kNackMagic})
    CHECK(clear_error(tcp::decode_hello(kValidHello.data(), kHelloBytes, kind, 0, kSecret).error),
          "decoders: a Hello taken for magic %08x", kind);
  std::vector<std::string> fixed;
  for (size_t n = 0; n < kHelloBytes; ++n) fixed.push_back(kValidHello.substr(0, n));
  fixed.push_back(kValidHello + "x");
  fixed.push_back(kValidHello + kValidHello);
  // Every bit of the message is checked (a flip of the sender's rank is the caller's).
  for (size_t bit = 0; bit < 8 * kHelloBytes; ++bit) {
    fixed.push_back(kValidHello);
    fixed.back()[bit / 8] = static_cast<char>(fixed.back()[bit / 8] ^ (1 << (bit % 8)));
  }
  for (const auto& bytes : fixed) {
    const std::string verdict = decode_verdict(bytes);
    CHECK(verdict.empty(), "decoders: a fixed Hello of %zu bytes: %s", bytes.size(), verdict.c_str());
  }
  // Every cut of a recorded session (less its Hello) finds the Abort's reason only once
  // all of it is there.
  const Session session;
  const std::string frames = session.bytes.substr(kHelloBytes);
  std::vector<Region> regions;
  for (const Region& r : session.regions)
    if (r.first >= kHelloBytes) regions.push_back({r.first - kHelloBytes, r.second});
  for (size_t n = 0; n <= frames.size(); ++n) {
    const auto got = tcp::find_abort_reason(frames.data(), n, kChunk);
    CHECK((n == frames.size()) == (got && *got == "rank 1 gave up"), "decoders: the session cut at %zu bytes", n);
  }
  uint64_t i = 0;
  for (; budget.more(i); ++i) {
    Rng rng = case_rng(seed, 0, i);
    const std::string label = "decoders: random case " + std::to_string(i) + " (seed " + std::to_string(seed) + ")";
    const std::string hello =
        below(rng, 4) ? mutate(rng, kValidHello, {{0, kHelloBytes}}) : random_bytes(rng, below(rng, 2 * kHelloBytes));
    std::string verdict = decode_verdict(hello);
    CHECK(verdict.empty(), "%s: Hello: %s", label.c_str(), verdict.c_str());
    FrameHeader h = header_with([](FrameHeader&) {});
    const std::string header = mutate(rng, bytes_of(h), {{0, sizeof h}});
    std::memcpy(&h, header.data(), std::min(header.size(), sizeof h));
    verdict = header_verdict(h);
    CHECK(verdict.empty(), "%s: header: %s", label.c_str(), verdict.c_str());
    verdict = scan_verdict(mutate(rng, frames, regions));
    CHECK(verdict.empty(), "%s: received bytes: %s", label.c_str(), verdict.c_str());
    const std::string reason = random_bytes(rng, below(rng, 64));
    CHECK(printable(tcp::printable_reason(reason.data(), reason.size())), "%s: printable_reason()", label.c_str());
  }
  std::printf("  decoders: %zu fixed Hellos, %zu session cuts, %llu random cases (%.1f s)\n", fixed.size(),
              frames.size() + 1, static_cast<unsigned long long>(i), seconds_since(start));
}

// ---- Phase 1's end: the group forms while silent connections fill the pending slots. ----

void flood_and_finish(Listener& l) {
  // tcp_mesh.cc keeps kSpareHandshakes (32) besides one per peer (rank 0 has 2).
  constexpr size_t kPending = 32 + 2, kFlood = kPending + 8;
  std::vector<RawSocket> flood;
  for (size_t i = 0; i < kFlood; ++i) flood.emplace_back(l.address());
  // The oldest beyond the cap are dropped to make room.
  size_t closed = 0;
  for (const auto until = Clock::now() + scaled(2000); closed < kFlood - kPending && Clock::now() < until;) {
    for (auto& s : flood) {
      if (s.ok() && s.next(milliseconds(0)) == RawSocket::Next::Closed) {
        s.close();
        ++closed;
      }
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  CHECK(closed >= kFlood - kPending, "flood: %zu of %zu silent connections dropped, %zu expected", closed, kFlood,
        kFlood - kPending);
  const std::string bad_hello = hello_with([](RawHello& h) { h.version = 9; });
  const std::string verdict = expect_dropped(l.address(), bad_hello, scaled(2000));
  CHECK(verdict.empty(), "flood: a bad Hello while flooded: %s", verdict.c_str());
  l.finish();
  std::printf("  flood: %zu silent connections, then the real rank 1 joined\n", kFlood);
}

}  // namespace

int main() {
  const uint64_t seed = env_u64("PYCOMM_FUZZ_SEED", kDefaultSeed);
  const uint64_t iterations = env_u64("PYCOMM_FUZZ_ITERATIONS", 5000);
  const uint64_t seconds = env_u64("PYCOMM_FUZZ_SECONDS", 25);
  std::printf("wire fuzz: PYCOMM_FUZZ_SEED=%llu PYCOMM_FUZZ_ITERATIONS=%llu PYCOMM_FUZZ_SECONDS=%llu\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(iterations),
              static_cast<unsigned long long>(seconds));
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each phase's line as it ends
  const auto start = Clock::now();
  // The phases' random cases get shares of the time left: 1/10, then 1/5 and 2/5 of what
  // is left, then the rest.
  const auto budget = [&](double share) {
    const auto end = start + std::chrono::seconds(seconds);
    const auto now = Clock::now();
    return Budget{iterations, now + std::chrono::duration_cast<Clock::duration>((end - now) * share)};
  };
  phase_decoders(seed, budget(0.1));
  Listener listener(scaled(60000) + std::chrono::seconds(seconds));
  phase_handshake(listener, seed, budget(0.2));
  phase_acceptor();
  phase_frames(seed, budget(0.4));
  phase_sessions(listener, seed, budget(1.0));
  flood_and_finish(listener);
  std::printf("test_wire_fuzz: %s (%d failures, %.1f s, PYCOMM_FUZZ_SEED=%llu)\n", failures ? "FAILED" : "ok", failures,
              seconds_since(start), static_cast<unsigned long long>(seed));
  return failures ? 1 : 0;
}
