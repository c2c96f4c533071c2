// The TCP transport's I/O thread (tcp_transport.h): it writes what the sockets did not
// take, reads for a recv from any source, makes the connections channels ask for, notices
// peers' closes, and delivers the Abort frames after abort() and the committed frames at
// shutdown.
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "transport/tcp_transport.h"

namespace pycomm {
namespace tcp {
namespace {

constexpr std::chrono::seconds kAbortFlush{1};  // to deliver Abort frames

}  // namespace

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
      const std::string frame = abort_frame(abort_reason_);
      for (auto& c : channels_)
        if (c) c->abort_frame_ = frame;
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

}  // namespace tcp
}  // namespace pycomm
