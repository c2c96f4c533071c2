// The TCP channel's I/O (tcp_transport.h): moving frames between its slots and its socket,
// and failing it, by whichever thread holds the channel's lock (a compute thread or the
// I/O thread).
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "core/error.h"
#include "transport/tcp_transport.h"

namespace pycomm {
namespace tcp {
namespace {

constexpr size_t kMaxPeek = size_t{64} << 20;  // receive queue scanned for an Abort

}  // namespace

void TcpChannel::read_some() {
  for (;;) {
    if (in_off_ == 0 && filled_ - released_ >= depth_) return;  // back-pressure: leave it in the socket
    FrameHeader& h = in_hdr_[filled_ % depth_];  // slot owned by the reader (see tcp_transport.h)
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
      const std::string bad = header_error(h, chunk_);
      if (!bad.empty())
        return fail_locked(ErrorKind::Mismatch, "malformed frame from " + peer_.describe() + ": " + bad);
    }
    if (in_off_ >= kHeaderBytes && in_off_ == kHeaderBytes + h.bytes) {
      in_off_ = 0;
      if (h.kind == static_cast<uint16_t>(FrameKind::Abort))
        return fail_locked(ErrorKind::PeerFailure,
                           peer_.describe() + " aborted: " + printable_reason(reason_, h.bytes));
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
  if (auto reason = peek_abort_reason())
    return fail_locked(ErrorKind::PeerFailure, peer_.describe() + " aborted: " + *reason);
  if (events & (EPOLLHUP | EPOLLERR)) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(sock_.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = 0;
    return fail_locked(ErrorKind::PeerFailure,
                       "connection to " + peer_.describe() + " lost: " + (err ? std::strerror(err) : "closed"));
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
  return find_abort_reason(buf.get(), static_cast<size_t>(n), chunk_);
}

void TcpChannel::socket_error(int err) {
  if (auto reason = peek_abort_reason())
    return fail_locked(ErrorKind::PeerFailure, peer_.describe() + " aborted: " + *reason);
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

}  // namespace tcp
}  // namespace pycomm
