// Set-up of the TCP transport: a full mesh of authenticated connections, one per peer.
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
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "core/error.h"
#include "transport/tcp_socket.h"

namespace pycomm {
namespace tcp {
namespace {

constexpr uint32_t kHelloMagic = 0x70634843;  // "pcHC": connector -> acceptor
constexpr uint32_t kAckMagic = 0x70634841;    // "pcHA": acceptor -> connector
constexpr uint32_t kProtocolVersion = 1;
constexpr size_t kMaxPendingHandshakes = 32;              // unauthenticated connections kept
constexpr std::chrono::seconds kHandshakeTimeout{10};     // for an accepted connection's Hello
constexpr std::chrono::milliseconds kMaxRetryDelay{500};  // between connect attempts


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

// One poll() loop connecting to lower ranks and accepting higher ones.
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

}  // namespace

std::vector<Fd> connect_mesh(const TransportSetup& s) {
  if (s.secret.size() > kMaxSecret)
    fail(ErrorKind::InvalidArgument, "pycomm: the group secret is longer than " + std::to_string(kMaxSecret) + " bytes");
  return MeshBuilder(s).run();
}

}  // namespace tcp
}  // namespace pycomm
