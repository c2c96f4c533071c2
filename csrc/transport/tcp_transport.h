// TCP transport: one authenticated connection per peer (tcp_mesh.h), each channel with a
// lock of its own, moved by the calling threads where they can and by one I/O thread per
// transport where they cannot. Its parts: the transport's set-up, abort and shutdown
// (tcp_transport.cc); the channel's compute side (tcp_channel.cc) and its I/O, by
// whichever thread holds its lock (tcp_channel_io.cc); the I/O thread (tcp_io_loop.cc);
// the connections and their handshakes (tcp_mesh.cc), the address each rank listens on
// (tcp_addresses.cc), and the bytes on the wire, frames and handshake (tcp_wire.h).
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
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "transport/tcp_mesh.h"
#include "transport/tcp_socket.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

namespace pycomm {
namespace tcp {

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using Slots = std::unique_ptr<char[], FreeDeleter>;

class TcpTransport;

class TcpChannel final : public Channel {
 public:
  TcpChannel(TcpTransport* t, const PeerInfo& peer, bool same_host, size_t chunk, size_t depth);

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

  // The channel's side of the I/O (tcp_channel_io.cc), with mu_ held, by whichever thread
  // holds it.
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
  explicit TcpTransport(const TransportSetup& s);
  ~TcpTransport() override;

  const char* name() const override { return "tcp"; }

  Channel* channel(int peer) override {
    return peer >= 0 && peer < static_cast<int>(channels_.size()) ? channels_[peer].get() : nullptr;
  }

  void abort(const std::string& reason) override;

  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // Once aborted(): the reason, which is never written again.
  const std::string& abort_reason() const { return abort_reason_; }

 private:
  friend class TcpChannel;

  static void validate(const TransportSetup& s);
  // The peers at a power-of-two distance around the ring: a symmetric set.
  static std::vector<int> eager_peers(const TransportSetup& s);
  // Hands the mesh's newly authenticated sockets to their channels and registers them.
  void attach_connected();
  // Sets the epoll events of peer p's socket: output and the peer's close, and input when
  // `input` (see the top).
  void register_events(int p, int fd, int op, bool input);
  void wake_io();
  // Asks the I/O thread to visit `c`; any thread, with or without c.mu_.
  void queue(TcpChannel& c);

  // The I/O thread (tcp_io_loop.cc).
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
  std::unique_ptr<Mesh> mesh_;                         // I/O thread only, after construction
  std::mutex queue_mu_;
  std::vector<int> queued_;  // channels to visit, guarded by queue_mu_
  std::thread io_;
};

}  // namespace tcp
}  // namespace pycomm
