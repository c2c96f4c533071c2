// TCP transport: one authenticated connection per peer (tcp_mesh.cc), each channel with a
// lock of its own, moved by the calling threads where they can and by one I/O thread per
// transport where they cannot.
//
// Connections. A rank connects at creation to its eager peers: those at a power-of-two
// distance around the ring of ranks (r +- 1, 2, 4, ...), which the ring, the dissemination
// barrier and the link-cost calibration at creation use: O(log n) of them. Every other
// connection is made when a channel is first used: begin_send(), begin_recv_next() or
// peek_recv() asks the I/O thread for it, which connects at once unless the peer's own
// connection comes first. Until then frames sent wait in the channel's slots, as they
// would for a slow reader. A rank thus holds a socket for each peer its operations or its
// peers' have used, plus one listener.
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
//     end_send() (f == committed_); the channel's writer's from end_send() (++committed_)
//     until its last byte is in the kernel (++written_), when the slot is free again.
//   inbound frame f: the channel's reader's while it reads it (f == filled_, which it may
//     start only when filled_ - released_ < depth); the compute thread's once complete
//     (released_ <= f < filled_) until end_recv() (++released_).
// The writer and the reader of a channel are whichever thread holds the channel's mutex:
// the compute thread writes each frame straight to the socket in end_send(), as much as
// the socket takes without blocking, and the I/O thread writes the rest once the socket
// has room (a hand-off of every large frame to the I/O thread, so that its copy into the
// kernel could overlap the sender's next chunk, cost 1.3-1.6x in time where ranks share
// cores: a context switch per frame and the slot's lines read on another core).
// send_host() goes further: it writes from the caller's memory, and only what the socket
// does not take is copied into the slot. Input is read by the thread that waits for it: a
// receive reads its socket itself, spinning and then sleeping in poll() on that socket,
// so that an arrival wakes the one thread that wants it (an I/O thread woken for every
// arrival as well costs a context switch per frame, about half the time of a small
// exchange where ranks share cores). Until a receive comes, frames wait in the kernel's
// socket buffer. The I/O thread reads a socket only for a recv from any source (which
// sleeps on the doorbell, see below), and when the peer closes its side. The mutex guards
// the counters, the partial-frame offsets, the socket and the failure state, and orders
// slot contents with the counters. When no inbound slot is free nobody reads that socket,
// so TCP's flow control is the back-pressure. A frame in an outbound slot counts as sent:
// a sender blocks only when all `pipeline_depth` of its slots wait for the kernel, so
// algorithms get at least the shared-memory transport's depth of frames in flight per
// pair.
//
// The I/O thread. Connected sockets are registered once with an epoll instance, edge
// triggered, for output and the peer's close; input is added to a socket's events only
// while a recv from any source waits (the channel is `watched_` and the doorbell armed),
// and dropped at the next visit after it stopped waiting. The thread polls the epoll
// descriptor, an eventfd and the mesh's handshakes.
// A thread that changes a channel so that the I/O thread may have work on it (frames the
// socket did not take, a slot freed, a connection wanted) queues the channel and writes
// the eventfd if the queue was empty; the I/O thread then visits the channels queued or
// reported by epoll, and no other: a wake costs the channels that changed, not all of them.
// Compute threads spin per SpinPolicy, then sleep in slices of at most kLivenessSlice: a
// receive in poll() on its socket and the transport's abort eventfd, anything else on the
// channel's condition variable. Each frame read into a slot rings the rank's doorbell
// (TransportSetup::doorbell).
//
// Failure. abort(reason) marks the transport aborted (every wait throws the reason at once:
// condition variables are notified, and the abort eventfd, which sleeping receives poll,
// becomes readable for good) and wakes the I/O thread, which finishes the frame each
// socket is in the middle of writing, sends an Abort frame and shuts each socket down, giving up after kAbortFlush. A
// received Abort frame fails that channel with "<peer> aborted: <reason>". EOF, ECONNRESET
// and EPIPE (sends use MSG_NOSIGNAL) fail the channel with "connection to <peer> lost: ...".
// Frames already complete in inbound slots stay readable after a channel failed (a peer
// may send its last frames and exit); everything else throws. A peer that closed its side
// while every inbound slot is full is noticed through EPOLLRDHUP: sends to it fail at once,
// and the kernel's receive queue is peeked for an Abort frame so that the reason still
// arrives.
//
// Shutdown. The destructor lets the I/O thread hand every committed frame to the kernel,
// connecting where it must (a completed send is delivered even when its sender leaves at
// once), for at most TransportSetup::linger (the group's timeout; skipped when aborted),
// says what it gave up on, shuts the sockets down, joins it and closes every
// descriptor. Descriptors are owned by Fd objects, so a constructor that throws part-way
// closes everything it opened.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
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
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/peer_watch.h"
#include "transport/tcp_socket.h"
#include "transport/transport.h"

namespace pycomm {
namespace {

using tcp::Fd;
using tcp::poll_timeout_ms;

constexpr size_t kMaxReason = 1024;                       // Abort frame payload cap
constexpr std::chrono::seconds kAbortFlush{1};            // to deliver Abort frames
constexpr size_t kMaxPeek = size_t{64} << 20;             // receive queue scanned for an Abort
constexpr size_t kMaxDrain = size_t{64} << 20;            // unread input dropped before close
constexpr size_t kHeaderBytes = sizeof(FrameHeader);

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
  TcpChannel(TcpTransport* t, const PeerInfo& peer, bool same_host, size_t chunk, size_t depth)
      : t_(t), peer_(peer), same_host_(same_host), chunk_(chunk), depth_(depth),
        out_mem_(allocate_slots(chunk * depth)), in_mem_(allocate_slots(chunk * depth)),
        out_hdr_(depth), in_hdr_(depth) {}

  const PeerInfo& peer_info() const override { return peer_; }
  size_t chunk_bytes() const override { return chunk_; }
  void* begin_send(const Deadline& deadline) override;
  void end_send(const FrameHeader& header) override;
  void send_host(const FrameHeader& header, const void* data, const Deadline& deadline) override;
  const void* begin_recv_next(FrameHeader& got, const Deadline& deadline) override;
  void end_recv() override;
  std::optional<FrameHeader> peek_recv() override;
  std::vector<Memory> slot_memory() const override {
    return {{out_mem_.get(), chunk_ * depth_}, {in_mem_.get(), chunk_ * depth_}};
  }

 private:
  friend class TcpTransport;
  using Lock = std::unique_lock<std::mutex>;
  char* out_slot(uint64_t frame) const { return out_mem_.get() + (frame % depth_) * chunk_; }
  char* in_slot(uint64_t frame) const { return in_mem_.get() + (frame % depth_) * chunk_; }
  bool movable() const { return connected_ && !dead_; }  // with mu_ held
  // Throws if the transport was aborted or this channel can no longer do `sending`/receiving.
  void throw_if_failed(bool sending) const;
  // Asks the I/O thread for this channel's connection if it has none yet; with mu_ held.
  void want_connection_locked();
  // The sending side, with mu_ held: waits for a free outbound slot; puts `header`,
  // checked and stamped, in the next outbound frame's place; after a commit, writes what
  // the socket takes now and leaves the rest to the I/O thread.
  void await_free_slot_locked(Lock& lk, const Deadline& deadline);
  FrameHeader& stamp_next_header_locked(const FrameHeader& header);
  void push_committed_locked();
  // Sleeps one slice; throws Timeout once `deadline` has passed, PeerFailure once a peer of
  // this host that never connected has exited.
  void sleep(Lock& lk, const Deadline& deadline, const char* what);
  // A receive's sleep on a connected channel: one slice in poll() on the socket (and the
  // abort eventfd), then reads what came; handles the peer's close where poll() saw it.
  void await_input(Lock& lk, const Deadline& deadline, const char* what);
  // Throws Timeout once `deadline` has passed.
  void throw_if_late(const Deadline& deadline, const char* what) const;
  template <class Ready>
  void wait(Lock& lk, const Deadline& deadline, const char* what, bool sending, Ready ready);

  // The channel's side of the I/O, with mu_ held, by whichever thread holds it.
  // Reads frames into free inbound slots until the socket has no more data, no slot is
  // free, or the stream ends. Each header is checked as soon as it is complete.
  void read_some();
  // Hands committed frames to the kernel, several per sendmsg(), in order, until none is
  // left or the socket takes no more.
  void write_some();
  // After abort(): completes the frame partly on the wire (the peer could not parse what
  // follows otherwise), then sends the Abort frame and shuts the socket down.
  void write_abort();
  // The peer shut its side down (EPOLLRDHUP) or the connection broke (EPOLLHUP/EPOLLERR).
  void peer_closed(uint32_t events);
  std::optional<std::string> peek_abort_reason();
  void socket_error(int err);
  // Ends the stream: no more I/O on this socket. Frames already complete stay readable.
  void fail_locked(ErrorKind kind, const std::string& what);
  void changed() {  // guarded state changed: wake waiters
    events_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }

  TcpTransport* const t_;
  const PeerInfo peer_;
  const bool same_host_;  // peer_.pid names a process this rank can watch
  const size_t chunk_, depth_;
  const Slots out_mem_, in_mem_;
  std::vector<FrameHeader> out_hdr_, in_hdr_;  // per slot, owned like the slot

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> events_{0};  // bumped on every change of guarded state (for spinning)
  std::atomic<bool> queued_{false};  // in the transport's queue of channels to visit
  // Guarded by mu_.
  Fd sock_;                 // once connected
  uint64_t committed_ = 0;  // outbound frames published by end_send()
  uint64_t written_ = 0;    // outbound frames wholly handed to the kernel
  uint64_t filled_ = 0;     // inbound frames wholly received
  uint64_t released_ = 0;   // inbound frames returned by end_recv()
  size_t out_off_ = 0;      // bytes of outbound frame written_ already sent
  size_t in_off_ = 0;       // bytes of inbound frame filled_ already received
  char reason_[kMaxReason] = {};  // an Abort frame's reason, while it is read
  ErrorKind error_kind_ = ErrorKind::PeerFailure;
  std::string error_;       // non-empty once the stream is over
  std::string send_error_;  // non-empty once the peer stopped reading (it closed its side)
  bool dead_ = false;       // error_ set: no more I/O
  bool rdhup_seen_ = false; // the peer's half-close handled once
  bool connected_ = false;  // sock_ is set
  bool polling_ = false;    // a receive sleeps in poll() on sock_: only it reads the socket
  uint32_t close_seen_ = 0; // the peer's close, as epoll reported it while polling_
  bool watched_ = false;    // a recv from any source found nothing here: push arrivals
  bool in_armed_ = false;   // input is among sock_'s epoll events (set by the I/O thread)
  bool wanted_ = false;     // an operation used the channel: connect it
  std::string pending_;     // while wanted and not connected: why not yet

  // I/O thread only.
  bool asked_ = false;       // the mesh was asked for the connection
  bool closed_ = false;      // abort frame delivered (or given up) and socket shut down
  std::string abort_frame_;  // header + reason, sent once the frame in flight is complete
  size_t abort_off_ = 0;
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TransportSetup& s) : spin_(s.spin), doorbell_(s.doorbell), linger_(s.linger) {
    validate(s);
    wake_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    abort_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_fd_ || !abort_fd_) fail(ErrorKind::Internal, errno_message("pycomm: eventfd"));
    epoll_fd_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_fd_) fail(ErrorKind::Internal, errno_message("pycomm: epoll_create1"));
    channels_.resize(s.size);
    for (int p : s.peers)
      channels_[p] = std::make_unique<TcpChannel>(this, s.ranks[p], s.ranks[p].shares_host_with(s.ranks[s.rank]),
                                                  s.config->tcp_chunk_bytes, static_cast<size_t>(s.config->pipeline_depth));
    mesh_ = std::make_unique<tcp::Mesh>(s, eager_peers(s));
    attach_connected();
    io_ = std::thread([this] { io_main(); });
  }

  ~TcpTransport() override {
    stopping_.store(true, std::memory_order_release);
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
      std::lock_guard<std::mutex> lk(abort_mu_);
      if (aborted_.load(std::memory_order_relaxed)) return;
      abort_reason_ = reason.empty() ? std::string("pycomm: aborted") : reason;
      aborted_.store(true, std::memory_order_release);
    }
    const uint64_t one = 1;
    ssize_t ignored = ::write(abort_fd_.get(), &one, sizeof one);  // wakes receives in poll()
    (void)ignored;
    for (auto& c : channels_) {
      if (!c) continue;
      std::lock_guard<std::mutex> lk(c->mu_);
      c->changed();
    }
    wake_io();
  }

  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // Once aborted(): the reason, which is never written again.
  const std::string& abort_reason() const { return abort_reason_; }

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
  }

  // The peers at a power-of-two distance around the ring: a symmetric set.
  static std::vector<int> eager_peers(const TransportSetup& s) {
    std::vector<int> eager;
    for (int p : s.peers) {
      const int ahead = ((p - s.rank) % s.size + s.size) % s.size, behind = s.size - ahead;
      const auto power_of_two = [](int d) { return d > 0 && (d & (d - 1)) == 0; };
      if (power_of_two(ahead) || power_of_two(behind)) eager.push_back(p);
    }
    return eager;
  }

  // Hands the mesh's newly authenticated sockets to their channels and registers them.
  void attach_connected() {
    for (auto& [p, fd] : mesh_->take_connected()) {
      TcpChannel& c = *channels_[p];
      register_events(p, fd.get(), EPOLL_CTL_ADD, false);
      std::lock_guard<std::mutex> lk(c.mu_);
      c.sock_ = std::move(fd);
      c.connected_ = true;
      c.pending_.clear();
      c.changed();
      queue(c);  // frames that waited for the connection
    }
  }

  // Sets the epoll events of peer p's socket: output and the peer's close, and input when
  // `input` (see the top).
  void register_events(int p, int fd, int op, bool input) {
    epoll_event e{};
    e.events = (input ? static_cast<uint32_t>(EPOLLIN) : 0u) | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    e.data.u32 = static_cast<uint32_t>(p);
    if (::epoll_ctl(epoll_fd_.get(), op, fd, &e) != 0) fail(ErrorKind::Internal, errno_message("pycomm: epoll_ctl"));
  }

  void wake_io() {
    const uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_.get(), &one, sizeof one);  // EAGAIN: already pending
    (void)ignored;
  }

  // Asks the I/O thread to visit `c`; any thread, with or without c.mu_.
  void queue(TcpChannel& c) {
    if (c.queued_.exchange(true, std::memory_order_acq_rel)) return;
    bool was_empty;
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      was_empty = queued_.empty();
      queued_.push_back(c.peer());
    }
    if (was_empty) wake_io();
  }

  void io_main();
  void io_loop();
  // The I/O thread's visit of one channel, for epoll's `events` (0: it was queued).
  void visit(TcpChannel& c, uint32_t events, std::vector<int>& to_connect);
  // Whether every channel has handed its committed frames over (lingering) or its Abort
  // frame (aborting); refreshes why unconnected channels are not connected yet.
  bool flushed();
  // Says, once the destructor's wait is over, which peers never got frames of completed
  // sends.
  void log_undelivered();

  const SpinPolicy spin_;
  const Doorbell doorbell_;  // rung when a frame arrives or a channel fails
  const std::chrono::milliseconds linger_;
  std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;          // written once, before aborted_
  std::atomic<bool> stopping_{false};
  bool abort_begun_ = false;          // I/O thread only
  Fd wake_fd_, epoll_fd_;
  Fd abort_fd_;  // readable once aborted: receives sleeping in poll() watch it
  std::vector<std::unique_ptr<TcpChannel>> channels_;  // by rank; fixed after construction
  std::unique_ptr<tcp::Mesh> mesh_;                    // I/O thread only, after construction
  std::mutex queue_mu_;
  std::vector<int> queued_;  // channels to visit, guarded by queue_mu_
  std::thread io_;
};

// ---- Channel: the compute thread's side. ----

void TcpChannel::throw_if_failed(bool sending) const {
  if (t_->aborted()) fail(ErrorKind::PeerFailure, t_->abort_reason());
  if (!error_.empty()) fail(error_kind_, error_);
  if (sending && !send_error_.empty()) fail(ErrorKind::PeerFailure, send_error_);
}

void TcpChannel::want_connection_locked() {
  if (connected_ || wanted_) return;
  wanted_ = true;
  t_->queue(*this);
}

void TcpChannel::sleep(Lock& lk, const Deadline& deadline, const char* what) {
  // A peer that exits before it connects leaves no socket to fail; on this host its
  // process tells. Watched per slice, so that no descriptor is held between waits.
  if (!connected_ && same_host_ && PeerWatch(peer_.pid).exited())
    fail(ErrorKind::PeerFailure, peer_.describe() + " exited before it connected over TCP");
  throw_if_late(deadline, what);
  cv_.wait_until(lk, std::min(deadline.at, Clock::now() + kLivenessSlice));
}

void TcpChannel::throw_if_late(const Deadline& deadline, const char* what) const {
  if (deadline.expired())
    fail(ErrorKind::Timeout, std::string("timed out waiting to ") + what + " " + peer_.describe() + " over TCP" +
                                 (connected_ ? "" : " (not connected: " + pending_ + ")"));
}

void TcpChannel::await_input(Lock& lk, const Deadline& deadline, const char* what) {
  throw_if_late(deadline, what);
  pollfd fds[2] = {{sock_.get(), POLLIN | POLLRDHUP, 0}, {t_->abort_fd_.get(), POLLIN, 0}};
  polling_ = true;
  lk.unlock();
  const int n = ::poll(fds, 2, poll_timeout_ms(std::min(deadline.at, Clock::now() + kLivenessSlice)));
  lk.lock();
  polling_ = false;
  if ((n <= 0 && !close_seen_) || !movable() || t_->aborted()) return;
  read_some();
  // The I/O thread leaves a polled socket alone, the peer's close included (an edge it saw
  // after poll() returned is in close_seen_).
  const uint32_t closed =
      (static_cast<uint32_t>(fds[0].revents) & (POLLRDHUP | POLLHUP | POLLERR)) | std::exchange(close_seen_, 0);
  if (closed && movable() && !rdhup_seen_) peer_closed(closed);
}

// Returns with `lk` (on mu_) held once `ready()` (evaluated under mu_) holds; throws on
// abort, failure or timeout. For SpinPolicy::spin a receive reads what the socket has
// itself, yielding the core between looks; then it sleeps in poll() on the socket, reading
// what wakes it. A send sleeps until the I/O thread has written enough (it always writes
// what a send waits for).
template <class Ready>
void TcpChannel::wait(Lock& lk, const Deadline& deadline, const char* what, bool sending, Ready ready) {
  const auto spin_end = Clock::now() + t_->spin_.spin;
  for (bool spinning = true;;) {
    if (!t_->aborted() && ready()) return;
    throw_if_failed(sending);
    if (!spinning) {
      if (!sending && movable()) await_input(lk, deadline, what);
      else sleep(lk, deadline, what);
      continue;
    }
    if (!sending && movable()) read_some();
    if (!t_->aborted() && ready()) return;
    spinning = Clock::now() < spin_end;
    if (spinning) {
      lk.unlock();
      std::this_thread::yield();
      lk.lock();
    }
  }
}

void TcpChannel::await_free_slot_locked(Lock& lk, const Deadline& deadline) {
  // A send fails on any failure, even with a free slot: the frame could never arrive.
  want_connection_locked();
  wait(lk, deadline, "send to", true, [&] {
    return error_.empty() && send_error_.empty() && committed_ - written_ < depth_;
  });
}

FrameHeader& TcpChannel::stamp_next_header_locked(const FrameHeader& header) {
  if (header.bytes > chunk_)
    fail(ErrorKind::Internal, "pycomm: frame of " + std::to_string(header.bytes) +
                                  " bytes exceeds the TCP chunk of " + std::to_string(chunk_));
  FrameHeader& h = out_hdr_[committed_ % depth_];
  h = header;
  h.magic = kFrameMagic;
  h.kind = static_cast<uint16_t>(FrameKind::Data);
  return h;
}

void TcpChannel::push_committed_locked() {
  if (movable() && !t_->aborted()) write_some();
  if (written_ < committed_) t_->queue(*this);  // the rest (or the connection) is the I/O thread's
}

void* TcpChannel::begin_send(const Deadline& deadline) {
  Lock lk(mu_);
  await_free_slot_locked(lk, deadline);
  return out_slot(committed_);
}

void TcpChannel::end_send(const FrameHeader& header) {
  Lock lk(mu_);
  stamp_next_header_locked(header);
  ++committed_;
  push_committed_locked();
}

// A frame with nothing queued ahead of it goes to the socket from `data`; only what the
// socket does not take at once is copied into the slot (under mu_, so that nothing can
// write the rest of the frame from a slot not yet filled), for write_some() to continue
// from out_off_.
void TcpChannel::send_host(const FrameHeader& header, const void* data, const Deadline& deadline) {
  Lock lk(mu_);
  await_free_slot_locked(lk, deadline);
  FrameHeader& h = stamp_next_header_locked(header);
  size_t sent = 0;
  if (written_ == committed_ && movable() && !t_->aborted()) {
    iovec iov[2] = {{&h, kHeaderBytes}, {const_cast<void*>(data), header.bytes}};
    const ssize_t n = send_pieces(sock_.get(), iov, header.bytes > 0 ? 2 : 1);
    if (n < 0) {
      ++committed_;
      return socket_error(static_cast<int>(-n));
    }
    sent = static_cast<size_t>(n);
  }
  ++committed_;
  if (sent == kHeaderBytes + header.bytes) {
    ++written_;
    changed();
    return;
  }
  const size_t payload_sent = sent > kHeaderBytes ? sent - kHeaderBytes : 0;
  std::memcpy(out_slot(committed_ - 1) + payload_sent, static_cast<const char*>(data) + payload_sent,
              header.bytes - payload_sent);
  if (sent == 0) return push_committed_locked();  // behind frames queued ahead of it, or none taken
  out_off_ = sent;  // of frame written_: this one
  t_->queue(*this);
}

const void* TcpChannel::begin_recv_next(FrameHeader& got, const Deadline& deadline) {
  // Frames already complete are delivered even after the channel failed.
  Lock lk(mu_);
  want_connection_locked();
  wait(lk, deadline, "receive from", false, [&] { return filled_ != released_; });
  got = in_hdr_[released_ % depth_];
  return in_slot(released_);
}

std::optional<FrameHeader> TcpChannel::peek_recv() {
  Lock lk(mu_);
  want_connection_locked();
  if (filled_ == released_ && movable() && !t_->aborted()) read_some();
  if (!t_->aborted() && filled_ != released_) return in_hdr_[released_ % depth_];
  throw_if_failed(false);
  if (!watched_) {  // its caller sleeps on the doorbell next: have arrivals pushed
    watched_ = true;
    if (!in_armed_) t_->queue(*this);
  }
  return std::nullopt;
}

void TcpChannel::end_recv() {
  Lock lk(mu_);
  if (filled_ == released_) return;
  const bool was_full = filled_ - released_ == depth_;
  ++released_;
  if (was_full && movable() && in_armed_) t_->queue(*this);  // input may wait in the socket for this slot
}

// ---- The channel's I/O, by whichever thread holds mu_. ----

void TcpChannel::read_some() {
  for (;;) {
    if (in_off_ == 0 && filled_ - released_ >= depth_) return;  // back-pressure: leave it in the socket
    FrameHeader& h = in_hdr_[filled_ % depth_];  // slot owned by the reader (see top)
    char* dst;
    size_t want;
    if (in_off_ < kHeaderBytes) {
      dst = reinterpret_cast<char*>(&h) + in_off_;
      want = kHeaderBytes - in_off_;
    } else {
      const size_t got = in_off_ - kHeaderBytes;
      dst = (h.kind == static_cast<uint16_t>(FrameKind::Data) ? in_slot(filled_) : reason_) + got;
      want = h.bytes - got;
    }
    const ssize_t n = ::recv(sock_.get(), dst, want, MSG_DONTWAIT);
    if (n == 0)
      return fail_locked(ErrorKind::PeerFailure, "connection to " + peer_.describe() + " lost: closed" +
                                                     (in_off_ > 0 ? " in the middle of a frame" : ""));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return socket_error(errno);
    }
    in_off_ += static_cast<size_t>(n);
    if (in_off_ == kHeaderBytes) {
      std::string bad;
      if (h.magic != kFrameMagic) {
        bad = "bad magic";
      } else if (h.kind == static_cast<uint16_t>(FrameKind::Data)) {
        if (h.bytes > chunk_)
          bad = "a payload of " + std::to_string(h.bytes) + " bytes exceeds this rank's chunk of " +
                std::to_string(chunk_) + " bytes (do PYCOMM_TCP_CHUNK_BYTES differ between ranks?)";
      } else if (h.kind == static_cast<uint16_t>(FrameKind::Abort)) {
        if (h.bytes > kMaxReason) bad = "abort reason of " + std::to_string(h.bytes) + " bytes";
      } else {
        bad = "unknown frame kind " + std::to_string(h.kind);
      }
      if (!bad.empty()) return fail_locked(ErrorKind::Mismatch, "malformed frame from " + peer_.describe() + ": " + bad);
    }
    if (in_off_ >= kHeaderBytes && in_off_ == kHeaderBytes + h.bytes) {
      in_off_ = 0;
      if (h.kind == static_cast<uint16_t>(FrameKind::Abort))
        return fail_locked(ErrorKind::PeerFailure, peer_.describe() + " aborted: " + printable_reason(reason_, h.bytes));
      ++filled_;  // hands the slot to the compute thread
      changed();
      t_->doorbell_.ring();
    }
  }
}

void TcpChannel::write_some() {
  constexpr uint64_t kBatch = 32;
  while (written_ < committed_) {
    const uint64_t last = std::min(committed_, written_ + kBatch);
    iovec iov[2 * kBatch];
    size_t count = 0, skip = out_off_, total = 0;
    const auto add = [&](const void* p, size_t len) {
      if (skip >= len) {
        skip -= len;
        return;
      }
      iov[count++] = iovec{const_cast<char*>(static_cast<const char*>(p)) + skip, len - skip};
      total += len - skip;
      skip = 0;
    };
    for (uint64_t f = written_; f < last; ++f) {
      const FrameHeader& h = out_hdr_[f % depth_];
      add(&h, kHeaderBytes);
      add(out_slot(f), h.bytes);
    }
    const ssize_t n = send_pieces(sock_.get(), iov, count);
    if (n == 0) return;
    if (n < 0) return socket_error(static_cast<int>(-n));
    size_t left = out_off_ + static_cast<size_t>(n);
    uint64_t done = 0;
    for (uint64_t f = written_; f < last; ++f) {
      const size_t frame = kHeaderBytes + out_hdr_[f % depth_].bytes;
      if (left < frame) break;
      left -= frame;
      ++done;
    }
    out_off_ = left;
    if (done > 0) {
      written_ += done;  // frees the slots
      changed();
    }
    if (static_cast<size_t>(n) < total) return;  // the socket buffer is full
  }
}

void TcpChannel::write_abort() {
  for (;;) {
    iovec iov[2];
    size_t count = 0;
    const FrameHeader& h = out_hdr_[written_ % depth_];
    if (out_off_ > 0) {
      size_t skip = out_off_;
      if (skip < kHeaderBytes) {
        iov[count++] = iovec{reinterpret_cast<char*>(const_cast<FrameHeader*>(&h)) + skip, kHeaderBytes - skip};
        skip = 0;
      } else {
        skip -= kHeaderBytes;
      }
      if (h.bytes > skip) iov[count++] = iovec{out_slot(written_) + skip, h.bytes - skip};
    } else if (abort_off_ < abort_frame_.size()) {
      iov[count++] = iovec{&abort_frame_[abort_off_], abort_frame_.size() - abort_off_};
    } else {
      ::shutdown(sock_.get(), SHUT_RDWR);
      closed_ = true;
      return;
    }
    const ssize_t n = send_pieces(sock_.get(), iov, count);
    if (n == 0) return;
    if (n < 0) {
      ::shutdown(sock_.get(), SHUT_RDWR);  // best effort only: give up on this peer
      closed_ = true;
      return;
    }
    if (out_off_ > 0) {
      out_off_ += static_cast<size_t>(n);
      if (out_off_ == kHeaderBytes + h.bytes) {
        out_off_ = 0;
        ++written_;
      }
    } else {
      abort_off_ += static_cast<size_t>(n);
    }
  }
}

void TcpChannel::peer_closed(uint32_t events) {
  // read_some() did not reach the end of the stream: every inbound slot is full, so what
  // the peer sent last (possibly an Abort frame) is still queued in the kernel.
  if (auto reason = peek_abort_reason()) return fail_locked(ErrorKind::PeerFailure, peer_.describe() + " aborted: " + *reason);
  if (events & (EPOLLHUP | EPOLLERR)) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(sock_.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = 0;
    return fail_locked(ErrorKind::PeerFailure, "connection to " + peer_.describe() + " lost: " +
                                                   (err ? std::strerror(err) : "closed"));
  }
  // Only a half-close: the frames queued before it stay readable, but nothing sent to the
  // peer will be read any more.
  rdhup_seen_ = true;
  if (send_error_.empty()) send_error_ = "connection to " + peer_.describe() + " lost: closed by the peer";
  changed();
}

// Looks through the unread receive queue, without consuming it, for an Abort frame: a peer
// that aborted while this rank was not reading from it still gets its reason across.
std::optional<std::string> TcpChannel::peek_abort_reason() {
  if (in_off_ != 0) return std::nullopt;  // only from a frame boundary
  int queued = 0;
  if (::ioctl(sock_.get(), FIONREAD, &queued) != 0 || queued <= 0) return std::nullopt;
  const size_t size = std::min(static_cast<size_t>(queued), kMaxPeek);
  std::unique_ptr<char[]> buf(new char[size]);
  const ssize_t n = ::recv(sock_.get(), buf.get(), size, MSG_PEEK | MSG_DONTWAIT);
  if (n <= 0) return std::nullopt;
  const size_t end = static_cast<size_t>(n);
  for (size_t pos = 0; pos + kHeaderBytes <= end;) {
    FrameHeader h;
    std::memcpy(&h, buf.get() + pos, kHeaderBytes);
    if (h.magic != kFrameMagic) break;
    if (h.kind == static_cast<uint16_t>(FrameKind::Data) && h.bytes <= chunk_) {
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

void TcpChannel::socket_error(int err) {
  if (auto reason = peek_abort_reason()) return fail_locked(ErrorKind::PeerFailure, peer_.describe() + " aborted: " + *reason);
  fail_locked(ErrorKind::PeerFailure, "connection to " + peer_.describe() + " lost: " + std::strerror(err));
}

void TcpChannel::fail_locked(ErrorKind kind, const std::string& what) {
  dead_ = true;
  if (sock_) ::shutdown(sock_.get(), SHUT_RDWR);
  if (error_.empty()) {
    error_kind_ = kind;
    error_ = what;
  }
  changed();
  t_->doorbell_.ring();
}

// ---- The I/O thread. ----

void TcpTransport::io_main() {
  try {
    io_loop();
  } catch (const std::exception& e) {
    abort(std::string("pycomm: TCP I/O thread failed: ") + e.what());
    for (auto& c : channels_)
      if (c) {
        std::lock_guard<std::mutex> lk(c->mu_);
        if (c->sock_) ::shutdown(c->sock_.get(), SHUT_RDWR);
      }
  }
}

// Each round: poll the eventfd, the epoll descriptor and the mesh's handshakes; visit the
// channels epoll reports and those queued. After abort(): finish the frame in flight on
// each socket, send the Abort frame, shut down (kAbortFlush at most). After the destructor
// asked to stop: keep going until every committed frame is in the kernel (linger_ at
// most), then shut down writing.
void TcpTransport::io_loop() {
  constexpr auto kNever = Clock::time_point::max();
  constexpr int kEvents = 256;
  epoll_event events[kEvents];
  std::vector<pollfd> fds;
  std::vector<int> visiting, to_connect, connecting;  // connecting: asked of the mesh, not connected
  Clock::time_point finish_by = kNever;
  bool lingering = false;
  for (;;) {
    const auto now = Clock::now();
    if (aborted() && !abort_begun_) {
      abort_begun_ = true;
      finish_by = now + kAbortFlush;
      const std::string reason = abort_reason_.substr(0, kMaxReason);
      FrameHeader h;
      h.kind = static_cast<uint16_t>(FrameKind::Abort);
      h.bytes = static_cast<uint32_t>(reason.size());
      for (auto& c : channels_)
        if (c) c->abort_frame_ = std::string(reinterpret_cast<const char*>(&h), sizeof h) + reason;
      for (auto& c : channels_)  // each visited once; epoll's edges drive the rest
        if (c) queue(*c);
    } else if (stopping_.load(std::memory_order_acquire) && !aborted() && !lingering) {
      lingering = true;
      finish_by = now + linger_;
      for (auto& c : channels_)
        if (c) queue(*c);
    }
    if (abort_begun_ || lingering) {
      const bool done = flushed();
      if (done || now >= finish_by) {
        if (lingering && !abort_begun_ && !done) log_undelivered();
        for (auto& c : channels_)
          if (c) {
            std::lock_guard<std::mutex> lk(c->mu_);
            if (c->sock_) ::shutdown(c->sock_.get(), done && !abort_begun_ ? SHUT_WR : SHUT_RDWR);
          }
        return;
      }
    }
    fds.assign({pollfd{wake_fd_.get(), POLLIN, 0}, pollfd{epoll_fd_.get(), POLLIN, 0}});
    Clock::time_point wake = finish_by;
    if (!abort_begun_) {
      for (int p : to_connect) mesh_->want(p);
      connecting.insert(connecting.end(), to_connect.begin(), to_connect.end());
      to_connect.clear();
      wake = std::min(wake, mesh_->poll_set(fds));
    }
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      if (!queued_.empty()) wake = now;  // visit them before sleeping
    }
    const int n = ::poll(fds.data(), fds.size(), wake == kNever ? -1 : poll_timeout_ms(wake));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(ErrorKind::Internal, errno_message("pycomm: poll"));
    }
    if (fds[0].revents) {
      uint64_t count;
      ssize_t ignored = ::read(wake_fd_.get(), &count, sizeof count);
      (void)ignored;
    }
    if (fds[1].revents) {
      const int ready = ::epoll_wait(epoll_fd_.get(), events, kEvents, 0);
      for (int i = 0; i < ready; ++i) visit(*channels_[events[i].data.u32], events[i].events, to_connect);
    }
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      visiting.swap(queued_);
    }
    for (int p : visiting) visit(*channels_[p], 0, to_connect);
    visiting.clear();
    if (!abort_begun_) {
      mesh_->progress(fds.data() + 2);
      attach_connected();
      for (auto& [p, why] : mesh_->take_refused()) {
        TcpChannel& c = *channels_[p];
        std::lock_guard<std::mutex> lk(c.mu_);
        c.fail_locked(ErrorKind::PeerFailure, why);
      }
      // Why each connection in the making is not there yet, for a waiter's timeout message.
      connecting.erase(std::remove_if(connecting.begin(), connecting.end(),
                                      [&](int p) {
                                        TcpChannel& c = *channels_[p];
                                        std::lock_guard<std::mutex> lk(c.mu_);
                                        if (c.connected_ || c.dead_) return true;
                                        c.pending_ = mesh_->pending(p);
                                        return false;
                                      }),
                       connecting.end());
    }
  }
}

void TcpTransport::visit(TcpChannel& c, uint32_t events, std::vector<int>& to_connect) {
  c.queued_.store(false, std::memory_order_release);  // changes from now on queue it again
  std::lock_guard<std::mutex> lk(c.mu_);
  if (!c.connected_) {
    if (abort_begun_ || !c.wanted_ || c.dead_) return;
    if (!c.asked_) c.asked_ = true, to_connect.push_back(c.peer());
    c.pending_ = mesh_->pending(c.peer());
    return;
  }
  if (c.dead_ || c.closed_) return;
  if (abort_begun_) return c.write_abort();
  if (c.watched_ && !doorbell_.waiting()) c.watched_ = false;  // the recv from any source is over
  if (c.watched_ != c.in_armed_) {
    register_events(c.peer(), c.sock_.get(), EPOLL_CTL_MOD, c.watched_);
    c.in_armed_ = c.watched_;
  }
  const uint32_t closed = events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR);
  if (c.polling_) c.close_seen_ |= closed;  // the receive in poll() handles it
  if (!c.polling_ && (c.in_armed_ || closed)) c.read_some();
  if (!c.dead_) c.write_some();
  if (!c.dead_ && !c.polling_ && !c.rdhup_seen_ && closed) c.peer_closed(events);
}

bool TcpTransport::flushed() {
  bool done = true;
  for (auto& cp : channels_) {
    if (!cp) continue;
    TcpChannel& c = *cp;
    std::lock_guard<std::mutex> lk(c.mu_);
    if (!c.connected_) {
      if (!abort_begun_ && c.wanted_ && !c.dead_ && c.written_ < c.committed_) {
        c.pending_ = mesh_->pending(c.peer());
        done = false;  // frames that wait for the connection
      }
      continue;
    }
    if (c.dead_ || c.closed_) continue;
    if (abort_begun_ || c.written_ < c.committed_) done = false;
  }
  return done;
}

void TcpTransport::log_undelivered() {
  for (const auto& cp : channels_) {
    if (!cp) continue;
    TcpChannel& c = *cp;
    std::lock_guard<std::mutex> lk(c.mu_);
    if (c.dead_ || c.written_ == c.committed_) continue;
    log_line("pycomm: TCP: " + std::to_string(c.committed_ - c.written_) + " frame(s) of completed sends to " +
             c.peer_.describe() + " not delivered within " + std::to_string(linger_.count()) +
             " ms of the group's end (" +
             (c.connected_ ? std::string("the peer did not read them") : "not connected: " + c.pending_) +
             "): they are lost");
  }
}

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const TransportSetup& setup) {
  return std::make_unique<TcpTransport>(setup);
}

}  // namespace pycomm
