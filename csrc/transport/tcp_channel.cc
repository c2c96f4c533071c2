// The TCP channel's compute side (tcp_transport.h): what the threads that call the
// Channel interface do, with the channel's lock held.
#include <poll.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/peer_watch.h"
#include "transport/tcp_transport.h"

namespace pycomm {
namespace tcp {
namespace {

// Whole pages: a device may page-lock them (Channel::slot_memory()).
constexpr size_t kPage = 4096;
Slots allocate_slots(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
  char* p = static_cast<char*>(std::aligned_alloc(kPage, rounded));
  if (!p) throw std::bad_alloc();
  return Slots(p);
}

}  // namespace

TcpChannel::TcpChannel(TcpTransport* t, const PeerInfo& peer, bool same_host, size_t chunk, size_t depth)
    : t_(t),
      peer_(peer),
      same_host_(same_host),
      chunk_(chunk),
      depth_(depth),
      out_mem_(allocate_slots(chunk * depth)),
      in_mem_(allocate_slots(chunk * depth)),
      out_hdr_(depth),
      in_hdr_(depth) {}

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
  wait(lk, deadline, "send to", true,
       [&] { return error_.empty() && send_error_.empty() && committed_ - written_ < depth_; });
}

FrameHeader& TcpChannel::stamp_next_header_locked(const FrameHeader& header) {
  if (header.bytes > chunk_)
    fail(ErrorKind::Internal, "pycomm: frame of " + std::to_string(header.bytes) + " bytes exceeds the TCP chunk of " +
                                  std::to_string(chunk_));
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

}  // namespace tcp
}  // namespace pycomm
