// The TCP transport's connections: one authenticated connection per pair of peers, made
// when the group is created for the eager peers and when first used for the others.
//
// Set-up. Every rank with peers listens on one IPv4 address (tcp_addresses.h chooses it),
// on an ephemeral port, for the group's life, and publishes "addr:port" under
// <key_prefix>/tcp/addr/<rank>; then it reads every peer's address at once. At creation
// the higher rank of each eager pair connects to the lower one. Afterwards whichever rank
// of a pair wants the connection first connects, so that a send never waits for its
// receiver to act; when both try at once, the higher rank's connection is kept: the higher
// rank refuses the lower one's (a Nack) while its own is in flight, and the lower rank
// drops its own attempt when the higher one's arrives. Before any frame the connector
// sends a Hello {magic, version, from, to, secret} (tcp_wire.h); the acceptor checks every
// field (to == self, from is a peer neither connected nor handshaking, the secret matches,
// compared in constant time) and answers with an Ack (or a Nack) carrying its own rank and
// the secret, which the connector checks in turn. A connection failing any check is
// closed; the acceptor keeps accepting, and keeps room for a handshake from every peer at
// once besides kSpareHandshakes strangers', so a stranger can neither take a peer's place
// nor stop the group from forming. Connects, accepts and handshakes all progress together
// in one poll() loop: set-up's, then the I/O thread's.
#include "transport/tcp_mesh.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>

#include "core/error.h"
#include "transport/tcp_addresses.h"
#include "transport/tcp_wire.h"

namespace pycomm {
namespace tcp {
namespace {

constexpr size_t kSpareHandshakes = 32;  // unauthenticated connections kept beyond one per peer
constexpr std::chrono::seconds kHandshakeTimeout{10};     // for an accepted connection's Hello
constexpr std::chrono::milliseconds kMaxRetryDelay{500};  // between connect attempts

Fd new_socket() {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) fail(ErrorKind::Internal, errno_message("pycomm: socket"));
  return fd;
}

void set_nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

// Connects to peers and accepts their connections, all sockets non-blocking and progressed
// together: by set-up's own poll() loop until the eager peers are connected, then by the
// transport's I/O thread, whose poll() includes poll_set()'s entries.
class Mesh::Impl {
 public:
  explicit Impl(const TransportSetup& s)
      : s_(s),
        peer_(s.size, 0),
        claimed_(s.size, 0),
        connected_(s.size, 0),
        outgoing_of_(s.size, -1),
        max_handshakes_(s.peers.size() + kSpareHandshakes) {
    if (s.secret.size() > kMaxSecret)
      fail(ErrorKind::InvalidArgument,
           "pycomm: the group secret is longer than " + std::to_string(kMaxSecret) + " bytes");
    for (int p : s.peers) peer_[p] = 1;
    if (!s.peers.empty()) listen_on(listen_address(s));
    addresses_.resize(s_.size);
    address_texts_.resize(s_.size);
    read_addresses([&](int p) { return p < s_.rank; });
  }

  // Starts connecting to `p` unless a connection exists or is being made, either way.
  void want(int p) {
    if (p < 0 || p >= s_.size || !peer_[p] || connected_[p] || claimed_[p] || outgoing_of_[p] >= 0) return;
    Outgoing o;
    o.peer = p;
    o.addr = addresses_[p];
    o.addr_text = address_texts_[p];
    o.hello = make_hello(kHelloMagic, s_.rank, p, s_.secret);
    o.retry_at = Clock::now();
    outgoing_of_[p] = static_cast<int>(out_.size());
    out_.push_back(std::move(o));
  }

  Clock::time_point poll_set(std::vector<pollfd>& fds) {
    const auto now = Clock::now();
    for (auto& o : out_)
      if (o.phase == Phase::Idle && now >= o.retry_at) start_connect(o);
    for (auto& i : in_)
      if (i.fd && now - i.since > kHandshakeTimeout) drop(i);
    prune();
    Clock::time_point wake = Clock::time_point::max();
    polled_out_.clear();
    for (size_t k = 0; k < out_.size(); ++k) {
      Outgoing& o = out_[k];
      if (o.phase == Phase::Idle) wake = std::min(wake, o.retry_at);
      if (o.phase == Phase::Connecting || o.phase == Phase::Sending) fds.push_back({o.fd.get(), POLLOUT, 0});
      else if (o.phase == Phase::Receiving) fds.push_back({o.fd.get(), POLLIN, 0});
      else continue;
      polled_out_.push_back(k);
    }
    polled_in_ = in_.size();
    for (auto& i : in_) {
      wake = std::min(wake, i.since + kHandshakeTimeout);
      fds.push_back({i.fd.get(), static_cast<short>(i.phase == Phase::Sending ? POLLOUT : POLLIN), 0});
    }
    polled_listener_ = listener_ && unconnected() > 0;
    if (polled_listener_) fds.push_back({listener_.get(), POLLIN, 0});
    return wake;
  }

  void progress(const pollfd* fds) {
    size_t k = 0;
    for (size_t o : polled_out_)
      if (fds[k++].revents) progress_outgoing(out_[o]);
    for (size_t j = 0; j < polled_in_; ++j)
      if (fds[k++].revents) progress_incoming(in_[j]);
    if (polled_listener_ && fds[k].revents) accept_all();
  }

  std::vector<std::pair<int, Fd>> take_connected() { return std::exchange(done_, {}); }
  std::vector<std::pair<int, std::string>> take_refused() { return std::exchange(refused_, {}); }

  std::string pending(int p) const {
    if (outgoing_of_[p] < 0) return "it has not connected to " + listen_text_ + ", nor this rank to it";
    const Outgoing& o = out_[outgoing_of_[p]];
    return "connecting to " + o.addr_text + ", last error: " + o.last_error;
  }

  // The higher rank of each eager pair connects; the lower one waits for it.
  void connect_eagerly(const std::vector<int>& eager) {
    for (int p : eager)
      if (p < s_.rank) want(p);
    std::vector<char> waiting(s_.size, 0);
    for (int p : eager) waiting[p] = 1;
    const auto left = [&] {
      size_t n = 0;
      for (int p : eager) n += connected_[p] ? 0 : 1;
      return n;
    };
    std::vector<pollfd> fds;
    while (left() > 0) {
      if (Clock::now() >= s_.deadline.at) fail(ErrorKind::Timeout, timeout_message(waiting));
      fds.clear();
      const auto wake = std::min(poll_set(fds), s_.deadline.at);
      const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(wake));
      if (n < 0 && errno != EINTR) fail(ErrorKind::Internal, errno_message("pycomm: poll"));
      if (n > 0) progress(fds.data());
    }
    // The higher peers' addresses, for connections on demand: read once this rank has
    // served its eager peers (a higher one connects before it waits for anyone).
    read_addresses([&](int p) { return p > s_.rank; });
    created_ = true;
  }

 private:
  enum class Phase { Idle, Connecting, Sending, Receiving, Done };

  struct Outgoing {  // this rank -> a peer
    int peer;
    sockaddr_in addr;
    std::string addr_text;
    Fd fd;
    Phase phase = Phase::Idle;
    Hello hello;
    char reply[kHelloBytes] = {};  // as received
    size_t off = 0;
    Clock::time_point retry_at;
    std::chrono::milliseconds delay{10};
    std::string last_error = "no attempt finished";
  };

  struct Incoming {  // an accepted connection, not yet authenticated
    Fd fd;
    Phase phase = Phase::Receiving;
    char hello[kHelloBytes] = {};  // as received
    Hello ack;                     // an Ack, or a Nack that closes the connection once sent
    size_t off = 0;
    int peer = -1;  // once its Hello was accepted
    Clock::time_point since;
  };

  size_t unconnected() const {
    size_t n = 0;
    for (int p = 0; p < s_.size; ++p) n += peer_[p] && !connected_[p] ? 1 : 0;
    return n;
  }

  // An attempt of this rank's own to `p` that has a socket (or waits to retry).
  Outgoing* attempt_to(int p) {
    if (outgoing_of_[p] < 0) return nullptr;
    Outgoing& o = out_[outgoing_of_[p]];
    return o.phase == Phase::Done ? nullptr : &o;
  }

  void connected(int p, Fd fd) {
    connected_[p] = 1;
    done_.emplace_back(p, std::move(fd));
  }

  void listen_on(const in_addr& addr) {
    listener_ = new_socket();
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr = addr;
    a.sin_port = 0;
    if (::bind(listener_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      fail(ErrorKind::Internal, errno_message("pycomm: cannot bind a TCP listener to " + ipv4_text(addr)));
    if (::listen(listener_.get(), SOMAXCONN) != 0) fail(ErrorKind::Internal, errno_message("pycomm: listen"));
    socklen_t len = sizeof a;
    if (::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
      fail(ErrorKind::Internal, errno_message("pycomm: getsockname"));
    listen_text_ = ipv4_text(addr) + ":" + std::to_string(ntohs(a.sin_port));
    s_.store->set(key(s_.rank), listen_text_);
  }

  std::string key(int rank) const { return s_.key_prefix + "/tcp/addr/" + std::to_string(rank); }

  // The addresses of the peers `which` selects, in one wait and one read of the store.
  template <class Which>
  void read_addresses(Which which) {
    std::vector<int> peers;
    std::vector<std::string> keys;
    for (int p : s_.peers)
      if (which(p)) peers.push_back(p), keys.push_back(key(p));
    if (keys.empty()) return;
    const std::vector<std::string> texts = get_all(*s_.store, keys, s_.deadline, [&](size_t i) {
      return "pycomm: no TCP address from " + s_.ranks[peers[i]].describe() + " (it never published one)";
    });
    for (size_t i = 0; i < peers.size(); ++i) {
      const int p = peers[i];
      const auto addr = parse_address(texts[i]);
      if (!addr)
        fail(ErrorKind::Mismatch, "pycomm: " + s_.ranks[p].describe() + " published an invalid TCP address '" +
                                      texts[i].substr(0, 64) + "'");
      addresses_[p] = *addr;
      address_texts_[p] = texts[i];
    }
  }

  // Once the group exists, every peer listens until it leaves: a refused connection
  // means it has gone, and the channel fails now rather than at its deadline. During
  // set-up a refusal is retried (the eager peers' errors name it at the set-up deadline).
  bool gone(Outgoing& o, int err) {
    if (!created_ || err != ECONNREFUSED) return false;
    o.fd.reset();
    o.phase = Phase::Done;
    refused_.emplace_back(o.peer, "connection to " + s_.ranks[o.peer].describe() + " at " + o.addr_text +
                                      " refused: it has exited or left the group");
    return true;
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
    if (::connect(o.fd.get(), reinterpret_cast<const sockaddr*>(&o.addr), sizeof o.addr) == 0) o.phase = Phase::Sending;
    else if (errno == EINPROGRESS) o.phase = Phase::Connecting;
    else if (!gone(o, errno)) retry_later(o, errno_message("connect"));
  }
  void progress_outgoing(Outgoing& o) {
    if (o.phase == Phase::Connecting) {
      int err = 0;
      socklen_t len = sizeof err;
      if (getsockopt(o.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err != 0) {
        if (!gone(o, err)) retry_later(o, std::string("connect: ") + std::strerror(err));
        return;
      }
      o.phase = Phase::Sending;
    }
    if (o.phase == Phase::Sending) {
      const ssize_t n =
          ::send(o.fd.get(), reinterpret_cast<char*>(&o.hello) + o.off, sizeof o.hello - o.off, MSG_NOSIGNAL);
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
      const ssize_t n = ::recv(o.fd.get(), o.reply + o.off, sizeof o.reply - o.off, 0);
      if (n == 0)
        return retry_later(o,
                           "the peer closed the connection during the handshake "
                           "(wrong secret, or a different pycomm version?)");
      if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) retry_later(o, errno_message("recv"));
        return;
      }
      o.off += static_cast<size_t>(n);
      if (o.off < sizeof o.reply) return;
      const DecodedHello nack = decode_hello(o.reply, o.off, kNackMagic, s_.rank, s_.secret);
      if (nack.message.from_rank == o.peer && !nack.error) {
        o.fd.reset();  // the peer's own connection, in flight, is the pair's
        o.phase = Phase::Done;
        o.last_error = "refused in favour of its own connection to this rank, not arrived yet";
        return;
      }
      const DecodedHello ack = decode_hello(o.reply, o.off, kAckMagic, s_.rank, s_.secret);
      if (ack.error || ack.message.from_rank != o.peer) return retry_later(o, "invalid handshake reply");
      connected(o.peer, std::move(o.fd));
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
      // round (its socket handed over) is forgotten first, so that evicting it never
      // frees the rank it claimed, nor wastes the eviction.
      prune();
      in_.push_back(std::move(i));
      if (in_.size() > max_handshakes_) drop(in_.front()), in_.erase(in_.begin());
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
      const ssize_t n = ::recv(i.fd.get(), i.hello + i.off, sizeof i.hello - i.off, 0);
      if (n == 0) return drop(i);
      if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) drop(i);
        return;
      }
      i.off += static_cast<size_t>(n);
      if (i.off < sizeof i.hello) return;
      const DecodedHello h = decode_hello(i.hello, i.off, kHelloMagic, s_.rank, s_.secret);
      const int from = h.message.from_rank;
      const bool from_ok = from >= 0 && from < s_.size && peer_[from] && !claimed_[from] && !connected_[from];
      if (h.error || !from_ok) return drop(i);
      i.off = 0;
      i.phase = Phase::Sending;
      Outgoing* mine = attempt_to(from);
      if (mine && mine->fd && s_.rank > from) {
        i.ack = make_hello(kNackMagic, s_.rank, from, s_.secret);  // this rank's own one wins
      } else {
        if (mine) mine->fd.reset(), mine->phase = Phase::Done;  // the peer's wins
        i.peer = from;
        claimed_[from] = 1;
        i.ack = make_hello(kAckMagic, s_.rank, from, s_.secret);
      }
    }
    if (i.phase == Phase::Sending) {
      const ssize_t n = ::send(i.fd.get(), reinterpret_cast<char*>(&i.ack) + i.off, sizeof i.ack - i.off, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) drop(i);
        return;
      }
      i.off += static_cast<size_t>(n);
      if (i.off < sizeof i.ack) return;
      if (i.peer < 0) return drop(i);      // a Nack delivered
      connected(i.peer, std::move(i.fd));  // leaves i.fd empty: erased next round
    }
  }

  std::string timeout_message(const std::vector<char>& waiting) const {
    std::ostringstream os;
    os << "pycomm: TCP set-up timed out on " << s_.ranks[s_.rank].describe() << "; not connected to ";
    bool first = true;
    for (int p = 0; p < s_.size; ++p) {
      if (!waiting[p] || connected_[p]) continue;
      os << (first ? "" : "; ") << s_.ranks[p].describe();
      if (outgoing_of_[p] >= 0) {
        const Outgoing& o = out_[outgoing_of_[p]];
        os << " at " << o.addr_text << " (last error: " << o.last_error << ")";
      } else {
        os << " (it never connected to " << listen_text_ << ")";
      }
      first = false;
    }
    return os.str();
  }

  const TransportSetup s_;              // a copy: the mesh outlives set-up
  std::vector<char> peer_;              // ranks served by this transport
  std::vector<char> claimed_;           // peers whose Hello was accepted, Ack not yet sent
  std::vector<char> connected_;         // authenticated sockets handed over
  std::vector<int> outgoing_of_;        // index in out_ of each peer wanted, else -1
  const size_t max_handshakes_;         // unauthenticated connections kept at once
  std::vector<sockaddr_in> addresses_;  // of the peers
  std::vector<std::string> address_texts_;
  Fd listener_;
  std::string listen_text_;
  std::vector<Outgoing> out_;
  std::vector<Incoming> in_;
  std::vector<std::pair<int, Fd>> done_;
  std::vector<std::pair<int, std::string>> refused_;  // peers found gone, and how
  bool created_ = false;                // the eager peers are connected: set-up is over
  std::vector<size_t> polled_out_;      // of the last poll_set(), in order
  size_t polled_in_ = 0;
  bool polled_listener_ = false;
};

Mesh::Mesh(const TransportSetup& s, const std::vector<int>& eager) : impl_(std::make_unique<Impl>(s)) {
  impl_->connect_eagerly(eager);
}
Mesh::~Mesh() = default;
void Mesh::want(int peer) { impl_->want(peer); }
Clock::time_point Mesh::poll_set(std::vector<pollfd>& fds) { return impl_->poll_set(fds); }
void Mesh::progress(const pollfd* fds) { impl_->progress(fds); }
std::vector<std::pair<int, Fd>> Mesh::take_connected() { return impl_->take_connected(); }
std::vector<std::pair<int, std::string>> Mesh::take_refused() { return impl_->take_refused(); }
std::string Mesh::pending(int peer) const { return impl_->pending(peer); }

}  // namespace tcp
}  // namespace pycomm
