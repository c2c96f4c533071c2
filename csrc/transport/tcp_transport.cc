// The TCP transport itself (tcp_transport.h): set-up, abort, shutdown, and the queue of
// channels for the I/O thread to visit.
#include "transport/tcp_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace pycomm {
namespace tcp {
namespace {

constexpr size_t kMaxDrain = size_t{64} << 20;  // unread input dropped before close

}  // namespace

TcpTransport::TcpTransport(const TransportSetup& s) : spin_(s.spin), doorbell_(s.doorbell), linger_(s.linger) {
  validate(s);
  wake_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  abort_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_ || !abort_fd_) fail(ErrorKind::Internal, errno_message("pycomm: eventfd"));
  epoll_fd_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_fd_) fail(ErrorKind::Internal, errno_message("pycomm: epoll_create1"));
  channels_.resize(s.size);
  for (int p : s.peers)
    channels_[p] =
        std::make_unique<TcpChannel>(this, s.ranks[p], s.ranks[p].shares_host_with(s.ranks[s.rank]),
                                     s.config->tcp_chunk_bytes, static_cast<size_t>(s.config->pipeline_depth));
  mesh_ = std::make_unique<Mesh>(s, eager_peers(s));
  attach_connected();
  io_ = std::thread([this] { io_main(); });
}

TcpTransport::~TcpTransport() {
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

void TcpTransport::abort(const std::string& reason) {
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

void TcpTransport::validate(const TransportSetup& s) {
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

std::vector<int> TcpTransport::eager_peers(const TransportSetup& s) {
  std::vector<int> eager;
  for (int p : s.peers) {
    const int ahead = ((p - s.rank) % s.size + s.size) % s.size, behind = s.size - ahead;
    const auto power_of_two = [](int d) { return d > 0 && (d & (d - 1)) == 0; };
    if (power_of_two(ahead) || power_of_two(behind)) eager.push_back(p);
  }
  return eager;
}

void TcpTransport::attach_connected() {
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

void TcpTransport::register_events(int p, int fd, int op, bool input) {
  epoll_event e{};
  e.events = (input ? static_cast<uint32_t>(EPOLLIN) : 0u) | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  e.data.u32 = static_cast<uint32_t>(p);
  if (::epoll_ctl(epoll_fd_.get(), op, fd, &e) != 0) fail(ErrorKind::Internal, errno_message("pycomm: epoll_ctl"));
}

void TcpTransport::wake_io() {
  const uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_.get(), &one, sizeof one);  // EAGAIN: already pending
  (void)ignored;
}

void TcpTransport::queue(TcpChannel& c) {
  if (c.queued_.exchange(true, std::memory_order_acq_rel)) return;
  bool was_empty;
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    was_empty = queued_.empty();
    queued_.push_back(c.peer());
  }
  if (was_empty) wake_io();
}

}  // namespace tcp

std::unique_ptr<Transport> make_tcp_transport(const TransportSetup& setup) {
  return std::make_unique<tcp::TcpTransport>(setup);
}

}  // namespace pycomm
