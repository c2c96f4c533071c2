// TCP transport: a full mesh of authenticated connections, one per peer, all driven by one
// I/O thread per transport.
//
// Set-up. Every rank that expects connections listens on one IPv4 address (127.0.0.1 when
// all its peers share its host, else PYCOMM_SOCKET_IFNAME's address, else the first up
// non-loopback interface's), on an ephemeral port, and publishes "addr:port" under
// <key_prefix>/tcp/addr/<rank>. For each pair the higher rank connects to the lower one.
// Before any frame the connector sends a Hello {magic, version, from, to, secret}; the
// acceptor checks every field (to == self, from is an expected peer not yet connected, the
// secret matches, compared in constant time) and answers with an Ack carrying its own rank
// and the secret, which the connector checks in turn. A connection failing any check is
// closed; the acceptor keeps accepting until every expected peer arrived or the set-up
// deadline passed, so a stranger can neither take a peer's place nor stop the group from
// forming. Connects, accepts and handshakes all progress together in one poll() loop.
//
// Wire. Each frame is a FrameHeader (48 bytes) followed by `bytes` payload bytes: Data
// frames carry at most chunk_bytes(); an Abort frame carries the reason (<= 1 KiB, shown
// as printable text).
// Every received header is checked (magic, kind, size) before its payload is read.
//
// Slots and ownership. Each channel has `pipeline_depth` outbound and inbound slots of
// chunk_bytes() in local memory, used as rings indexed by frame number:
//   outbound frame f (slot f % depth): free while f >= committed_ and
//     committed_ - written_ < depth; the compute thread's between begin_send() and
//     end_send() (f == committed_); the I/O thread's from end_send() (++committed_) until
//     its last byte is in the kernel (++written_), when the slot is free again.
//   inbound frame f: the I/O thread's while it reads it (f == filled_, which it may start
//     only when filled_ - released_ < depth); the compute thread's once complete
//     (released_ <= f < filled_) until end_recv() (++released_).
// The four counters, the failure state and the I/O thread's poll interest are guarded by
// the transport's mutex; taking it on both sides orders slot contents with the counters.
// When no inbound slot is free the I/O thread stops reading that socket, so TCP's flow
// control is the back-pressure. It keeps reading every other socket, and the two
// directions of one socket are independent, so a rank blocked sending to A while A is
// blocked sending to it cannot deadlock: each I/O thread drains into the other's free slots.
//
// Threads and waiting. The I/O thread blocks in poll() on every socket it can make progress
// on plus an eventfd; end_send()/end_recv() write the eventfd only when the I/O thread is
// not already polling for the progress they enable. Compute threads spin per SpinPolicy,
// then sleep on a condition variable in slices of at most kLivenessSlice.
//
// Failure. abort(reason) marks the transport aborted (every wait throws the reason at once)
// and wakes the I/O thread, which finishes the frame it is in the middle of writing, sends
// an Abort frame and shuts each socket down, giving up after kAbortFlush. A received Abort
// frame fails that channel with "<peer> aborted: <reason>". EOF, ECONNRESET and EPIPE (sends
// use MSG_NOSIGNAL) fail the channel with "connection to <peer> lost: ...". Frames already
// complete in inbound slots stay readable after a channel failed (a peer may send its last
// frames and exit); everything else throws. A peer that closed its side while every inbound
// slot is full is noticed through POLLRDHUP: sends to it fail at once, and the kernel's
// receive queue is peeked for an Abort frame so that the reason still arrives.
//
// Shutdown. The destructor lets the I/O thread hand every committed frame to the kernel
// (at most kLinger; skipped when aborted), shuts the sockets down, joins it and closes every
// descriptor. Descriptors are owned by Fd objects, so a constructor that throws part-way
// closes everything it opened.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "transport/transport.h"

namespace pycomm {
namespace {

constexpr uint32_t kHelloMagic = 0x70634843;  // "pcHC": connector -> acceptor
constexpr uint32_t kAckMagic = 0x70634841;    // "pcHA": acceptor -> connector
constexpr uint32_t kProtocolVersion = 1;
constexpr size_t kMaxSecret = 64;
constexpr size_t kMaxReason = 1024;                       // Abort frame payload cap
constexpr size_t kMaxPendingHandshakes = 32;              // unauthenticated connections kept
constexpr std::chrono::seconds kHandshakeTimeout{10};     // for an accepted connection's Hello
constexpr std::chrono::milliseconds kMaxRetryDelay{500};  // between connect attempts
constexpr std::chrono::seconds kAbortFlush{1};            // to deliver Abort frames
constexpr std::chrono::seconds kLinger{5};                // to flush committed frames on destroy
constexpr size_t kMaxPeek = size_t{64} << 20;             // receive queue scanned for an Abort
constexpr size_t kMaxDrain = size_t{64} << 20;            // unread input dropped before close
constexpr size_t kHeaderBytes = sizeof(FrameHeader);

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// The handshake message, both directions (magic tells which). Native byte order, like
// FrameHeader.
struct Hello {
  uint32_t magic = 0;
  uint32_t version = 0;
  int32_t from_rank = -1;
  int32_t to_rank = -1;
  uint32_t secret_bytes = 0;
  uint32_t reserved = 0;
  unsigned char secret[kMaxSecret] = {};
};
static_assert(sizeof(Hello) == 88, "Hello is a wire format");

Hello make_hello(uint32_t magic, int from, int to, const std::string& secret) {
  Hello h;
  h.magic = magic;
  h.version = kProtocolVersion;
  h.from_rank = from;
  h.to_rank = to;
  h.secret_bytes = static_cast<uint32_t>(secret.size());
  std::memcpy(h.secret, secret.data(), secret.size());
  return h;
}

// Compares the whole secret field and its length whatever their contents, so the time
// taken tells nothing about how much of a guess was right.
bool secret_matches(const Hello& h, const std::string& secret) {
  unsigned char expected[kMaxSecret] = {};
  std::memcpy(expected, secret.data(), secret.size());
  uint32_t diff = h.secret_bytes ^ static_cast<uint32_t>(secret.size());
  for (size_t i = 0; i < kMaxSecret; ++i) diff |= static_cast<uint32_t>(h.secret[i] ^ expected[i]);
  return diff == 0;
}

// True when `h` is a handshake message of kind `magic` (Hello or Ack) for rank `to` that
// proves the secret; the sender's rank is the caller's to check. Reserved must be zero, so
// that every byte of the message is checked. The secret is compared even when the rest is
// invalid, to keep timing uniform.
bool handshake_valid(const Hello& h, uint32_t magic, int to, const std::string& secret) {
  const bool fields = h.magic == magic && h.version == kProtocolVersion && h.reserved == 0 && h.to_rank == to;
  return secret_matches(h, secret) && fields;
}

// A peer's abort reason as it goes into an error message: printable ASCII, any other byte
// as \xNN. The bytes come off the wire: a NUL would cut the message short, bytes that are
// not UTF-8 would fail its conversion to a Python string, control characters could forge
// log lines.
std::string printable_reason(const char* p, size_t n) {
  static const char hex[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(p[i]);
    if (c >= 0x20 && c < 0x7f) s += static_cast<char>(c);
    else s += {'\\', 'x', hex[c >> 4], hex[c & 15]};
  }
  return s;
}

std::string ipv4_text(const in_addr& a) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a, buf, sizeof buf);
  return buf;
}

// The one address this rank listens on (see the file comment).
in_addr listen_address(const TransportSetup& s) {
  in_addr loopback{};
  loopback.s_addr = htonl(INADDR_LOOPBACK);
  const std::string& mine = s.ranks[s.rank].host_key;
  if (std::all_of(s.peers.begin(), s.peers.end(),
                  [&](int p) { return s.ranks[p].host_key == mine; }))
    return loopback;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) fail(ErrorKind::Internal, errno_message("pycomm: getifaddrs"));
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, freeifaddrs);
  const std::string& wanted = s.config->socket_ifname;  // an interface name or one of its addresses
  in_addr wanted_address{};
  const bool by_address = inet_pton(AF_INET, wanted.c_str(), &wanted_address) == 1;
  for (const ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    const in_addr a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr;
    if (!wanted.empty()) {
      if (by_address ? a.s_addr != wanted_address.s_addr : wanted != i->ifa_name) continue;
      if (!(i->ifa_flags & IFF_UP))
        fail(ErrorKind::InvalidArgument,
             "pycomm: PYCOMM_SOCKET_IFNAME=" + wanted + ": the interface is down");
      return a;
    }
    if ((i->ifa_flags & IFF_UP) && !(i->ifa_flags & IFF_LOOPBACK)) return a;
  }
  if (!wanted.empty())
    fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_SOCKET_IFNAME=" + wanted +
                                         ": no network interface of that name with an IPv4 address, nor an interface with that address");
  return loopback;
}

// Parses "a.b.c.d:port" as published by a peer.
std::optional<sockaddr_in> parse_address(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon + 1 >= text.size() || text.size() - colon > 6)
    return std::nullopt;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (inet_pton(AF_INET, text.substr(0, colon).c_str(), &a.sin_addr) != 1) return std::nullopt;
  unsigned long port = 0;
  for (size_t i = colon + 1; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return std::nullopt;
    port = port * 10 + static_cast<unsigned long>(text[i] - '0');
  }
  if (port == 0 || port > 65535) return std::nullopt;
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

Fd new_socket() {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) fail(ErrorKind::Internal, errno_message("pycomm: socket"));
  return fd;
}

void set_nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// sendmsg() of `count` pieces without blocking, again where a signal interrupted it: the
// bytes the kernel took (0 where the socket buffer is full), or -errno.
ssize_t send_pieces(int fd, iovec* iov, size_t count) {
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = count;
  for (;;) {
    const ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno != EINTR) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
  }
}

int poll_timeout_ms(Clock::time_point until) {
  const auto left = until - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(left).count() + 1;
  return static_cast<int>(std::min<long long>(ms, 1 << 30));
}

// ---- Set-up: one poll() loop connecting to lower ranks and accepting higher ones. ----

class MeshBuilder {
 public:
  explicit MeshBuilder(const TransportSetup& s) : s_(s), result_(s.size), expected_(s.size, 0),
                                                 claimed_(s.size, 0) {}

  // One authenticated socket per peer, indexed by rank.
  std::vector<Fd> run() {
    const in_addr addr = listen_address(s_);
    for (int p : s_.peers)
      if (p > s_.rank) expected_[p] = 1, ++incoming_left_;
    if (incoming_left_ > 0) listen_on(addr);
    for (int p : s_.peers)
      if (p < s_.rank) add_outgoing(p);
    std::vector<pollfd> fds;
    while (connected() < s_.peers.size()) {
      const auto now = Clock::now();
      if (now >= s_.deadline.at) fail(ErrorKind::Timeout, timeout_message());
      for (auto& o : out_)
        if (o.phase == Phase::Idle && now >= o.retry_at) start_connect(o);
      for (auto& i : in_)
        if (i.fd && now - i.since > kHandshakeTimeout) drop(i);
      prune();
      Clock::time_point wake = s_.deadline.at;
      fds.clear();
      for (auto& o : out_) {
        if (o.phase == Phase::Idle) wake = std::min(wake, o.retry_at);
        if (o.phase == Phase::Connecting || o.phase == Phase::Sending) fds.push_back({o.fd.get(), POLLOUT, 0});
        if (o.phase == Phase::Receiving) fds.push_back({o.fd.get(), POLLIN, 0});
      }
      for (auto& i : in_) {
        wake = std::min(wake, i.since + kHandshakeTimeout);
        fds.push_back({i.fd.get(), static_cast<short>(i.phase == Phase::Sending ? POLLOUT : POLLIN), 0});
      }
      if (listener_ && incoming_left_ > 0) fds.push_back({listener_.get(), POLLIN, 0});
      const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(wake));
      if (n < 0 && errno != EINTR) fail(ErrorKind::Internal, errno_message("pycomm: poll"));
      if (n <= 0) continue;
      // Entries were pushed in the order out_, in_, listener; handlers never reorder out_
      // or in_ (accept appends after this walk).
      size_t k = 0;
      for (auto& o : out_)
        if (o.phase == Phase::Connecting || o.phase == Phase::Sending || o.phase == Phase::Receiving)
          if (fds[k++].revents) progress_outgoing(o);
      for (size_t j = 0, m = in_.size(); j < m; ++j)
        if (fds[k++].revents) progress_incoming(in_[j]);
      if (k < fds.size() && fds[k].revents) accept_all();
    }
    return std::move(result_);
  }

 private:
  enum class Phase { Idle, Connecting, Sending, Receiving, Done };

  struct Outgoing {  // this rank -> a lower rank
    int peer;
    sockaddr_in addr;
    std::string addr_text;
    Fd fd;
    Phase phase = Phase::Idle;
    Hello hello, reply;
    size_t off = 0;
    Clock::time_point retry_at;
    std::chrono::milliseconds delay{10};
    std::string last_error = "no attempt finished";
  };

  struct Incoming {  // an accepted connection, not yet authenticated
    Fd fd;
    Phase phase = Phase::Receiving;
    Hello hello, ack;
    size_t off = 0;
    int peer = -1;  // once its Hello was accepted
    Clock::time_point since;
  };

  size_t connected() const {
    size_t n = 0;
    for (const auto& fd : result_) n += fd ? 1 : 0;
    return n;
  }

  void listen_on(const in_addr& addr) {
    listener_ = new_socket();
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr = addr;
    a.sin_port = 0;
    if (::bind(listener_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      fail(ErrorKind::Internal, errno_message("pycomm: cannot bind a TCP listener to " + ipv4_text(addr)));
    if (::listen(listener_.get(), SOMAXCONN) != 0)
      fail(ErrorKind::Internal, errno_message("pycomm: listen"));
    socklen_t len = sizeof a;
    if (::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
      fail(ErrorKind::Internal, errno_message("pycomm: getsockname"));
    listen_text_ = ipv4_text(addr) + ":" + std::to_string(ntohs(a.sin_port));
    s_.store->set(key(s_.rank), listen_text_);
  }

  std::string key(int rank) const { return s_.key_prefix + "/tcp/addr/" + std::to_string(rank); }

  void add_outgoing(int p) {
    std::string text;
    try {
      text = s_.store->get(key(p));
    } catch (const Error& e) {
      fail(e.kind(), "pycomm: no TCP address from " + s_.ranks[p].describe() + ": " + e.what());
    } catch (const std::exception& e) {
      fail(ErrorKind::Timeout, "pycomm: no TCP address from " + s_.ranks[p].describe() + ": " + e.what());
    }
    const auto addr = parse_address(text);
    if (!addr)
      fail(ErrorKind::Mismatch, "pycomm: " + s_.ranks[p].describe() + " published an invalid TCP address '" +
                                    text.substr(0, 64) + "'");
    Outgoing o;
    o.peer = p;
    o.addr = *addr;
    o.addr_text = text;
    o.hello = make_hello(kHelloMagic, s_.rank, p, s_.secret);
    o.retry_at = Clock::now();
    out_.push_back(std::move(o));
  }

  void retry_later(Outgoing& o, const std::string& why) {
    o.fd.reset();
    o.phase = Phase::Idle;
    o.last_error = why;
    o.retry_at = Clock::now() + o.delay;
    o.delay = std::min(o.delay * 2, kMaxRetryDelay);
  }

  void start_connect(Outgoing& o) {
    o.fd = new_socket();
    set_nodelay(o.fd.get());
    o.off = 0;
    if (::connect(o.fd.get(), reinterpret_cast<const sockaddr*>(&o.addr), sizeof o.addr) == 0)
      o.phase = Phase::Sending;
    else if (errno == EINPROGRESS)
      o.phase = Phase::Connecting;
    else
      retry_later(o, errno_message("connect"));
  }

  void progress_outgoing(Outgoing& o) {
    if (o.phase == Phase::Connecting) {
      int err = 0;
      socklen_t len = sizeof err;
      if (getsockopt(o.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err != 0) return retry_later(o, std::string("connect: ") + std::strerror(err));
      o.phase = Phase::Sending;
    }
    if (o.phase == Phase::Sending) {
      const ssize_t n = ::send(o.fd.get(), reinterpret_cast<char*>(&o.hello) + o.off,
                               sizeof o.hello - o.off, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) retry_later(o, errno_message("send"));
        return;
      }
      o.off += static_cast<size_t>(n);
      if (o.off < sizeof o.hello) return;
      o.phase = Phase::Receiving;
      o.off = 0;
      return;  // the Ack needs a round trip: wait for POLLIN
    }
    if (o.phase == Phase::Receiving) {
      const ssize_t n = ::recv(o.fd.get(), reinterpret_cast<char*>(&o.reply) + o.off,
                               sizeof o.reply - o.off, 0);
      if (n == 0)
        return retry_later(o, "the peer closed the connection during the handshake "
                              "(wrong secret, or a different pycomm version?)");
      if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) retry_later(o, errno_message("recv"));
        return;
      }
      o.off += static_cast<size_t>(n);
      if (o.off < sizeof o.reply) return;
      const Hello& r = o.reply;
      if (!(handshake_valid(r, kAckMagic, s_.rank, s_.secret) && r.from_rank == o.peer))
        return retry_later(o, "invalid handshake reply");
      result_[o.peer] = std::move(o.fd);
      o.phase = Phase::Done;
    }
  }

  void accept_all() {
    for (;;) {
      const int c = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        fail(ErrorKind::Internal, errno_message("pycomm: accept"));
      }
      Incoming i;
      i.fd = Fd(c);
      i.since = Clock::now();
      set_nodelay(c);
      // Only connections still handshaking may be evicted: one dropped or finished this
      // round (its socket moved to result_) is forgotten first, so that evicting it never
      // frees the rank it claimed, nor wastes the eviction.
      prune();
      in_.push_back(std::move(i));
      if (in_.size() > kMaxPendingHandshakes) drop(in_.front()), in_.erase(in_.begin());
    }
  }

  void prune() {
    in_.erase(std::remove_if(in_.begin(), in_.end(), [](const Incoming& i) { return !i.fd; }), in_.end());
  }

  void drop(Incoming& i) {
    if (i.peer >= 0) claimed_[i.peer] = 0;
    i.fd.reset();
  }

  void progress_incoming(Incoming& i) {
    if (i.phase == Phase::Receiving) {
      const ssize_t n = ::recv(i.fd.get(), reinterpret_cast<char*>(&i.hello) + i.off,
                               sizeof i.hello - i.off, 0);
      if (n == 0) return drop(i);
      if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) drop(i);
        return;
      }
      i.off += static_cast<size_t>(n);
      if (i.off < sizeof i.hello) return;
      const Hello& h = i.hello;
      const bool from_ok = h.from_rank > s_.rank && h.from_rank < s_.size && expected_[h.from_rank] &&
                           !claimed_[h.from_rank];
      if (!(handshake_valid(h, kHelloMagic, s_.rank, s_.secret) && from_ok)) return drop(i);
      i.peer = h.from_rank;
      claimed_[i.peer] = 1;
      i.ack = make_hello(kAckMagic, s_.rank, i.peer, s_.secret);
      i.phase = Phase::Sending;
      i.off = 0;
    }
    if (i.phase == Phase::Sending) {
      const ssize_t n = ::send(i.fd.get(), reinterpret_cast<char*>(&i.ack) + i.off,
                               sizeof i.ack - i.off, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) drop(i);
        return;
      }
      i.off += static_cast<size_t>(n);
      if (i.off < sizeof i.ack) return;
      result_[i.peer] = std::move(i.fd);  // leaves i.fd empty: erased next round
      --incoming_left_;
    }
  }

  std::string timeout_message() const {
    std::ostringstream os;
    os << "pycomm: TCP set-up timed out on " << s_.ranks[s_.rank].describe()
       << "; not connected to ";
    bool first = true;
    for (const auto& o : out_) {
      if (result_[o.peer]) continue;
      os << (first ? "" : "; ") << s_.ranks[o.peer].describe() << " at " << o.addr_text
         << " (last error: " << o.last_error << ")";
      first = false;
    }
    for (int p = 0; p < s_.size; ++p) {
      if (!expected_[p] || result_[p]) continue;
      os << (first ? "" : "; ") << s_.ranks[p].describe() << " (it never connected to "
         << listen_text_ << ")";
      first = false;
    }
    return os.str();
  }

  const TransportSetup& s_;
  std::vector<Fd> result_;
  std::vector<char> expected_;  // higher ranks that connect to this one
  std::vector<char> claimed_;   // expected ranks whose Hello was accepted
  size_t incoming_left_ = 0;
  Fd listener_;
  std::string listen_text_;
  std::vector<Outgoing> out_;
  std::vector<Incoming> in_;
};

// ---- Channels and the I/O thread. ----

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using Slots = std::unique_ptr<char[], FreeDeleter>;

// Whole pages: a device may page-lock them (Channel::slot_memory()).
constexpr size_t kPage = 4096;
Slots allocate_slots(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
  char* p = static_cast<char*>(std::aligned_alloc(kPage, rounded));
  if (!p) throw std::bad_alloc();
  return Slots(p);
}

class TcpTransport;

class TcpChannel final : public Channel {
 public:
  TcpChannel(TcpTransport* t, const PeerInfo& peer, Fd sock, size_t chunk, size_t depth)
      : t_(t), peer_(peer), sock_(std::move(sock)), chunk_(chunk), depth_(depth),
        out_mem_(allocate_slots(chunk * depth)), in_mem_(allocate_slots(chunk * depth)),
        out_hdr_(depth), in_hdr_(depth) {}

  int peer() const override { return peer_.rank; }
  size_t chunk_bytes() const override { return chunk_; }
  void* begin_send(const Deadline& deadline) override;
  void end_send(const FrameHeader& header) override;
  const void* begin_recv(const FrameHeader& expect, const Deadline& deadline) override;
  void end_recv() override;
  std::optional<FrameHeader> peek_recv() override;
  std::vector<Memory> slot_memory() const override {
    return {{out_mem_.get(), chunk_ * depth_}, {in_mem_.get(), chunk_ * depth_}};
  }

 private:
  friend class TcpTransport;
  char* out_slot(uint64_t frame) const { return out_mem_.get() + (frame % depth_) * chunk_; }
  char* in_slot(uint64_t frame) const { return in_mem_.get() + (frame % depth_) * chunk_; }
  // Throws if the transport was aborted or this channel can no longer do `sending`/receiving.
  void throw_if_failed(bool sending) const;
  // Sleeps one slice; throws Timeout once `deadline` has passed.
  void sleep(std::unique_lock<std::mutex>& lk, const Deadline& deadline, const char* what);
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lk, const Deadline& deadline, const char* what,
            bool sending, Ready ready);

  TcpTransport* const t_;
  const PeerInfo peer_;
  Fd sock_;
  const size_t chunk_, depth_;
  const Slots out_mem_, in_mem_;
  std::vector<FrameHeader> out_hdr_, in_hdr_;  // per slot, owned like the slot

  // Guarded by TcpTransport::mu_.
  uint64_t committed_ = 0;  // outbound frames published by end_send()
  uint64_t written_ = 0;    // outbound frames wholly handed to the kernel
  uint64_t filled_ = 0;     // inbound frames wholly received
  uint64_t released_ = 0;   // inbound frames returned by end_recv()
  ErrorKind error_kind_ = ErrorKind::PeerFailure;
  std::string error_;       // non-empty once the stream is over; set only by the I/O thread
  std::string send_error_;  // non-empty once the peer stopped reading (it closed its side)
  bool io_wants_in_ = false;   // the I/O thread is (about to be) polling for input
  bool io_wants_out_ = false;  // ... for output

  // I/O thread only.
  bool dead_ = false;        // error_ set: no more I/O
  bool closed_ = false;      // abort frame delivered (or given up) and socket shut down
  bool rdhup_seen_ = false;  // POLLRDHUP handled once; not polled for again
  size_t out_off_ = 0;       // bytes of outbound frame written_ already sent
  size_t in_off_ = 0;        // bytes of inbound frame filled_ already received
  std::string abort_frame_;  // header + reason, sent once the frame in flight is complete
  size_t abort_off_ = 0;
  char reason_[kMaxReason] = {};
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TransportSetup& s) : spin_(s.spin) {
    validate(s);
    wake_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_fd_) fail(ErrorKind::Internal, errno_message("pycomm: eventfd"));
    std::vector<Fd> socks = MeshBuilder(s).run();
    channels_.resize(s.size);
    for (int p : s.peers)
      channels_[p] = std::make_unique<TcpChannel>(this, s.ranks[p], std::move(socks[p]),
                                                  s.config->tcp_chunk_bytes,
                                                  static_cast<size_t>(s.config->pipeline_depth));
    io_ = std::thread([this] { io_main(); });
  }

  ~TcpTransport() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    wake_io();
    if (io_.joinable()) io_.join();
    // Unread input would make close() send a reset, which can destroy data the peer has
    // not read yet; drop what is queued first.
    char sink[16384];
    for (auto& c : channels_) {
      if (!c || !c->sock_) continue;
      ssize_t n;
      for (size_t drained = 0; drained < kMaxDrain; drained += static_cast<size_t>(n))
        if ((n = ::recv(c->sock_.get(), sink, sizeof sink, MSG_DONTWAIT)) <= 0) break;
    }
  }

  const char* name() const override { return "tcp"; }

  Channel* channel(int peer) override {
    return peer >= 0 && peer < static_cast<int>(channels_.size()) ? channels_[peer].get() : nullptr;
  }

  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) return;
      aborted_ = true;
      abort_reason_ = reason.empty() ? std::string("pycomm: aborted") : reason;
      ++events_;
    }
    cv_.notify_all();
    wake_io();
  }

 private:
  friend class TcpChannel;

  static void validate(const TransportSetup& s) {
    if (!s.store || !s.config) fail(ErrorKind::InvalidArgument, "pycomm: TCP set-up needs a store and a config");
    if (s.size < 1 || s.rank < 0 || s.rank >= s.size || static_cast<int>(s.ranks.size()) != s.size)
      fail(ErrorKind::InvalidArgument, "pycomm: TCP set-up with an invalid rank or size");
    std::vector<char> seen(s.size, 0);
    for (int p : s.peers) {
      if (p < 0 || p >= s.size || p == s.rank || seen[p])
        fail(ErrorKind::InvalidArgument, "pycomm: TCP set-up with an invalid peer list");
      seen[p] = 1;
    }
    if (s.config->tcp_chunk_bytes == 0 || s.config->tcp_chunk_bytes > (size_t{1} << 31))
      fail(ErrorKind::InvalidArgument, "pycomm: invalid TCP chunk size " + std::to_string(s.config->tcp_chunk_bytes));
    if (s.config->pipeline_depth < 1)
      fail(ErrorKind::InvalidArgument, "pycomm: invalid pipeline depth " + std::to_string(s.config->pipeline_depth));
    if (s.secret.size() > kMaxSecret)
      fail(ErrorKind::InvalidArgument, "pycomm: the group secret is longer than " + std::to_string(kMaxSecret) + " bytes");
  }

  void wake_io() {
    const uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_.get(), &one, sizeof one);  // EAGAIN: already pending
    (void)ignored;
  }

  // Records a change of guarded state for spinning waiters; called with mu_ held. The
  // caller notifies cv_ once it has released mu_.
  void changed_locked() { ++events_; }

  void io_main();
  void io_loop();
  void handle(TcpChannel& c, short revents);
  void read_ready(TcpChannel& c);
  void write_ready(TcpChannel& c);
  void write_abort(TcpChannel& c);
  void peer_closed(TcpChannel& c, short revents);
  std::optional<std::string> peek_abort_reason(TcpChannel& c);
  void fail_channel(TcpChannel& c, ErrorKind kind, const std::string& what);
  void socket_error(TcpChannel& c, int err);

  const SpinPolicy spin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> events_{0};  // bumped on every change of guarded state (for spinning)
  bool aborted_ = false;             // guarded by mu_
  std::string abort_reason_;         // guarded by mu_
  bool stopping_ = false;            // guarded by mu_
  bool abort_begun_ = false;         // I/O thread only
  Fd wake_fd_;
  std::vector<std::unique_ptr<TcpChannel>> channels_;  // by rank; fixed after construction
  std::thread io_;
};

// ---- Channel: the compute thread's side. ----

void TcpChannel::throw_if_failed(bool sending) const {
  if (t_->aborted_) fail(ErrorKind::PeerFailure, t_->abort_reason_);
  if (!error_.empty()) fail(error_kind_, error_);
  if (sending && !send_error_.empty()) fail(ErrorKind::PeerFailure, send_error_);
}

void TcpChannel::sleep(std::unique_lock<std::mutex>& lk, const Deadline& deadline, const char* what) {
  if (deadline.expired())
    fail(ErrorKind::Timeout, std::string("timed out waiting to ") + what + " " + peer_.describe() + " over TCP");
  t_->cv_.wait_until(lk, std::min(deadline.at, Clock::now() + kLivenessSlice));
}

// Returns with `lk` (on mu_) held once `ready()` (evaluated under mu_) holds; throws on
// abort, failure or timeout. Spins per SpinPolicy on the event counter before sleeping.
template <class Ready>
void TcpChannel::wait(std::unique_lock<std::mutex>& lk, const Deadline& deadline, const char* what,
                      bool sending, Ready ready) {
  bool spun = t_->spin_.spin.count() <= 0;
  for (;;) {
    if (!t_->aborted_ && ready()) return;
    throw_if_failed(sending);
    if (!spun) {
      spun = true;
      const uint64_t seen = t_->events_.load(std::memory_order_acquire);
      lk.unlock();
      spin_until([&] { return t_->events_.load(std::memory_order_acquire) != seen; }, t_->spin_);
      lk.lock();
      continue;
    }
    sleep(lk, deadline, what);
  }
}

void* TcpChannel::begin_send(const Deadline& deadline) {
  // A send fails on any failure, even with a free slot: the frame could never arrive.
  std::unique_lock<std::mutex> lk(t_->mu_);
  wait(lk, deadline, "send to", true, [&] {
    return error_.empty() && send_error_.empty() && committed_ - written_ < depth_;
  });
  return out_slot(committed_);
}

void TcpChannel::end_send(const FrameHeader& header) {
  if (header.bytes > chunk_)
    fail(ErrorKind::Internal, "pycomm: frame of " + std::to_string(header.bytes) +
                                  " bytes exceeds the TCP chunk of " + std::to_string(chunk_));
  bool wake;
  {
    std::lock_guard<std::mutex> lk(t_->mu_);
    FrameHeader& h = out_hdr_[committed_ % depth_];
    h = header;
    h.magic = kFrameMagic;
    h.kind = static_cast<uint16_t>(FrameKind::Data);
    ++committed_;
    wake = !io_wants_out_;
  }
  if (wake) t_->wake_io();
}

const void* TcpChannel::begin_recv(const FrameHeader& expect, const Deadline& deadline) {
  // Frames already complete are delivered even after the channel failed.
  FrameHeader got;
  const char* slot;
  {
    std::unique_lock<std::mutex> lk(t_->mu_);
    wait(lk, deadline, "receive from", false, [&] { return filled_ != released_; });
    got = in_hdr_[released_ % depth_];
    slot = in_slot(released_);
  }
  check_frame(got, expect, peer_);
  return slot;
}

std::optional<FrameHeader> TcpChannel::peek_recv() {
  std::lock_guard<std::mutex> lk(t_->mu_);
  if (!t_->aborted_ && filled_ != released_) return in_hdr_[released_ % depth_];
  throw_if_failed(false);
  return std::nullopt;
}

void TcpChannel::end_recv() {
  bool wake;
  {
    std::lock_guard<std::mutex> lk(t_->mu_);
    if (filled_ == released_) return;
    ++released_;
    wake = !io_wants_in_;
  }
  if (wake) t_->wake_io();
}


// ---- The I/O thread. ----

void TcpTransport::io_main() {
  try {
    io_loop();
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!aborted_) {
        aborted_ = true;
        abort_reason_ = std::string("pycomm: TCP I/O thread failed: ") + e.what();
      }
      changed_locked();
    }
    cv_.notify_all();
    for (auto& c : channels_)
      if (c) ::shutdown(c->sock_.get(), SHUT_RDWR);
  }
}

// Each round: under mu_, decide per socket what progress is possible (and publish it in
// io_wants_*); poll; move bytes. Normal mode reads into free inbound slots and writes
// committed outbound frames. After abort(): finish the frame in flight, send the Abort
// frame, shut down (kAbortFlush at most). After the destructor asked to stop: keep going
// until every committed frame is in the kernel (kLinger at most), then shut down writing.
void TcpTransport::io_loop() {
  constexpr auto kNever = Clock::time_point::max();
  std::vector<pollfd> fds;
  std::vector<TcpChannel*> polled;
  Clock::time_point finish_by = kNever;
  for (;;) {
    fds.assign(1, pollfd{wake_fd_.get(), POLLIN, 0});
    polled.clear();
    {
      std::lock_guard<std::mutex> lk(mu_);
      const auto now = Clock::now();
      if (aborted_ && !abort_begun_) {
        abort_begun_ = true;
        finish_by = now + kAbortFlush;
        const std::string reason = abort_reason_.substr(0, kMaxReason);
        FrameHeader h;
        h.kind = static_cast<uint16_t>(FrameKind::Abort);
        h.bytes = static_cast<uint32_t>(reason.size());
        for (auto& c : channels_)
          if (c && !c->dead_)
            c->abort_frame_ = std::string(reinterpret_cast<const char*>(&h), sizeof h) + reason;
      } else if (stopping_ && !aborted_ && finish_by == kNever) {
        finish_by = now + kLinger;
      }
      const bool lingering = stopping_ && !aborted_;
      bool busy = false;
      for (auto& cp : channels_) {
        if (!cp) continue;
        TcpChannel& c = *cp;
        c.io_wants_in_ = c.io_wants_out_ = false;
        if (c.dead_ || c.closed_) continue;
        short events = 0;
        if (abort_begun_) {
          events = POLLOUT;
          busy = true;
        } else {
          if (c.in_off_ > 0 || c.filled_ - c.released_ < c.depth_) events |= POLLIN, c.io_wants_in_ = true;
          if (c.written_ < c.committed_) events |= POLLOUT, c.io_wants_out_ = true, busy = true;
          if (!c.rdhup_seen_) events |= POLLRDHUP;
        }
        fds.push_back(pollfd{c.sock_.get(), events, 0});
        polled.push_back(&c);
      }
      const bool flushed = (abort_begun_ || lingering) && !busy;
      if (flushed || now >= finish_by) {
        for (TcpChannel* c : polled) ::shutdown(c->sock_.get(), flushed && lingering ? SHUT_WR : SHUT_RDWR);
        return;
      }
    }
    const int n = ::poll(fds.data(), fds.size(), finish_by == kNever ? -1 : poll_timeout_ms(finish_by));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(ErrorKind::Internal, errno_message("pycomm: poll"));
    }
    if (fds[0].revents) {
      uint64_t count;
      ssize_t ignored = ::read(wake_fd_.get(), &count, sizeof count);
      (void)ignored;
    }
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents) handle(*polled[i - 1], fds[i].revents);
  }
}

void TcpTransport::handle(TcpChannel& c, short revents) {
  if (abort_begun_) return write_abort(c);
  if (revents & POLLNVAL)
    return fail_channel(c, ErrorKind::Internal, "pycomm: invalid socket for " + c.peer_.describe());
  if (revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR)) read_ready(c);
  if (!c.dead_ && (revents & (POLLOUT | POLLHUP | POLLERR))) write_ready(c);
  if (!c.dead_ && (revents & (POLLRDHUP | POLLHUP | POLLERR))) peer_closed(c, revents);
}

// Reads frames into free inbound slots until the socket has no more data, no slot is free,
// or the stream ends. Each header is checked as soon as it is complete.
void TcpTransport::read_ready(TcpChannel& c) {
  for (;;) {
    if (c.in_off_ == 0) {
      std::lock_guard<std::mutex> lk(mu_);
      if (c.filled_ - c.released_ >= c.depth_) return;  // back-pressure: leave it in the socket
    }
    FrameHeader& h = c.in_hdr_[c.filled_ % c.depth_];  // slot owned by this thread (see top)
    char* dst;
    size_t want;
    if (c.in_off_ < kHeaderBytes) {
      dst = reinterpret_cast<char*>(&h) + c.in_off_;
      want = kHeaderBytes - c.in_off_;
    } else {
      const size_t got = c.in_off_ - kHeaderBytes;
      dst = (h.kind == static_cast<uint16_t>(FrameKind::Data) ? c.in_slot(c.filled_) : c.reason_) + got;
      want = h.bytes - got;
    }
    const ssize_t n = ::recv(c.sock_.get(), dst, want, MSG_DONTWAIT);
    if (n == 0)
      return fail_channel(c, ErrorKind::PeerFailure,
                          "connection to " + c.peer_.describe() + " lost: closed" +
                              (c.in_off_ > 0 ? " in the middle of a frame" : ""));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return socket_error(c, errno);
    }
    c.in_off_ += static_cast<size_t>(n);
    if (c.in_off_ == kHeaderBytes) {
      std::string bad;
      if (h.magic != kFrameMagic) {
        bad = "bad magic";
      } else if (h.kind == static_cast<uint16_t>(FrameKind::Data)) {
        if (h.bytes > c.chunk_)
          bad = "a payload of " + std::to_string(h.bytes) + " bytes exceeds this rank's chunk of " +
                std::to_string(c.chunk_) + " bytes (do PYCOMM_TCP_CHUNK_BYTES differ between ranks?)";
      } else if (h.kind == static_cast<uint16_t>(FrameKind::Abort)) {
        if (h.bytes > kMaxReason) bad = "abort reason of " + std::to_string(h.bytes) + " bytes";
      } else {
        bad = "unknown frame kind " + std::to_string(h.kind);
      }
      if (!bad.empty())
        return fail_channel(c, ErrorKind::Mismatch, "malformed frame from " + c.peer_.describe() + ": " + bad);
    }
    if (c.in_off_ >= kHeaderBytes && c.in_off_ == kHeaderBytes + h.bytes) {
      c.in_off_ = 0;
      if (h.kind == static_cast<uint16_t>(FrameKind::Abort))
        return fail_channel(c, ErrorKind::PeerFailure,
                            c.peer_.describe() + " aborted: " + printable_reason(c.reason_, h.bytes));
      {
        std::lock_guard<std::mutex> lk(mu_);
        ++c.filled_;  // hands the slot to the compute thread
        changed_locked();
      }
      cv_.notify_all();
    }
  }
}

// Hands committed frames to the kernel, several per sendmsg(), in order.
void TcpTransport::write_ready(TcpChannel& c) {
  constexpr uint64_t kBatch = 32;
  for (;;) {
    uint64_t written, committed;
    {
      std::lock_guard<std::mutex> lk(mu_);
      written = c.written_;
      committed = c.committed_;
    }
    if (written == committed) return;
    const uint64_t last = std::min(committed, written + kBatch);
    iovec iov[2 * kBatch];
    size_t count = 0, skip = c.out_off_, total = 0;
    const auto add = [&](const void* p, size_t len) {
      if (skip >= len) {
        skip -= len;
        return;
      }
      iov[count++] = iovec{const_cast<char*>(static_cast<const char*>(p)) + skip, len - skip};
      total += len - skip;
      skip = 0;
    };
    for (uint64_t f = written; f < last; ++f) {
      const FrameHeader& h = c.out_hdr_[f % c.depth_];
      add(&h, kHeaderBytes);
      add(c.out_slot(f), h.bytes);
    }
    const ssize_t n = send_pieces(c.sock_.get(), iov, count);
    if (n == 0) return;
    if (n < 0) return socket_error(c, static_cast<int>(-n));
    size_t left = c.out_off_ + static_cast<size_t>(n);
    uint64_t done = 0;
    for (uint64_t f = written; f < last; ++f) {
      const size_t frame = kHeaderBytes + c.out_hdr_[f % c.depth_].bytes;
      if (left < frame) break;
      left -= frame;
      ++done;
    }
    c.out_off_ = left;
    if (done > 0) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        c.written_ += done;  // frees the slots
        changed_locked();
      }
      cv_.notify_all();
    }
    if (static_cast<size_t>(n) < total) return;  // the socket buffer is full
  }
}

// After abort(): completes the frame partly on the wire (the peer could not parse what
// follows otherwise), then sends the Abort frame and shuts the socket down.
void TcpTransport::write_abort(TcpChannel& c) {
  for (;;) {
    iovec iov[2];
    size_t count = 0;
    const FrameHeader& h = c.out_hdr_[c.written_ % c.depth_];  // written_: only this thread writes it
    if (c.out_off_ > 0) {
      size_t skip = c.out_off_;
      if (skip < kHeaderBytes) {
        iov[count++] = iovec{reinterpret_cast<char*>(const_cast<FrameHeader*>(&h)) + skip, kHeaderBytes - skip};
        skip = 0;
      } else {
        skip -= kHeaderBytes;
      }
      if (h.bytes > skip) iov[count++] = iovec{c.out_slot(c.written_) + skip, h.bytes - skip};
    } else if (c.abort_off_ < c.abort_frame_.size()) {
      iov[count++] = iovec{&c.abort_frame_[c.abort_off_], c.abort_frame_.size() - c.abort_off_};
    } else {
      ::shutdown(c.sock_.get(), SHUT_RDWR);
      c.closed_ = true;
      return;
    }
    const ssize_t n = send_pieces(c.sock_.get(), iov, count);
    if (n == 0) return;
    if (n < 0) {
      ::shutdown(c.sock_.get(), SHUT_RDWR);  // best effort only: give up on this peer
      c.closed_ = true;
      return;
    }
    if (c.out_off_ > 0) {
      c.out_off_ += static_cast<size_t>(n);
      if (c.out_off_ == kHeaderBytes + h.bytes) {
        c.out_off_ = 0;
        std::lock_guard<std::mutex> lk(mu_);
        ++c.written_;
      }
    } else {
      c.abort_off_ += static_cast<size_t>(n);
    }
  }
}

// The peer shut its side down (POLLRDHUP) or the connection broke (POLLHUP/POLLERR), and
// read_ready() did not reach the end of the stream: every inbound slot is full, so what
// the peer sent last (possibly an Abort frame) is still queued in the kernel.
void TcpTransport::peer_closed(TcpChannel& c, short revents) {
  if (auto reason = peek_abort_reason(c))
    return fail_channel(c, ErrorKind::PeerFailure, c.peer_.describe() + " aborted: " + *reason);
  if (revents & (POLLHUP | POLLERR)) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(c.sock_.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = 0;
    return fail_channel(c, ErrorKind::PeerFailure, "connection to " + c.peer_.describe() + " lost: " +
                                                       (err ? std::strerror(err) : "closed"));
  }
  // Only a half-close: the frames queued before it stay readable, but nothing sent to the
  // peer will be read any more.
  c.rdhup_seen_ = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (c.send_error_.empty()) c.send_error_ = "connection to " + c.peer_.describe() + " lost: closed by the peer";
    changed_locked();
  }
  cv_.notify_all();
}

// Looks through the unread receive queue, without consuming it, for an Abort frame: a peer
// that aborted while this rank was not reading from it still gets its reason across.
std::optional<std::string> TcpTransport::peek_abort_reason(TcpChannel& c) {
  if (c.in_off_ != 0) return std::nullopt;  // only from a frame boundary
  int queued = 0;
  if (::ioctl(c.sock_.get(), FIONREAD, &queued) != 0 || queued <= 0) return std::nullopt;
  const size_t size = std::min(static_cast<size_t>(queued), kMaxPeek);
  std::unique_ptr<char[]> buf(new char[size]);
  const ssize_t n = ::recv(c.sock_.get(), buf.get(), size, MSG_PEEK | MSG_DONTWAIT);
  if (n <= 0) return std::nullopt;
  const size_t end = static_cast<size_t>(n);
  for (size_t pos = 0; pos + kHeaderBytes <= end;) {
    FrameHeader h;
    std::memcpy(&h, buf.get() + pos, kHeaderBytes);
    if (h.magic != kFrameMagic) break;
    if (h.kind == static_cast<uint16_t>(FrameKind::Data) && h.bytes <= c.chunk_) {
      pos += kHeaderBytes + h.bytes;
      continue;
    }
    if (h.kind == static_cast<uint16_t>(FrameKind::Abort) && h.bytes <= kMaxReason &&
        pos + kHeaderBytes + h.bytes <= end)
      return printable_reason(buf.get() + pos + kHeaderBytes, h.bytes);
    break;
  }
  return std::nullopt;
}

void TcpTransport::socket_error(TcpChannel& c, int err) {
  if (auto reason = peek_abort_reason(c))
    return fail_channel(c, ErrorKind::PeerFailure, c.peer_.describe() + " aborted: " + *reason);
  fail_channel(c, ErrorKind::PeerFailure, "connection to " + c.peer_.describe() + " lost: " + std::strerror(err));
}

// Ends the stream: no more I/O on this socket. Frames already complete stay readable.
void TcpTransport::fail_channel(TcpChannel& c, ErrorKind kind, const std::string& what) {
  c.dead_ = true;
  ::shutdown(c.sock_.get(), SHUT_RDWR);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (c.error_.empty()) {
      c.error_kind_ = kind;
      c.error_ = what;
    }
    changed_locked();
  }
  cv_.notify_all();
}

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const TransportSetup& setup) {
  return std::make_unique<TcpTransport>(setup);
}

}  // namespace pycomm
